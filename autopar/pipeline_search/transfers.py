"""Moving activations between pipeline stages: the layout-free estimate the stage DP uses
(`transfer_s`, `least_transfer_s`) and the layout-aware price of the assembled plan
(`price_transfers`, `passes.transfer_cost`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autopar import pipeline
from autopar.cost_model import ClusterSpec, Link
from autopar.cost_model.collectives import send_recv_s
from autopar.graph import Graph
from autopar.passes.sharding_spec import (
    MeshContext,
    Spec,
)
from autopar.passes.transfer_cost import Layout, TransferPrice, price_transfer
from autopar.plan import StagePlan

from .layer_cost import LayerCost


def transfer_s(nbytes: float, src_devices: int, dst_devices: int, link: Link) -> float:
    """Seconds to move a value of `nbytes` between two sub-meshes over `link`, its layouts
    unknown (the stage DP's estimate): the devices move their shares in parallel, as many
    pairs as the smaller side has devices.  The assembled plan prices each transfer from
    both layouts instead (`_with_transfers`)."""
    return send_recv_s(nbytes / max(1, min(src_devices, dst_devices)), 2, link)


def least_transfer_s(submesh: tuple[int, int], nbytes: float, hosts: int, per_host: int,
                     cluster: ClusterSpec, cross: bool = False) -> float:
    """The fewest seconds a stage on `submesh` (of a `hosts` x `per_host` cluster) can take
    to receive a value of `nbytes` from another stage: each of its devices copying at most
    its own share, 1/size of the value (`transfer_cost.price_transfer`: a sender of as many
    devices copies each device's shard, one of another size whole copies; the re-layouts
    on either side cost >= 0), over the fastest link its sender can be behind (another
    host's, when the stage holds whole hosts: `_stage_link`; with `cross`, the sender is
    known to be on another host)."""
    size = submesh[0] * submesh[1]
    links = ([cluster.inter_host] if hosts > 1 and (submesh[1] == per_host or cross)
             else [cluster.intra_host] + ([cluster.inter_host] if hosts > 1 else []))
    return min(send_recv_s(nbytes / size, 2, link) for link in links)


def _stage_link(a: Sequence[int], b: Sequence[int], cluster: ClusterSpec,
                per_host: int) -> Link:
    hosts = {d // per_host for d in a} | {d // per_host for d in b}
    return cluster.intra_host if len(hosts) == 1 else cluster.inter_host


@dataclasses.dataclass(frozen=True)
class StageLayouts:
    """Where a planned stage holds the values it exchanges with other stages, by F value
    id, on its logical mesh `mesh`: its inputs (the layout of the first layer reading
    each), the cotangents its backward makes for them (`ct_outs`), its outputs as the
    producing layer makes them, the layout that layer's backward wants their cotangents in
    (`ct_ins`), and each parameter's reduced gradient (`states`)."""

    mesh: MeshContext
    inputs: dict[int, Spec]
    ct_outs: dict[int, Spec]
    outputs: dict[int, Spec]
    ct_ins: dict[int, Spec]
    states: dict[int, Spec]

    @staticmethod
    def of(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
           states: dict[int, Spec]) -> StageLayouts:
        """A stage of these layer solutions (on one logical mesh), its parameters' reduced
        gradients in `states`."""
        inputs: dict[int, Spec] = {}
        ct_outs: dict[int, Spec] = {}
        outputs: dict[int, Spec] = {}
        ct_ins: dict[int, Spec] = {}
        for p, prog in zip(priced, programs):
            for vid, spec in zip(prog.inputs, p.input_specs):
                inputs.setdefault(vid, spec)
            for vid, ct in zip(prog.inputs, p.ct_out_specs):
                if ct is not None:
                    ct_outs.setdefault(vid, ct)
            outputs.update(zip(prog.outputs, p.output_specs))
            ct_ins.update((v, c) for v, c in zip(prog.outputs, p.ct_in_specs) if c is not None)
        return StageLayouts(priced[0].mesh, inputs, ct_outs, outputs, ct_ins, states)

    def at(self, specs: dict[int, Spec], vid: int, ndim: int) -> Layout:
        """`vid`'s layout in `specs` (one of this stage's tables; replicated if absent)."""
        return Layout(specs.get(vid, ((),) * ndim), self.mesh)


def _with_transfers(stages: list[StagePlan], layouts: Sequence[StageLayouts], graph: Graph,
                    diff: set[int], params: set[int], cluster: ClusterSpec, per_host: int
                    ) -> tuple[list[StagePlan], float, list[dict[str, Any]]]:
    """The stages with the seconds per micro-batch of receiving their activations (and
    sending the cotangents back) added (`StagePlan.transfer_s`), the seconds per step of
    moving values several stages read, and the priced transfers (`price_transfers`)."""
    per_micro, per_step, records = price_transfers(
        [pipeline.program_for_range(graph, *st.eqn_range) for st in stages],
        [st.device_ids for st in stages], layouts, graph, diff, params, cluster, per_host)
    return ([dataclasses.replace(st, predicted_s=st.predicted_s + t, transfer_s=t)
             for st, t in zip(stages, per_micro)], per_step, records)


def price_transfers(programs: Sequence[pipeline.StageProgram],
                    devices: Sequence[Sequence[int]], layouts: Sequence[StageLayouts],
                    graph: Graph, diff: set[int], params: set[int], cluster: ClusterSpec,
                    per_host: int) -> tuple[list[float], float, list[dict[str, Any]]]:
    """Per stage (its program, device ids and layouts), the seconds per micro-batch of
    receiving its activations and sending their cotangents back; the seconds per step of
    moving values several stages read (a tied embedding) to them and their gradients back;
    and a record of each transfer priced (`_transfer_record`).  Each is priced from the two
    stages' layouts as the runtime moves it (`passes.transfer_cost`;
    `PipelineRuntime._lay_out_transfers`): an activation leaves its producer in the tiling
    of its first later reader where that reader has as many devices (else as its producing
    layer made it); its cotangent goes back in the tiling of the activation as the
    producing layer made it, and is re-laid out there into the layout that layer's
    backward wants."""
    made_by: dict[int, int] = {}
    reader: dict[int, int] = {}
    sent: dict[int, Layout] = {}        # an activation as it leaves its producer
    ct_relaid: set[int] = set()         # cotangents whose re-layout on arrival is priced
    out, per_step, records = [], 0.0, []

    def priced(what: str, v: int, a: int, b: int, src: Layout, dst: Layout,
               then: Spec | None = None) -> float:
        value = graph.values[v]
        link = _stage_link(devices[a], devices[b], cluster, per_host)
        price = price_transfer(value.shape, value.nbytes, src, dst, link, then)
        records.append(_transfer_record(what, v, value.nbytes, a, b, price))
        return price.total_s

    for k, (prog, here) in enumerate(zip(programs, layouts)):
        seconds = 0.0
        for v in prog.inputs:
            ndim = graph.values[v].ndim
            src = made_by.get(v, reader.get(v))
            if src is None:
                reader[v] = k
                continue
            there = layouts[src]
            if v in made_by:
                made = there.at(there.outputs, v, ndim)
                seconds += priced("activation", v, src, k, sent.get(v, made),
                                  here.at(here.inputs, v, ndim))
                if v not in sent:
                    same = len(devices[src]) == len(devices[k])
                    sent[v] = here.at(here.inputs, v, ndim) if same else made
                if v in diff:
                    then = there.ct_ins.get(v) if v not in ct_relaid else None
                    ct_relaid.add(v)
                    ct = here.at(here.ct_outs if v in here.ct_outs else here.inputs, v, ndim)
                    seconds += priced("cotangent", v, k, src, ct, made, then)
            else:
                per_step += priced("input", v, src, k, there.at(there.inputs, v, ndim),
                                   here.at(here.inputs, v, ndim))
                if v in diff and v in params:
                    per_step += priced("gradient", v, k, src, here.at(here.states, v, ndim),
                                       there.at(there.states, v, ndim))
        made_by.update((o, k) for o in prog.outputs)
        out.append(seconds)
    return out, per_step, records


def _transfer_record(what: str, vid: int, nbytes: int, src: int, dst: int,
                     price: TransferPrice) -> dict[str, Any]:
    """One priced transfer as the plan's `solver["transfers"]` lists it (per micro-batch
    for activations and cotangents, per step for inputs several stages read and their
    gradients); seconds and bytes: `nbytes` of the whole value, of the re-layout per
    sending device, of the copy per receiving device and of the receiver's gather of the
    wire pieces per receiving device (`transfer_cost.TransferPrice`)."""
    return {"what": what, "value": vid, "nbytes": nbytes, "from_stage": src, "to_stage": dst,
            "route": price.route, "relayout_bytes": price.relayout_bytes,
            "relayout_s": price.relayout_s, "copy_bytes": price.copy_bytes,
            "copy_s": price.copy_s, "gather_bytes": price.gather_bytes,
            "gather_s": price.gather_s, "receive_s": price.receive_s, "total_s": price.total_s}
