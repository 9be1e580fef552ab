"""Paper-shaped checks of the simulator on the paper cluster with analytic vgg19/resnet152 profiles.

The predicted numbers beside the paper's are in docs/simulator.md
(``python benchmarks/paper_table4.py`` regenerates them).
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from planner.cluster import Cluster, load_cluster
from planner.plan import Plan
from planner.sim.simulator import allreduce_for_plan, best_by_simulation, simulate
from planner.sim.types import SimResult
from profiler.table import Profile
from tests.conftest import EXAMPLES

planner_mod = pytest.importorskip("planner.planner")
analytic = pytest.importorskip("profiler.analytic")

TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
CAPS = (4, 8)  # Nm caps tried by best_by_simulation (kept small: the tests must stay quick)


@cache
def profiles(model: str) -> dict[str, Profile]:
    return {t: analytic.analytic_profile(model, 32, t) for t in TYPES}


@cache
def cluster(nodes: tuple[str, ...] = ("V", "R", "G", "Q")) -> Cluster:
    full = load_cluster(EXAMPLES / "paper_cluster.yaml")
    return dataclasses.replace(full, nodes=tuple(n for n in full.nodes if n.name in nodes))


@cache
def best(
    model: str,
    policy: str,
    placement: str = "default",
    nodes: tuple[str, ...] = ("V", "R", "G", "Q"),
    vws: int | None = None,
) -> tuple[Plan, SimResult]:
    cl = cluster(nodes)
    used = {n.gpu_type for n in cl.nodes}
    profs = {t: p for t, p in profiles(model).items() if t in used}

    def make(cap: int) -> Plan:
        return planner_mod.make_plan(  # type: ignore[no-any-return]
            cl,
            profs,
            model=model,
            batch_size=32,
            policy=policy,
            nm=cap,
            placement=placement,
            num_vws=vws,
        )

    return best_by_simulation(make, CAPS, waves=8, profile=next(iter(profs.values())))


@pytest.mark.parametrize("model", ["vgg19", "resnet152"])
def test_np_is_limited_by_the_vw_with_least_memory(model: str) -> None:
    plan = planner_mod.make_plan(
        cluster(),
        profiles(model),
        model=model,
        batch_size=32,
        policy="np",
        options=planner_mod.PlanOptions(nm_choice="max"),
    )
    least = min(plan.virtual_workers, key=lambda vw: sum(g.memory_bytes for g in vw.gpus))
    assert least.signature == "GGGG"  # 4 x 6 GiB RTX 2060
    assert plan.nm == least.nm_max == min(vw.nm_max for vw in plan.virtual_workers)
    res = simulate(plan, waves=4)
    assert res.max_in_flight[least.id][0] == plan.nm  # the first stage really holds Nm


@pytest.mark.parametrize("model", ["vgg19", "resnet152"])
def test_ed_and_hd_beat_np(model: str) -> None:
    np_thr = best(model, "np")[1].throughput
    assert best(model, "ed")[1].throughput > np_thr
    assert best(model, "hd")[1].throughput > np_thr


@pytest.mark.xfail(
    strict=True,
    reason="not reproduced: with analytic profiles the partition cuts vgg19 inside its conv "
    "layers, so ED-local moves ~12.9 MB/sample of activations across nodes vs ~8.4 MB/sample "
    "for the ring all-reduce (paper: 103 MB vs 515 MB); see docs/simulator.md",
)
def test_ed_local_moves_fewer_cross_node_bytes_than_allreduce_vgg19() -> None:
    plan, res = best("vgg19", "ed", "local")
    ar = allreduce_for_plan(plan, profiles("vgg19"))
    samples = 8 * plan.nm * plan.batch_size * len(plan.virtual_workers)
    ar_per_sample = ar.cross_node_bytes_per_iter / (ar.gpus * plan.batch_size)
    assert res.cross_node_bytes / samples < ar_per_sample


def test_ed_local_moves_fewer_bytes_than_ed_default() -> None:
    plan_d, res_d = best("vgg19", "ed", "default")
    plan_l, res_l = best("vgg19", "ed", "local")
    per_sample_d = res_d.cross_node_bytes / (8 * plan_d.nm * 32 * 4)
    per_sample_l = res_l.cross_node_bytes / (8 * plan_l.nm * 32 * 4)
    assert per_sample_l < per_sample_d


@pytest.mark.parametrize("model", ["vgg19", "resnet152"])
def test_table4_throughput_grows_with_whimpy_nodes(model: str) -> None:
    """Paper Table 4 shape: V alone (one VW), then ED-local with 4 VWs on +R, +Q, +G."""
    v4 = best(model, "np", "default", ("V",), 1)[1].throughput
    r = best(model, "ed", "local", ("V", "R"), 4)[1].throughput
    q = best(model, "ed", "local", ("V", "R", "Q"), 4)[1].throughput
    g = best(model, "ed", "local", ("V", "R", "Q", "G"), 4)[1].throughput
    assert v4 < r < q < g
