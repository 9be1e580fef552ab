"""``make_plan``: allocation -> per-VW Nm and partition -> shard placement -> predictions.

Steps (paper Sec. 4, 7, 8.1):

1. one profile per GPU type of the cluster: given ones first; missing types are filled with
   the analytic profiler (built-in or importable models) or by scaling a given profile with
   ``profiler.analytic.scale_profile``; the plan's ``profiles`` field records the provenance;
2. the allocation policy forms the VWs (``auto`` tries every applicable allocation and keeps
   the best predicted throughput);
3. each VW's ``nm_max`` is the largest Nm (up to ``nm_limit``) for which some GPU order and
   partition fit memory; Nm may not exceed their minimum (paper Sec. 4: Nm is the same in every
   VW), nor the user's ``nm``; below that bound the default ``nm_choice="best"`` takes the Nm
   with the best predicted throughput (paper Sec. 4: "Nm ... is basically determined by
   considering the throughput of the pipeline"; Sec. 8.3). The largest feasible Nm is often
   not the fastest: stage 0 must hold Nm minibatches and the partition degenerates;
   ``nm_choice="max"`` takes it anyway;
4. each VW is partitioned at that Nm (MILP by default); isomorphic VWs (same GPU types and
   node pattern, e.g. the four ED VWs) are solved once;
5. shards are placed and throughput is predicted: by the discrete-event simulator
   (``planner.sim.simulator``) when it is available, else analytically (:mod:`planner.predict`);
   ``auto`` ranks its candidate allocations by that prediction.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.allocation import Allocation, allocate, candidate_allocations, default_policy
from planner.auto_search import Candidate, compare_allocations
from planner.cluster import Cluster, Device, Link
from planner.costmodel import CostModel, optimizer_factor
from planner.memory_choice import memory_candidates, memory_ladder, refined_ms, stage_placements
from planner.offload import LADDER, MemoryPlacement
from planner.partition.dp import Partition
from planner.partition.memory import check_stage_count, fits_memory, min_memory_shortfall
from planner.partition.milp import partition_milp
from planner.partition.search import lower_bound_ms, partition_exact
from planner.placement import PipelineLayout, cross_node_bytes_per_wave, place_shards
from planner.plan import GpuSlot, Plan, Prediction, ShardPlan, StagePlan, VirtualWorker
from planner.predict import allreduce_throughput, cluster_throughput, vw_throughput
from planner.profiles import resolve_profiles
from profiler.errors import PlanError
from profiler.table import Profile
from profiler.units import format_bytes

__all__ = ["PlanOptions", "make_plan", "plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the partitioning step.

    Attributes:
        partitioner: ``dp`` (default: the exact DP over GPU-class multisets,
            :mod:`planner.partition.search`) or ``milp`` (PuLP MILP choosing order and split).
        solver: MILP back end: ``auto``, ``highs`` or ``cbc``.
        max_cuts: ``None`` (default, exact): every layer boundary is a candidate cut. A number
            coarsens larger graphs to single-tensor cuts (an approximation: each VW then records
            a proven lower bound on the exact optimum, :func:`planner.partition.search.lower_bound_ms`).
        nm_limit: largest Nm considered.
        time_limit_s: solver time limit per partition; when hit, the best partition found is
            kept and the VW records the proven lower bound (its gap).
        auto_max_vw_gpus: largest VW the ``auto`` policy tries.
        auto_budget_s: planning-time budget of ``auto``: candidates not reached within it are
            reported as skipped.
        nm_choice: without a user ``nm``: ``best`` (default) compares Nm = 1..S+2, powers of
            two and the largest feasible Nm by predicted throughput (paper Sec. 8.3: "Nm is set
            such that performance is maximized"; ties go to the smaller Nm, less staleness);
            ``max`` takes the largest feasible Nm (the minimum over VWs of their ``nm_max``).
        simulate_waves: when >= 2, the prediction (and ``auto``'s ranking) comes from the
            discrete-event simulator (``planner.sim.simulator``) over this many waves; the analytic
            estimate is the fallback.
        memory: the memory manager (:mod:`planner.offload`): ``keep`` (default: everything on
            the device), ``auto`` (per Nm, each VW is partitioned under every placement of
            :data:`planner.offload.LADDER` that fits, each stage then takes its fastest fitting
            placement, and the fastest result wins) or one placement for every stage
            (``activations:recompute``).
    """

    partitioner: str = "dp"
    solver: str = "auto"
    max_cuts: int | None = None
    nm_limit: int = 64
    time_limit_s: float = 60.0
    auto_max_vw_gpus: int = 16
    auto_budget_s: float = 120.0
    nm_choice: str = "best"
    simulate_waves: int = 8
    memory: str = "keep"


@dataclass
class _Planner:
    cluster: Cluster
    cm: CostModel
    opts: PlanOptions
    original: Cluster  # the cluster as given (stored in the plan)
    full: CostModel | None = None  # the uncoarsened model when --max-cuts coarsened ``cm``
    cache: dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...], float, str]] = field(
        default_factory=dict
    )
    nm_cache: dict[tuple[object, ...], tuple[int, int]] = field(default_factory=dict)
    cms: dict[MemoryPlacement, CostModel] = field(default_factory=dict)

    # ------------------------------------------------------------ memory placements
    @property
    def ladder(self) -> tuple[MemoryPlacement, ...]:
        """Uniform placements the partitioner may use, cheapest first (``opts.memory``)."""
        return memory_ladder(self.opts.memory)

    @property
    def candidates(self) -> tuple[MemoryPlacement, ...]:
        """Placements one stage may take after partitioning."""
        return memory_candidates(self.opts.memory)

    def cm_for(self, placement: MemoryPlacement) -> CostModel:
        """The cost model with every stage under ``placement``."""
        if placement not in self.cms:
            self.cms[placement] = self.cm.with_placement(placement)
        return self.cms[placement]

    # ------------------------------------------------------------ isomorphic VWs
    @staticmethod
    def canonical(gpus: Sequence[Device]) -> tuple[tuple[object, ...], list[Device]]:
        """A key equal for VWs that differ only by node names/indices, and the GPUs in key order."""
        ordered = sorted(gpus, key=lambda d: (d.type, d.memory_bytes, d.node, d.index))
        ids: dict[str, int] = {}
        key = tuple((d.type, d.memory_bytes, ids.setdefault(d.node, len(ids))) for d in ordered)
        return key, ordered

    def nm_max(self, gpus: Sequence[Device]) -> tuple[int, int]:
        """Largest feasible Nm (0 if none) and the Nm=1 shortfall in bytes when infeasible."""
        key, ordered = self.canonical(gpus)
        if key not in self.nm_cache:
            self.nm_cache[key] = self._nm_max(ordered)
        return self.nm_cache[key]

    def _nm_max(self, gpus: Sequence[Device]) -> tuple[int, int]:
        """The largest Nm over the ladder's placements, and the smallest Nm=1 shortfall."""
        found, host_error = [], None
        for pl in self.ladder:
            try:
                found.append(self._nm_max_under(self.cm_for(pl), gpus))
            except PlanError as exc:  # its offloaded bytes exceed host memory at any size
                host_error = host_error or exc
        if not found and host_error is not None:
            raise host_error
        best = max(nm for nm, _ in found)
        return (best, 0) if best else (0, min(short for _, short in found))

    def _nm_max_under(self, cm: CostModel, gpus: Sequence[Device]) -> tuple[int, int]:
        """Bisection on Nm with the exact every-order memory check (:mod:`planner.partition.memory`)."""
        if not fits_memory(cm, gpus, 1):
            return 0, min_memory_shortfall(cm, gpus, 1)
        lo, hi = 1, 2
        while hi <= self.opts.nm_limit and fits_memory(cm, gpus, hi):
            lo, hi = hi, hi * 2
        hi = min(hi, self.opts.nm_limit + 1)
        while hi - lo > 1:  # lo fits, hi does not (or exceeds the limit)
            mid = (lo + hi) // 2
            if fits_memory(cm, gpus, mid):
                lo = mid
            else:
                hi = mid
        return lo, 0

    def partition(self, gpus: Sequence[Device], nm: int, screen: bool = False) -> Partition:
        """Optimal order and split of ``gpus`` at ``nm`` (cached over isomorphic VWs).

        With several ladder placements (``--memory auto``) each one under which the VW fits is
        partitioned, and the partition whose slowest stage is fastest once each stage takes its
        own best placement (:meth:`refined_ms`) wins; ties go to the cheaper ladder entry.

        ``screen``: use the exact DP search whatever the partitioner, for comparing Nm
        candidates; the final plan uses ``opts.partitioner``.
        """
        best: tuple[float, Partition] | None = None
        for pl in self.ladder:
            if len(self.ladder) > 1 and not fits_memory(self.cm_for(pl), gpus, nm):
                continue
            part = self._partition_under(gpus, nm, screen, pl)
            ms = (
                refined_ms(self.cm, self.cluster, part, nm, self.candidates)
                if len(self.ladder) > 1
                else part.bottleneck_ms
            )
            if best is None or ms < best[0]:
                best = (ms, part)
        if best is None:  # nothing fits: the partitioner's own error names the shortfall
            return self._partition_under(gpus, nm, screen, self.ladder[-1])
        return best[1]

    def _partition_under(
        self, gpus: Sequence[Device], nm: int, screen: bool, placement: MemoryPlacement
    ) -> Partition:
        """Optimal order and split of ``gpus`` at ``nm`` with every stage under ``placement``."""
        key, ordered = self.canonical(gpus)
        use_dp = self.opts.partitioner == "dp" or screen
        cm = self.cm_for(placement)
        ck = (key, nm, use_dp, placement)
        if ck not in self.cache:
            reuse = self._reusable(key, ordered, nm, use_dp, placement)
            if reuse is not None:
                self.cache[ck] = reuse
        if ck not in self.cache:
            limit = self.opts.time_limit_s
            if use_dp:
                part = partition_exact(cm, ordered, nm, time_limit_s=limit)
            elif self.opts.partitioner == "milp":
                part = partition_milp(cm, ordered, nm, solver=self.opts.solver, time_limit_s=limit)
            else:
                raise PlanError(f"unknown partitioner {self.opts.partitioner!r}; use dp or milp")
            bound = part.lower_bound_ms
            if self.full is not None:  # coarsened (--max-cuts): bound the exact optimum instead
                bound = min(bound, lower_bound_ms(self.full, ordered))
            where = {id(d): i for i, d in enumerate(ordered)}
            perm = tuple(where[id(d)] for d in part.gpus)
            self.cache[ck] = (perm, part.bounds, bound, part.solver)
            log.info(
                "partitioned %s at Nm=%d with %s in %.3f s (gap %.2g)",
                _letters(part.gpus),
                nm,
                part.solver,
                part.solve_s,
                part.gap,
            )
        perm, bounds, bound, solver = self.cache[ck]
        order = tuple(ordered[i] for i in perm)
        stage_ms = tuple(
            cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(order))
        )
        cuts = tuple(int(cm.positions[b]) for b in bounds)
        return Partition(order, bounds, cuts, stage_ms, max(stage_ms), solver, 0.0, bound)

    def _reusable(
        self,
        key: tuple[object, ...],
        ordered: Sequence[Device],
        nm: int,
        use_dp: bool,
        placement: MemoryPlacement,
    ) -> tuple[tuple[int, ...], tuple[int, ...], float, str] | None:
        """An optimum at a smaller Nm that still fits memory at ``nm`` (then it is optimal here too).

        Memory only grows with Nm, so the feasible partitions at ``nm`` are a subset of those
        at any smaller Nm: the smaller Nm's optimum, when it fits and the stage times are the
        same at both (the placement moves the same bytes), is optimal at ``nm``; its lower
        bound stays valid.
        """
        same = (key, use_dp, placement)
        done = sorted(
            ((ck[1], v) for ck, v in self.cache.items() if (ck[0], ck[2], ck[3]) == same),
            key=lambda item: item[0] if isinstance(item[0], int) else 0,
        )
        cm = self.cm_for(placement)
        for small, (perm, bounds, bound, solver) in reversed(done):
            if not isinstance(small, int) or small >= nm:
                continue
            if not cm.same_times(len(ordered), small, nm):  # more moves at ``nm``: re-solve
                continue
            order = [ordered[i] for i in perm]
            if all(
                cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).memory_bytes
                <= order[j].memory_bytes
                for j in range(len(order))
            ):
                return perm, bounds, bound, solver
        return None


def _letters(gpus: Sequence[Device]) -> str:
    return "".join(d.letter for d in gpus)


def _slot(d: Device) -> GpuSlot:
    return GpuSlot(
        d.node, d.index, d.type, d.memory_bytes, d.emulation.speed if d.emulation else 0.0
    )


def _stages(pl: _Planner, part: Partition, nm: int) -> tuple[StagePlan, ...]:
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
    """The discrete-event simulator's prediction (``None`` when it refuses the plan or waves < 2)."""
    if waves < 2:
        return None
    from planner.sim.simulator import simulate

    try:
        res = simulate(plan, waves=waves)
    except PlanError as exc:
        log.warning("simulator refused the plan (%s); keeping the analytic prediction", exc)
        return None
    p = plan.predicted
    return Prediction(
        res.throughput,
        tuple(res.per_vw_throughput),
        p.allreduce_throughput,
        p.allreduce_gpus,
        "simulated",
    )


def _plan_allocation(
    pl: _Planner,
    alloc: Allocation,
    model: str,
    batch: int,
    nm: int | None,
    D: int,
    placement: str,
    provenance: dict[str, str],
) -> Plan:
    nm_max = []
    for v, gpus in enumerate(alloc.groups):
        best, short = pl.nm_max(gpus)
        if best == 0:
            fix = "give it more or larger GPUs (another policy or --vws)"
            if pl.opts.memory != "auto" and any(fits_memory(pl.cm_for(x), gpus, 1) for x in LADDER):
                fix = "let the memory manager offload or recompute (--memory auto), or " + fix
            emulated = {g.node: g.emulation for g in gpus if g.emulation is not None}
            if emulated:  # every stage fits once each GPU has the smallest shortfall more
                fix = "raise emulate.memory in the cluster file: " + ", ".join(
                    f"node {node} {format_bytes(e.memory_bytes)} -> "
                    f"{format_bytes(e.memory_bytes + int(short) + 1)}"
                    for node, e in sorted(emulated.items())
                )
            raise PlanError(
                f"VW {v} ({_letters(gpus)}) cannot hold {model} even with Nm=1: smallest shortfall "
                f"{format_bytes(short)} on one stage; {fix}"
            )
        nm_max.append(best)
    plan_nm = min(nm_max)
    args = (model, batch, D, placement, provenance)
    if nm is not None:
        if nm < 1:
            raise PlanError(f"--nm must be >= 1, got {nm}")
        if nm > plan_nm:
            log.warning("--nm %d exceeds what memory allows (%d); using %d", nm, plan_nm, plan_nm)
        plan_nm = min(plan_nm, nm)
    elif pl.opts.nm_choice == "best":
        s_max = max(len(g) for g in alloc.groups)
        scored = []
        for cand in _nm_candidates(plan_nm, s_max):
            try:
                trial = _build(pl, alloc, cand, nm_max, *args, screen=True)
            except PlanError:  # the offloaded bytes exceed a node's host_memory at this Nm
                if cand == 1 or pl.opts.memory == "keep":
                    raise
                continue
            scored.append((trial.predicted.throughput, -cand))
            log.debug(
                "Nm=%d -> %.1f samples/s (%s)",
                cand,
                trial.predicted.throughput,
                trial.predicted.method,
            )
        plan_nm = _stable_best_nm(scored)
    elif pl.opts.nm_choice != "max":
        raise PlanError(f"unknown Nm choice {pl.opts.nm_choice!r}; use best or max")
    return _build(pl, alloc, plan_nm, nm_max, *args)


NM_TOLERANCE = 0.03  # Nm within this fraction of the best predicted throughput counts as best


def _stable_best_nm(scored: Sequence[tuple[float, int]]) -> int:
    """The smallest Nm whose predicted throughput is within :data:`NM_TOLERANCE` of the best.

    ``scored`` holds ``(throughput, -Nm)`` pairs. Predictions that differ by a few per cent are
    within the profile's noise; the smaller Nm then wins, because it needs less memory and
    gives less staleness (paper Sec. 5), and the choice no longer flips between runs.
    """
    top = max(t for t, _ in scored)
    return min(-neg for t, neg in scored if t >= (1.0 - NM_TOLERANCE) * top)


def _nm_candidates(hi: int, s_max: int) -> list[int]:
    """Nm values worth comparing: ``1 .. S+2``, powers of two and the largest feasible ``hi``."""
    cands = set(range(1, min(hi, s_max + 2) + 1)) | {2**k for k in range(1, 8) if 2**k <= hi} | {hi}
    return sorted(cands)


def _build(
    pl: _Planner,
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
    total = cluster_throughput(per_vw, traffic, pl.cluster.inter_node.bandwidth_bps, plan_nm, batch)
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


def planning_view(cluster: Cluster) -> Cluster:
    """The cluster as the planner sees it: emulated devices have their emulated memory cap."""
    if not any(n.emulation for n in cluster.nodes):
        return cluster
    nodes = tuple(
        replace(n, memory_bytes=n.emulation.memory_bytes) if n.emulation is not None else n
        for n in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def make_plan(
    cluster: Cluster,
    profiles: Mapping[str, Profile] | Sequence[Profile] | None = None,
    model: str | None = None,
    batch_size: int | None = None,
    policy: str | None = None,
    nm: int | None = None,
    D: int = 0,
    placement: str = "default",
    num_vws: int | None = None,
    optimizer: str = "momentum",
    links: Mapping[str, Link] | None = None,
    options: PlanOptions | None = None,
    reference_type: str | None = None,
    report: list[Candidate] | None = None,
    precision: str = "fp32",
) -> Plan:
    """Plan HetPipe training of a model on a cluster.

    Args:
        cluster: the cluster.
        profiles: measured/imported profiles (one per GPU type, or a list); may be empty when
            ``model`` is a built-in or importable model (analytic profiles are used).
        model: model reference; checked against the profiles' model.
        batch_size: minibatch size; checked against the profiles' (default: theirs, else 32).
        policy: ``np``, ``ed``, ``hd`` or ``auto`` (default:
            :func:`planner.allocation.default_policy`, ``hd`` where it applies, else ``ed``).
        nm: cap on the number of concurrent minibatches per VW.
        D: WSP clock-distance threshold (recorded; bounds global staleness).
        placement: ``default`` or ``local`` parameter-server shard placement.
        num_vws: number of virtual workers (default: the policy's).
        optimizer: ``sgd``, ``momentum`` or ``adam`` (optimizer-state memory).
        links: measured ``intra_node``/``inter_node`` links overriding the cluster's.
        options: partitioner knobs.
        reference_type: GPU type an imported profile of unknown hardware was measured on.
        report: with ``policy="auto"``, receives one :class:`~planner.auto_search.Candidate`
            row per allocation considered (for ``hetpipe plan``'s table).
        precision: ``fp32`` or ``bf16``: float32 profiles are converted to bfloat16 bytes
            (:meth:`profiler.table.Profile.at_precision`); the plan records it.

    Raises:
        PlanError, ProfileError, ConfigError: one line saying what is wrong and how to fix it.
    """
    t0 = time.perf_counter()
    opts = options or PlanOptions()
    if D < 0:
        raise PlanError(f"-D must be >= 0, got {D}")
    if links:
        cluster = replace(
            cluster,
            intra_node=links.get("intra_node", cluster.intra_node),
            inter_node=links.get("inter_node", cluster.inter_node),
        )
    original = cluster
    cluster = planning_view(cluster)
    by_type, provenance, model_name, batch = resolve_profiles(
        cluster, profiles, model, batch_size, reference_type, precision
    )
    by_type = {t: prof.at_precision(precision) for t, prof in by_type.items()}
    first_measured = next(
        (t for t, p in provenance.items() if not p.startswith(("analytic", "scaled"))), None
    )
    memory_ladder(opts.memory)  # a bad --memory fails before any work
    cm = CostModel(
        by_type,
        cluster.link,
        optimizer_factor(optimizer),
        opts.max_cuts,
        first_measured,
        cluster.host_link,
        cluster.host_shares(),
    )
    full = None
    if cm.num_segments < cm.num_layers:  # --max-cuts coarsened the graph: bound the exact optimum
        full = CostModel(by_type, cluster.link, optimizer_factor(optimizer), None, first_measured)
        log.warning(
            "--max-cuts %s: %d of %d candidate cuts kept; each VW records a proven lower bound "
            "on the exact optimum",
            opts.max_cuts,
            cm.num_segments - 1,
            cm.num_layers - 1,
        )
    pl = _Planner(cluster, cm, opts, original, full)
    args = (model_name, batch, nm, D, placement, provenance)
    if policy is None:
        policy = default_policy(cluster, num_vws)
    if policy != "auto":
        plan = _plan_allocation(pl, allocate(cluster, policy, num_vws), *args)
        log.info("planned %s on %s in %.2f s", model_name, cluster.name, time.perf_counter() - t0)
        return replace(plan, precision=precision)

    def bound(alloc: Allocation) -> float:
        worst = max(lower_bound_ms(cm, g) for g in alloc.groups)
        for g in alloc.groups:
            check_stage_count(cm, len(g))
        return len(alloc.groups) * batch * 1000.0 / worst if worst > 0 else float("inf")

    allocs = candidate_allocations(cluster, num_vws, opts.auto_max_vw_gpus)
    best, rows = compare_allocations(
        allocs, bound, lambda al: _plan_allocation(pl, al, *args), opts.auto_budget_s
    )
    if report is not None:
        report.extend(rows)
    if best is None:
        reasons = [f"{'/'.join(r.signatures)}: {r.status}" for r in rows]
        raise PlanError("policy 'auto' found no feasible allocation: " + "; ".join(reasons[:3]))
    log.info("planned %s on %s in %.2f s", model_name, cluster.name, time.perf_counter() - t0)
    return replace(best, policy=f"auto:{best.policy}", precision=precision)


def plan(
    cluster: Cluster | str | os.PathLike[str],
    profiles: Mapping[str, Profile]
    | Sequence[Profile]
    | Sequence[str | os.PathLike[str]]
    | None = None,
    policy: str | None = None,
    **kwargs: Any,
) -> Plan:
    """The Python API behind ``hetpipe plan``: ``plan("cluster.yaml", ["profiles/"], policy="ed")``.

    Args:
        cluster: a :class:`Cluster` or a cluster.yaml path.
        profiles: profiles, or CSV files/folders of them.
        policy: ``np``, ``ed``, ``hd`` or ``auto`` (default: ``hd`` where it applies, else ``ed``).
        **kwargs: any other :func:`make_plan` argument (``model``, ``batch_size``, ``nm``, ``D``, ...).
    """
    from planner.cluster import load_cluster
    from profiler.table import load_profile_set

    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    plist: Mapping[str, Profile] | Sequence[Profile] | None
    if (
        profiles is not None
        and not isinstance(profiles, Mapping)
        and any(not isinstance(p, Profile) for p in profiles)
    ):
        given = [p for p in profiles if isinstance(p, Profile)]
        plist = given + load_profile_set([p for p in profiles if not isinstance(p, Profile)])
    else:
        plist = profiles  # type: ignore[assignment]
    return make_plan(cl, plist, policy=policy, **kwargs)
