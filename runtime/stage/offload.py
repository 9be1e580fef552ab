"""A stage's memory manager: executes the placement the plan chose (:mod:`planner.offload`).

* ``activations: recompute`` -- activation checkpointing: the stage's forward runs under
  :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``, the RNG state preserved),
  which keeps only its inputs and runs the forward again inside the backward. The first
  minibatch runs without it so that its saved bytes are measured (the backward's working set);
  checkpointing changes where bytes live, not the result (bit-equal, tested).
* ``activations: offload`` -- every tensor autograd saves for backward (weights excluded) is
  packed to host memory by ``torch.autograd.graph.saved_tensors_hooks`` as the forward runs and
  brought back before its backward: :meth:`OffloadManager.prefetch` starts the copies of the
  next backward's tensors one task ahead (the schedule fixes the order), so unpacking finds them
  ready. On CUDA the copies run on a side stream into pinned host buffers (used only when CUDA
  is available); on the CPU the "host" copy is a second buffer, so the code path and the
  accounting are exercised while the values stay identical.
* stashed weight versions, optimizer state and gradients move to host memory and back by
  :mod:`runtime.stage.moves` (the same copier, :class:`runtime.stage.moves.HostCopies`). On an
  emulated device the host-link time the plan charges (``StagePlan.transfer_ms``, in
  ``bwd_ms``) is paced.

:class:`ResidencyMeter` extends the byte accounting of :class:`runtime.stage.emulation.MemoryMeter`
with the device/host split of the rule: device bytes are checked against the device's cap, host
bytes against the node's host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from planner.offload import ACTIVATION_BUFFERS, VERSION_BUFFERS, MemoryPlacement, Place
from profiler.errors import HetPipeRuntimeError
from runtime.stage.emulation import MemoryMeter, SavedBytes
from runtime.stage.moves import HostCopies, parse_placement

if TYPE_CHECKING:
    from runtime.stage.weights import VersionedWeights

__all__ = ["OffloadManager", "ResidencyMeter", "memory_manager", "metered_forward"]


def memory_manager(
    memory: str,
    where: str,
    cap_bytes: int,
    host_cap_bytes: int,
    param_bytes: int,
    buffer_bytes: int,
    optimizer_state_factor: float,
    buffers: Sequence[Tensor] = (),
) -> tuple[OffloadManager | None, MemoryMeter]:
    """The manager and byte meter of a stage with placement ``memory`` (``None``: all kept);
    ``buffers``: the stage's buffers (see :class:`OffloadManager`).

    Raises:
        HetPipeRuntimeError: ``memory`` is not a placement.
    """
    placement = parse_placement(memory, where)
    args = (where, cap_bytes, param_bytes, buffer_bytes, optimizer_state_factor)
    if placement.kept:
        return None, MemoryMeter(*args)
    return OffloadManager(placement, buffers), ResidencyMeter(*args, placement, host_cap_bytes)


def metered_forward(
    mb: int,
    call: Callable[..., Any],
    inputs: tuple[Tensor, ...],
    leaves: dict[str, Tensor],
    offload: OffloadManager | None,
    memory: MemoryMeter,
    weights: VersionedWeights,
) -> Any:
    """A stage's forward ``call(*inputs)`` of minibatch ``mb`` with its bytes checked: run by
    the memory manager (``offload``), or, on an emulated device (``memory.cap_bytes > 0``), with what
    autograd saves counted (:class:`SavedBytes`); unmetered otherwise."""
    if offload is not None:  # the memory manager runs and accounts the forward
        out = offload.forward(mb, call, inputs, [*leaves.values(), *inputs])
        recv_bytes = sum(x.numel() * x.element_size() for x in inputs)
        memory.check(mb, offload.saved_bytes + recv_bytes, weights.stashed_bytes)
    elif memory.cap_bytes > 0:  # emulated device: account what autograd saves
        with SavedBytes([*leaves.values(), *inputs]) as saved:
            out = call(*inputs)
        recv_bytes = sum(x.numel() * x.element_size() for x in inputs)
        memory.check(mb, saved.nbytes + recv_bytes, weights.stashed_bytes)
    else:
        out = call(*inputs)
    return out


class _Packed:
    """One saved tensor in host memory, and its device copy once prefetched."""

    __slots__ = ("device", "host", "nbytes", "ready")

    def __init__(self, host: Tensor, device: torch.device, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.ready: Tensor | None = None


class _KeepBuffers:
    """Restores buffers on exit: a recomputed forward leaves batch-norm statistics as they were."""

    def __init__(self, buffers: Sequence[Tensor]) -> None:
        self._buffers = buffers
        self._saved: list[Tensor] = []

    def __enter__(self) -> None:
        self._saved = [b.detach().clone() for b in self._buffers]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, old in zip(self._buffers, self._saved, strict=True):
                b.copy_(old)
        self._saved = []


class OffloadManager:
    """Runs a stage's forward under its activation placement.

    Args:
        placement: the stage's placement (the plan's ``StagePlan.memory``).
        buffers: the stage's buffers (batch-norm statistics): the recomputation inside the
            backward must not update them a second time, so they are restored after it.
    """

    def __init__(self, placement: MemoryPlacement, buffers: Sequence[Tensor] = ()) -> None:
        self.placement = placement
        self._buffers = list(buffers)
        self._exclude: set[int] = set()
        self._packed: dict[int, list[_Packed]] = {}
        # during a forward: storage -> view -> its packed copy (each counted and copied once)
        self._seen: dict[int, dict[tuple[Any, ...], _Packed]] = {}
        self._alive: list[Tensor] = []
        self._mb = 0
        self.saved_bytes = 0  # bytes the last forward saved (device or host)
        self.working_bytes = 0  # recompute: one minibatch's activations, measured on the first
        self._copies = HostCopies()

    @property
    def recompute(self) -> bool:
        """Whether the forward is checkpointed."""
        return self.placement.activations is Place.RECOMPUTE

    @property
    def offload(self) -> bool:
        """Whether saved activations move to host memory."""
        return self.placement.activations is Place.OFFLOAD

    def forward(
        self,
        mb: int,
        fn: Callable[..., Any],
        inputs: tuple[Tensor, ...],
        exclude: Sequence[Tensor] = (),
    ) -> Any:
        """``fn(*inputs)`` for minibatch ``mb`` under the placement; ``exclude``: tensors never
        offloaded nor counted as saved (the weight version and the received inputs, which the
        worker accounts itself)."""
        self.saved_bytes = 0
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen = {}
        if self.recompute and self.working_bytes > 0:
            return checkpoint(
                fn,
                *inputs,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=self._contexts,
            )
        if not (self.offload or self.recompute):
            return fn(*inputs)
        self._mb = mb
        self._packed[mb] = []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = fn(*inputs)
        self._seen, self._alive = {}, []  # no references past the forward
        if self.recompute:  # the first minibatch: measured, kept (the rest are checkpointed)
            self.working_bytes = max(1, self.saved_bytes)
        return out

    def _contexts(self) -> tuple[contextlib.AbstractContextManager[None], _KeepBuffers]:
        """Forward and recompute contexts of :func:`checkpoint`."""
        return contextlib.nullcontext(), _KeepBuffers(self._buffers)

    def _pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude:
            return t
        if ptr not in self._seen:  # a storage saved twice (ReLU and the next layer) counts once
            self._seen[ptr] = {}
            self.saved_bytes += int(storage.nbytes())
            # alive until the forward ends: a freed storage's address could be reused by a
            # later tensor of the same shape, which would then match the old copy
            self._alive.append(t)
        if not self.offload:
            return t
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in self._seen[ptr]:  # the same view again: one host copy
            return self._seen[ptr][key]
        nbytes = int(t.numel() * t.element_size())
        packed = _Packed(self._copies.down(t), t.device, nbytes)
        self._packed[self._mb].append(packed)
        self._seen[ptr][key] = packed
        return packed

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        if packed.ready is None:
            self._fetch(packed)
        out = packed.ready
        if out is None:
            raise HetPipeRuntimeError("an offloaded activation was lost before its backward")
        return self._copies.ready(out)

    def _fetch(self, p: _Packed) -> None:
        p.ready = self._copies.up(p.host, p.device)

    def prefetch(self, mb: int) -> None:
        """Start bringing minibatch ``mb``'s offloaded activations back (before its backward)."""
        for p in self._packed.get(mb, ()):
            if p.ready is None:
                self._fetch(p)

    def prefetch_ahead(self) -> None:
        """At the start of a task: bring back the activations of the next backward(s).

        Backward tasks run in minibatch order (:mod:`planner.schedule`, rule 2), so the oldest
        minibatches still offloaded are the next to need theirs: the running backward's and the
        one after (double buffering, :data:`planner.offload.ACTIVATION_BUFFERS`).
        """
        for mb in list(self._packed)[:ACTIVATION_BUFFERS]:
            self.prefetch(mb)

    def release(self, mb: int, meter: MemoryMeter | None = None) -> None:
        """Minibatch ``mb``'s backward finished: drop its host copies; a recompute stage's
        measured working set is accounted from now on."""
        self._packed.pop(mb, None)
        if isinstance(meter, ResidencyMeter) and self.recompute:
            meter.working_bytes = self.working_bytes


class ResidencyMeter(MemoryMeter):
    """:class:`MemoryMeter` with the device/host split of the placement.

    Args:
        where, cap_bytes, param_bytes, buffer_bytes, optimizer_state_factor: as for
            :class:`MemoryMeter`.
        placement: the stage's placement.
        host_cap_bytes: host memory this stage may use (0: unbounded).
    """

    def __init__(
        self,
        where: str,
        cap_bytes: int,
        param_bytes: int,
        buffer_bytes: int,
        optimizer_state_factor: float,
        placement: MemoryPlacement,
        host_cap_bytes: int = 0,
    ) -> None:
        super().__init__(where, cap_bytes, param_bytes, buffer_bytes, optimizer_state_factor)
        self.placement = placement
        self.param_bytes = param_bytes
        self.host_cap_bytes = host_cap_bytes
        moved = 0.0
        if placement.gradients is Place.OFFLOAD:
            moved += param_bytes
        if placement.optimizer is Place.OFFLOAD:
            moved += optimizer_state_factor * param_bytes
        self.static_bytes -= int(moved)
        self.static_host_bytes = int(moved)
        self.peak_bytes = self.static_bytes
        self.peak_host_bytes = self.static_host_bytes
        self.working_bytes = 0  # recompute: one minibatch's activations during its backward

    def split(self, stashed_bytes: int) -> tuple[int, int]:
        """Device and host bytes of the minibatches held and the stashed versions."""
        held = sorted(self.held.values(), reverse=True)
        on_device = held
        if self.placement.activations is Place.OFFLOAD:
            on_device = held[:ACTIVATION_BUFFERS]
        act_dev = sum(on_device) + self.working_bytes
        act_host = sum(held) - sum(on_device)
        ver_dev = stashed_bytes
        if self.placement.weights is Place.OFFLOAD and self.param_bytes:
            ver_dev = min(stashed_bytes, VERSION_BUFFERS * self.param_bytes)
        return act_dev + ver_dev, act_host + stashed_bytes - ver_dev

    def check(self, mb: int, held_bytes: int, stashed_bytes: int) -> int:
        """Record minibatch ``mb``'s held bytes and check device and host totals.

        Returns:
            The device total in bytes.

        Raises:
            HetPipeRuntimeError: the device total exceeds its cap, or the host total the host
                memory (the plan should have prevented both).
        """
        self.held[mb] = held_bytes
        dev, host = self.split(stashed_bytes)
        host_total = self.static_host_bytes + host
        self.peak_host_bytes = max(self.peak_host_bytes, host_total)
        if self.host_cap_bytes and host_total > self.host_cap_bytes:
            raise HetPipeRuntimeError(
                f"out of host memory on {self.where}: {host_total / 2**20:.2f} MiB offloaded > "
                f"{self.host_cap_bytes / 2**20:.2f} MiB; raise the node's host_memory or re-plan"
            )
        return self._check_total(self.static_bytes + dev, stashed_bytes)
