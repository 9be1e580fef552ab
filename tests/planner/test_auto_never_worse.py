"""Policy ``auto`` is never worse (predicted throughput) than a plain policy it could have run."""

from __future__ import annotations

import pytest

from planner.cluster import Cluster, parse_cluster
from planner.planner import PlanOptions, make_plan
from profiler.errors import PlanError
from tests.planner.synth import synthetic_profiles

FAST = PlanOptions(simulate_waves=0)  # analytic predictions: the comparison is under test


def _node(name: str, gpu: str, count: int, memory: str | None = None) -> dict[str, object]:
    out: dict[str, object] = {"name": name, "gpu": gpu, "count": count}
    if memory is not None:
        out["memory"] = memory
    return out


CLUSTERS = {
    # NP's natural count (3 VWs: one per node) divides no GPU total of 8: not a VW-count candidate
    "k80x4-v100x2x2": [_node("a", "K80", 4), _node("b", "V100", 2), _node("c", "V100", 2)],
    "t4x4-v100x2x2": [_node("a", "T4", 4), _node("b", "V100", 2), _node("c", "V100", 2)],
    # 10 GPUs, NP's 3 VWs of 2 A100 / 4 T4 / 4 T4
    "a100x2-t4x4x2": [_node("a", "A100", 2), _node("b", "T4", 4), _node("c", "T4", 4)],
    # ED and HD give the same VW letters (WWKK); HD's span 2 nodes, ED's 4
    "pairs": [
        _node("a", "V100", 2),
        _node("b", "V100", 2),
        _node("c", "K80", 2),
        _node("d", "K80", 2),
    ],
    # whimpy GPUs (1.5 GiB) beside big ones, mixed counts
    "whimpy": [_node("v", "V100", 2), _node("w", "T4", 4, "1.5GiB"), _node("k", "K80", 2)],
    # one 20-GPU node: NP's natural VW is larger than auto's VW size limit (16)
    "big-node": [_node("a", "V100", 20), _node("b", "T4", 4)],
    "four-types": [
        _node("a", "A100", 2),
        _node("t", "T4", 4),
        _node("k", "K80", 8),
        _node("v", "V100", 2),
    ],
}
TYPES = ("A100", "T4", "K80", "V100")


def _cluster(name: str) -> Cluster:
    return parse_cluster({"name": name, "nodes": CLUSTERS[name]})


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_auto_at_least_every_plain_policy(name: str) -> None:
    cluster = _cluster(name)
    profs = synthetic_profiles(24, TYPES, seed=5, act_mib=24.0, param_mib=40.0)
    auto = make_plan(cluster, profs, policy="auto", options=FAST)
    plain = {}
    for policy in ("np", "ed", "hd"):
        try:
            plain[policy] = make_plan(cluster, profs, policy=policy, options=FAST)
        except PlanError:  # the policy cannot apply, or its VWs cannot hold the model
            continue
    assert plain, "no plain policy applies: the case tests nothing"
    for policy, plan in plain.items():
        assert auto.predicted.throughput >= plan.predicted.throughput * (1 - 1e-9), (
            policy,
            [vw.signature for vw in plan.virtual_workers],
            auto.policy,
            [vw.signature for vw in auto.virtual_workers],
        )
