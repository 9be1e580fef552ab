"""make_plan is exact by default, plans large and mixed VWs, and states its gap when approximate."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.allocation import Allocation, candidate_allocations
from planner.auto_search import Candidate, compare_allocations
from planner.cluster import Cluster, load_cluster, parse_cluster
from planner.plan import Plan
from planner.planner import PlanOptions, make_plan
from profiler.errors import PlanError
from tests.conftest import EXAMPLES
from tests.planner.synth import synthetic_profiles
from tests.planner.test_partition_search import branchy

FAST = PlanOptions(simulate_waves=0)  # analytic predictions: the partitioner is under test


def _cluster(*nodes: tuple[str, str, int]) -> Cluster:
    return parse_cluster({"nodes": [{"name": n, "gpu": g, "count": c} for n, g, c in nodes]})


def _exact(plan: Plan) -> None:
    for vw in plan.virtual_workers:
        assert vw.partitioner == "dp" and vw.bound_ms > 0 and vw.gap < 1e-9
        slowest = max(s.time_ms for s in vw.stages)
        assert vw.bound_ms == pytest.approx(slowest, rel=1e-9)


def test_sixteen_gpus_one_node() -> None:
    one = _cluster(("n", "V100", 16))
    profs = synthetic_profiles(60, ("V100",), seed=1, act_mib=8.0, param_mib=2.0)
    plan = make_plan(one, profs, policy="np", options=FAST)
    assert [len(vw.stages) for vw in plan.virtual_workers] == [16]
    _exact(plan)


def test_sixteen_gpus_more_than_segments_is_one_line() -> None:
    one = _cluster(("n", "V100", 16))
    profs = branchy(60, 30, ("V100",))  # few single-tensor cuts: --max-cuts 0 keeps 3
    with pytest.raises(PlanError, match=r"16 GPUs needs 16 non-empty stages.*--vws") as info:
        make_plan(one, profs, policy="np", options=PlanOptions(max_cuts=0, simulate_waves=0))
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def four_types() -> Cluster:
    return _cluster(("a", "A100", 2), ("t", "T4", 4), ("k", "K80", 8), ("v", "V100", 2))


def test_eight_gpus_of_four_types_ed(four_types: Cluster) -> None:
    profs = synthetic_profiles(
        300, ("A100", "T4", "K80", "V100"), seed=2, act_mib=8.0, param_mib=2.0
    )
    plan = make_plan(four_types, profs, policy="ed", options=FAST)
    assert sorted(vw.signature for vw in plan.virtual_workers) != []
    assert all(len(vw.gpus) == 8 for vw in plan.virtual_workers)
    _exact(plan)


def test_auto_compares_large_vws(four_types: Cluster) -> None:
    profs = synthetic_profiles(
        80, ("A100", "T4", "K80", "V100"), seed=3, act_mib=8.0, param_mib=2.0
    )
    rows: list[Candidate] = []
    plan = make_plan(four_types, profs, policy="auto", options=FAST, report=rows)
    assert plan.policy.startswith("auto:")
    assert sum(r.status == "chosen" for r in rows) == 1
    chosen = next(r for r in rows if r.status == "chosen")
    assert chosen.throughput == pytest.approx(plan.predicted.throughput)
    assert any(r.policy == "ed" and len(r.signatures[0]) == 8 for r in rows)  # VWs > 4 GPUs
    planned = [r for r in rows if r.throughput > 0]
    assert all(r.throughput <= r.bound * 1.1 for r in planned)  # the bound is an upper bound
    assert all(r.throughput <= chosen.throughput for r in planned)


def test_max_cuts_is_an_approximation_with_a_bound() -> None:
    paper = load_cluster(EXAMPLES / "paper_cluster.yaml")
    types = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
    profs = branchy(1200, 400, types)
    exact = make_plan(paper, profs, policy="np", options=FAST)
    approx = make_plan(
        paper, profs, policy="np", options=PlanOptions(max_cuts=320, simulate_waves=0)
    )
    _exact(exact)
    for e, a in zip(exact.virtual_workers, approx.virtual_workers, strict=True):
        slowest_e = max(s.time_ms for s in e.stages)
        slowest_a = max(s.time_ms for s in a.stages)
        assert a.bound_ms <= slowest_e * (1 + 1e-9) <= slowest_a * (1 + 1e-9)
        assert a.gap >= slowest_a / slowest_e - 1 - 1e-9 and a.gap > 0
    assert (
        Plan.from_dict(approx.to_dict()).virtual_workers[0].bound_ms
        == approx.virtual_workers[0].bound_ms
    )


def test_auto_budget_skips_but_reports() -> None:
    """With the budget spent, later candidates are listed as cut, with their bound (fake clock);
    each plain policy's own allocation is solved whatever the budget."""
    paper = load_cluster(EXAMPLES / "paper_cluster.yaml")
    profs = synthetic_profiles(30, seed=4)

    def plan_one(alloc: Allocation, share_s: float) -> Plan:
        return make_plan(paper, profs, policy=alloc.policy, num_vws=len(alloc.groups), options=FAST)

    allocs = candidate_allocations(paper, None, 4)
    assert [a.policy for a in allocs if a.natural] == ["np", "ed", "hd"]
    ticks = iter(range(0, 10_000, 100))
    best, rows = compare_allocations(
        allocs, lambda a: 1e9, plan_one, 50.0, clock=lambda: next(ticks)
    )
    assert best is not None and len(rows) == len(allocs)
    cut = [r for r in rows if r.status == "cut by budget"]
    assert len(cut) == sum(not a.natural for a in allocs) > 0
    assert all(r.bound == 1e9 and r.solve == "" for r in cut)
    assert all(r.solve == "exact" for r in rows if r.throughput > 0)


def test_auto_shares_the_budget_between_candidates() -> None:
    """Each solve gets what is left over the candidates left (natural ones: no cap), and the
    search stops once the best beats every remaining bound."""
    paper = load_cluster(EXAMPLES / "paper_cluster.yaml")
    profs = synthetic_profiles(30, seed=4)
    allocs = [replace(a, natural=False) for a in candidate_allocations(paper, None, 4)]
    allocs[-1] = replace(allocs[-1], natural=True)
    shares: list[float] = []

    def plan_one(alloc: Allocation, share_s: float) -> Plan:
        shares.append(share_s)
        return make_plan(paper, profs, policy=alloc.policy, num_vws=len(alloc.groups), options=FAST)

    ticks = iter(range(0, 10_000, 10))  # every clock read spends 10 s
    budget = 10.0 * (3 * len(allocs) + 1)  # enough for every candidate
    bounds = {a.signatures: 1e9 - i for i, a in enumerate(allocs)}  # visiting order = list order
    compare_allocations(
        allocs, lambda a: bounds[a.signatures], plan_one, budget, clock=lambda: next(ticks)
    )
    n = len(allocs)
    expected = [max(1.0, (budget - 10.0 * (1 + 3 * i)) / (n - i)) for i in range(n - 1)]
    assert shares == [*expected, math.inf]
    _, rows = compare_allocations(allocs, lambda a: 1e-3, plan_one, budget)
    assert [r.status for r in rows[1:]] == ["cannot win"] * (n - 1)
