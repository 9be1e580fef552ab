"""The runtime-overhead model: the planner records it in the plan, the simulator charges it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from planner.cluster import Cluster, parse_cluster
from planner.manual import cpu_cluster, manual_plan
from planner.overhead import RuntimeOverhead, plan_overhead_ms, plan_processes
from planner.plan import Plan
from planner.planner import PlanOptions, make_plan
from planner.sim.simulator import pipeline_specs, simulate
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


def test_the_model_stretches_with_processes_over_cores() -> None:
    model = RuntimeOverhead(0.5, cores=2)
    assert model.per_task_ms(1) == 0.5  # a core each: no stretch
    assert model.per_task_ms(8) == pytest.approx(2.0)
    assert RuntimeOverhead(0.5).per_task_ms(1000) == 0.5  # real GPU hosts: a core per rank


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
    assert simulate(plan, waves=6).throughput == pytest.approx(p.throughput, rel=1e-9)
    without = simulate(plan, waves=6, overhead_ms_per_task=0.0).throughput
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
     ({"per_task": 1}, "runtime_overhead.per_task")],
)  # fmt: skip
def test_a_bad_runtime_overhead_is_one_line_naming_it(overhead: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^four.yaml: {field}: ") as exc:
        _cluster(overhead)
    assert "\n" not in str(exc.value)
