"""`hetpipe simulate`'s engine: predict a plan's behaviour, and the AllReduce BSP baseline.

:func:`simulate` turns a :class:`~planner.plan.Plan` into one
:class:`~planner.sim.engine.PipelineSpec` per virtual worker (stage times and transfer
times straight from the plan, push/pull times from the shard placement and the cluster's
links) and runs the discrete-event loop of :mod:`planner.sim.engine`, whose docstring
defines the model and the throughput. :func:`planner.predict.simulate_allreduce` is the paper's Horovod
comparison: data parallelism with a ring all-reduce (BSP) on the GPUs that hold the whole model.

Shard traffic: stage ``s`` of a VW pushes (and pulls) the bytes of its parameters that live
in each shard. With a profile (layer names and ``param_bytes``) the split is exact. Without
one it is estimated: ``local`` placement sends a stage's parameters to the shards on its own
node (when there is one); otherwise each shard receives a share proportional to its size.
Transfers to a shard on the GPU's own node use the intra-node link, others the inter-node one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from planner.cluster import LinkTable
from planner.offload import host_link_ms
from planner.overhead import wave_overhead_ms
from planner.plan import Plan, StagePlan, VirtualWorker
from planner.predict import AllReduceResult, ring_link, simulate_allreduce
from planner.rules import ALONE_RULE, layout
from planner.schedule import schedule_named
from planner.sim.engine import simulate_pipelines
from planner.sim.types import PipelineSpec, SimResult
from planner.sync import effective_rule
from profiler.errors import PlanError
from profiler.table import Profile

__all__ = [
    "allreduce_for_plan",
    "best_by_simulation",
    "pipeline_specs",
    "shard_ms",
    "simulate",
    "stage_shard_bytes",
]

log = logging.getLogger(__name__)


def stage_shard_bytes(
    plan: Plan, vw: VirtualWorker, stage: StagePlan, profile: Profile | None = None
) -> list[tuple[str, int]]:
    """``(shard node, bytes)`` of ``stage``'s parameters held by each shard (see module doc)."""
    shards = [s for s in plan.shards if s.param_bytes > 0]
    if not shards or stage.param_bytes <= 0:
        return []
    if profile is not None:
        table = profile.table
        index = {
            str(n): (i, int(b))
            for i, (n, b) in enumerate(zip(table["layer"], table["param_bytes"], strict=True))
        }
        out = []
        for sh in shards:
            got = [index.get(name) for name in sh.layers]
            if any(g is None for g in got):
                break
            nbytes = sum(b for i, b in got if stage.first_index <= i <= stage.last_index)  # type: ignore[misc]
            if nbytes:
                out.append((sh.node, nbytes))
        else:
            return out
        log.warning("shard layer names are not in the profile: estimating shard traffic")
    node = vw.gpus[stage.gpu].node
    if plan.placement == "local":
        mine = [s for s in shards if s.node == node]
        if mine:
            total = sum(s.param_bytes for s in mine)
            return [(s.node, stage.param_bytes * s.param_bytes // total) for s in mine]
    total = sum(s.param_bytes for s in shards)
    return [(s.node, stage.param_bytes * s.param_bytes // total) for s in shards]


def shard_ms(links: LinkTable, node: str, shard_node: str, nbytes: float) -> float:
    """Milliseconds one push (or pull) of ``nbytes`` between a stage on ``node`` and a shard
    on ``shard_node`` takes: what the simulator charges and the runtime paces."""
    return links.between(node, shard_node).time_s(nbytes) * 1e3


def pipeline_specs(
    plan: Plan, profile: Profile | None = None, overhead_ms_per_task: float | None = None
) -> list[PipelineSpec]:
    """One simulator spec per virtual worker of ``plan`` (times in ms, as planned; every task
    costs ``overhead_ms_per_task`` more, the runtime's own cost: :class:`PipelineSpec`;
    ``None``: the overhead the plan's prediction assumed, ``predicted.overhead_ms_per_task``,
    and its per-wave terms, :func:`planner.overhead.wave_overhead_ms`; a number given, as
    ``--profile-runtime`` measures it, already holds the per-wave cost: none is added).

    Raises:
        PlanError: a VW has no stage or a stage points at a missing GPU.
    """
    overhead_ms_per_task, wave_ms = _overheads(plan, overhead_ms_per_task)
    specs = []
    for vw in plan.virtual_workers:
        if not vw.stages:
            raise PlanError(f"plan: virtual worker {vw.id} has no stages (re-run 'hetpipe plan')")
        push, push_inter, cross_recv, cross_sync, labels = [], [], [], [], []
        for j, st in enumerate(vw.stages):
            if not 0 <= st.gpu < len(vw.gpus):
                raise PlanError(
                    f"plan: VW {vw.id} stage {j} uses GPU {st.gpu} but the VW has {len(vw.gpus)}"
                )
            gpu = vw.gpus[st.gpu]
            labels.append(f"{gpu.node}:{gpu.index}")
            prev = vw.gpus[vw.stages[j - 1].gpu].node if j > 0 else gpu.node
            cross_recv.append(st.recv_bytes if prev != gpu.node else 0)
            traffic = stage_shard_bytes(plan, vw, st, profile)
            links = plan.cluster.links  # charged as the runtime paces them (scaled)
            push.append(sum(shard_ms(links, gpu.node, n, b) for n, b in traffic if n == gpu.node))
            push_inter.append(
                sum(shard_ms(links, gpu.node, n, b) for n, b in traffic if n != gpu.node)
            )
            cross_sync.append(sum(b for n, b in traffic if n != gpu.node))
        specs.append(
            PipelineSpec(
                fwd_ms=tuple(s.fwd_ms for s in vw.stages),
                bwd_ms=tuple(s.bwd_ms for s in vw.stages),
                recv_fwd_ms=tuple(s.recv_fwd_ms if j > 0 else 0.0 for j, s in enumerate(vw.stages)),
                recv_bwd_ms=tuple(
                    s.recv_bwd_ms if j < len(vw.stages) - 1 else 0.0
                    for j, s in enumerate(vw.stages)
                ),
                push_ms=tuple(push),
                pull_ms=tuple(
                    a + b for a, b in zip(push, push_inter, strict=True)
                ),  # same bytes back
                cross_recv_bytes=tuple(cross_recv),
                cross_sync_bytes=tuple(cross_sync),
                labels=tuple(labels),
                nodes=tuple(vw.gpus[s.gpu].node for s in vw.stages),
                push_inter_ms=tuple(push_inter),
                host_ms=tuple(
                    host_link_ms(
                        float(s.transfer_bytes),
                        plan.cluster.links.host,
                        plan.cluster.host_share(vw.gpus[s.gpu].node).sharers,
                    )
                    for s in vw.stages
                ),
                host_exposed_ms=tuple(s.transfer_ms for s in vw.stages),
                overhead_ms_per_task=overhead_ms_per_task,
                wave_overhead_ms=wave_ms(vw),
            ).validated()
        )
    return specs


def _overheads(
    plan: Plan, overhead_ms_per_task: float | None
) -> tuple[float, Callable[[VirtualWorker], tuple[float, ...]]]:
    """The overhead per task to charge and, per VW, each stage's per-wave overhead (``()``:
    none): the plan's own terms, or ``overhead_ms_per_task`` alone when one is given."""
    pred = plan.predicted
    per_wave, per_mb = pred.overhead_ms_per_wave, pred.overhead_ms_per_mb
    if overhead_ms_per_task is not None or not (per_wave or per_mb):
        return (
            pred.overhead_ms_per_task if overhead_ms_per_task is None else overhead_ms_per_task,
            lambda vw: (),
        )
    return pred.overhead_ms_per_task, lambda vw: tuple(
        wave_overhead_ms(per_wave, per_mb, s.param_bytes) for s in vw.stages
    )


def simulate(
    plan: Plan,
    waves: int = 20,
    profile: Profile | None = None,
    record_trace: bool = False,
    overhead_ms_per_task: float | None = None,
) -> SimResult:
    """Simulate ``plan`` for ``waves`` waves per virtual worker.

    Args:
        plan: the plan (its Nm, D, schedule, stages, shards and cluster are used as they are).
        waves: waves per VW (>= 2; wave 0 is warm-up and not measured).
        profile: optional profile of the model (any GPU type) for exact shard traffic.
        record_trace: keep every interval for Gantt charts and Chrome traces.
        overhead_ms_per_task: the runtime's own cost of every task (``hetpipe run
            --profile-runtime`` measures it), added to each task; 0: none; ``None``: the
            plan's own assumption (``predicted.overhead_ms_per_task``, :mod:`planner.overhead`).

    Raises:
        PlanError: invalid plan, ``waves < 2`` or a negative or non-finite overhead.
    """
    specs = pipeline_specs(plan, profile, overhead_ms_per_task)
    schedule = schedule_named(plan.schedule)
    alone = len(specs) == 1 and effective_rule(plan.sync, len(plan.shards), 1) == ALONE_RULE
    return simulate_pipelines(
        specs, plan.nm, plan.D, waves, plan.batch_size, record_trace, schedule, alone
    )


def best_by_simulation(
    make: Callable[[int], Plan],
    caps: Iterable[int],
    waves: int = 10,
    profile: Profile | None = None,
) -> tuple[Plan, SimResult]:
    """Choose Nm by simulation: plan with each Nm cap, simulate, keep the fastest.

    A larger Nm can force a worse partition (more in-flight memory on the early stages), and
    with Nm equal to the number of stages the FIFO rule may not fill the pipeline (see
    docs/simulator.md), so the analytic best is not always the real best.

    Args:
        make: builds the plan for an Nm cap (e.g. ``lambda nm: make_plan(..., nm=nm)``); it
            may raise :class:`PlanError` for caps that do not fit, which are skipped.
        caps: Nm caps to try.
        waves: waves per simulation.
        profile: optional profile for exact shard traffic.

    Raises:
        PlanError: no cap gave a plan.
    """
    best: tuple[Plan, SimResult] | None = None
    seen: set[int] = set()
    last_error: PlanError | None = None
    for cap in caps:
        try:
            plan = make(cap)
        except PlanError as exc:
            last_error = exc
            continue
        if plan.nm in seen:
            continue
        seen.add(plan.nm)
        res = simulate(plan, waves=waves, profile=profile)
        log.debug("Nm cap %d -> Nm %d: %.1f samples/s simulated", cap, plan.nm, res.throughput)
        if best is None or res.throughput > best[1].throughput:
            best = (plan, res)
    if best is None:
        raise PlanError(f"no Nm cap gave a plan ({last_error})")
    return best


# -------------------------------------------------------------------- AllReduce BSP baseline


def allreduce_for_plan(
    plan: Plan, profiles: Mapping[str, Profile] | None = None
) -> AllReduceResult:
    """The AllReduce baseline on ``plan``'s cluster: every GPU that can hold the whole model.

    With ``profiles`` (one per GPU type, as for planning) whole-model time and memory come
    from the planner's cost model. Without them they are estimated from the plan: a VW made
    of one GPU type gives that type's whole-model time exactly; other types are scaled by
    catalog fp32 peak; the whole-model memory is the plan's per-stage memory with one
    minibatch in flight and one weight version.
    """
    cluster = plan.cluster
    if layout(plan.sync) == "ddp":  # the baseline's own plan: its devices and whole-model times
        stages = [vw.stages[0] for vw in plan.virtual_workers]
        nodes = [vw.gpus[0].node for vw in plan.virtual_workers]
        return simulate_allreduce(
            [st.fwd_ms + st.bwd_ms for st in stages],
            stages[0].param_bytes,
            ring_link(cluster, nodes),
            plan.batch_size,
            nodes,
            tuple(f"{vw.gpus[0].node}:{vw.gpus[0].index}" for vw in plan.virtual_workers),
        )
    if profiles:
        from planner.costmodel import CostModel

        at = {t: prof.at_precision(plan.precision) for t, prof in profiles.items()}
        cm = CostModel(at, cluster.link, plan.optimizer_state_factor)
        need = cm.model_memory_bytes(1)
        params = cm.total_param_bytes()
        whole = {t: float(cm.compute_ms(t)[-1]) for t in cm.types}
        time_on: Callable[[str], float | None] = whole.get
    else:
        need, params, time_on = _estimate_from_plan(plan)
    workers = [d for d in cluster.devices if d.memory_bytes >= need and time_on(d.type) is not None]
    times = [time_on(d.type) or 0.0 for d in workers]
    nodes = [d.node for d in workers]
    link = ring_link(cluster, nodes)
    return simulate_allreduce(
        times, params, link, plan.batch_size, nodes, tuple(d.label for d in workers)
    )


def _estimate_from_plan(plan: Plan) -> tuple[int, int, Callable[[str], float | None]]:
    from profiler.catalog import CATALOG

    f = plan.optimizer_state_factor
    vw0 = plan.virtual_workers[0]
    params = sum(s.param_bytes for s in vw0.stages)
    need = 0
    for s in vw0.stages:
        static = s.param_bytes * (2 + f) + (plan.nm - 1) * s.param_bytes
        per_mb = max(0.0, s.memory_bytes - static) / max(1, s.in_flight)
        need += int(s.param_bytes * (2 + f) + per_mb)
    exact: dict[str, float] = {}
    for vw in plan.virtual_workers:
        types = {vw.gpus[s.gpu].type for s in vw.stages}
        if len(types) == 1:
            exact[types.pop()] = sum(s.fwd_ms + s.bwd_ms for s in vw.stages)

    def peak(t: str) -> float:
        spec = CATALOG.get(t)
        return spec.fp32_tflops if spec is not None else 0.0

    def time_on(t: str) -> float | None:
        if t in exact:
            return exact[t]
        if peak(t) <= 0:
            return None
        return sum((s.fwd_ms + s.bwd_ms) * peak(vw0.gpus[s.gpu].type) / peak(t) for s in vw0.stages)

    return need, params, time_on
