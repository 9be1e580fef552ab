"""The planner's memory manager: placements chosen with the partition and Nm (planner.offload)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hetpipe.planning import profiles_for
from planner.cluster import PCIE, Cluster, Link, load_cluster, parse_cluster
from planner.offload import LADDER, MemoryPlacement, Place
from planner.partition.milp import partition_milp
from planner.plan import Plan
from planner.plan_file import load_plan
from planner.planner import PlanOptions, make_plan
from profiler.errors import ConfigError, PlanError

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples" / "emulated_cluster.yaml"
MODEL = "mlp(hidden=400,depth=8)"  # needs Nm = 2 without the memory manager on CLUSTER


def _plan(memory: str, cluster: Cluster | None = None, **kw: object) -> Plan:
    opts = PlanOptions(memory=memory, simulate_waves=0, nm_choice="max")
    args: dict[str, object] = dict(
        model=MODEL, batch_size=32, policy="ed", num_vws=1, optimizer="sgd", options=opts
    )
    args.update(kw)
    cl = cluster or load_cluster(CLUSTER)
    cpu = profiles_for(cl, [], str(args["model"]), 32)
    return make_plan(cl, cpu, **args)  # type: ignore[arg-type]


def test_keep_is_the_default_and_records_keep() -> None:
    plan = _plan("keep")
    assert plan.nm == 2
    assert all(s.memory == "keep" and s.host_bytes == 0 for s in plan.virtual_workers[0].stages)


def test_auto_reaches_a_larger_nm_within_the_caps() -> None:
    keep, auto = _plan("keep"), _plan("auto")
    assert auto.nm > keep.nm
    vw = auto.virtual_workers[0]
    assert any(s.memory != "keep" for s in vw.stages)
    assert all(s.memory_bytes <= s.capacity_bytes for s in vw.stages)
    for s in vw.stages:  # bwd_ms carries the placement's extra time
        assert s.recompute_ms >= 0 and s.transfer_ms >= 0
        if MemoryPlacement.parse(s.memory).activations is not Place.RECOMPUTE:
            assert s.recompute_ms == 0


def test_plan_file_round_trip_and_old_plans_load_as_keep(tmp_path: Path) -> None:
    auto = _plan("auto")
    path = auto.save(tmp_path / "plan.yaml")
    again = load_plan(path)
    assert again.virtual_workers[0].stages == auto.virtual_workers[0].stages
    d = auto.to_dict()
    for st in d["virtual_workers"][0]["stages"]:  # a plan written before the memory manager
        for key in ("memory", "host_bytes", "transfer_bytes", "recompute_ms", "transfer_ms"):
            del st[key]
    old = Plan.from_dict(d)
    assert all(s.memory == "keep" for s in old.virtual_workers[0].stages)
    d["virtual_workers"][0]["stages"][0]["memory"] = "weights:recompute"
    with pytest.raises(PlanError, match=r"stages\[0\]\.memory"):
        Plan.from_dict(d)


def test_bad_memory_option_is_one_line() -> None:
    with pytest.raises(PlanError, match="--memory"):
        _plan("everything:offload")


def test_forced_recompute_charges_the_forward_again() -> None:
    plan = _plan("activations:recompute", nm=3)
    stages = plan.virtual_workers[0].stages
    assert any(s.recompute_ms > 0 for s in stages[:-1])
    assert stages[-1].recompute_ms == 0  # the last stage holds one minibatch: nothing to gain
    for s in stages:
        if s.recompute_ms:
            assert s.recompute_ms == pytest.approx(s.fwd_ms)


def test_slow_host_link_exposes_transfer_time() -> None:
    cluster = load_cluster(CLUSTER)
    slow = replace(cluster, host_link=Link(1e6, 0.0))  # 1 MB/s: nothing hides behind compute
    plan = _plan("weights:offload,gradients:offload", slow, nm=6)
    moving = [s for s in plan.virtual_workers[0].stages if s.transfer_bytes]
    assert moving and all(s.transfer_ms > 0 for s in moving)


def test_milp_uses_the_same_memory_model() -> None:
    plan_cluster = load_cluster(CLUSTER)
    from planner.costmodel import CostModel
    from planner.planner import planning_view
    from planner.profiles import resolve_profiles

    view = planning_view(plan_cluster)
    by_type, *_ = resolve_profiles(view, profiles_for(view, [], MODEL, 32), MODEL, 32, None)
    cm = CostModel(by_type, view.link, 0.0).with_placement(LADDER[-1])
    gpus = list(view.devices)
    part = partition_milp(cm, gpus, 6, time_limit_s=30)
    for j, g in enumerate(part.gpus):
        cost = cm.stage_cost(part.gpus, j, part.bounds[j], part.bounds[j + 1], 6)
        assert cost.memory_bytes <= g.memory_bytes
    keep = CostModel(by_type, view.link, 0.0)
    with pytest.raises(PlanError):
        partition_milp(keep, gpus, 6, time_limit_s=30)


def test_cluster_host_link_and_host_memory() -> None:
    doc = {
        "nodes": [{"name": "A", "gpu": "TITAN V", "count": 2, "host_memory": "8GiB"}],
        "links": {"host_link": {"bandwidth": "8GB/s", "latency": "5us"}},
    }
    c = parse_cluster(doc)
    assert c.host_link.bandwidth_bps == 8e9 and c.host_memory_bytes("A") == 4 * 2**30
    assert parse_cluster(c.to_dict()) == replace(c, source="<memory>")
    plain = parse_cluster({"nodes": [{"name": "A", "gpu": "TITAN V", "count": 1}]})
    assert plain.host_link == PCIE and plain.host_memory_bytes("A") == 0
    with pytest.raises(ConfigError, match="host_memory"):
        parse_cluster({"nodes": [{"name": "A", "gpu": "TITAN V", "count": 1, "host_memory": -1}]})


def test_simulator_draws_the_host_transfers(tmp_path: Path) -> None:
    from planner.draw import write_gantt
    from planner.sim.simulator import simulate

    cluster = load_cluster(CLUSTER)
    slow = replace(cluster, host_link=Link(5e7, 0.0))
    plan = _plan("weights:offload,gradients:offload", slow, nm=4)
    res = simulate(plan, waves=3, record_trace=True)
    host = [e for e in res.trace if e.cat == "host"]
    stages = plan.virtual_workers[0].stages
    assert {e.stage for e in host} == {j for j, s in enumerate(stages) if s.transfer_bytes}
    ms = {j: slow.host_link.time_s(s.transfer_bytes) * 1e3 for j, s in enumerate(stages)}
    for e in host:
        assert e.end_ms - e.start_ms == pytest.approx(ms[e.stage])
    assert write_gantt(res.trace, tmp_path / "g.png").stat().st_size > 0


def test_small_host_memory_falls_back_to_a_smaller_nm() -> None:
    cluster = load_cluster(CLUSTER)
    nodes = tuple(replace(n, host_memory_bytes=1) for n in cluster.nodes)
    opts = PlanOptions(memory="auto", simulate_waves=0)
    plan = _plan("auto", replace(cluster, nodes=nodes), options=opts)
    assert plan.nm == _plan("keep").nm  # nothing can be offloaded: the all-keep Nm
    assert all(s.host_bytes == 0 for s in plan.virtual_workers[0].stages)


def test_predict_plans_within_its_extra_weight_copies(tmp_path: Path) -> None:
    """``--remedy predict`` keeps a predicted copy per stage from Nm 2 on and, with plain SGD,
    the last gradient (planner.staleness.remedy_weight_copies): MODEL fits Nm 2 on CLUSTER
    without it, only Nm 1 with it (counting Nm - 1 copies, the plan ran out of memory)."""
    predicting = PlanOptions(memory="keep", simulate_waves=0, nm_choice="max", remedy="predict")
    none, predict = _plan("keep"), _plan("keep", options=predicting)
    assert (none.nm, none.remedy, predict.nm, predict.remedy) == (2, "none", 1, "predict")
    assert load_plan(predict.save(tmp_path / "p.json")).remedy == "predict"
