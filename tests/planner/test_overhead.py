"""The runtime-overhead model: the planner records it in the plan, the simulator charges it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cluster import Cluster, parse_cluster
from planner.manual import cpu_cluster, manual_plan
from planner.overhead import (
    RuntimeOverhead,
    plan_overhead_ms,
    plan_processes,
    plan_wave_overhead_ms,
)
from planner.plan import Plan
from planner.planner import PlanOptions, make_plan
from planner.sim.engine import simulate_pipelines
from planner.sim.simulator import pipeline_specs, simulate
from planner.sim.types import PipelineSpec, SimResult
from planner.throughput import steady_throughput
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from profiler.models import resolve_model
from tests.planner.synth import synthetic_profiles

TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")


def _cluster(overhead: dict[str, Any] | None) -> Cluster:
    """One node of each of the four types, two GPUs each; ``runtime_overhead`` when given."""
    doc: dict[str, Any] = {
        "name": "four",
        "nodes": [{"name": f"n{t}", "gpu": gpu, "count": 2} for t, gpu in enumerate(TYPES)],
    }
    if overhead is not None:
        doc["runtime_overhead"] = overhead
    return parse_cluster(doc, "four.yaml")


def _plan(overhead: dict[str, Any] | None) -> Plan:
    profs = synthetic_profiles(16, TYPES, seed=3, act_mib=8.0, param_mib=4.0)
    return make_plan(_cluster(overhead), profs, policy="hd", options=PlanOptions(simulate_waves=6))


def _steady(plan: Plan, res: SimResult) -> float:
    """The planner's reading of a simulation: its steady state."""
    return steady_throughput(res.completions_ms, plan.nm, plan.batch_size)


def test_the_model_stretches_with_processes_over_cores() -> None:
    model = RuntimeOverhead(0.5, cores=2)
    assert model.per_task_ms(1) == 0.5  # a core each: no stretch
    assert model.per_task_ms(8) == pytest.approx(2.0)
    assert RuntimeOverhead(0.5).per_task_ms(1000) == 0.5  # real GPU hosts: a core per rank
    assert RuntimeOverhead(cores=2).stretch(8) == 4.0
    for name in ("ms_per_task", "ms_per_wave", "ms_per_mb"):
        with pytest.raises(ConfigError, match=rf"^x.yaml: {name} = -1.0: give a finite") as exc:
            RuntimeOverhead(**{name: -1.0}).validated("x.yaml")  # type: ignore[arg-type]
        assert "\n" not in str(exc.value)


def test_the_planner_records_the_overhead_it_charged() -> None:
    """The plan holds the overhead the cluster's model gives its processes, the simulated
    throughput with it and, next to it, the throughput without it."""
    plan = _plan({"ms_per_task": 0.5, "cores": 2})
    p = plan.predicted
    processes = sum(len(v.stages) for v in plan.virtual_workers) + len(plan.shards)
    assert plan_processes(plan) == processes
    assert p.method == "simulated"
    assert p.overhead_ms_per_task == pytest.approx(0.5 * max(1.0, processes / 2))
    assert p.overhead_ms_per_task == plan_overhead_ms(plan)
    assert p.throughput < p.throughput_without_overhead
    # the simulator charges the plan's own assumption unless told otherwise
    assert all(s.overhead_ms_per_task == p.overhead_ms_per_task for s in pipeline_specs(plan))
    assert _steady(plan, simulate(plan, waves=6)) == pytest.approx(p.throughput, rel=1e-9)
    without = _steady(plan, simulate(plan, waves=6, overhead_ms_per_task=0.0))
    assert without == pytest.approx(p.throughput_without_overhead, rel=1e-9)


def test_no_model_no_overhead_and_the_same_plan() -> None:
    """A cluster without ``runtime_overhead`` plans as before: nothing charged or recorded."""
    plan = _plan(None)
    assert plan.predicted.overhead_ms_per_task == 0.0
    assert plan.predicted.throughput_without_overhead == plan.predicted.throughput
    assert "runtime_overhead" not in plan.cluster.to_dict()


def test_the_simulator_charges_the_plans_overhead_analytically() -> None:
    """One stage runs FB tasks back to back: a minibatch takes fwd + bwd + the overhead the
    plan's prediction assumed (and the overhead passed, when one is)."""
    graph = ModelGraph.from_spec(resolve_model("mlp", 8))
    plan = manual_plan(graph, (), "mlp", 8, 1, cpu_cluster(1), fwd_ms=[2.0], bwd_ms=[3.0])
    charged = dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, overhead_ms_per_task=1.0)
    )
    assert simulate(plan, waves=20).throughput == pytest.approx(8e3 / 5.0)
    assert simulate(charged, waves=20).throughput == pytest.approx(8e3 / 6.0)
    assert simulate(charged, waves=20, overhead_ms_per_task=0.0).throughput == pytest.approx(
        8e3 / 5.0
    )


def test_plans_without_the_fields_load_with_none() -> None:
    plan = _plan({"ms_per_task": 0.5, "cores": 2})
    doc = plan.to_dict()
    assert doc["cluster"]["runtime_overhead"] == {"ms_per_task": 0.5, "cores": 2}
    back = Plan.from_dict(doc)  # round trip
    assert back.predicted == plan.predicted
    assert back.cluster.runtime_overhead == RuntimeOverhead(0.5, 2)
    for key in ("overhead_ms_per_task", "throughput_without_overhead"):
        del doc["predicted"][key]
    del doc["cluster"]["runtime_overhead"]
    old = Plan.from_dict(doc, "old.json")
    assert old.predicted.overhead_ms_per_task == 0.0
    assert old.predicted.throughput_without_overhead == 0.0
    assert old.cluster.runtime_overhead == RuntimeOverhead()
    assert all(s.overhead_ms_per_task == 0.0 for s in pipeline_specs(old))


@pytest.mark.parametrize(
    ("overhead", "field"),
    [({"ms_per_task": -1}, "runtime_overhead.ms_per_task"), ({"cores": -2}, "runtime_overhead.cores"),
     ({"per_task": 1}, "runtime_overhead.per_task"), ({"ms_per_wave": -1}, "runtime_overhead.ms_per_wave"),
     ({"ms_per_mb": float("nan")}, "runtime_overhead.ms_per_mb"),
     ({"ms_per_wave": "fast"}, "runtime_overhead.ms_per_wave")],
)  # fmt: skip
def test_a_bad_runtime_overhead_is_one_line_naming_it(overhead: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^four.yaml: {field}: ") as exc:
        _cluster(overhead)
    assert "\n" not in str(exc.value)


def _two_stage(wave_ms: tuple[float, ...]) -> PipelineSpec:
    """Stage 0: F 1 ms, B 2 ms; stage 1 (the last): FB 3 + 4 ms; no links; ``wave_ms`` per
    stage per wave."""
    spec = PipelineSpec.from_times([1.0, 3.0], [2.0, 4.0])
    return dataclasses.replace(spec, wave_overhead_ms=wave_ms).validated()


def test_the_wave_term_is_charged_to_each_stages_last_backward_of_a_wave() -> None:
    """Every task lasts its planned time; the backward (stage 0) and the FB (the last stage)
    of minibatches Nm, 2 Nm, ... last the stage's wave overhead more (where the runtime
    pushes), and nothing else does."""
    nm, waves = 3, 4
    res = simulate_pipelines([_two_stage((0.5, 2.0))], nm, waves=waves, record_trace=True)
    base = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "FB"): 7.0}
    wave = {0: 0.5, 1: 2.0}
    tasks = [e for e in res.trace if e.cat in ("F", "B", "FB")]
    assert len(tasks) == 3 * nm * waves
    for e in tasks:
        extra = wave[e.stage] if e.cat != "F" and e.mb % nm == 0 else 0.0
        assert e.end_ms - e.start_ms == pytest.approx(base[(e.stage, e.cat)] + extra)


def test_one_stage_wave_term_hand_computed() -> None:
    """One stage (FB tasks of 2 + 3 ms), Nm 2, 4 ms per wave: a wave of two minibatches takes
    5 + 5 + 4 ms, so 2 minibatches of 8 samples per 14 ms."""
    spec = PipelineSpec.from_times([2.0], [3.0])
    charged = dataclasses.replace(spec, wave_overhead_ms=(4.0,))
    res = simulate_pipelines([charged], 2, waves=20, batch_size=8)
    assert res.throughput == pytest.approx(8 * 2 / 14e-3)
    assert simulate_pipelines([spec], 2, waves=20, batch_size=8).throughput == pytest.approx(
        8 / 5e-3
    )


def test_zero_wave_terms_are_the_old_model_bit_for_bit() -> None:
    """A model whose wave terms are 0 plans exactly as the per-task model alone: the same
    prediction to the last bit, the same plan file."""
    old = _plan({"ms_per_task": 0.5, "cores": 2})
    new = _plan({"ms_per_task": 0.5, "cores": 2, "ms_per_wave": 0.0, "ms_per_mb": 0.0})
    assert new.predicted == old.predicted
    assert new.to_dict() == old.to_dict()
    assert pipeline_specs(new) == pipeline_specs(old)
    assert simulate(new, waves=6) == simulate(old, waves=6)


def test_the_planner_records_and_charges_the_wave_terms() -> None:
    """The plan records the stretched wave terms; each stage's spec holds
    ``per wave + per MB x its parameter MB``; the prediction is lower than with the per-task
    term alone and equals the simulator's on the plan."""
    plan = _plan({"ms_per_task": 0.5, "cores": 2, "ms_per_wave": 1.0, "ms_per_mb": 2.0})
    p, stretch = plan.predicted, max(1.0, plan_processes(plan) / 2)
    assert (p.overhead_ms_per_wave, p.overhead_ms_per_mb) == pytest.approx((stretch, 2 * stretch))
    assert plan_wave_overhead_ms(plan) == (p.overhead_ms_per_wave, p.overhead_ms_per_mb)
    for vw, spec in zip(plan.virtual_workers, pipeline_specs(plan), strict=True):
        want = [stretch * (1.0 + 2.0 * s.param_bytes / 1e6) for s in vw.stages]
        assert spec.wave_overhead_ms == pytest.approx(want)
    task_only = _plan({"ms_per_task": 0.5, "cores": 2})
    assert p.throughput < task_only.predicted.throughput
    assert _steady(plan, simulate(plan, waves=6)) == pytest.approx(p.throughput, rel=1e-9)
    without = _steady(plan, simulate(plan, waves=6, overhead_ms_per_task=0.0))
    assert without == pytest.approx(p.throughput_without_overhead, rel=1e-9)
    # a measured per-task overhead already holds the waves' cost: none is added to it
    assert all(not s.wave_overhead_ms for s in pipeline_specs(plan, overhead_ms_per_task=1.0))
    doc = plan.to_dict()
    assert doc["cluster"]["runtime_overhead"]["ms_per_wave"] == 1.0
    assert Plan.from_dict(doc).predicted == p


def test_no_parameter_servers_no_wave_terms() -> None:
    """The AllReduce baseline and a plan without shards push nothing: no wave term."""
    plan = _plan({"ms_per_task": 0.5, "cores": 2, "ms_per_wave": 1.0})
    assert plan_wave_overhead_ms(dataclasses.replace(plan, shards=())) == (0.0, 0.0)
    assert plan_wave_overhead_ms(dataclasses.replace(plan, sync="allreduce")) == (0.0, 0.0)


def test_old_plans_load_without_the_wave_terms() -> None:
    plan = _plan({"ms_per_task": 0.5, "cores": 2, "ms_per_wave": 1.0, "ms_per_mb": 2.0})
    doc = plan.to_dict()
    for key in ("overhead_ms_per_wave", "overhead_ms_per_mb"):
        del doc["predicted"][key]
    old = Plan.from_dict(doc, "old.json")
    assert (old.predicted.overhead_ms_per_wave, old.predicted.overhead_ms_per_mb) == (0.0, 0.0)
    assert all(not s.wave_overhead_ms for s in pipeline_specs(old))


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**7), 10**7),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.none(),
    st.booleans(),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(["ms_per_task", "cores", "ms_per_wave", "ms_per_mb"]), _VALUES)
def test_any_runtime_overhead_value_loads_or_is_one_line_naming_it(key: str, value: object) -> None:
    """Whatever a term is given: a cluster whose model holds a finite value >= 0, or one line
    naming the file and the field."""
    try:
        cluster = _cluster({key: value})
    except ConfigError as exc:
        assert str(exc).startswith(f"four.yaml: runtime_overhead.{key}: ")
        assert "\n" not in str(exc)
        return
    got = getattr(cluster.runtime_overhead, key)
    assert 0 <= got < math.inf
    assert cluster.runtime_overhead.validated() == cluster.runtime_overhead


def test_a_wave_term_alone_is_an_overhead_the_summary_shows() -> None:
    """A model of wave terms only: the plan charges it, and a run's summary shows the
    prediction without it beside the one with it."""
    from runtime.results.run_result import _without_overhead

    plan = _plan({"cores": 2, "ms_per_wave": 1.0})
    p = plan.predicted
    assert p.overhead_ms_per_task == 0.0 and p.charges_overhead
    assert _without_overhead(plan) == p.throughput_without_overhead > p.throughput


@pytest.mark.parametrize(
    ("where", "value", "said"),
    [("predicted", -1.0, "predicted.overhead_ms_per_wave: -1.0 must be at least 0"),
     ("cluster", float("nan"), "runtime_overhead.ms_per_wave: ")],
)  # fmt: skip
def test_a_plan_file_with_a_bad_wave_term_is_one_line(
    tmp_path: Path, where: str, value: float, said: str
) -> None:
    from planner.plan_file import load_plan
    from profiler.errors import HetPipeError

    doc = _plan({"ms_per_task": 0.5, "cores": 2, "ms_per_wave": 1.0}).to_dict()
    if where == "predicted":
        doc["predicted"]["overhead_ms_per_wave"] = value
    else:
        doc["cluster"]["runtime_overhead"]["ms_per_wave"] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(HetPipeError) as exc:
        load_plan(path)
    assert said in str(exc.value) and "\n" not in str(exc.value)
