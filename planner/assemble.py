"""Assembling a :class:`~planner.plan.Plan` from an allocation at one Nm.

:func:`build_plan` partitions every VW (:class:`planner.vw_solver.VWSolver`), gives each
stage its fastest fitting memory placement, places the parameter-server shards, and predicts
throughput: analytically (per-VW pipelines plus each node's network traffic), then by the
discrete-event simulator when it accepts the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, replace

from planner.allocation import Allocation
from planner.cluster import Device
from planner.memory_choice import stage_placements
from planner.partition.dp import Partition
from planner.placement import PipelineLayout, cross_node_bytes_per_wave, place_shards
from planner.plan import GpuSlot, Plan, Prediction, ShardPlan, StagePlan, VirtualWorker
from planner.predict import allreduce_throughput, cluster_throughput, vw_throughput
from planner.vw_solver import VWSolver, pipeline_key
from profiler.errors import PlanError

__all__ = ["build_plan"]

log = logging.getLogger(__name__)


def _slot(d: Device) -> GpuSlot:
    """The plan's record of device ``d``."""
    return GpuSlot(
        d.node, d.index, d.type, d.memory_bytes, d.emulation.speed if d.emulation else 0.0
    )


def _stages(pl: VWSolver, part: Partition, nm: int) -> tuple[StagePlan, ...]:
    """The stages of ``part``, each with its fastest fitting memory placement (computed once
    per pipeline that differs only by node names: a 10,240-GPU plan has 1,280 alike VWs)."""
    key = (pipeline_key(pl.cluster, part.gpus), part.bounds, nm)
    if key not in pl.stage_cache:
        pl.stage_cache[key] = _stages_of(pl, part, nm)
    return pl.stage_cache[key]


def _stages_of(pl: VWSolver, part: Partition, nm: int) -> tuple[StagePlan, ...]:
    """The stages of ``part``, each with its fastest fitting memory placement."""
    names = pl.cm.layer_names
    out = []
    mems = stage_placements(pl.cm, pl.cluster, part, nm, pl.candidates)
    for j, (gpu, mem) in enumerate(zip(part.gpus, mems, strict=True)):
        p, q = part.bounds[j], part.bounds[j + 1]
        cost = pl.cm.stage_cost(part.gpus, j, p, q, nm, mem.placement)
        a, b = part.cuts[j], part.cuts[j + 1]
        out.append(
            StagePlan(
                gpu=j,
                first_layer=names[a],
                last_layer=names[b - 1],
                first_index=a,
                last_index=b - 1,
                capacity_bytes=gpu.memory_bytes,
                **asdict(cost),
                memory=str(mem.placement),
                host_bytes=mem.host_bytes,
                transfer_bytes=mem.transfer_bytes,
                recompute_ms=mem.recompute_ms,
                transfer_ms=mem.transfer_ms,
            )
        )
    return tuple(out)


def _node_traffic(
    layouts: Sequence[PipelineLayout],
    shards: Sequence[ShardPlan],
    param_bytes: Sequence[int],
    names: Sequence[str],
    nm: int,
) -> dict[str, int]:
    """Bytes each node's (full-duplex) network card sends per wave, all VWs together.

    Every transfer is symmetric per wave (activations out / gradients back, push / pull), so a
    node sends as many bytes as it receives; the busier direction is this count.
    """
    index = {n: i for i, n in enumerate(names)}
    traffic: dict[str, int] = {}
    for lay in layouts:
        for j in range(len(lay.gpus) - 1):
            a, b = lay.gpus[j].node, lay.gpus[j + 1].node
            if a != b:
                for n in (a, b):
                    traffic[n] = traffic.get(n, 0) + nm * lay.cut_bytes[j]
        for shard in shards:
            for name in shard.layers:
                i = index[name]
                node = lay.node_of_layer(i)
                if node != shard.node:
                    for n in (node, shard.node):
                        traffic[n] = traffic.get(n, 0) + int(param_bytes[i])
    return traffic


def _simulated(plan: Plan, waves: int) -> Prediction | None:
    """The discrete-event simulator's steady-state prediction
    (:func:`planner.throughput.steady_throughput`) with the runtime overhead the cluster's model
    gives the plan (:func:`planner.overhead.plan_overhead_ms`), recorded next to the
    prediction without it (``None`` when the simulator refuses the plan or waves < 2)."""
    if waves < 2:
        return None
    from planner.overhead import plan_overhead_ms, plan_wave_overhead_ms
    from planner.symmetry import simulate_distinct
    from planner.throughput import steady_throughput

    p = plan.predicted
    over = plan_overhead_ms(plan)
    per_wave, per_mb = plan_wave_overhead_ms(plan)
    assumed = replace(
        p, overhead_ms_per_task=over, overhead_ms_per_wave=per_wave, overhead_ms_per_mb=per_mb
    )
    charged = replace(plan, predicted=assumed)
    try:
        throughput, per_vw = simulate_distinct(charged, waves, steady_throughput)
        # A second run on purpose, of other inputs: ``plan`` carries the analytic prediction,
        # which charges no overhead, so it gives ``throughput_without_overhead`` (what the run
        # summary shows beside the charged figure). Without an overhead model both runs
        # would be the same simulation, and the first one's result is reused.
        without = (
            simulate_distinct(plan, waves, steady_throughput)[0]
            if assumed.charges_overhead
            else throughput
        )
    except PlanError as exc:
        log.warning("simulator refused the plan (%s); keeping the analytic prediction", exc)
        return None
    return replace(assumed, throughput=throughput, per_vw=per_vw, method="simulated",
                   throughput_without_overhead=without)  # fmt: skip


def build_plan(
    pl: VWSolver,
    alloc: Allocation,
    plan_nm: int,
    nm_max: Sequence[int],
    model: str,
    batch: int,
    D: int,
    placement: str,
    provenance: dict[str, str],
    screen: bool = False,
) -> Plan:
    """The plan of ``alloc`` at ``plan_nm`` (``screen``: fast exact partitioner, for comparisons)."""
    parts = [pl.partition(g, plan_nm, screen) for g in alloc.groups]
    cm = pl.cm
    names = cm.layer_names
    layer_params = [int(b) for b in cm.layer_param_bytes]
    layouts = [
        PipelineLayout(p.gpus, p.cuts, tuple(int(cm.layer_cut_bytes[c]) for c in p.cuts[1:-1]))
        for p in parts
    ]
    shards = place_shards(pl.cluster, layouts, names, layer_params, placement)
    stages = [_stages(pl, p, plan_nm) for p in parts]
    per_vw = [vw_throughput([s.time_ms for s in st], plan_nm, batch) for st in stages]
    vws = tuple(
        VirtualWorker(
            id=v,
            gpus=tuple(_slot(d) for d in p.gpus),
            stages=stages[v],
            nm_max=nm_max[v],
            throughput=per_vw[v],
            cross_node_bytes_per_wave=cross_node_bytes_per_wave(
                layouts[v], shards, names, layer_params, plan_nm
            ),
            partitioner=p.solver,
            bound_ms=p.lower_bound_ms,
        )
        for v, p in enumerate(parts)
    )
    traffic = _node_traffic(layouts, shards, layer_params, names, plan_nm)
    inter = pl.cluster.inter_node.scaled(pl.cluster.link_scale)  # as charged
    total = cluster_throughput(per_vw, traffic, inter.bandwidth_bps, plan_nm, batch)
    ar, ar_gpus = allreduce_throughput(pl.cluster, cm, batch)
    plan = Plan(
        model=model,
        batch_size=batch,
        policy=alloc.policy,
        nm=plan_nm,
        D=D,
        placement=placement,
        cluster=pl.original,
        virtual_workers=vws,
        shards=shards,
        predicted=Prediction(total, tuple(per_vw), ar, ar_gpus, "analytic"),
        num_layers=cm.num_layers,
        profiles=dict(provenance),
        optimizer_state_factor=cm.optimizer_state_factor,
    )
    sim = _simulated(plan, pl.opts.simulate_waves)
    return plan if sim is None else replace(plan, predicted=sim)
