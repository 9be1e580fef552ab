"""The AllReduce baseline's plan-side rules: which devices can train the whole model (the
memory rule) and how long the whole model takes on an emulated device (its pacing).

``hetpipe run --sync allreduce`` (:mod:`runtime.ddp`) runs one rank per device whose memory (its
emulated cap when emulated) holds the planner's estimate of the whole model
(:meth:`planner.costmodel.CostModel.model_memory_bytes`, ``Nm = 1``).
"""

from __future__ import annotations

from planner.cluster import Cluster, Device

__all__ = ["device_capacity_bytes", "eligible_devices", "model_memory_bytes", "model_solo_s"]


def device_capacity_bytes(device: Device) -> int:
    """Memory a device offers: its emulated cap when emulated, else its memory (bytes)."""
    return device.emulation.memory_bytes if device.emulation is not None else device.memory_bytes


def eligible_devices(cluster: Cluster, need_bytes: int) -> tuple[Device, ...]:
    """The devices of ``cluster`` that can hold ``need_bytes`` (the whole model), in cluster order."""
    return tuple(d for d in cluster.devices if device_capacity_bytes(d) >= need_bytes)


def model_memory_bytes(
    cluster: Cluster, model_ref: str, batch_size: int, optimizer: str = "momentum"
) -> int:
    """The planner's memory estimate of the whole model on one device (bytes, ``Nm = 1``).

    Uses the same profiles (analytic or emulated) and cost model as ``hetpipe plan``.
    """
    from planner.costmodel import CostModel, optimizer_factor
    from planner.profiles import resolve_profiles

    profiles, _, _, _ = resolve_profiles(cluster, None, model_ref, batch_size)
    cm = CostModel(profiles, cluster.link, optimizer_factor(optimizer))
    return cm.model_memory_bytes(1)


def model_solo_s(cluster: Cluster, model_ref: str, batch_size: int) -> tuple[float, float]:
    """Solo (single-threaded CPU) forward and backward seconds of the whole model: the
    planner's profile of an emulated device times its speed, i.e. the same table the pipeline's
    emulated stages are paced by (:meth:`runtime.emulation.Calibration.from_plan`).

    Raises:
        ConfigError: the cluster has no emulated device.
    """
    from planner.profiles import resolve_profiles
    from profiler.errors import ConfigError

    node = next((n for n in cluster.nodes if n.emulation is not None), None)
    if node is None or node.emulation is None:
        raise ConfigError(f"{cluster.source}: no emulated device, nothing to pace")
    profiles, _, _, _ = resolve_profiles(cluster, None, model_ref, batch_size)
    table = profiles[node.gpu_type].table
    speed = node.emulation.speed
    return float(table["fwd_ms"].sum()) * speed / 1e3, float(table["bwd_ms"].sum()) * speed / 1e3
