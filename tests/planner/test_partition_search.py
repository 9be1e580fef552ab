"""The exact partition search: equal to enumerating every GPU order, on synthetic and real graphs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cluster import Cluster, Device, load_cluster, parse_cluster
from planner.costmodel import CostModel
from planner.partition.dp import (
    InfeasiblePartition,
    _bottleneck,
    _shortfall_mats,
    distinct_orders,
    partition_dp,
    partition_dp_best_order,
)
from planner.partition.memory import feasible_order, fits_memory, min_memory_shortfall
from planner.partition.milp import partition_milp
from planner.partition.search import lower_bound_ms, partition_exact
from profiler.analytic import scale_profile
from profiler.errors import PlanError
from profiler.pipedream import import_pipedream
from profiler.table import Profile
from tests.conftest import EXAMPLES, PIPEDREAM
from tests.planner.synth import synthetic_profiles

REL = 1e-6
MODELS = sorted(p.name for p in PIPEDREAM.iterdir() if (p / "graph.txt").is_file())


@pytest.fixture(scope="module")
def paper() -> Cluster:
    return load_cluster(EXAMPLES / "paper_cluster.yaml")


def _vw(cluster: Cluster, spec: str) -> list[Device]:
    by = {f"{d.node}{d.index}": d for d in cluster.devices}
    return [by[s] for s in spec.split()]


def _close(a: float, b: float) -> None:
    assert abs(a - b) <= REL * max(abs(a), abs(b), 1e-12), (a, b)


def branchy(n_layers: int, block: int, types: tuple[str, ...], seed: int = 0) -> dict[str, Profile]:
    """A wide, branchy graph: inside every ``block`` layers each layer also reads the block's
    first output (a DenseNet-like skip), so only block boundaries are single-tensor cuts."""
    profs = synthetic_profiles(
        n_layers, types, seed=seed, skip_prob=0.0, act_mib=2.0, param_mib=0.5
    )
    out = {}
    for t, p in profs.items():
        table = p.table.copy()
        names = list(table["layer"])
        inputs = list(table["inputs"])
        for i in range(2, n_layers):
            head = (i // block) * block
            if i % block != 1 and head < i - 1:
                inputs[i] = f"{names[head]};{inputs[i]}"
        table["inputs"] = inputs
        out[t] = Profile(table, p.meta)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vw", ["V0 R0 G0 Q0", "V0 V1 Q0 Q1", "R0 G0 G1", "V0 R0 R1 G0 Q0 Q1"])
@pytest.mark.parametrize("memory", [False, True])
def test_equals_every_order(paper: Cluster, seed: int, vw: str, memory: bool) -> None:
    act, par = (600.0, 120.0) if memory else (64.0, 16.0)
    cm = CostModel(synthetic_profiles(28 + seed, seed=seed, act_mib=act, param_mib=par), paper.link)
    gpus = _vw(paper, vw)
    for nm in (1, 3):
        try:
            ref = partition_dp_best_order(cm, gpus, nm, memory=memory)
        except InfeasiblePartition:
            assert not fits_memory(cm, gpus, nm)
            with pytest.raises(InfeasiblePartition):
                partition_exact(cm, gpus, nm, memory=memory)
            continue
        got = partition_exact(cm, gpus, nm, memory=memory)
        _close(got.objective_ms, ref.objective_ms)
        _close(got.bottleneck_ms, ref.objective_ms)
        assert got.gap == 0 and got.solver == "dp"
        assert sorted(d.label for d in got.gpus) == sorted(d.label for d in gpus)
        if memory:
            assert fits_memory(cm, gpus, nm)
            for j, cost in enumerate(got.stages(cm, nm)):
                assert cost.memory_bytes <= got.gpus[j].memory_bytes


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("vw", ["V0 R0 G0 Q0", "V0 V1 Q0 Q1", "V0 V1 R0 R1 G0 Q0"])
def test_pipedream_profiles_exact(paper: Cluster, model: str, vw: str) -> None:
    """Every vendored PipeDream profile, every cut a candidate: search == enumeration == MILP."""
    base = import_pipedream(PIPEDREAM / model / "graph.txt")
    profs = {
        t: scale_profile(base, t, from_type="V100") for t in sorted({d.type for d in paper.devices})
    }
    cm = CostModel(profs, paper.link, max_cuts=None)
    assert cm.num_segments == cm.num_layers
    gpus = _vw(paper, vw)
    got = partition_exact(cm, gpus, 2)
    _close(got.objective_ms, partition_dp_best_order(cm, gpus, 2).objective_ms)
    if len(gpus) <= 4:
        _close(got.objective_ms, partition_milp(cm, gpus, 2).objective_ms)
    assert lower_bound_ms(cm, gpus) <= got.objective_ms * (1 + 1e-9)


def test_wide_branchy_graph_exact_beats_coarsening(paper: Cluster) -> None:
    """1,200 layers where coarsening keeps 2 cuts: the exact search finds the true optimum."""
    profs = branchy(1200, 400, ("TITAN V", "Quadro P4000"))
    gpus = _vw(paper, "V0 V1 Q0 Q1")
    exact = CostModel(profs, paper.link, max_cuts=None)
    coarse = CostModel(profs, paper.link, max_cuts=320)
    assert coarse.num_segments < 10 and exact.num_segments == 1200
    got = partition_exact(exact, gpus, 1)
    _close(got.objective_ms, partition_dp_best_order(exact, gpus, 1).objective_ms)
    assert got.objective_ms < 0.8 * partition_exact(coarse, gpus, 1).objective_ms


@pytest.mark.parametrize("n_layers", [1000])
def test_long_chain_eight_gpus_of_four_types(paper: Cluster, n_layers: int) -> None:
    profs = synthetic_profiles(n_layers, seed=5, skip_prob=0.3, act_mib=4.0, param_mib=1.0)
    cm = CostModel(profs, paper.link)
    gpus = _vw(paper, "V0 V1 R0 R1 G0 G1 Q0 Q1")
    got = partition_exact(cm, gpus, 2)
    assert got.gap == 0 and len(got.gpus) == 8
    # a fixed order can only be worse: the search covered it
    for order in itertools.islice(distinct_orders(gpus), 0, 2520, 1200):
        assert partition_dp(cm, order, 2).objective_ms >= got.objective_ms * (1 - 1e-9)


def test_time_limit_returns_best_with_bound(paper: Cluster) -> None:
    cm = CostModel(synthetic_profiles(200, seed=3), paper.link)
    gpus = _vw(paper, "V0 V1 R0 R1 G0 G1 Q0 Q1")
    exact = partition_exact(cm, gpus, 1)
    cut = partition_exact(cm, gpus, 1, time_limit_s=0.0)
    assert cut.solver == "dp (time limit)"
    assert cut.lower_bound_ms <= exact.objective_ms * (1 + 1e-9) <= cut.objective_ms * (1 + 2e-9)
    assert cut.gap >= 0 and np.isfinite(cut.gap)


def test_milp_time_limit_is_not_a_failure(paper: Cluster) -> None:
    cm = CostModel(synthetic_profiles(120, seed=4), paper.link)
    gpus = _vw(paper, "V0 V1 R0 R1 G0 Q0")
    part = partition_milp(cm, gpus, 1, time_limit_s=0.01)
    exact = partition_exact(cm, gpus, 1).objective_ms
    assert part.lower_bound_ms <= exact * (1 + 1e-6) <= part.bottleneck_ms * (1 + 1e-6)
    assert part.solver.endswith("(time limit)") or part.gap == 0


def test_more_gpus_than_segments_is_one_line(paper: Cluster) -> None:
    cm = CostModel(synthetic_profiles(3, seed=1), paper.link)
    gpus = _vw(paper, "V0 V1 V2 V3")
    for call in (
        lambda: partition_exact(cm, gpus),
        lambda: fits_memory(cm, gpus, 1),
        lambda: min_memory_shortfall(cm, gpus, 1),
    ):
        with pytest.raises(PlanError, match=r"4 GPUs needs 4 non-empty stages.*--vws") as info:
            call()
        assert "\n" not in str(info.value)


def _reference_shortfall(cm: CostModel, gpus: list[Device], nm: int) -> float:
    return min(_bottleneck(_shortfall_mats(cm, o, nm))[0] for o in distinct_orders(gpus))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_layers=st.integers(6, 16),
    seed=st.integers(0, 10_000),
    nodes=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 2), st.floats(0.3, 6.0)), min_size=1, max_size=3
    ),
    nm=st.integers(1, 4),
)
def test_milp_and_dp_agree_with_random_memory(
    n_layers: int, seed: int, nodes: list[tuple[int, int, float]], nm: int
) -> None:
    """Random small instances and memory limits: MILP == search == enumeration, or all infeasible."""
    types = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
    spec = [
        {"name": f"n{i}", "gpu": types[t], "count": c, "memory": f"{gib:.3f}GiB"}
        for i, (t, c, gib) in enumerate(nodes)
    ]
    links = {
        "intra_node": {"bandwidth": "10GB/s"},
        "inter_node": {"bandwidth": "1GB/s", "latency": "20us"},
    }
    cluster = parse_cluster({"nodes": spec, "links": links})
    profs = synthetic_profiles(n_layers, seed=seed, act_mib=200.0, param_mib=60.0)
    cm = CostModel(profs, cluster.link)
    gpus = list(cluster.devices)
    if len(gpus) > cm.num_segments or len(gpus) < 2:
        return
    try:
        ref: float | None = partition_dp_best_order(cm, gpus, nm).objective_ms
    except InfeasiblePartition:
        ref = None
    assert fits_memory(cm, gpus, nm) == (ref is not None)
    if ref is None:
        short = min_memory_shortfall(cm, gpus, nm)
        assert short > 0 and abs(short - _reference_shortfall(cm, gpus, nm)) <= 2
        with pytest.raises(InfeasiblePartition):
            partition_exact(cm, gpus, nm)
        with pytest.raises(InfeasiblePartition):
            partition_milp(cm, gpus, nm)
        return
    assert min_memory_shortfall(cm, gpus, nm) == 0
    _close(partition_exact(cm, gpus, nm).objective_ms, ref)
    _close(partition_milp(cm, gpus, nm).objective_ms, ref)


@pytest.mark.parametrize("seed", range(6))
def test_feasible_order_fits_exactly_when_memory_allows(paper: Cluster, seed: int) -> None:
    profs = synthetic_profiles(20 + seed, seed=seed, act_mib=600.0, param_mib=120.0)
    cm = CostModel(profs, paper.link)
    for vw in ("V0 R0 G0 Q0", "V0 V1 Q0 Q1", "V0 R0 R1 G0 Q0 Q1"):
        gpus = _vw(paper, vw)
        for nm in (1, 3):
            order = feasible_order(cm, gpus, nm)
            assert (order is not None) == fits_memory(cm, gpus, nm)
            if order is not None:
                assert sorted(d.label for d in order) == sorted(d.label for d in gpus)
                partition_dp(cm, order, nm)  # raises InfeasiblePartition if it does not fit
