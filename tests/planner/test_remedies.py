"""A model that does not fit: the refusal lists every way to fit it, and each way works."""

from __future__ import annotations

import re

import pytest

from hetpipe.planning import profiles_for
from planner.cluster import Cluster, load_cluster, parse_cluster
from planner.planner import PlanOptions, make_plan
from profiler.errors import PlanError
from profiler.units import parse_bytes
from tests.conftest import EXAMPLES
from tests.planner.synth import synthetic_profiles

FAST = PlanOptions(simulate_waves=0)
TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")


def _refusal(cluster: Cluster, profs: object, **kw: object) -> str:
    with pytest.raises(PlanError, match="cannot hold") as info:
        make_plan(cluster, profs, options=FAST, **kw)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def _one_node(memory: int) -> Cluster:
    return parse_cluster(
        {"nodes": [{"name": "a", "gpu": "TITAN V", "count": 4, "memory": str(memory)}]}
    )


def test_more_memory_per_stage_says_how_much_and_that_is_enough() -> None:
    profs = synthetic_profiles(12, ("TITAN V",), seed=1, act_mib=2000.0)
    cap = 4 * 2**30
    msg = _refusal(_one_node(cap), profs, policy="np")
    found = re.search(
        r"(?:it: |; or )([\d.]+ \w+) more memory per stage \(on each GPU of VW 0\)", msg
    )
    assert found, msg
    more = parse_bytes(found.group(1).replace(" ", ""))
    make_plan(_one_node(cap + int(more * 1.01)), profs, policy="np", options=FAST)
    with pytest.raises(PlanError, match="cannot hold"):
        make_plan(_one_node(cap + int(more * 0.95)), profs, policy="np", options=FAST)
    assert msg.endswith("(no smaller VW count fits)")  # one node: no fewer VWs to offer


def test_fewer_larger_vws_names_a_count_that_fits() -> None:
    paper = load_cluster(EXAMPLES / "paper_cluster.yaml")
    profs = synthetic_profiles(12, TYPES, seed=1, act_mib=4000.0)
    msg = _refusal(paper, profs, policy="np")
    found = re.search(
        r"more GPUs per VW: --policy (\w+) --vws (\d+) \(VWs of (\d+) GPUs fit\)", msg
    )
    assert found, msg
    policy, vws = found.group(1), int(found.group(2))
    assert vws < 4 and int(found.group(3)) == 16 // vws
    plan = make_plan(paper, profs, policy=policy, num_vws=vws, options=FAST)
    assert len(plan.virtual_workers) == vws
    assert "--memory auto" not in msg  # offloading does not rescue a 4-GPU VW here


def test_offloading_is_offered_when_it_fits() -> None:
    emulated = load_cluster(EXAMPLES / "emulated_cluster.yaml")
    cpu = profiles_for(emulated, [], "mlp", 32)
    msg = _refusal(emulated, cpu, model="mlp", batch_size=32, policy="np")
    assert "let the memory manager offload or recompute (--memory auto)" in msg
    assert "raise emulate.memory" in msg and "--vws 1" in msg
    auto = PlanOptions(simulate_waves=0, memory="auto")
    plan = make_plan(emulated, cpu, model="mlp", batch_size=32, policy="np", options=auto)
    assert any(s.memory != "keep" for vw in plan.virtual_workers for s in vw.stages)
