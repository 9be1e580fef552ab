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

from planner.cluster import Cluster, Device
from planner.costmodel import CostModel

__all__ = ["allreduce_throughput", "cluster_throughput", "vw_throughput"]


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


def allreduce_throughput(
    cluster: Cluster, cm: CostModel, batch_size: int, devices: Sequence[Device] | None = None
) -> tuple[float, int]:
    """Data-parallel AllReduce (BSP) samples/s on the GPUs that hold the whole model (or on
    ``devices``), and their count."""
    need = cm.model_memory_bytes(1)
    gpus: list[Device] = (
        list(devices)
        if devices is not None
        else [d for d in cluster.devices if d.memory_bytes >= need and d.type in cm.types]
    )
    if not gpus:
        return 0.0, 0
    step_ms = max(float(cm.compute_ms(d.type)[-1]) for d in gpus)
    n = len(gpus)
    if n > 1:
        nodes = {d.node for d in gpus}
        link = cluster.inter_node if len(nodes) > 1 else cluster.intra_node
        if len(nodes) > 1 and cluster.intra_node.bandwidth_bps < link.bandwidth_bps:
            link = cluster.intra_node
        chunk = cm.total_param_bytes() / n
        step_ms += 2 * (n - 1) * link.time_s(chunk) * 1e3
    return n * batch_size * 1000.0 / step_ms, n
