"""Simulating one copy of each distinct group of VWs equals simulating every VW."""

from __future__ import annotations

import pytest

from planner.cluster import Cluster, parse_cluster
from planner.planner import PlanOptions, make_plan
from planner.sim.simulator import pipeline_specs, simulate
from planner.symmetry import simulate_distinct, vw_groups
from tests.planner.synth import synthetic_profiles

TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")


def _repeated(copies: int, per_node: int = 2) -> Cluster:
    """``copies`` copies of one node of each of the four types."""
    nodes = [
        {"name": f"n{c}{t}", "gpu": gpu, "count": per_node}
        for c in range(copies)
        for t, gpu in enumerate(TYPES)
    ]
    return parse_cluster({"name": "repeated", "nodes": nodes})


@pytest.mark.parametrize(("policy", "copies", "D"), [("np", 3, 0), ("hd", 2, 1), ("ed", 2, 0)])
def test_distinct_groups_equal_the_full_simulation(policy: str, copies: int, D: int) -> None:
    cluster = _repeated(copies)
    profs = synthetic_profiles(24, TYPES, seed=3, act_mib=8.0, param_mib=4.0)
    plan = make_plan(cluster, profs, policy=policy, D=D, options=PlanOptions(simulate_waves=0))
    if policy != "ed":  # ED spreads every node over every VW: one group, nothing to skip
        assert len(vw_groups(plan)) >= copies
    full = simulate(plan, waves=6)
    throughput, per_vw = simulate_distinct(plan, 6)
    assert throughput == pytest.approx(full.throughput, rel=1e-12)
    assert per_vw == pytest.approx(full.per_vw_throughput, rel=1e-12)


def test_groups_share_no_node() -> None:
    cluster = _repeated(2)
    profs = synthetic_profiles(24, TYPES, seed=3, act_mib=8.0, param_mib=4.0)
    plan = make_plan(cluster, profs, policy="hd", options=PlanOptions(simulate_waves=0))
    specs = pipeline_specs(plan)
    groups = vw_groups(plan)
    assert sorted(v for g in groups for v in g) == list(range(len(specs)))
    nodes = [{n for v in g for n in specs[v].nodes} for g in groups]
    assert all(not (a & b) for i, a in enumerate(nodes) for b in nodes[i + 1 :])
    assert len(groups) > 1
