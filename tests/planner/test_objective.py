"""The efficiency model (planner.efficiency) and ``--objective time``'s ranking (planner.objective)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.efficiency import (
    MEASURED_TO_TARGET,
    SEQUENTIAL_TO_TARGET,
    EfficiencyInputs,
    Setting,
    default_inputs,
    efficiency,
    fit_delay_cost,
    mean_delay,
)
from planner.objective import Choice, choice_of, plan_for_time, rank, takes_d
from planner.plan import Plan
from profiler.errors import ConfigError, PlanError

COSTS = {"none": 0.9, "predict": 0.25, "pipemare": 1.0}
noise = st.floats(0.0, 1e6)
delays = st.floats(0.0, 100.0)
batches = st.integers(1, 4096)


def _inputs(phi: float) -> EfficiencyInputs:
    return EfficiencyInputs(phi, COSTS, "test")


# ---------------------------------------------------------------- the efficiency model


@given(noise, st.integers(1, 4096), st.sampled_from(sorted(COSTS)))
def test_one_vw_at_nm_1_and_d_0_is_sequential_sgd(phi: float, b: int, remedy: str) -> None:
    local, foreign = mean_delay(nm=1, n_vws=1, D=0)
    assert (local, foreign) == (0.0, 0.0)
    assert efficiency(Setting(b, b, local, foreign, remedy), _inputs(phi)) == 1.0


@given(noise, batches, st.integers(1, 64), delays, delays)
def test_monotone_in_batch_and_delay(phi: float, b: int, k: int, d1: float, d2: float) -> None:
    e = _inputs(phi)
    lo, hi = sorted((d1, d2))
    assert efficiency(Setting(b * k, b), e) <= efficiency(Setting(b, b), e)
    for remedy in COSTS:
        fresh = efficiency(Setting(b, b, lo, 0.0, remedy), e)
        assert efficiency(Setting(b, b, hi, 0.0, remedy), e) <= fresh
        assert efficiency(Setting(b, b, lo, hi - lo, remedy), e) <= fresh
        assert 0.0 < efficiency(Setting(b * k, b, hi, hi, remedy), e) <= 1.0


@given(st.integers(1, 16), st.integers(1, 16), st.integers(0, 8))
def test_delay_grows_with_nm_vws_and_d(nm: int, n: int, D: int) -> None:
    local, foreign = mean_delay(nm, n, D)
    assert local == nm - 1 and (foreign == 0.0) == (n == 1)
    assert sum(mean_delay(nm + 1, n, D)) > local + foreign
    assert sum(mean_delay(nm, n + 1, D)) > local + foreign
    assert sum(mean_delay(nm, n, D + 1)) >= local + foreign


def test_noise_scale_decides_what_a_bigger_batch_is_worth() -> None:
    assert efficiency(Setting(128, 32), _inputs(0.0)) == pytest.approx(0.25)  # no noise: b / B
    assert efficiency(Setting(128, 32), _inputs(1e9)) == pytest.approx(1.0)  # all noise: free


@given(st.floats(0.0, 3.0), st.lists(st.integers(1, 8), min_size=1, max_size=4))
def test_fit_recovers_the_delay_cost(c: float, taus: list[int]) -> None:
    points = [(float(t), 1000.0 * (1.0 + c * t)) for t in taus]
    assert fit_delay_cost(1000.0, points) == pytest.approx(c, abs=1e-9)


def test_defaults_follow_the_measured_figures() -> None:
    """docs/convergence.md: prediction with momentum removes most of the delay's cost; plain
    SGD at lr 0.1 pays far less per update of delay than momentum 0.9 at lr 0.02."""
    mom, sgd = default_inputs("momentum").delay_cost, default_inputs("sgd").delay_cost
    assert mom["predict"] < mom["none"] / 2 and sgd["none"] < mom["none"] / 2
    assert "predict" not in default_inputs("adam").delay_cost  # the runtime refuses it
    assert "default" in default_inputs("sgd").source
    samples = dict(MEASURED_TO_TARGET["momentum"]["none"])  # Nm 2: 12,902 vs 7,219 sequential
    assert 1 + mom["none"] == pytest.approx(samples[1] / SEQUENTIAL_TO_TARGET["momentum"], rel=0.2)


# ---------------------------------------------------------------- the ranking


def _wsp(nm: int, n: int, tp: float, remedy: str = "none", D: int = 0) -> Choice:
    local, foreign = mean_delay(nm, n, D)
    return Choice(f"wsp {n} Nm {nm} {remedy}", "wsp", n, nm, D, remedy, tp,
                  Setting(32, 32, local, foreign, remedy))  # fmt: skip


def _allreduce(n: int, tp: float) -> Choice:
    return Choice(f"allreduce {n}", "allreduce", n, 1, 0, "none", tp, Setting(32 * n, 32))


HAND_BUILT = [
    _wsp(1, 2, 600.0),
    _wsp(3, 2, 1000.0),
    _wsp(3, 2, 1000.0, "predict"),
    _wsp(3, 1, 700.0, "predict"),
    _allreduce(4, 800.0),
]


def test_allreduce_wins_when_its_batch_costs_little() -> None:
    """phi >> 4 x 32: AllReduce's big batch is nearly free (800 goodput); the fastest pipeline
    pays 1 + 0.9 x 2 ... of staleness (1 VW, Nm 3, predict: 700 / 1.5 = 467)."""
    ranked = rank(HAND_BUILT, _inputs(1e6), target_samples=8000.0)
    assert ranked[0].choice.sync == "allreduce"
    assert ranked[0].relative_time == 1.0 and ranked[0].seconds == pytest.approx(10.0, rel=1e-3)
    times = [r.relative_time for r in ranked]
    assert times == sorted(times)
    assert ranked[1].choice.label == "wsp 1 Nm 3 predict"


def test_a_pipeline_wins_when_big_batches_waste_samples() -> None:
    """phi = 0: AllReduce's 128-sample update is worth 32 (goodput 200); one VW at Nm 3 with
    weight prediction keeps 700 / (1 + 0.25 x 2) = 467, the best; two VWs at Nm 3 also miss
    the other VW's 3 updates of the wave, which prediction covers too (1000 / (1 + 0.25 x 5)
    = 444) and plain delayed SGD pays in full (1000 / (1 + 0.9 x 5) = 182)."""
    ranked = rank(HAND_BUILT, _inputs(0.0))
    assert [r.choice.label for r in ranked] == [
        "wsp 1 Nm 3 predict",  # 467
        "wsp 2 Nm 3 predict",  # 444
        "wsp 2 Nm 1 none",  # 600 / 1.9 = 316
        "allreduce 4",  # 200
        "wsp 2 Nm 3 none",  # 1000 / 5.5 = 182
    ]
    assert ranked[-1].relative_time == pytest.approx(467 / 182, rel=0.01)
    assert ranked[0].goodput == pytest.approx(700.0 / 1.5)
    assert all(r.seconds == 0.0 for r in ranked)  # no target: relative times only


def test_ties_go_to_less_delay_then_no_remedy() -> None:
    e = EfficiencyInputs(0.0, {"none": 0.0, "predict": 0.0})
    ranked = rank([_wsp(2, 1, 100.0, "predict"), _wsp(2, 1, 100.0), _wsp(1, 1, 100.0)], e)
    assert [r.choice.label for r in ranked] == ["wsp 1 Nm 1 none", "wsp 1 Nm 2 none",
                                               "wsp 1 Nm 2 predict"]  # fmt: skip


# ---------------------------------------------------------------- from plans


@cache
def _base() -> Plan:
    from planner.manual import cpu_cluster, hand_cut_plan
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource
    from runtime.stage.model import resolve_source

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 32, meta=True))
    return hand_cut_plan(graph, "mlp", 32, 2, cpu_cluster(2, 0.1), 1)


def _at(nm: int, tp: float, **kw: object) -> Plan:
    base = _base()
    return replace(base, nm=nm, predicted=replace(base.predicted, throughput=tp), **kw)  # type: ignore[arg-type]


def test_plan_for_time_picks_allreduce_and_records_why() -> None:
    calls: list[tuple[int, str]] = []

    def replan(nm: int, memory: str, D: int) -> Plan:
        calls.append((nm, memory))
        if memory == "predict" and nm == 3:
            raise PlanError("does not fit")
        return _at(min(nm, 3), 100.0 * nm)

    allreduce = _at(1, 250.0, sync="allreduce", policy="allreduce")
    plan, ranked = plan_for_time([(replan, [1, 2, 3, 4])], lambda: allreduce, _inputs(1e6), 1000.0)
    assert plan.sync == "allreduce" and plan.objective["objective"] == "time"
    assert plan.objective["noise_scale"] == 1e6 and plan.objective["source"] == "test"
    assert plan.objective["seconds_to_target"] == pytest.approx(4.0)
    assert (3, "predict") in calls and (4, "none") in calls
    labels = {r.choice.label for r in ranked}  # Nm 4 came back at 3: not a candidate
    assert "wsp manual 1 VW Nm 3 pipemare" in labels and not any("Nm 4" in x for x in labels)
    assert "wsp manual 1 VW Nm 3 predict" not in labels


def test_plan_for_time_keeps_the_winning_remedy() -> None:
    def two_vws(nm: int, memory: str, D: int) -> Plan:
        base = _at(nm, 150.0 * nm)
        return replace(base, virtual_workers=base.virtual_workers * 2)

    allocations = [(lambda nm, _, D: _at(nm, 100.0 * nm), [1, 2, 3]), (two_vws, [1, 2, 3])]
    plan, ranked = plan_for_time(allocations, None, _inputs(0))
    assert len(ranked) == 12 and any(r.choice.vws == 2 for r in ranked)  # 6 per allocation
    assert ranked[0].choice.label == "wsp manual 1 VW Nm 3 predict"
    assert (plan.nm, plan.remedy) == (3, "predict")


def _two_vws_with_shards(nm: int, D: int, tp: float) -> Plan:
    """Two VWs synchronised through a shard (``D`` acts), at ``D``, ``tp`` samples/s."""
    from planner.plan import ShardPlan

    base = _at(nm, tp, D=D)
    node = base.virtual_workers[0].gpus[0].node
    return replace(base, virtual_workers=base.virtual_workers * 2,
                   shards=(ShardPlan(0, node, (), 0),))  # fmt: skip


@pytest.mark.parametrize(("cost", "winner"), [(0.02, 1), (0.9, 0)])
def test_d_1_wins_on_throughput_only_when_delay_is_cheap(cost: float, winner: int) -> None:
    """Two VWs at Nm 2: D = 1 stops the fold wait (650 against 600 samples/s) but adds half a
    wave of the other VW's updates (foreign delay 2 -> 3). At 0.02 per update D = 1 is sooner
    (650 / 1.08 = 602 against 600 / 1.06 = 566); at 0.9 it is later (650 / 4.6 = 141 against
    600 / 3.7 = 162)."""
    e = EfficiencyInputs(0.0, {"none": cost})
    choices = [choice_of(_two_vws_with_shards(2, 0, 600.0)),
               choice_of(_two_vws_with_shards(2, 1, 650.0))]  # fmt: skip
    assert [c.setting.foreign_delay for c in choices] == [2.0, 3.0]
    ranked = rank(choices, e)
    labels = ["wsp manual 2 VWs Nm 2", "wsp manual 2 VWs Nm 2 D 1"]
    assert [r.choice.label for r in ranked] == (labels[::-1] if winner else labels)
    assert [r.choice.D for r in ranked] == [winner, 1 - winner]
    d0 = next(r for r in ranked if r.choice.D == 0)
    assert d0.goodput == pytest.approx(600.0 / (1 + cost * 3))


@pytest.mark.parametrize(("cost", "winner"), [(0.02, 1), (0.9, 0)])
def test_plan_for_time_plans_each_d_and_keeps_the_winners(cost: float, winner: int) -> None:
    """Each D of ``d_values`` is planned (its simulated throughput: more at D = 1, little more
    at 2); the winner's D reaches the plan, the label and the record."""
    tp = {0: 600.0, 1: 650.0, 2: 655.0}
    calls: list[int] = []

    def replan(nm: int, memory: str, D: int) -> Plan:
        calls.append(D)
        return _two_vws_with_shards(nm, D, tp[D])

    e = EfficiencyInputs(0.0, {"none": cost})
    plan, ranked = plan_for_time([(replan, [2])], None, e, d_values=(0, 1, 2))
    assert calls == [0, 1, 2] and len(ranked) == 3
    assert {r.choice.D: r.choice.label for r in ranked} == {
        0: "wsp manual 2 VWs Nm 2",
        1: "wsp manual 2 VWs Nm 2 D 1",
        2: "wsp manual 2 VWs Nm 2 D 2",
    }
    chosen_d = (ranked[0].choice.D, plan.D)  # the table's pick and the plan's threshold
    assert chosen_d == (winner, winner)
    assert plan.predicted.throughput == tp[winner]
    assert plan.objective["d_values"] == [0, 1, 2]


def test_d_is_planned_once_where_it_does_not_act() -> None:
    """One VW without shards (the ``local`` rule): every D is the same plan, planned once;
    a Nm that does not fit at the first D is not tried at the others."""
    calls: list[tuple[int, int]] = []

    def replan(nm: int, memory: str, D: int) -> Plan:
        calls.append((nm, D))
        if nm == 2:
            raise PlanError("does not fit")
        return _at(nm, 100.0, D=D)

    e = EfficiencyInputs(0.0, {"none": 0.5})
    plan, ranked = plan_for_time([(replan, [1, 2])], None, e, d_values=(0, 1, 2))
    assert calls == [(1, 0), (2, 0)]
    assert [r.choice.label for r in ranked] == ["wsp manual 1 VW Nm 1"]
    assert plan.objective["d_values"] == []  # D acted on no candidate
    assert not takes_d(plan) and takes_d(_two_vws_with_shards(1, 0, 1.0))
    assert not takes_d(replace(_two_vws_with_shards(1, 0, 1.0), sync="backup"))


def test_no_candidate_and_easgd_are_one_line_errors() -> None:
    def never(nm: int, memory: str, D: int) -> Plan:
        raise PlanError("no")

    with pytest.raises(PlanError, match="no candidate plan fits"):
        plan_for_time([(never, [1, 2])], None, _inputs(1.0))
    with pytest.raises(ConfigError, match="--sync easgd"):
        choice_of(_at(2, 1.0, sync="easgd"))


@pytest.mark.parametrize("module", ["planner.efficiency", "planner.objective"])
def test_doctests(module: str) -> None:
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(module))
    assert res.attempted > 0 and res.failed == 0
