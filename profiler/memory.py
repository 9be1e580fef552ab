"""Exact memory accounting: bytes autograd saves for backward, and the CUDA peak.

RSS and ``tracemalloc`` are both wrong for torch (the caching allocator and
out-of-Python allocations hide the real figure), so on CPU the bytes a layer keeps
alive until its backward are counted exactly with
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd packs is recorded
once per storage (views and detached aliases share one). Parameters are excluded (they are accounted as weights). The same
counter works on ``meta`` tensors, so analytic profiles get exact saved bytes without
computing anything. On CUDA the measured allocator peak is available as well.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Self

import torch
from torch import Tensor

__all__ = [
    "SavedTensorCounter",
    "SavedTensorsHooks",
    "cuda_peak_bytes",
    "reset_cuda_peak",
    "storage_bytes",
    "tensor_bytes",
]

log = logging.getLogger(__name__)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) tuple/list/dict ``value``; 0 for non-tensors."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def storage_bytes(t: Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (a view's base included)."""
    return int(t.untyped_storage().nbytes())


def _storage_key(t: Tensor) -> int:
    """Identity of the memory behind ``t``: its storage, shared by views and detached aliases."""
    return int(t.untyped_storage()._cdata)


class SavedTensorsHooks:
    """Base of the saved-for-backward byte counters: while the ``with`` block runs, every tensor
    autograd saves goes through :meth:`_pack` (``torch.autograd.graph.saved_tensors_hooks``)."""

    _hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    def __enter__(self) -> Self:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)
            self._hooks = None


class SavedTensorCounter(SavedTensorsHooks):
    """Context manager counting the bytes autograd saves for backward inside it.

    Use one counter across a whole model run and :meth:`take` after each layer: a storage
    saved by several layers is charged once, to the first one. Tensors listed with
    :meth:`exclude` (the parameters) are never charged.

    Example::

        counter = SavedTensorCounter(exclude=model.parameters())
        with counter:
            y = layer(x)
        saved_bytes = counter.take()
    """

    def __init__(self, exclude: Any = ()) -> None:
        self._seen: set[int] = set()
        self._keep: list[Tensor] = []  # keeps storage ids unique while counting
        self._pending = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        for p in exclude:
            self.exclude(p)

    def exclude(self, t: Tensor) -> None:
        """Never charge the storage of ``t`` (e.g. a parameter)."""
        self._seen.add(_storage_key(t))
        self._keep.append(t.detach())

    def seen(self, t: Tensor) -> bool:
        """Whether the storage of ``t`` is already charged (or excluded)."""
        return _storage_key(t) in self._seen

    def _pack(self, t: Tensor) -> Tensor:
        # Keep and hand autograd a detached alias: the tensor itself would tie a saved output
        # to its own grad_fn, a reference cycle the garbage collector cannot see (a leak).
        alias = t.detach()
        key = _storage_key(alias)
        if key not in self._seen:
            self._seen.add(key)
            self._keep.append(alias)
            self._pending += storage_bytes(alias)
        return alias

    def take(self) -> int:
        """Bytes newly saved since the last call."""
        value, self._pending = self._pending, 0
        return value


def reset_cuda_peak(device: torch.device) -> None:
    """Reset the allocator peak of a CUDA device (no-op on other devices)."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device) -> int:
    """Allocator peak since the last reset on a CUDA device, 0 elsewhere (bytes)."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    return 0
