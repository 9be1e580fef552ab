"""One stage of a partition, exactly: its bytes, their placement and its cost (paper Sec. 4, 7).

:class:`StageCosts` is mixed into :class:`planner.costmodel.CostModel`: where the cost model's
matrices price every position range at once for the partitioners, these methods evaluate one
stage ``j`` over positions ``[p, q)`` under any :class:`~planner.offload.MemoryPlacement`
(device, host and host-link bytes, recompute and exposed transfer time) with the same
functions of :mod:`planner.offload`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.cluster import Device, Link
from planner.offload import (
    HostShare,
    MemoryPlacement,
    StageBytes,
    device_bytes,
    effective,
    exposed_ms,
    host_bytes,
    host_link_ms,
    recompute_ms,
    transfer_bytes,
)
from planner.plan import StageCost
from planner.schedule import Schedule
from planner.staleness import remedy_weight_copies

__all__ = ["StageCosts", "StageMemory"]


@dataclass(frozen=True)
class StageMemory:
    """Where one stage's bytes live and what that costs per minibatch (:mod:`planner.offload`).

    Attributes:
        placement: the placement, with moves that save nothing undone (:func:`effective`).
        device_bytes: peak device bytes.
        host_bytes: host bytes of the offloaded classes.
        transfer_bytes: host-link bytes per minibatch (both directions).
        recompute_ms: forward time again per minibatch (recompute).
        transfer_ms: host-link time per minibatch not hidden behind compute (overlap rule).
    """

    placement: MemoryPlacement
    device_bytes: int
    host_bytes: int
    transfer_bytes: int
    recompute_ms: float
    transfer_ms: float


class StageCosts:
    """Exact cost of one stage; the attributes are set by :class:`planner.costmodel.CostModel`."""

    link: Callable[[Device, Device], Link]
    schedule: Schedule
    optimizer_state_factor: float
    remedy: str
    host_link: Link
    hosts: dict[str, HostShare]
    placement: MemoryPlacement
    cut_bytes: np.ndarray
    param_prefix: np.ndarray
    buffer_prefix: np.ndarray
    saved_prefix: np.ndarray
    fwd_prefix: dict[str, np.ndarray]
    bwd_prefix: dict[str, np.ndarray]

    def in_flight(self, j: int, n_stages: int, nm: int) -> int:
        """Minibatches stage ``j`` of ``n_stages`` holds at most with ``nm`` in flight, under the
        cost model's schedule (:meth:`planner.schedule.Schedule.in_flight_bound`)."""
        return self.schedule.in_flight_bound(j, n_stages, nm)

    def host_share(self, gpu: Device) -> HostShare:
        """``gpu``'s share of its node's host link and host memory."""
        return self.hosts.get(gpu.node, HostShare())

    def remedy_copies(self, nm: int) -> int:
        """Parameter-sized copies the staleness remedy adds on the device at ``nm``
        (:func:`planner.staleness.remedy_weight_copies`)."""
        return remedy_weight_copies(self.remedy, nm, self.optimizer_state_factor)

    def stage_bytes(self, p: int, q: int) -> StageBytes:
        """The sizes of a stage over positions ``[p, q)`` (:class:`planner.offload.StageBytes`)."""
        return StageBytes(
            param=float(self.param_prefix[q] - self.param_prefix[p]),
            buffer=float(self.buffer_prefix[q] - self.buffer_prefix[p]),
            saved=float(self.saved_prefix[q] - self.saved_prefix[p]),
            cut=float(self.cut_bytes[p]),
        )

    def stage_memory(
        self,
        gpus: Sequence[Device],
        j: int,
        p: int,
        q: int,
        nm: int,
        placement: MemoryPlacement | None = None,
    ) -> StageMemory:
        """Where stage ``j``'s bytes live under ``placement`` (default: the model's) and what
        that costs per minibatch."""
        k = self.in_flight(j, len(gpus), nm)
        pl = effective(self.placement if placement is None else placement, nm, k)
        b, o, t = self.stage_bytes(p, q), self.optimizer_state_factor, gpus[j].type
        fwd = float(self.fwd_prefix[t][q] - self.fwd_prefix[t][p])
        extra = recompute_ms(pl, fwd, k)
        moved = transfer_bytes(b, pl, nm, k, o)
        compute = fwd + float(self.bwd_prefix[t][q] - self.bwd_prefix[t][p]) + extra
        return StageMemory(
            placement=pl,
            device_bytes=device_bytes(b, pl, nm, k, o, self.remedy_copies(nm)),
            host_bytes=host_bytes(b, pl, nm, k, o),
            transfer_bytes=moved,
            recompute_ms=extra,
            transfer_ms=exposed_ms(
                host_link_ms(float(moved), self.host_link, self.host_share(gpus[j]).sharers),
                compute,
            ),
        )

    def stage_cost(
        self,
        gpus: Sequence[Device],
        j: int,
        p: int,
        q: int,
        nm: int,
        placement: MemoryPlacement | None = None,
    ) -> StageCost:
        """Cost of stage ``j`` over positions ``[p, q)`` of the pipeline ``gpus``.

        ``memory_bytes`` counts device bytes; ``bwd_ms`` includes the recompute and the
        exposed host-link time of the placement (default: the cost model's).
        """
        t = gpus[j].type
        recv_b = int(self.cut_bytes[p])
        send_b = int(self.cut_bytes[q])
        recv_ms = self.link(gpus[j - 1], gpus[j]).time_s(recv_b) * 1e3 if j > 0 else 0.0
        send_ms = self.link(gpus[j], gpus[j + 1]).time_s(send_b) * 1e3 if j + 1 < len(gpus) else 0.0
        mem = self.stage_memory(gpus, j, p, q, nm, placement)
        bwd = float(self.bwd_prefix[t][q] - self.bwd_prefix[t][p])
        return StageCost(
            fwd_ms=float(self.fwd_prefix[t][q] - self.fwd_prefix[t][p]),
            bwd_ms=bwd + mem.recompute_ms + mem.transfer_ms,
            recv_fwd_ms=recv_ms,
            recv_bwd_ms=send_ms,
            recv_bytes=recv_b,
            send_bytes=send_b,
            param_bytes=int(self.param_prefix[q] - self.param_prefix[p]),
            in_flight=self.in_flight(j, len(gpus), nm),
            memory_bytes=mem.device_bytes,
        )

    def choose_placement(
        self,
        gpus: Sequence[Device],
        j: int,
        p: int,
        q: int,
        nm: int,
        candidates: Sequence[MemoryPlacement],
    ) -> StageMemory | None:
        """The fastest placement of stage ``j`` among ``candidates`` that fits its GPU and its
        host share; ties go to fewer host-link bytes, then to the earlier candidate. ``None``:
        none fits."""
        host_cap = self.host_share(gpus[j]).memory_bytes
        best: tuple[float, int, int] | None = None
        chosen = None
        for i, pl in enumerate(candidates):
            mem = self.stage_memory(gpus, j, p, q, nm, pl)
            if mem.device_bytes > gpus[j].memory_bytes or (host_cap and mem.host_bytes > host_cap):
                continue
            key = (mem.recompute_ms + mem.transfer_ms, mem.transfer_bytes, i)
            if best is None or key < best:
                best, chosen = key, mem
        return chosen
