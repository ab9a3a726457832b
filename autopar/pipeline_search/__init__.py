"""The pipeline search (`PipeshardParallel`): layering, per-layer intra-op pricing, the
stage DP and the plan's assembly (DESIGN §5), one module per job:

- `layer_cost`: a layer range's forward+backward solved on each logical mesh of a
  sub-mesh (`start_price_stage` -> `LayerCost`), and the resharding between neighbours;
- `reuse`: one solve for identical layers and identical problems;
- `state`: parameter updates and optimizer-state splits (`StateSplit`), memory prices;
- `stage_memory`: a stage's bytes per device and per-step work from its layers;
- `transfers`: moving activations between stages, estimated and layout-aware;
- `assemble`: the plan from the stage DP's choice, and its refinement;
- `driver`: the search (`search`) as four phases, each in its module and returning a typed
  result: `context.prepare` (layering -> `SearchContext`), `layer_solutions` (every
  layer's ILPs -> `LayerSolutions`), `stage_costs` (a layer range as a stage, the stage
  DP's costs -> `StageCosts`, `StageCostTable`) with the DP (`StageChoices`), and the
  assembly; what it did goes in the plan as a `SearchReport`.
"""

from .driver import SearchReport, StageChoices, layered_step_s, recording, search
from .layer_cost import LayerCost, diff_values, price_stage, start_price_stage
from .layer_solutions import AFTER_NONE, AFTER_OWN, AFTER_TARGETS, AFTER_WHOLE
from .stage_costs import StageCostTable
from .stage_memory import internal_reshard_s, stage_memory_bytes, state_layouts, updates_s
from .state import (
    LEAN_PENALTY_S,
    StateSplit,
    gather_after_update_s,
    knee_price,
    state_floor_bytes,
)

__all__ = [
    "AFTER_NONE",
    "AFTER_OWN",
    "AFTER_TARGETS",
    "AFTER_WHOLE",
    "LEAN_PENALTY_S",
    "LayerCost",
    "SearchReport",
    "StageChoices",
    "StageCostTable",
    "StateSplit",
    "diff_values",
    "gather_after_update_s",
    "internal_reshard_s",
    "knee_price",
    "layered_step_s",
    "price_stage",
    "recording",
    "search",
    "stage_memory_bytes",
    "start_price_stage",
    "state_floor_bytes",
    "state_layouts",
    "updates_s",
]
