"""``make_plan``: allocation -> per-VW Nm and partition -> shard placement -> predictions.

Steps (paper Sec. 4, 7, 8.1):

1. one profile per GPU type of the cluster: given ones first; missing types are filled with
   the analytic profiler (built-in or importable models) or by scaling a given profile with
   ``profiler.analytic.scale_profile``, an emulated cluster's from the given ``cpu`` profile
   (the front end measures it: :mod:`hetpipe.planning`); the plan's ``profiles`` field
   records the provenance;
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

Steps 3-4 for one VW are :class:`planner.vw_solver.VWSolver`; step 5 and the plan's
assembly are :func:`planner.assemble.build_plan`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from planner.allocation import Allocation, allocate, candidate_allocations, default_policy
from planner.assemble import build_plan
from planner.auto_search import Candidate, compare_allocations
from planner.cluster import Cluster, Device, Link
from planner.costmodel import CostModel, optimizer_factor
from planner.memory_choice import memory_ladder
from planner.offload import LADDER
from planner.partition.memory import check_stage_count, fits_memory
from planner.partition.search import lower_bound_ms
from planner.plan import Plan
from planner.profiles import resolve_profiles
from planner.remedies import Refusal, fit_remedies, refusal_message
from planner.vw_solver import VWSolver
from profiler.errors import PlanError
from profiler.table import Profile

__all__ = ["PlanOptions", "make_plan"]

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
        auto_budget_s: CPU seconds ``auto`` may spend on its candidates, shared between them
            (:mod:`planner.auto_search`); candidates not reached within it are reported as cut.
        nm_choice: without a user ``nm``: ``best`` (default) compares Nm = 1..S+2, powers of
            two and the largest feasible Nm by predicted throughput (paper Sec. 8.3: "Nm is set
            such that performance is maximized"; ties go to the smaller Nm, less staleness);
            ``max`` takes the largest feasible Nm (the minimum over VWs of their ``nm_max``).
        simulate_waves: when >= 2, the prediction (and ``auto``'s ranking) comes from the
            discrete-event simulator (``planner.sim.simulator``) over this many waves, read at
            steady state (:func:`planner.throughput.steady_throughput`: every VW at the slowest
            VW's rate; within ~0.5 % of a 1,000-wave run at 32 waves, docs/simulator.md); the
            analytic estimate is the fallback.
        memory: the memory manager (:mod:`planner.offload`): ``keep`` (default: everything on
            the device), ``auto`` (per Nm, each VW is partitioned under every placement of
            :data:`planner.offload.LADDER` that fits, each stage then takes its fastest fitting
            placement, and the fastest result wins) or one placement for every stage
            (``activations:recompute``).
        remedy: the run's staleness remedy (:data:`planner.staleness.REMEDIES`): the memory
            model counts the weight copies it keeps (``predict``:
            :func:`planner.staleness.remedy_weight_copies`); the plan records it.
    """

    partitioner: str = "dp"
    solver: str = "auto"
    max_cuts: int | None = None
    nm_limit: int = 64
    time_limit_s: float = 60.0
    auto_max_vw_gpus: int = 16
    auto_budget_s: float = 120.0
    nm_choice: str = "best"
    simulate_waves: int = 32
    memory: str = "keep"
    remedy: str = "none"


def _plan_allocation(
    pl: VWSolver,
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
            raise PlanError(_refusal(pl, alloc, v, gpus, model, short))
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
                trial = build_plan(pl, alloc, cand, nm_max, *args, screen=True)
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
    return build_plan(pl, alloc, plan_nm, nm_max, *args)


def _refusal(
    pl: VWSolver, alloc: Allocation, v: int, gpus: Sequence[Device], model: str, short: int
) -> str:
    """The refusal of VW ``v``, which cannot hold the model even with Nm = 1, with every remedy."""
    offload = None
    if pl.opts.memory != "auto":
        offload = any(fits_memory(pl.cm_for(x), gpus, 1) for x in LADDER)
    refusal = Refusal(v, tuple(gpus), model, short, offload)

    def fits(group: Sequence[Device]) -> bool:
        return any(fits_memory(pl.cm_for(x), group, 1) for x in pl.ladder)

    remedies = fit_remedies(pl.cluster, alloc, refusal, fits, pl.cm.num_segments)
    return refusal_message(refusal, remedies)


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


def planning_view(cluster: Cluster) -> Cluster:
    """The cluster as the planner sees it: emulated devices have their emulated memory cap."""
    if not any(n.emulation for n in cluster.nodes):
        return cluster
    nodes = tuple(
        replace(n, memory_bytes=n.emulation.memory_bytes) if n.emulation is not None else n
        for n in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def _cost_models(
    by_type: Mapping[str, Profile],
    cluster: Cluster,
    optimizer: str,
    max_cuts: int | None,
    first_measured: str | None,
    remedy: str = "none",
) -> tuple[CostModel, CostModel | None]:
    """The cost model (coarsened by ``max_cuts``), and the uncoarsened one when it was."""
    cm = CostModel(
        by_type,
        cluster.link,
        optimizer_factor(optimizer),
        max_cuts,
        first_measured,
        cluster.links.host,  # as charged (an emulated cluster's links.scale)
        cluster.host_shares(),
        remedy,
    )
    full = None
    if cm.num_segments < cm.num_layers:  # --max-cuts coarsened the graph: bound the exact optimum
        full = CostModel(
            by_type, cluster.link, optimizer_factor(optimizer), None, first_measured,
            remedy=remedy,
        )  # fmt: skip
        log.warning(
            "--max-cuts %s: %d of %d candidate cuts kept; each VW records a proven lower bound "
            "on the exact optimum",
            max_cuts,
            cm.num_segments - 1,
            cm.num_layers - 1,
        )
    return cm, full


def _plan_auto(
    pl: VWSolver,
    cluster: Cluster,
    num_vws: int | None,
    args: tuple[str, int, int | None, int, str, dict[str, str]],
    report: list[Candidate] | None,
) -> Plan:
    """Policy ``auto``: the best predicted plan over the candidate allocations."""
    cm, batch, opts = pl.cm, args[1], pl.opts

    bounds: dict[tuple[object, ...], float] = {}  # alike VWs (thousands at 10,240 GPUs): once

    def vw_bound(gpus: Sequence[Device]) -> float:
        key, _ = pl.canonical(gpus)
        if key not in bounds:
            check_stage_count(cm, len(gpus))
            bounds[key] = lower_bound_ms(cm, gpus)
        return bounds[key]

    def bound(alloc: Allocation) -> float:
        worst = max(vw_bound(g) for g in alloc.groups)
        return len(alloc.groups) * batch * 1000.0 / worst if worst > 0 else float("inf")

    allocs = candidate_allocations(cluster, num_vws, opts.auto_max_vw_gpus)

    def plan_one(alloc: Allocation, share_s: float) -> Plan:
        limited = replace(opts, time_limit_s=min(opts.time_limit_s, share_s))
        return _plan_allocation(replace(pl, opts=limited), alloc, *args)

    best, rows = compare_allocations(allocs, bound, plan_one, opts.auto_budget_s)
    if report is not None:
        report.extend(rows)
    if best is None:
        reasons = [f"{'/'.join(r.signatures)}: {r.status}" for r in rows]
        raise PlanError("policy 'auto' found no feasible allocation: " + "; ".join(reasons[:3]))
    return best


def make_plan(  # long by its signature and docstring (15 options, documented); the body is ~30 lines
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
        cluster, profiles, model, batch_size, reference_type
    )
    by_type = {t: prof.at_precision(precision) for t, prof in by_type.items()}
    first_measured = next(
        (t for t, p in provenance.items() if not p.startswith(("analytic", "scaled"))), None
    )
    memory_ladder(opts.memory)  # a bad --memory fails before any work
    cm, full = _cost_models(by_type, cluster, optimizer, opts.max_cuts, first_measured, opts.remedy)
    pl = VWSolver(cluster, cm, opts, original, full)
    args = (model_name, batch, nm, D, placement, provenance)
    if policy is None:
        policy = default_policy(cluster, num_vws)
    if policy != "auto":
        plan = _plan_allocation(pl, allocate(cluster, policy, num_vws), *args)
        log.info("planned %s on %s in %.2f s", model_name, cluster.name, time.perf_counter() - t0)
        return replace(plan, precision=precision, remedy=opts.remedy)

    best = _plan_auto(pl, cluster, num_vws, args, report)
    log.info("planned %s on %s in %.2f s", model_name, cluster.name, time.perf_counter() - t0)
    return replace(best, policy=f"auto:{best.policy}", precision=precision, remedy=opts.remedy)
