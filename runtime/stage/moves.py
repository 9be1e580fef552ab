"""Moves of a stage's weight versions, optimizer state and gradients to host memory and back
(the ``offload`` places of :mod:`planner.offload` other than activations).

:class:`HostCopies` copies tensors between a device and host memory, written once over the
pair (device, host): on CUDA the copies run on a side stream into pinned host buffers and a
copy brought back is waited on by an event before its first use; anywhere else (the CPU in
tests and on emulated devices) they are plain copies into fresh storage. Either way a tensor
comes back bit-identical.

:class:`ClassMoves` applies the placement with it:

* ``weights: offload`` -- a stashed weight version (one the master has moved on from) goes
  to host memory as soon as it is stashed and after each forward that used it; it comes back
  before a forward that needs it and is prefetched one task ahead of its minibatch's backward
  (the schedule fixes the order). The version's leaf tensors stay the same objects: only their
  storage moves (``leaf.data``), so the autograd graph and the gradients are untouched.
* ``gradients: offload`` -- the gradients of a backward go to host memory while they wait for
  the synchronisation rule (the push) and come back for the update.
* ``optimizer: offload`` -- the optimizer state lives in host memory between updates and
  comes up for each update.

The update itself always runs on the device (the results are those of the all-keep run).
:attr:`ClassMoves.host_bytes` counts the bytes in host memory per class, with their peaks,
for the residency meter and the tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from planner.offload import MemoryPlacement, Place
from profiler.errors import HetPipeRuntimeError

__all__ = ["ClassMoves", "HostCopies", "class_moves", "parse_placement"]


def parse_placement(memory: str, where: str) -> MemoryPlacement:
    """The stage's placement (``StagePlan.memory``).

    Raises:
        HetPipeRuntimeError: ``memory`` is not a placement (one line naming the stage).
    """
    try:
        return MemoryPlacement.parse(memory)
    except ValueError as exc:
        raise HetPipeRuntimeError(f"{where}: memory placement: {exc}") from None


def class_moves(
    memory: str, where: str, device: torch.device, copy: bool = True
) -> ClassMoves | None:
    """The moves of placement ``memory`` on ``device`` (``None``: it keeps weights, optimizer
    state and gradients on the device); ``copy``: see :class:`HostCopies`.

    Raises:
        HetPipeRuntimeError: ``memory`` is not a placement.
    """
    placement = parse_placement(memory, where)
    moved = (placement.weights, placement.optimizer, placement.gradients)
    if all(p is Place.KEEP for p in moved):
        return None
    return ClassMoves(placement, HostCopies(copy), device)


def _nbytes(t: Tensor) -> int:
    return int(t.numel() * t.element_size())


class HostCopies:
    """Copies between a device and host memory: on CUDA (when available) in the background on
    one side stream into pinned host buffers, elsewhere plain copies into fresh storage.

    Copies run in issue order on the side stream, so a tensor brought back up after going
    down reads the finished host copy; the compute stream waits for a copy brought up in
    :meth:`ready`, and the CPU for the host copies in :meth:`sync`.

    Args:
        copy: on the CPU, copy (the tests: exactness and byte counts on the path CUDA takes)
            or hand the same tensor back: an emulated device *is* host memory, and a copy
            would spend CPU time inside its paced tasks that a GPU's copy engine does not
            (the plan's host-link time is paced instead). CUDA tensors are always copied.
    """

    def __init__(self, copy: bool = True) -> None:
        self._copy = copy
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._events: dict[int, Any] = {}  # device copy's storage -> its copy's event
        self.moved_bytes = 0  # bytes copied either way

    def down(self, t: Tensor) -> Tensor:
        """A host copy of ``t`` (pinned and asynchronous on CUDA)."""
        self.moved_bytes += _nbytes(t)
        if self._stream is None or not t.is_cuda:
            return t.detach().clone() if self._copy else t.detach()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(self._stream)
        return host

    def up(self, t: Tensor, device: torch.device) -> Tensor:
        """A copy of host tensor ``t`` on ``device``; call :meth:`ready` before using it."""
        self.moved_bytes += _nbytes(t)
        if self._stream is None or device.type != "cuda":
            return t.detach().clone() if self._copy else t.detach()
        with torch.cuda.stream(self._stream):
            out = t.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[out.untyped_storage().data_ptr()] = event
        return out

    def ready(self, t: Tensor) -> Tensor:
        """``t`` once its copy up finished (the compute stream waits for the side stream)."""
        event = self._events.pop(t.untyped_storage().data_ptr(), None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            t.record_stream(torch.cuda.current_stream())  # used here: freed after this use
        return t

    def sync(self) -> None:
        """Wait until the host copies are complete (before the CPU reads them)."""
        if self._stream is not None:
            self._stream.synchronize()


class ClassMoves:
    """Executes ``placement``'s moves of weight versions, optimizer state and gradients.

    Args:
        placement: the stage's placement.
        copies: the copier between the stage's device and host memory.
        device: where the stage computes.
    """

    def __init__(
        self, placement: MemoryPlacement, copies: HostCopies, device: torch.device
    ) -> None:
        self.placement = placement
        self.copies = copies
        self.device = device
        self._on_host: set[int] = set()  # ids of version dicts whose storage is in host memory
        self.host_bytes = {"weights": 0, "optimizer": 0, "gradients": 0}
        self.peak_host_bytes = dict(self.host_bytes)

    def _count(self, cls: str, delta: int) -> None:
        self.host_bytes[cls] += delta
        self.peak_host_bytes[cls] = max(self.peak_host_bytes[cls], self.host_bytes[cls])

    @property
    def weights(self) -> bool:
        """Whether stashed versions are offloaded."""
        return self.placement.weights is Place.OFFLOAD

    # ------------------------------------------------------------ stashed versions
    def version_down(self, leaves: dict[str, Tensor]) -> None:
        """Move a stashed version's storage to host memory (its leaves stay the same tensors)."""
        if not self.weights or id(leaves) in self._on_host:
            return
        with torch.no_grad():
            for t in leaves.values():
                t.data = self.copies.down(t.data)
        self._on_host.add(id(leaves))
        self._count("weights", sum(_nbytes(t) for t in leaves.values()))

    def version_up(self, leaves: dict[str, Tensor], wait: bool = True) -> None:
        """Bring a version back to the device (``wait=False``: a prefetch, not yet used)."""
        if id(leaves) in self._on_host:
            with torch.no_grad():
                for t in leaves.values():
                    t.data = self.copies.up(t.data, self.device)
            self._on_host.discard(id(leaves))
            self._count("weights", -sum(_nbytes(t) for t in leaves.values()))
        if wait:
            for t in leaves.values():
                self.copies.ready(t.data)

    def forget(self, leaves: dict[str, Tensor]) -> None:
        """A version was dropped: its host bytes are free."""
        if id(leaves) in self._on_host:
            self._on_host.discard(id(leaves))
            self._count("weights", -sum(_nbytes(t) for t in leaves.values()))

    # ------------------------------------------------------------ gradients
    def grads_down(self, grads: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """The gradients in host memory while they wait for the push."""
        if self.placement.gradients is not Place.OFFLOAD:
            return grads
        out = {n: None if g is None else self.copies.down(g) for n, g in grads.items()}
        self._count("gradients", sum(_nbytes(g) for g in out.values() if g is not None))
        self.copies.sync()  # the push may read them on the CPU
        return out

    def grads_up(self, grads: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """The gradients back on the device for the update."""
        if self.placement.gradients is not Place.OFFLOAD:
            return grads
        self._count("gradients", -self.host_bytes["gradients"])  # one minibatch's at a time
        up = self.copies.up
        return {
            n: None if g is None else self.copies.ready(up(g, self.device))
            for n, g in grads.items()
        }

    # ------------------------------------------------------------ optimizer state
    def _state(self, optimizer: torch.optim.Optimizer) -> Iterable[tuple[dict[str, Tensor], str]]:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    yield state, key

    def state_up(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer state back on the device before an update."""
        if self.placement.optimizer is not Place.OFFLOAD:
            return
        for state, key in list(self._state(optimizer)):
            self._count("optimizer", -_nbytes(state[key]))
            state[key] = self.copies.ready(self.copies.up(state[key], self.device))

    def state_down(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer state to host memory after an update."""
        if self.placement.optimizer is not Place.OFFLOAD:
            return
        for state, key in list(self._state(optimizer)):
            state[key] = self.copies.down(state[key])
            self._count("optimizer", _nbytes(state[key]))
