"""Allocation policies on clusters too large to enumerate every HD grouping."""

from __future__ import annotations

from collections import Counter

import pytest

from planner.allocation import HD_MAX_NODES, allocate, default_policy
from planner.cluster import Cluster, parse_cluster

TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")


def _cluster(types: list[str], count: int = 4) -> Cluster:
    nodes = [{"name": f"n{i}", "gpu": t, "count": count} for i, t in enumerate(types)]
    return parse_cluster({"name": "big", "nodes": nodes})


def test_hd_groups_a_repeating_cluster_as_the_exact_search_groups_two_copies() -> None:
    big = _cluster(list(TYPES) * 40)  # 160 nodes, 640 GPUs: Bell(160) groupings
    two = _cluster(list(TYPES) * 2)  # 8 nodes: every grouping enumerated
    assert len(two.nodes) <= HD_MAX_NODES < len(big.nodes)
    alloc, exact = allocate(big, "hd"), allocate(two, "hd")
    assert len(alloc.groups) == 160 and alloc.note == exact.note  # same imbalance

    def kinds(groups: object) -> Counter[str]:
        return Counter("".join(sorted(d.letter for d in g)) for g in groups)  # type: ignore[attr-defined]

    assert {k: 20 * c for k, c in kinds(exact.groups).items()} == kinds(alloc.groups)
    copy = {f"n{i}": i // 4 for i in range(160)}
    assert all(len({copy[d.node] for d in g}) == 1 for g in alloc.groups)  # inside one copy
    assert default_policy(big) == "hd"


def test_hd_refuses_a_large_cluster_without_a_small_repeating_unit() -> None:
    odd = _cluster([*TYPES * 3, "V100"])  # 13 nodes, no repeating unit
    assert len(odd.nodes) > HD_MAX_NODES
    with pytest.raises(
        Exception, match=r"policy 'hd' groups at most 9 distinct nodes.*use np or ed"
    ):
        allocate(odd, "hd", 13)
    assert default_policy(odd) == "ed"
