"""MILP == DP: the MILP's optimum equals the exact DP's on random and real instances."""

from __future__ import annotations

import pytest

from planner.cluster import Cluster, Device, load_cluster
from planner.costmodel import CostModel
from planner.partition.dp import (
    InfeasiblePartition,
    distinct_orders,
    partition_dp,
    partition_dp_best_order,
)
from planner.partition.milp import available_solvers, partition_milp
from profiler.analytic import scale_profile
from profiler.pipedream import import_pipedream
from tests.conftest import EXAMPLES, PIPEDREAM
from tests.planner.synth import synthetic_profiles

REL = 1e-6


@pytest.fixture(scope="module")
def paper() -> Cluster:
    return load_cluster(EXAMPLES / "paper_cluster.yaml")


def _vw(cluster: Cluster, spec: str) -> list[Device]:
    """``"V0 R0 G0 Q0"`` -> devices."""
    by = {f"{d.node}{d.index}": d for d in cluster.devices}
    return [by[s] for s in spec.split()]


def _close(a: float, b: float) -> None:
    assert abs(a - b) <= REL * max(abs(a), abs(b), 1e-12), (a, b)


VWS = ["V0 V1 V2 V3", "V0 R0 G0 Q0", "V0 V1 Q0 Q1", "R0 G0 G1"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vw", VWS)
def test_milp_matches_dp_random(paper: Cluster, seed: int, vw: str) -> None:
    profs = synthetic_profiles(24 + 3 * seed, seed=seed, skip_prob=0.2)
    cm = CostModel(profs, paper.link)
    gpus = _vw(paper, vw)
    ref = partition_dp_best_order(cm, gpus, nm=2, memory=False)
    milp = partition_milp(cm, gpus, nm=2, memory=False)
    _close(milp.objective_ms, ref.objective_ms)
    _close(milp.bottleneck_ms, ref.objective_ms)
    fixed = partition_milp(
        cm, list(ref.gpus), nm=2, memory=False, fixed_order=True, use_bound=False
    )
    _close(fixed.objective_ms, partition_dp(cm, ref.gpus, nm=2, memory=False).objective_ms)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vw", VWS)
def test_milp_matches_dp_with_memory(paper: Cluster, seed: int, vw: str) -> None:
    # large activations and parameters: the memory limits bind on 6-12 GiB GPUs
    profs = synthetic_profiles(30, seed=100 + seed, act_mib=600.0, param_mib=120.0)
    cm = CostModel(profs, paper.link)
    gpus = _vw(paper, vw)
    free = partition_dp_best_order(cm, gpus, nm=3, memory=False)
    try:
        ref = partition_dp_best_order(cm, gpus, nm=3)
    except InfeasiblePartition:
        with pytest.raises(InfeasiblePartition):
            partition_milp(cm, gpus, nm=3)
        return
    milp = partition_milp(cm, gpus, nm=3)
    _close(milp.objective_ms, ref.objective_ms)
    assert ref.objective_ms >= free.objective_ms - 1e-9
    for j, cost in enumerate(milp.stages(cm, 3)):
        assert cost.memory_bytes <= milp.gpus[j].memory_bytes


def test_memory_limits_bind_somewhere(paper: Cluster) -> None:
    """The memory tests above are not vacuous: some instance's optimum moves because of memory."""
    moved = 0
    for seed in range(6):
        cm = CostModel(
            synthetic_profiles(30, seed=100 + seed, act_mib=600.0, param_mib=120.0), paper.link
        )
        gpus = _vw(paper, "V0 R0 G0 Q0")
        try:
            with_mem = partition_dp_best_order(cm, gpus, nm=3).objective_ms
        except InfeasiblePartition:
            moved += 1
            continue
        moved += (
            with_mem > partition_dp_best_order(cm, gpus, nm=3, memory=False).objective_ms + 1e-9
        )
    assert moved >= 1


@pytest.mark.parametrize("model", ["vgg16", "resnet50", "gnmt"])
@pytest.mark.parametrize("vw", ["V0 R0 G0 Q0", "V0 V1 Q0 Q1"])
@pytest.mark.parametrize("memory", [False, True])
def test_milp_matches_dp_pipedream(paper: Cluster, model: str, vw: str, memory: bool) -> None:
    base = import_pipedream(PIPEDREAM / model / "graph.txt")
    types = {d.type for d in paper.devices}
    profs = {t: scale_profile(base, t, from_type="V100") for t in sorted(types)}
    cm = CostModel(profs, paper.link)
    gpus = _vw(paper, vw)
    ref = partition_dp_best_order(cm, gpus, nm=1, memory=memory)
    milp = partition_milp(cm, gpus, nm=1, memory=memory)
    _close(milp.objective_ms, ref.objective_ms)


@pytest.mark.parametrize("solver", available_solvers())
def test_each_solver(paper: Cluster, solver: str) -> None:
    cm = CostModel(synthetic_profiles(30, seed=7), paper.link)
    gpus = _vw(paper, "V0 R0 G0 Q0")
    _close(
        partition_milp(cm, gpus, solver=solver).objective_ms,
        partition_dp_best_order(cm, gpus).objective_ms,
    )


def test_dp_is_optimal_by_brute_force(paper: Cluster) -> None:
    import itertools

    cm = CostModel(synthetic_profiles(12, seed=3), paper.link)
    gpus = _vw(paper, "V0 G0 Q0")
    best = min(
        max(cm.stage_cost(gpus, j, b[j], b[j + 1], 1).time_ms for j in range(3))
        for cut in itertools.combinations(range(1, cm.num_segments), 2)
        for b in [(0, *cut, cm.num_segments)]
    )
    _close(partition_dp(cm, gpus, memory=False).objective_ms, best)


def test_distinct_orders_skip_identical_gpus(paper: Cluster) -> None:
    assert len(list(distinct_orders(_vw(paper, "V0 V1 Q0 Q1")))) == 6
    assert len(list(distinct_orders(_vw(paper, "V0 R0 G0 Q0")))) == 24
    assert len(list(distinct_orders(_vw(paper, "V0 V1 V2 V3")))) == 1


def test_infeasible_names_shortfall(paper: Cluster) -> None:
    cm = CostModel(synthetic_profiles(10, seed=1, act_mib=20000.0), paper.link)
    with pytest.raises(InfeasiblePartition, match="shortfall") as info:
        partition_dp(cm, _vw(paper, "G0 G1"), nm=1)
    assert info.value.shortfall_bytes > 0
