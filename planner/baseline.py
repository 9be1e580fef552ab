"""The AllReduce (DDP) baseline's plan: which devices train the whole model and how fast.

``hetpipe run --sync allreduce`` trains a plan made here, like every run: one virtual worker
per device whose memory (its emulated cap when emulated) holds the planner's estimate of the
whole model (:meth:`planner.costmodel.CostModel.model_memory_bytes`, ``Nm = 1``), each a
single stage over every layer, no parameter-server shards, ``sync = "allreduce"``. The stage
times are the same profile's whole-model times the pipeline plans use (an emulated device is
paced by them), and the prediction is :func:`planner.predict.allreduce_throughput`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from planner.cluster import Cluster, Device
from planner.plan import GpuSlot, Plan, Prediction, StagePlan, VirtualWorker
from profiler.errors import ConfigError
from profiler.table import Profile

if TYPE_CHECKING:
    from planner.costmodel import CostModel

__all__ = ["allreduce_plan", "device_capacity_bytes", "eligible_devices", "model_memory_bytes"]


def device_capacity_bytes(device: Device) -> int:
    """Memory a device offers: its emulated cap when emulated, else its memory (bytes)."""
    return device.emulation.memory_bytes if device.emulation is not None else device.memory_bytes


def eligible_devices(cluster: Cluster, need_bytes: int) -> tuple[Device, ...]:
    """The devices of ``cluster`` that can hold ``need_bytes`` (the whole model), in cluster order."""
    return tuple(d for d in cluster.devices if device_capacity_bytes(d) >= need_bytes)


def model_memory_bytes(
    cluster: Cluster,
    model_ref: str,
    batch_size: int,
    optimizer: str = "momentum",
    profiles: Sequence[Profile] = (),
) -> int:
    """The planner's memory estimate of the whole model on one device (bytes, ``Nm = 1``), from
    ``profiles`` as for planning (an emulated cluster's ``cpu`` profile among them)."""
    from planner.costmodel import CostModel, optimizer_factor
    from planner.profiles import resolve_profiles

    by_type, _, _, _ = resolve_profiles(cluster, profiles, model_ref, batch_size)
    cm = CostModel(by_type, cluster.link, optimizer_factor(optimizer))
    return cm.model_memory_bytes(1)


def _holders(
    cluster: Cluster, types: Sequence[str], need: int, model: str, batch: int
) -> list[Device]:
    """The devices of a profiled type that hold the whole model (``need`` bytes).

    Raises:
        ConfigError: none can (says how much it needs and the largest cap).
    """
    devices = [d for d in eligible_devices(cluster, need) if d.type in types]
    if not devices:
        biggest = max(device_capacity_bytes(d) for d in cluster.devices)
        raise ConfigError(
            f"{cluster.source}: no device can hold {model} at batch {batch} "
            f"({need / 2**20:.2f} MiB > largest device {biggest / 2**20:.2f} MiB); AllReduce "
            "needs the whole model on every device: lower the batch size or use HetPipe"
        )
    return devices


def allreduce_plan(
    cluster: Cluster,
    model: str | None,
    batch_size: int | None = None,
    *,
    profiles: Mapping[str, Profile] | Sequence[Profile] | None = None,
    optimizer: str = "momentum",
    max_devices: int = 0,
    memory_bytes: int | None = None,
) -> Plan:
    """The AllReduce baseline's plan: every device that holds the whole model, one VW each.

    Args:
        cluster: the cluster.
        model: model reference (built-in or ``package.module:factory``).
        batch_size: samples per minibatch per device (default: the profiles', else 32).
        profiles: measured or imported profiles (default: as ``hetpipe plan``).
        optimizer: ``sgd``, ``momentum`` or ``adam`` (optimizer-state memory).
        max_devices: use at most this many eligible devices (0 = all).
        memory_bytes: the whole model's memory need (default: the planner's estimate).

    Raises:
        ConfigError: no device can hold the model (says how much it needs and the largest cap).
    """
    from planner.costmodel import CostModel, optimizer_factor
    from planner.planner import planning_view
    from planner.predict import allreduce_throughput
    from planner.profiles import resolve_profiles

    view = planning_view(cluster)
    by_type, provenance, model_name, batch = resolve_profiles(view, profiles, model, batch_size)
    cm = CostModel(by_type, view.link, optimizer_factor(optimizer))
    need = cm.model_memory_bytes(1) if memory_bytes is None else memory_bytes
    devices = _holders(cluster, cm.types, need, model_name, batch)
    if max_devices:
        devices = devices[:max_devices]
    vws = [_whole_model_vw(k, d, cm, need, batch) for k, d in enumerate(devices)]
    planned = [next(v for v in view.devices if v.label == d.label) for d in devices]
    ar, n_gpus = allreduce_throughput(view, cm, batch, planned)
    return Plan(
        model=model_name,
        batch_size=batch,
        policy="allreduce",
        nm=1,
        D=0,
        placement="none",
        cluster=cluster,
        virtual_workers=tuple(vws),
        shards=(),
        predicted=Prediction(ar, tuple(v.throughput for v in vws), ar, n_gpus, "analytic"),
        num_layers=cm.num_layers,
        profiles=provenance,
        optimizer_state_factor=cm.optimizer_state_factor,
        sync="allreduce",
    )


def _whole_model_vw(k: int, d: Device, cm: CostModel, need: int, batch: int) -> VirtualWorker:
    """VW ``k``: device ``d`` alone, one stage over every layer (the cost model's times)."""
    n_layers = cm.num_layers
    cost = cm.stage_cost([d], 0, 0, n_layers, 1)
    stage = StagePlan(
        gpu=0,
        first_layer=cm.layer_names[0],
        last_layer=cm.layer_names[-1],
        first_index=0,
        last_index=n_layers - 1,
        capacity_bytes=device_capacity_bytes(d),
        **{**asdict(cost), "recv_fwd_ms": 0.0, "recv_bwd_ms": 0.0, "memory_bytes": need},
    )
    slot = GpuSlot(
        d.node, d.index, d.type, stage.capacity_bytes, d.emulation.speed if d.emulation else 0.0
    )
    alone = batch * 1e3 / stage.time_ms if stage.time_ms > 0 else 0.0
    return VirtualWorker(k, (slot,), (stage,), nm_max=1, throughput=alone)
