"""The ``auto`` policy's search: compare every allocation that could win, within a CPU budget.

Cheap bounds first: every candidate (each plain policy's own allocation, every policy x VW
count, :func:`planner.allocation.candidate_allocations`) gets an optimistic throughput bound
(``#VWs x batch / slowest VW's lower bound``, :func:`planner.partition.search.lower_bound_ms`;
WSP is straggler-bound, so no plan of that allocation can do better). Then exact solves, in
decreasing order of bound, until

- the best prediction so far beats every remaining bound (times :data:`MARGIN`, which covers
  the simulator's prediction exceeding the analytic one): the rest ``cannot win``; or
- the budget (CPU seconds of this process, so that other processes' load does not spend it)
  is spent: the rest are ``cut by budget``, with their bound.

The budget is shared: each solve gets a fair share of what is left (``left / candidates
left``, at least :data:`MIN_SHARE_S`) as its partition time limit, so one slow candidate cannot
starve the rest; a candidate stopped by its share keeps its best partition and proven gap.
The first feasible candidate and each plain policy's own allocation (``Allocation.natural``)
are solved whatever the budget, so ``auto`` never predicts less than ``--policy np/ed/hd``.

Every candidate comes back as a :class:`Candidate` row, which ``hetpipe plan`` shows as a table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planner.allocation import Allocation
from planner.plan import Plan
from profiler.errors import PlanError

__all__ = ["MARGIN", "MIN_SHARE_S", "Candidate", "compare_allocations"]

MARGIN = 1.1
"""A candidate whose bound is below ``best / MARGIN`` cannot win."""

MIN_SHARE_S = 1.0
"""Smallest partition time limit a solve is given (the exact search needs a moment to find a
first partition)."""


@dataclass(frozen=True)
class Candidate:
    """One allocation ``auto`` considered.

    Attributes:
        policy: ``np``, ``ed`` or ``hd``.
        signatures: GPU letters of each VW.
        bound: optimistic throughput bound, samples/s (0: none, e.g. too many GPUs per VW).
        throughput: predicted samples/s (0: not planned).
        nm: the plan's Nm (0: not planned).
        seconds: CPU seconds spent on it.
        status: ``chosen``, ``planned``, ``cannot win``, ``cut by budget`` or ``infeasible: ...``.
        solve: ``exact`` (every VW's partition proven optimal), ``gap N %`` (stopped by its
            time share: the slowest stage is at most N % above the optimum) or empty (not solved).
    """

    policy: str
    signatures: tuple[str, ...]
    bound: float
    throughput: float
    nm: int
    seconds: float
    status: str
    solve: str = ""


def _by_bound(
    allocs: Sequence[Allocation], bound: Callable[[Allocation], float]
) -> tuple[list[tuple[float, Allocation]], list[Candidate]]:
    """The allocations with their optimistic bound, best first, and a row for each one whose
    bound refused it (infeasible)."""
    rows: list[Candidate] = []
    scored: list[tuple[float, Allocation]] = []
    for alloc in allocs:
        try:
            scored.append((bound(alloc), alloc))
        except PlanError as exc:
            rows.append(
                Candidate(alloc.policy, alloc.signatures, 0.0, 0.0, 0, 0.0, f"infeasible: {exc}")
            )
    scored.sort(key=lambda x: -x[0])
    return scored, rows


def _solve_kind(plan: Plan) -> str:
    """``exact`` when every VW's partition is proven optimal, else its largest proven gap."""
    if all(vw.bound_ms > 0 and vw.gap <= 1e-6 for vw in plan.virtual_workers):
        return "exact"
    gaps = [vw.gap for vw in plan.virtual_workers if vw.bound_ms > 0]
    return f"gap {100 * max(gaps):.1f} %" if gaps else "gap unknown"


def compare_allocations(
    allocs: Sequence[Allocation],
    bound: Callable[[Allocation], float],
    plan_one: Callable[[Allocation, float], Plan],
    budget_s: float,
    clock: Callable[[], float] = time.process_time,
) -> tuple[Plan | None, list[Candidate]]:
    """The best plan among ``allocs`` and a row for every candidate (in visiting order).

    Args:
        allocs: candidate allocations.
        bound: optimistic throughput of an allocation (may raise :class:`PlanError`).
        plan_one: the full plan of an allocation under a partition time limit in seconds
            (``inf``: the user's own, for natural allocations; may raise :class:`PlanError`).
        budget_s: CPU seconds for the whole search; once spent, the remaining candidates are
            cut (the first feasible one and the natural ones are always solved).
        clock: CPU seconds (injected by tests).
    """
    t0 = clock()
    scored, rows = _by_bound(allocs, bound)
    best: Plan | None = None
    best_row = -1
    for i, (ub, alloc) in enumerate(scored):
        sig = alloc.signatures
        if best is not None and ub * MARGIN < best.predicted.throughput:
            rows.append(Candidate(alloc.policy, sig, ub, 0.0, 0, 0.0, "cannot win"))
            continue
        left = budget_s - (clock() - t0)
        if best is not None and left <= 0 and not alloc.natural:
            rows.append(Candidate(alloc.policy, sig, ub, 0.0, 0, 0.0, "cut by budget"))
            continue
        share = math.inf if alloc.natural else max(MIN_SHARE_S, left / (len(scored) - i))
        start = clock()
        try:
            plan = plan_one(alloc, share)
        except PlanError as exc:
            rows.append(
                Candidate(alloc.policy, sig, ub, 0.0, 0, clock() - start, f"infeasible: {exc}")
            )
            continue
        took, got = clock() - start, plan.predicted.throughput
        rows.append(Candidate(alloc.policy, sig, ub, got, plan.nm, took, "planned", _solve_kind(plan)))  # fmt: skip
        if best is None or got > best.predicted.throughput:
            best, best_row = plan, len(rows) - 1
    if best_row >= 0:
        rows[best_row] = replace(rows[best_row], status="chosen")
    return best, rows
