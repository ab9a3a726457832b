"""The pipeline search (`PipeshardParallel`): layering, per-layer intra-op pricing, the
stage DP and the plan's assembly (DESIGN §5), one module per job:

- `layer_cost`: a layer range's forward+backward solved on each logical mesh of a
  sub-mesh (`start_price_stage` -> `LayerCost`), and the resharding between neighbours;
- `reuse`: one solve for identical layers and identical problems;
- `state`: parameter updates and optimizer-state splits (`StateSplit`), memory prices;
- `stage_memory`: a stage's bytes per device and per-step work from its layers;
- `transfers`: moving activations between stages, estimated and layout-aware;
- `assemble`: the plan from the stage DP's choice, and its refinement;
- `driver`: the search (`search`) and what it records (`StageCostTable`, `recording`).
"""

from .driver import (
    AFTER_NONE,
    AFTER_OWN,
    AFTER_TARGETS,
    AFTER_WHOLE,
    StageCostTable,
    recording,
    search,
)
from .layer_cost import LayerCost, diff_values, price_stage, start_price_stage
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
    "StageCostTable",
    "StateSplit",
    "diff_values",
    "gather_after_update_s",
    "internal_reshard_s",
    "knee_price",
    "price_stage",
    "recording",
    "search",
    "stage_memory_bytes",
    "start_price_stage",
    "state_floor_bytes",
    "state_layouts",
    "updates_s",
]
