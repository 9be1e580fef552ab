"""Whether a model fits this host's memory: refused before it is built, or its failed allocation
named.

A built-in's weights are counted on the ``meta`` device (nothing allocated) and compared with
the host's physical memory; any model whose build still runs out of memory (a user factory, a
host already busy) turns into one :class:`~profiler.errors.ModelError` line instead of
torch's traceback.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from profiler.errors import ModelError, shown

__all__ = [
    "allocation_error",
    "building",
    "check_fits_host",
    "host_memory_bytes",
    "is_allocation_failure",
    "model_bytes",
]

_FIX = "use a smaller model, or plan it from --profiles measured where it fits"
_ALLOC_WORDS = ("not enough memory", "can't allocate", "out of memory")
_TRIED = re.compile(r"allocate (\d+) bytes")


def host_memory_bytes() -> int | None:
    """This host's physical memory in bytes (``None``: the system does not say)."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown
        return None
    return pages * page if pages > 0 and page > 0 else None


def model_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (works on ``meta`` tensors)."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def check_fits_host(ref: str, module: nn.Module, host_bytes: int | None = None) -> None:
    """Refuse ``module`` (built on ``meta``) when its weights alone exceed ``host_bytes``
    (default: :func:`host_memory_bytes`).

    Raises:
        ModelError: the weights do not fit; names the model, both sizes and the fix.
    """
    host = host_memory_bytes() if host_bytes is None else host_bytes
    need = model_bytes(module)
    if host is not None and need > host:
        raise ModelError(
            f"model {shown(ref)} needs {need:,} bytes of weights but this host has {host:,} "
            f"bytes of memory; {_FIX}"
        )


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator running out of memory (torch's or Python's)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _ALLOC_WORDS)


def allocation_error(ref: str, exc: BaseException) -> ModelError:
    """The one-line :class:`ModelError` for ``exc``, an allocation failure building ``ref``."""
    tried = _TRIED.search(str(exc))
    what = f"tried to allocate {int(tried.group(1)):,} bytes" if tried else "an allocation failed"
    return ModelError(
        f"model {shown(ref)} does not fit in this host's memory ({what}, "
        f"{type(exc).__name__}); {_FIX}"
    )


@contextmanager
def building(ref: str) -> Iterator[None]:
    """Turn an allocation failure inside the block into :func:`allocation_error`."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not is_allocation_failure(exc):
            raise
        raise allocation_error(ref, exc) from exc
