"""PuLP MILP that chooses a virtual worker's GPU order *and* its layer split (paper Sec. 4, 7).

:func:`partition_milp` solves the model of :class:`planner.partition.milp_model.MilpModel`,
whose module docstring writes the formulation out, with HiGHS or CBC, seeded by the DP upper
bound. The solver status is always checked: anything but a proven optimum returns the best
partition found marked ``(time limit)`` with a proven lower bound, or raises
:class:`PlanError` when none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import pulp

from planner.cluster import Device
from planner.costmodel import CostModel
from planner.partition.bounds import (
    classes,
    upper_bound,
)
from planner.partition.dp import (
    InfeasiblePartition,
    Partition,
    partition_dp,
)
from planner.partition.milp_model import MilpModel
from planner.partition.search import lower_bound_ms
from profiler.errors import ConfigError, PlanError

__all__ = ["available_solvers", "partition_milp"]

log = logging.getLogger(__name__)


def available_solvers() -> list[str]:
    """MILP back ends usable here: ``highs`` (highspy) and/or ``cbc`` (bundled with PuLP)."""
    out = []
    if pulp.HiGHS(msg=False).available():
        out.append("highs")
    if pulp.PULP_CBC_CMD(msg=False).available():
        out.append("cbc")
    return out


def _make_solver(name: str, time_limit_s: float) -> tuple[pulp.LpSolver, str]:
    name = name.lower()
    if name not in ("auto", "highs", "cbc"):
        raise ConfigError(f"unknown MILP solver {name!r}; use auto, highs or cbc")
    if name in ("auto", "highs"):
        solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=1e-9, threads=1)
        if solver.available():
            return solver, "milp-highs"
        if name == "highs":
            raise ConfigError(
                "solver 'highs' requested but highspy is not installed (pip install highspy)"
            )
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-9, threads=1), "milp-cbc"


def _solved(prob: pulp.LpProblem) -> bool:
    """Whether the solver proved an optimum or infeasibility (anything else: it gave up)."""
    optimal = prob.status == pulp.LpStatusOptimal and prob.sol_status == pulp.LpSolutionOptimal
    return optimal or prob.status == pulp.LpStatusInfeasible


def _solve(prob: pulp.LpProblem, solver: str, time_limit_s: float, t0: float) -> str:
    """Solve ``prob`` with ``solver``; under ``auto``, CBC again when HiGHS did not decide.

    Returns the label of the solver that ran last (``milp-highs`` or ``milp-cbc``)."""
    lp_solver, label = _make_solver(solver, time_limit_s)
    prob.solve(lp_solver)
    if label == "milp-highs" and solver.lower() == "auto" and not _solved(prob):
        # HiGHS through PuLP is not always reliable (highspy 1.16 with PuLP 3.3 returns 'Not
        # Solved' at once on models 1.15 solves): CBC decides instead of failing the plan
        log.warning(
            "MILP: HiGHS ended with status %r; solving again with CBC",
            pulp.LpStatus[prob.status],
        )
        lp_solver, label = _make_solver("cbc", max(1.0, time_limit_s - (time.perf_counter() - t0)))
        prob.solve(lp_solver)
    return label


def _time_limited(
    model: MilpModel,
    cm: CostModel,
    gpus: Sequence[Device],
    ub_part: Partition | None,
    label: str,
    time_limit_s: float,
    t0: float,
) -> tuple[Partition | None, float]:
    """A time limit (or solver trouble): keep the better of the solver's incumbent and the DP
    upper bound, and say what is proven about it (never a bare 'Optimal' failure).

    Returns the DP partition when it is the better one (else ``None``: use the incumbent) and
    the proven lower bound (ms)."""
    took = time.perf_counter() - t0
    has_incumbent = model.prob.sol_status == pulp.LpSolutionIntegerFeasible
    if not has_incumbent and ub_part is None:
        raise PlanError(
            f"MILP solver {label} stopped after {took:.1f} s (time limit {time_limit_s:g} s) "
            f"without a partition that fits; raise --time-limit or use --partitioner dp"
        )
    bound = lower_bound_ms(cm, gpus)
    log.warning(
        "MILP %s stopped at its time limit (%.1f s) without proving optimality; keeping the "
        "best partition found (proven lower bound %.4f ms)",
        label,
        took,
        bound,
    )
    if ub_part is not None and (
        not has_incumbent or ub_part.objective_ms <= float(pulp.value(model.z))
    ):
        return replace(ub_part, solver=f"{label} (time limit)", bound_ms=bound, solve_s=took), bound
    return None, bound


def _solution(
    model: MilpModel, cm: CostModel, nm: int, label: str, proven: bool, bound: float, t0: float
) -> Partition:
    """The solver's partition (``proven``: optimal, else its incumbent with lower bound ``bound``)."""
    bounds, order = model.solution()
    obj = float(pulp.value(model.z))
    stage_ms = tuple(
        cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(order))
    )
    part = Partition(
        gpus=tuple(order),
        bounds=tuple(bounds),
        cuts=tuple(int(cm.positions[b]) for b in bounds),
        stage_ms=stage_ms,
        objective_ms=obj,
        solver=label if proven else f"{label} (time limit)",
        solve_s=time.perf_counter() - t0,
        bound_ms=bound if not proven else float("nan"),
    )
    log.debug(
        "%s: %d GPUs x %d segments in %.3f s, bottleneck %.4f ms",
        label,
        model.k,
        cm.num_segments,
        part.solve_s,
        obj,
    )
    return part


def partition_milp(
    cm: CostModel,
    gpus: Sequence[Device],
    nm: int = 1,
    memory: bool = True,
    solver: str = "auto",
    fixed_order: bool = False,
    time_limit_s: float = 60.0,
    use_bound: bool = True,
    disaggregate: bool = False,
) -> Partition:
    """Optimal GPU order and partition for one virtual worker, proven by a MILP solver.

    Args:
        cm: cost model.
        gpus: the VW's GPUs (any order unless ``fixed_order``).
        nm: minibatches in flight (sets each stage's memory need).
        memory: enforce the memory limits.
        solver: ``auto`` (HiGHS when installed, else CBC), ``highs`` or ``cbc``.
        fixed_order: keep ``gpus`` in the given order (then the MILP cross-checks the DP).
        time_limit_s: solver time limit; when hit, the best partition found (the solver's or the
            DP upper bound's) is returned with ``bound_ms`` a proven lower bound (never silently:
            ``solver`` ends in ``(time limit)``).
        use_bound: use the DP upper bound to fix variables (off only to benchmark the plain model).

    Raises:
        InfeasiblePartition: no order and partition fit memory.
        PlanError: the solver stopped without any partition that fits.
    """
    t0 = time.perf_counter()
    if len(gpus) > cm.num_segments:
        raise PlanError(
            f"{len(gpus)} GPUs but only {cm.num_segments} candidate segments; use fewer GPUs per VW"
        )
    cls = classes(gpus)
    ub_part = None
    if use_bound:
        ub_part = (
            partition_dp(cm, gpus, nm, memory)
            if fixed_order
            else upper_bound(cm, cls, gpus, nm, memory)
        )
    if len(gpus) == 1:
        return partition_dp(cm, gpus, nm, memory)
    model = MilpModel(
        cm, gpus, nm, memory, fixed_order, ub_part.objective_ms if ub_part else None, disaggregate
    )
    label = _solve(model.prob, solver, time_limit_s, t0)
    if model.prob.status == pulp.LpStatusInfeasible:
        letters = "".join(g.letter for g in gpus)
        raise InfeasiblePartition(
            f"MILP: no order and partition of {letters} fits memory with Nm={nm}", 0
        )
    proven = _solved(model.prob)
    bound = float("nan")
    if not proven:
        kept, bound = _time_limited(model, cm, gpus, ub_part, label, time_limit_s, t0)
        if kept is not None:
            return kept
    return _solution(model, cm, nm, label, proven, bound, t0)
