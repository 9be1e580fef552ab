"""Allocation policies: the paper's Table 3 and general clusters."""

from __future__ import annotations

import pytest

from planner.allocation import allocate, candidate_allocations, hybrid_distribution
from planner.cluster import Cluster, load_cluster, parse_cluster
from profiler.errors import PlanError
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def paper() -> Cluster:
    return load_cluster(EXAMPLES / "paper_cluster.yaml")


def test_table3(paper: Cluster) -> None:
    assert allocate(paper, "np").signatures == ("VVVV", "RRRR", "GGGG", "QQQQ")
    assert allocate(paper, "ed").signatures == ("VRGQ",) * 4
    assert allocate(paper, "hd").signatures == ("VVQQ", "VVQQ", "RRGG", "RRGG")


def test_every_gpu_used_once(paper: Cluster) -> None:
    for policy in ("np", "ed", "hd"):
        groups = allocate(paper, policy).groups
        labels = [d.label for g in groups for d in g]
        assert sorted(labels) == sorted(d.label for d in paper.devices)


def _cluster(*nodes: tuple[str, str, int]) -> Cluster:
    return parse_cluster({"nodes": [{"name": n, "gpu": g, "count": c} for n, g, c in nodes]})


def test_uneven_counts() -> None:
    cl = _cluster(("a", "V100", 4), ("b", "T4", 2), ("c", "K80", 2))
    assert allocate(cl, "ed").signatures == ("WWTK", "WWTK")
    with pytest.raises(PlanError, match="node a has 4 GPUs for 3 VWs"):
        allocate(cl, "ed", 3)
    assert allocate(cl, "np").signatures == ("WWWW", "TT", "KK")
    with pytest.raises(PlanError, match="not a multiple"):
        allocate(cl, "np", 2)


def test_user_vw_count(paper: Cluster) -> None:
    assert allocate(paper, "ed", 2).signatures == ("VVRRGGQQ",) * 2
    assert allocate(paper, "np", 8).signatures == ("VV", "VV", "RR", "RR", "GG", "GG", "QQ", "QQ")
    assert allocate(paper, "hd", 2).signatures == ("VVVVQQQQ", "RRRRGGGG")


def test_hd_needs_three_nodes() -> None:
    with pytest.raises(PlanError, match="hd"):
        allocate(_cluster(("a", "V100", 2), ("b", "T4", 2)), "hd")


def test_unknown_policy(paper: Cluster) -> None:
    with pytest.raises(PlanError, match="unknown allocation policy"):
        allocate(paper, "xx")


def test_candidates_are_distinct(paper: Cluster) -> None:
    cands = candidate_allocations(paper, max_vw_gpus=4)
    keys = [tuple(sorted(a.signatures)) for a in cands]
    assert len(keys) == len(set(keys))
    assert ("VRGQ",) * 4 in keys and ("RRGG", "RRGG", "VVQQ", "VVQQ") in keys
    assert all(len(g) <= 4 for a in cands for g in a.groups)


def test_hd_mixed_groupings_where_plain_hd_has_none() -> None:
    cl = _cluster(("a", "A100", 2), ("t", "T4", 4), ("k", "K80", 8), ("v", "V100", 2))
    with pytest.raises(PlanError, match="found no grouping"):
        allocate(cl, "hd", 4)
    mixed = hybrid_distribution(cl, 4, mixed=True)
    assert sorted(mixed.signatures) == ["ATTW", "ATTW", "KKKK", "KKKK"]
    sigs = {tuple(sorted(a.signatures)) for a in candidate_allocations(cl, None, 16)}
    assert ("ATTW", "ATTW", "KKKK", "KKKK") in sigs
    assert ("ATTKKKKW", "ATTKKKKW") in sigs  # ED with 8-GPU VWs
    # on the paper cluster mixed groupings add nothing: Table 3's HD stays
    paper = load_cluster(EXAMPLES / "paper_cluster.yaml")
    assert hybrid_distribution(paper, mixed=True).signatures == ("VVQQ", "VVQQ", "RRGG", "RRGG")
