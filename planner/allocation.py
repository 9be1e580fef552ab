"""Resource allocation policies: which GPUs form each virtual worker (paper Sec. 8.1, Table 3).

- ``np`` (Node Partition): one node per VW (a node may be split into equal VWs when more VWs
  are asked for); homogeneous VWs, intra-node links only, stragglers likely.
- ``ed`` (Equal Distribution): every node's GPUs spread evenly over the VWs, so every VW gets
  the same mix; no stragglers, inter-node links inside every VW.
- ``hd`` (Hybrid Distribution): nodes are grouped (groups of at least 2 nodes, not all of them)
  and each group's GPUs are spread evenly over that group's VWs; the grouping chosen makes the
  VWs' aggregate compute (FP32 peak) and memory as equal as possible, scored as
  ``log(max/min compute) + log(max/min memory)``, fewer nodes per VW breaking ties.
- ``auto``: :func:`candidate_allocations` lists every applicable allocation (each policy with
  every VW count that divides the cluster, and HD with mixed groupings); the planner compares
  them (:mod:`planner.auto_search`) and keeps the best predicted throughput.

On ``examples/paper_cluster.yaml`` this gives Table 3 exactly: NP = VVVV/RRRR/GGGG/QQQQ,
ED = 4 x VRGQ, HD = 2 x VVQQ + 2 x RRGG. A policy that cannot apply raises
:class:`~profiler.errors.PlanError` saying why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from planner.cluster import Cluster, Device, Node
from profiler.catalog import CATALOG
from profiler.errors import PlanError

__all__ = [
    "POLICIES",
    "Allocation",
    "allocate",
    "candidate_allocations",
    "default_policy",
]

POLICIES = ("np", "ed", "hd", "auto")

SpeedFn = Callable[[str], float]


@dataclass(frozen=True)
class Allocation:
    """GPUs of each virtual worker (in node order; the partitioner picks the pipeline order).

    Attributes:
        policy: ``np``, ``ed`` or ``hd``.
        groups: one tuple of devices per VW.
        note: how the allocation was chosen (shown to the user).
        natural: the plain policy's own allocation (its default VW count): ``auto`` plans it
            whatever its budget, so it is never worse than ``--policy`` alone.
    """

    policy: str
    groups: tuple[tuple[Device, ...], ...]
    note: str = ""
    natural: bool = False

    @property
    def signatures(self) -> tuple[str, ...]:
        """GPU letters of each VW in node order, e.g. ``("VVQQ", "VVQQ", "RRGG", "RRGG")``."""
        return tuple("".join(d.letter for d in g) for g in self.groups)


def _catalog_speed(gpu_type: str) -> float:
    spec = CATALOG.get(gpu_type)
    return spec.fp32_tflops if spec is not None else 1.0


def _split(devs: Sequence[Device], parts: int) -> list[tuple[Device, ...]]:
    size = len(devs) // parts
    return [tuple(devs[i * size : (i + 1) * size]) for i in range(parts)]


def _node_devices(cluster: Cluster) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {n.name: [] for n in cluster.nodes}
    for d in cluster.devices:
        out[d.node].append(d)
    return out


def _spread(
    nodes: Sequence[Node], devs: dict[str, list[Device]], parts: int
) -> list[tuple[Device, ...]]:
    """Each node's GPUs split evenly over ``parts`` VWs (node order inside a VW)."""
    chunks = [_split(devs[n.name], parts) for n in nodes]
    return [tuple(d for ch in chunks for d in ch[v]) for v in range(parts)]


def node_partition(cluster: Cluster, num_vws: int | None = None) -> Allocation:
    """NP: one VW per node, or each node split into ``num_vws / #nodes`` equal VWs.

    Raises:
        PlanError: ``num_vws`` is not a multiple of the node count, or does not divide a node.
    """
    n = len(cluster.nodes)
    want = n if num_vws is None else num_vws
    if want % n:
        raise PlanError(
            f"policy 'np' gives each node's GPUs to its own VWs: {want} VWs is not a multiple of the "
            f"{n} nodes of {cluster.source}; use --vws {n} or policy ed/hd"
        )
    per = want // n
    bad = [nd for nd in cluster.nodes if nd.count % per]
    if bad:
        raise PlanError(
            f"policy 'np' with {want} VWs splits every node into {per} VWs, but node {bad[0].name} has "
            f"{bad[0].count} GPUs; use --vws {n}"
        )
    devs = _node_devices(cluster)
    groups = [g for nd in cluster.nodes for g in _split(devs[nd.name], per)]
    return Allocation("np", tuple(groups), f"one node per VW ({per} VW(s) per node)")


def equal_distribution(cluster: Cluster, num_vws: int | None = None) -> Allocation:
    """ED: every node's GPUs spread evenly over all VWs (default VW count: gcd of the node sizes).

    Raises:
        PlanError: some node's GPU count is not divisible by the number of VWs.
    """
    counts = [nd.count for nd in cluster.nodes]
    want = math.gcd(*counts) if num_vws is None else num_vws
    bad = [nd for nd in cluster.nodes if nd.count % want]
    if want < 1 or bad:
        raise PlanError(
            f"policy 'ed' spreads every node's GPUs evenly over the VWs, but node {bad[0].name if bad else '?'} "
            f"has {bad[0].count if bad else 0} GPUs for {want} VWs; use a VW count dividing every node "
            f"(gcd = {math.gcd(*counts)}) or policy np/hd"
        )
    groups = _spread(cluster.nodes, _node_devices(cluster), want)
    return Allocation("ed", tuple(groups), f"each node's GPUs spread over {want} VWs")


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


HD_MAX_NODES = 9
"""HD enumerates every grouping (Bell(9) = 21,147) of at most this many nodes; larger clusters
are grouped per copy of their repeating unit (:func:`_node_groupings`)."""


def _node_groupings(cluster: Cluster) -> Iterator[list[list[int]]]:
    """Groupings of the cluster's node indices that HD scores.

    Up to :data:`HD_MAX_NODES` nodes: every set partition. Larger clusters: nodes that differ
    only by name are interchangeable, so a cluster of ``g`` identical copies of a unit (``g`` =
    gcd of how many nodes each kind has) is grouped as its unit, every copy alike: the set
    partitions of one unit's nodes, replicated. A unit above :data:`HD_MAX_NODES` nodes is
    refused (use np or ed).

    Raises:
        PlanError: the repeating unit has more than :data:`HD_MAX_NODES` nodes.
    """
    n = len(cluster.nodes)
    if n <= HD_MAX_NODES:
        yield from _set_partitions(list(range(n)))
        return
    kinds: dict[tuple[object, ...], list[int]] = {}
    for i, nd in enumerate(cluster.nodes):
        key = (nd.gpu_type, nd.count, nd.memory_bytes, nd.emulation, nd.host_memory_bytes)
        kinds.setdefault(key, []).append(i)
    copies = math.gcd(*(len(v) for v in kinds.values()))
    unit = [(k, j) for k, v in kinds.items() for j in range(len(v) // copies)]
    if len(unit) > HD_MAX_NODES:
        raise PlanError(
            f"policy 'hd' groups at most {HD_MAX_NODES} distinct nodes, but the repeating unit of "
            f"{cluster.source} has {len(unit)} ({copies} copies of it); use np or ed, or policy auto"
        )
    for part in _set_partitions(list(range(len(unit)))):
        yield [
            [kinds[unit[u][0]][r * (len(kinds[unit[u][0]]) // copies) + unit[u][1]] for u in block]
            for r in range(copies)
            for block in part
        ]


def _imbalance(groups: Sequence[Sequence[Device]], speed: SpeedFn) -> float:
    comp = [sum(speed(d.type) for d in g) for g in groups]
    mem = [sum(d.memory_bytes for d in g) for g in groups]
    return math.log(max(comp) / min(comp)) + math.log(max(mem) / min(mem))


def _best_grouping(
    cluster: Cluster, size: int, speed: SpeedFn, mixed: bool
) -> tuple[tuple[float, int], list[tuple[Device, ...]]] | None:
    """HD's grouping of the nodes into VWs of ``size`` GPUs with the least imbalance (then the
    fewest nodes per group), each group spread evenly over its VWs; ``None`` if none."""
    nodes = list(cluster.nodes)
    n = len(nodes)
    devs = _node_devices(cluster)
    best: tuple[tuple[float, int], list[tuple[Device, ...]]] | None = None
    for part in _node_groupings(cluster):
        if any(len(b) == n for b in part) or not any(len(b) >= 2 for b in part):
            continue
        if not mixed and any(len(b) < 2 for b in part):
            continue
        groups: list[tuple[Device, ...]] = []
        for block in sorted(part):
            members = [nodes[i] for i in block]
            gpus = sum(nd.count for nd in members)
            vws = gpus // size
            if gpus % size or any(nd.count % vws for nd in members):
                break
            groups += _spread(members, devs, vws)
        else:
            score = (round(_imbalance(groups, speed), 12), sum(len(b) for b in part))
            if best is None or score < best[0]:
                best = (score, groups)
    return best


def hybrid_distribution(
    cluster: Cluster,
    num_vws: int | None = None,
    speed: SpeedFn | None = None,
    mixed: bool = False,
) -> Allocation:
    """HD: group nodes (>= 2 per group, not all) and spread each group evenly over its VWs.

    Args:
        cluster: the cluster.
        num_vws: number of VWs (default: one per node, as in the paper; where that gives no
            even grouping, e.g. single-GPU nodes, the largest VW count that does).
        speed: relative compute of a GPU type (default: catalog FP32 peak).
        mixed: also allow single-node groups beside the multi-node ones (at least one group
            still mixes nodes), e.g. AAVV + TTTT + 2 x KKKK on 2 A100, 4 T4, 8 K80, 2 V100,
            where no grouping of >= 2 nodes per group yields equal VWs (``auto`` tries it).

    Raises:
        PlanError: fewer than 3 nodes, or no grouping yields equal-size VWs.
    """
    speed = speed or _catalog_speed
    nodes = list(cluster.nodes)
    n = len(nodes)
    if n < 3:
        raise PlanError(
            f"policy 'hd' mixes a few nodes per VW but {cluster.source} has {n} node(s); use np or ed"
        )
    total = sum(nd.count for nd in nodes)
    if num_vws is None:
        # the paper's default (one VW per node), else the most VWs HD can form evenly
        tries = [n] + [v for v in range(total - 1, 1, -1) if total % v == 0 and v != n]
        for want in tries:
            try:
                return hybrid_distribution(cluster, want, speed)
            except PlanError:
                continue
        return hybrid_distribution(cluster, n, speed)  # raises, naming the paper's default
    want = num_vws
    if want < 1 or total % want:
        raise PlanError(
            f"policy 'hd' needs equal VWs: {total} GPUs do not split into {want} VWs; pick --vws dividing {total}"
        )
    size = total // want
    best = _best_grouping(cluster, size, speed, mixed)
    if best is None:
        raise PlanError(
            f"policy 'hd' found no grouping of the {n} nodes into VWs of {size} GPUs with every node "
            f"spread evenly; use --vws or policy np/ed"
        )
    return Allocation(
        "hd",
        tuple(best[1]),
        f"{'mixed ' if mixed else ''}node groups balancing compute and memory "
        f"(imbalance {best[0][0]:.3f})",
    )


def default_policy(cluster: Cluster, num_vws: int | None = None) -> str:
    """The policy ``hetpipe plan`` and ``hetpipe run`` use when none is given: ``hd`` where it
    applies to ``cluster`` (3+ nodes grouped evenly), else ``ed``."""
    try:
        hybrid_distribution(cluster, num_vws)
    except PlanError:
        return "ed"
    return "hd"


def allocate(
    cluster: Cluster, policy: str, num_vws: int | None = None, speed: SpeedFn | None = None
) -> Allocation:
    """The allocation of ``policy`` (``np``, ``ed`` or ``hd``; ``auto`` is the planner's search).

    Raises:
        PlanError: unknown policy, or the policy cannot apply to this cluster (says why).
    """
    if num_vws is not None and num_vws < 1:
        raise PlanError(f"--vws must be >= 1, got {num_vws}")
    if policy == "np":
        return node_partition(cluster, num_vws)
    if policy == "ed":
        return equal_distribution(cluster, num_vws)
    if policy == "hd":
        return hybrid_distribution(cluster, num_vws, speed)
    raise PlanError(f"unknown allocation policy {policy!r}; use one of {', '.join(POLICIES)}")


def _pattern(alloc: Allocation) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """A key equal for allocations whose VWs are the same up to node names: each VW's GPU types,
    memory and node pattern (which GPUs share a node), sorted."""
    keys = []
    for group in alloc.groups:
        ids: dict[str, int] = {}
        ordered = sorted(group, key=lambda d: (d.type, d.memory_bytes, d.node, d.index))
        keys.append(
            tuple((d.type, d.memory_bytes, ids.setdefault(d.node, len(ids))) for d in ordered)
        )
    return tuple(sorted(keys))


def _natural(cluster: Cluster, num_vws: int | None) -> Iterator[Allocation]:
    """Each plain policy's own allocation (``num_vws`` or its default VW count), where it applies."""
    for policy in ("np", "ed", "hd"):
        try:
            yield replace(allocate(cluster, policy, num_vws), natural=True)
        except PlanError:
            continue


def candidate_allocations(
    cluster: Cluster, num_vws: int | None = None, max_vw_gpus: int = 8
) -> list[Allocation]:
    """Every distinct applicable allocation for ``auto``: each plain policy's own allocation
    (so ``auto`` is never worse than one of them), then each policy x each VW count, and HD
    with mixed groupings (single-node groups beside multi-node ones).

    VW counts range over divisors of the GPU total whose VWs have at most ``max_vw_gpus`` GPUs
    (or just ``num_vws``); the plain policies' own allocations are kept whatever their VW size.
    Allocations whose VWs are the same up to node names are listed once.
    """
    total = sum(nd.count for nd in cluster.nodes)
    counts = (
        [num_vws]
        if num_vws is not None
        else [v for v in range(1, total + 1) if total % v == 0 and total // v <= max_vw_gpus]
    )

    def per_count() -> Iterator[Allocation]:
        for policy in ("np", "ed", "hd", "hd-mixed"):
            for v in counts:
                try:
                    if policy == "hd-mixed":
                        yield hybrid_distribution(cluster, v, mixed=True)
                    else:
                        yield allocate(cluster, policy, v)
                except PlanError:
                    continue

    seen: set[tuple[tuple[tuple[str, int, int], ...], ...]] = set()
    out = []
    for alloc in (*_natural(cluster, num_vws), *per_count()):
        key = _pattern(alloc)
        if key not in seen:
            seen.add(key)
            out.append(alloc)
    if not out:
        raise PlanError(f"no allocation policy applies to {cluster.source} with {num_vws} VWs")
    return out
