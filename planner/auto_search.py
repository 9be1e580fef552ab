"""The ``auto`` policy's search: compare every allocation that could win, within a time budget.

Candidates (every policy x VW count, :func:`planner.allocation.candidate_allocations`) are
visited in decreasing order of an optimistic throughput bound (``#VWs x batch / slowest VW's
lower bound``, :func:`planner.partition.search.lower_bound_ms`; WSP is straggler-bound, so no
plan of that allocation can do better). A candidate is planned in full unless

- its bound is below the best prediction so far divided by :data:`MARGIN` (it cannot win:
  the margin covers the simulator's prediction exceeding the analytic one), or
- the planning-time budget is spent (it is reported as skipped, never silently dropped).

Every candidate comes back as a :class:`Candidate` row, which ``hetpipe plan`` shows as a table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.allocation import Allocation
from planner.plan import Plan
from profiler.errors import PlanError

__all__ = ["MARGIN", "Candidate", "compare_allocations"]

MARGIN = 1.1
"""A candidate whose bound is below ``best / MARGIN`` cannot win."""


@dataclass(frozen=True)
class Candidate:
    """One allocation ``auto`` considered.

    Attributes:
        policy: ``np``, ``ed`` or ``hd``.
        signatures: GPU letters of each VW.
        bound: optimistic throughput bound, samples/s (0: none, e.g. too many GPUs per VW).
        throughput: predicted samples/s (0: not planned).
        nm: the plan's Nm (0: not planned).
        seconds: planning time spent on it.
        status: ``chosen``, ``planned``, ``cannot win``, ``skipped (budget)`` or ``infeasible: ...``.
    """

    policy: str
    signatures: tuple[str, ...]
    bound: float
    throughput: float
    nm: int
    seconds: float
    status: str


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


def compare_allocations(
    allocs: Sequence[Allocation],
    bound: Callable[[Allocation], float],
    plan_one: Callable[[Allocation], Plan],
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Plan | None, list[Candidate]]:
    """The best plan among ``allocs`` and a row for every candidate (in visiting order).

    Args:
        allocs: candidate allocations.
        bound: optimistic throughput of an allocation (may raise :class:`PlanError`).
        plan_one: the full plan of an allocation (may raise :class:`PlanError`).
        budget_s: planning-time budget; once spent, the remaining candidates are skipped (the
            first feasible one is always planned, so ``auto`` never fails for lack of time alone).
        clock: seconds (injected by tests).
    """
    t0 = clock()
    scored, rows = _by_bound(allocs, bound)
    best: Plan | None = None
    best_row = -1
    for ub, alloc in scored:
        sig = alloc.signatures
        if best is not None and ub * MARGIN < best.predicted.throughput:
            rows.append(Candidate(alloc.policy, sig, ub, 0.0, 0, 0.0, "cannot win"))
            continue
        if best is not None and clock() - t0 > budget_s:
            rows.append(Candidate(alloc.policy, sig, ub, 0.0, 0, 0.0, "skipped (budget)"))
            continue
        start = clock()
        try:
            plan = plan_one(alloc)
        except PlanError as exc:
            rows.append(
                Candidate(alloc.policy, sig, ub, 0.0, 0, clock() - start, f"infeasible: {exc}")
            )
            continue
        took = clock() - start
        rows.append(Candidate(alloc.policy, sig, ub, plan.predicted.throughput, plan.nm, took, "planned"))  # fmt: skip
        if best is None or plan.predicted.throughput > best.predicted.throughput:
            best, best_row = plan, len(rows) - 1
    if best_row >= 0:
        r = rows[best_row]
        rows[best_row] = Candidate(
            r.policy, r.signatures, r.bound, r.throughput, r.nm, r.seconds, "chosen"
        )
    return best, rows
