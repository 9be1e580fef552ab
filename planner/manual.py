"""Plans cut by hand (given cut points or a stage count) for the API, tests and benchmarks.

The planner (``planner.planner.make_plan``) is the main source of plans; this module fills a
:class:`planner.plan.Plan` from a model graph and chosen cut points, so a model can run without
a profile (``hetpipe run CLUSTER.yaml --stages K``, ``hetpipe.train(module, stages=K)``). Stage
times are left at 0 (no prediction) unless given. Like every plan, these are made here in the
planner; the runtime only executes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from planner.cluster import Cluster, Device, Emulation, Link, Node
from planner.plan import GpuSlot, Plan, Prediction, ShardPlan, StagePlan, VirtualWorker
from planner.schedule import HETPIPE
from profiler.errors import PlanError
from profiler.graph import ModelGraph

__all__ = ["balanced_cuts", "cpu_cluster", "hand_cut_plan", "manual_plan", "multi_vw_plan"]


def balanced_cuts(graph: ModelGraph, n_stages: int) -> tuple[int, ...]:
    """Cut points splitting the layers with parameters into ``n_stages`` groups of similar bytes.

    Raises:
        PlanError: fewer layers than stages.
    """
    n = len(graph.layers)
    if n_stages < 1 or n_stages > n - 1:
        raise PlanError(f"cannot split {n} layers into {n_stages} stages")
    if n_stages == 1:
        return ()
    cum: list[int] = []
    acc = 0
    for lay in graph.layers:
        acc += max(lay.param_bytes, 1)
        cum.append(acc)
    cuts: list[int] = []
    for k in range(1, n_stages):
        c = next(i + 1 for i in range(n) if cum[i] >= acc * k / n_stages)
        c = max(c, cuts[-1] + 1 if cuts else 1)
        cuts.append(min(c, n - n_stages + k))
    return tuple(cuts)


def cpu_cluster(n: int, speed: float = 0.0, memory_bytes: int = 1 << 30) -> Cluster:
    """A cluster of ``n`` CPU devices on one node (emulated at ``speed`` when > 0)."""
    emu = Emulation(speed, memory_bytes) if speed > 0 else None
    node = Node("cpu", "localhost", "CPU", "C", n, memory_bytes, emu)
    return Cluster("cpu", (node,), Link(1e9, 1e-5), Link(1e9, 1e-5))


def _slot(d: Device) -> GpuSlot:
    """A device as the plan records it: an emulated one with its emulated memory and speed."""
    return GpuSlot(
        d.node,
        d.index,
        d.type,
        d.emulation.memory_bytes if d.emulation else d.memory_bytes,
        d.emulation.speed if d.emulation else 0.0,
    )


def _stage(
    graph: ModelGraph,
    s: int,
    bounds: Sequence[int],
    nm: int,
    capacity_bytes: int,
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
) -> StagePlan:
    """Stage ``s`` of a hand cut: layers ``bounds[s] .. bounds[s+1]-1`` of ``graph``."""
    n_stages = len(bounds) - 1
    lo, hi = bounds[s], bounds[s + 1] - 1
    return StagePlan(
        gpu=s,
        first_layer=graph.layers[lo].name,
        last_layer=graph.layers[hi].name,
        first_index=lo,
        last_index=hi,
        fwd_ms=fwd_ms[s] if fwd_ms else 0.0,
        bwd_ms=bwd_ms[s] if bwd_ms else 0.0,
        recv_fwd_ms=0.0,
        recv_bwd_ms=0.0,
        recv_bytes=graph.cut_bytes(lo) if s else 0,
        send_bytes=graph.cut_bytes(bounds[s + 1]) if s < n_stages - 1 else 0,
        param_bytes=sum(lay.param_bytes for lay in graph.layers[lo : hi + 1]),
        in_flight=HETPIPE.in_flight_bound(s, n_stages, nm),
        memory_bytes=0,
        capacity_bytes=capacity_bytes,
    )


def manual_plan(
    graph: ModelGraph,
    cuts: Sequence[int],
    model: str,
    batch_size: int,
    nm: int,
    cluster: Cluster | None = None,
    devices: Sequence[Device] | None = None,
    fwd_ms: Sequence[float] = (),
    bwd_ms: Sequence[float] = (),
) -> Plan:
    """A one-VW plan running ``graph`` split at ``cuts`` on the first devices of ``cluster``.

    Args:
        graph: the model graph.
        cuts: cut points (``len(cuts) + 1`` stages).
        model: model reference stored in the plan.
        batch_size: samples per minibatch.
        nm: minibatches in flight.
        cluster: the cluster (default: CPU devices, one per stage).
        devices: the devices in pipeline order (default: the cluster's first ones).
        fwd_ms, bwd_ms: per-stage times, if known (for the predicted throughput).

    Raises:
        PlanError: more stages than devices.
    """
    n_stages = len(cuts) + 1
    cluster = cluster or cpu_cluster(n_stages)
    devs = list(devices) if devices is not None else list(cluster.devices[:n_stages])
    if len(devs) < n_stages:
        raise PlanError(f"{n_stages} stages need {n_stages} devices; the cluster has {len(devs)}")
    bounds = [0, *cuts, len(graph.layers)]
    gpus = tuple(_slot(d) for d in devs[:n_stages])
    stages = [
        _stage(graph, s, bounds, nm, gpus[s].memory_bytes, fwd_ms, bwd_ms) for s in range(n_stages)
    ]
    slowest = max((st.fwd_ms + st.bwd_ms for st in stages), default=0.0)
    throughput = batch_size / (slowest / 1e3) if slowest > 0 else 0.0
    vw = VirtualWorker(0, gpus, tuple(stages), nm_max=nm, throughput=throughput)
    return Plan(
        model=model,
        batch_size=batch_size,
        policy="manual",
        nm=nm,
        D=0,
        placement="none",
        cluster=cluster,
        virtual_workers=(vw,),
        shards=(),
        predicted=Prediction(throughput, (throughput,)),
        num_layers=len(graph.layers),
    )


def multi_vw_plan(
    graph: ModelGraph,
    vw_cuts: Sequence[Sequence[int]],
    model: str,
    batch_size: int,
    nm: int,
    D: int = 0,
    n_shards: int = 1,
    cluster: Cluster | None = None,
) -> Plan:
    """Several VWs (one per entry of ``vw_cuts``) on consecutive devices, with ``n_shards``
    parameter-server shards holding the layers with parameters round-robin (``default``).

    Raises:
        PlanError: more stages than devices, or no shard.
    """
    n_dev = sum(len(c) + 1 for c in vw_cuts)
    cluster = cluster or cpu_cluster(n_dev)
    devs = list(cluster.devices)
    if len(devs) < n_dev or n_shards < 1:
        raise PlanError(f"{n_dev} stages and {n_shards} shards do not fit {len(devs)} devices")
    vws, first = [], 0
    for k, cuts in enumerate(vw_cuts):
        one = manual_plan(
            graph, cuts, model, batch_size, nm, cluster, devs[first : first + len(cuts) + 1]
        )
        vws.append(replace(one.virtual_workers[0], id=k))
        first += len(cuts) + 1
    with_params = [lay for lay in graph.layers if lay.params]
    shards = tuple(
        ShardPlan(
            s,
            devs[s % len(devs)].node,
            tuple(lay.name for lay in with_params[s::n_shards]),
            sum(lay.param_bytes for lay in with_params[s::n_shards]),
        )
        for s in range(n_shards)
    )
    total = sum(v.throughput for v in vws)
    return Plan(
        model=model,
        batch_size=batch_size,
        policy="manual",
        nm=nm,
        D=D,
        placement="default",
        cluster=cluster,
        virtual_workers=tuple(vws),
        shards=shards,
        predicted=Prediction(total, tuple(v.throughput for v in vws)),
        num_layers=len(graph.layers),
    )


def hand_cut_plan(
    graph: ModelGraph,
    model: str,
    batch_size: int,
    nm: int,
    cluster: Cluster | None = None,
    stages: int = 0,
    cuts: Sequence[int] | None = None,
) -> Plan:
    """A one-VW plan cut at ``cuts``, or into ``stages`` (default: one per cluster device)
    groups of similar parameter bytes (:func:`balanced_cuts`).

    Raises:
        PlanError: more stages than layers or devices.
    """
    n = stages or (
        len(cuts) + 1 if cuts is not None else len(cluster.devices) if cluster is not None else 1
    )
    chosen = tuple(cuts) if cuts is not None else balanced_cuts(graph, n)
    return manual_plan(graph, chosen, model, batch_size, nm or 1, cluster)
