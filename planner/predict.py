"""Analytic throughput predictions for a plan (the simulator refines them).

Virtual worker (VW) with stage times ``t_j`` (ms per minibatch, compute + receives) and ``Nm``
minibatches in flight: a minibatch visits every stage once forward and once backward, so one
round trip takes at least ``sum_j t_j`` and, by Little's law, at most ``Nm`` minibatches
complete per round trip; the slowest stage completes at most one per ``max_j t_j``::

    vw_samples_per_s = batch * 1000 * min(1 / max_j t_j, Nm / sum_j t_j)

Whole cluster under WSP: the global clock is the slowest VW's, so in the long run every VW
advances at the straggler's pace (``n_vws * min`` of the VW rates); and every wave each node's
network card carries the cross-node activations, gradients, pushes and pulls of all VWs, which
bounds the wave rate too.

AllReduce baseline (the paper's Horovod comparison): every GPU that can hold the whole model
trains a full minibatch, then a ring all-reduce over the slowest link moves
``2 (n-1)/n x param_bytes`` per GPU; BSP steps at the slowest GPU's pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cluster import Cluster, Device, Link, allreduce_s
from planner.costmodel import CostModel

__all__ = [
    "AllReduceResult",
    "allreduce_throughput",
    "cluster_throughput",
    "ring_link",
    "simulate_allreduce",
    "vw_throughput",
]


def vw_throughput(stage_ms: Sequence[float], nm: int, batch_size: int) -> float:
    """Samples/s of one VW alone with ``nm`` minibatches in flight."""
    slowest = max(stage_ms)
    round_trip = sum(stage_ms)
    if slowest <= 0:
        return float("inf")
    per_ms = min(1.0 / slowest, nm / round_trip)
    return batch_size * 1000.0 * per_ms


def cluster_throughput(
    per_vw: Sequence[float],
    node_bytes_per_wave: dict[str, int],
    inter_bw_bps: float,
    nm: int,
    batch_size: int,
) -> float:
    """Straggler-bound WSP throughput, capped by the busiest node's network per wave."""
    n = len(per_vw)
    compute_bound = n * min(per_vw)
    busiest = max(node_bytes_per_wave.values(), default=0)
    if busiest <= 0:
        return compute_bound
    wave_s = busiest / inter_bw_bps
    return min(compute_bound, n * nm * batch_size / wave_s)


def ring_link(cluster: Cluster, nodes: Sequence[str]) -> Link:
    """The slowest link of a ring over GPUs on ``nodes``, as charged (the cluster's
    ``links.scale`` applied): intra-node on one node, else the slower of the intra- and
    inter-node links."""
    scale = cluster.link_scale
    if len(set(nodes)) <= 1:
        return cluster.intra_node.scaled(scale)
    slowest = min(cluster.inter_node, cluster.intra_node, key=lambda link: link.bandwidth_bps)
    return slowest.scaled(scale)


def allreduce_throughput(
    cluster: Cluster, cm: CostModel, batch_size: int, devices: Sequence[Device] | None = None
) -> tuple[float, int]:
    """Data-parallel AllReduce (BSP) samples/s on the GPUs that hold the whole model (or on
    ``devices``), and their count (:func:`simulate_allreduce` on the planner's cost model)."""
    need = cm.model_memory_bytes(1)
    gpus: list[Device] = (
        list(devices)
        if devices is not None
        else [d for d in cluster.devices if d.memory_bytes >= need and d.type in cm.types]
    )
    times = [float(cm.compute_ms(d.type)[-1]) for d in gpus]
    nodes = [d.node for d in gpus]
    r = simulate_allreduce(
        times, cm.total_param_bytes(), ring_link(cluster, nodes), batch_size, nodes
    )
    return r.throughput, r.gpus


@dataclass(frozen=True)
class AllReduceResult:
    """Data-parallel AllReduce BSP prediction.

    Attributes:
        throughput: samples/s of all workers together (0.0 when no GPU holds the model).
        gpus: number of workers (GPUs that hold the whole model).
        iteration_ms: one BSP step: the slowest worker's compute plus the ring all-reduce.
        allreduce_ms: the ring all-reduce part.
        cross_node_bytes_per_iter: bytes crossing nodes per step.
        labels: the workers' GPU labels.
    """

    throughput: float
    gpus: int
    iteration_ms: float
    allreduce_ms: float
    cross_node_bytes_per_iter: int
    labels: tuple[str, ...] = ()


def simulate_allreduce(
    compute_ms: list[float],
    param_bytes: int,
    link: Link,
    batch_size: int,
    nodes: list[str] | None = None,
    labels: tuple[str, ...] = (),
) -> AllReduceResult:
    """BSP data parallelism: every step waits for the slowest worker, then a ring all-reduce.

    A ring over ``n`` workers takes ``2 (n - 1)`` steps, each moving ``param_bytes / n`` over
    ``link`` (the slowest link of the ring). Steps are identical, so one step is the whole
    simulation: throughput = ``n * batch_size / (max(compute_ms) + allreduce_ms)``.

    Args:
        compute_ms: forward+backward time of one minibatch of the whole model, per worker.
        param_bytes: bytes of all parameters (the gradient volume).
        link: the slowest link on the ring.
        batch_size: samples per minibatch per worker.
        nodes: node of each worker, ring ordered node by node, for the cross-node byte count.
        labels: worker labels (reported only).
    """
    n = len(compute_ms)
    if n == 0:
        return AllReduceResult(0.0, 0, 0.0, 0.0, 0, labels)
    chunk = param_bytes / n
    ar_ms = allreduce_s(link, param_bytes, n) * 1e3
    it_ms = max(compute_ms) + ar_ms
    crossing_edges = 0
    if nodes is not None and n > 1:
        ring = sorted(range(n), key=lambda i: nodes[i])
        crossing_edges = sum(nodes[ring[i]] != nodes[ring[(i + 1) % n]] for i in range(n))
    per_edge = 2 * (n - 1) * chunk
    return AllReduceResult(
        throughput=n * batch_size / (it_ms / 1e3) if it_ms > 0 else float("inf"),
        gpus=n,
        iteration_ms=it_ms,
        allreduce_ms=ar_ms,
        cross_node_bytes_per_iter=int(crossing_edges * per_edge),
        labels=labels,
    )
