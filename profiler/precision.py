"""Training precision: ``fp32``, or ``bf16`` mixed precision (autocast, fp32 master weights).

With ``bf16`` every forward (and the loss) runs under ``torch.autocast(device, bfloat16)``:
matrix products and convolutions compute in bfloat16 on a bfloat16 copy of their weights,
which autograd keeps for the backward pass; the parameters, their gradients, the optimizer
state and the parameter servers stay float32. Floating-point tensors crossing a pipeline cut
travel in bfloat16 (half the bytes). The profiler, the planner's memory model and the
simulator use the same accounting (:func:`bf16_memory`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from profiler.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's plan path stays torch-free
    import torch

__all__ = [
    "PRECISIONS",
    "autocast",
    "bf16_memory",
    "check_precision",
    "dtype_name",
    "wire_dtype",
]

PRECISIONS = ("fp32", "bf16")


def check_precision(value: str, where: str = "--precision") -> str:
    """``value`` if it names a precision.

    Raises:
        ConfigError: an unknown precision, naming ``where``.
    """
    if value not in PRECISIONS:
        raise ConfigError(f"{where}: precision {value!r} is unknown; use one of {PRECISIONS}")
    return value


def dtype_name(precision: str) -> str:
    """The dtype a profile records for ``precision`` (``float32`` or ``bfloat16``)."""
    return "bfloat16" if check_precision(precision) == "bf16" else "float32"


def wire_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype a tensor of ``dtype`` crosses a cut in (floats in bfloat16 under ``bf16``)."""
    import torch

    return torch.bfloat16 if precision == "bf16" and dtype.is_floating_point else dtype


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to bfloat16 under ``bf16`` (CPU or CUDA), else nothing."""
    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type, dtype=torch.bfloat16)


def bf16_memory(act_bytes: int, saved_bytes: int, param_bytes: int) -> tuple[int, int]:
    """A float32 layer's ``(act_bytes, saved_bytes)`` under ``bf16`` autocast.

    Activations and what autograd saves shrink to 2 bytes per element, and the bfloat16 copy
    of the layer's weights (``param_bytes / 2``) is saved for the backward pass of every
    minibatch in flight.
    """
    return act_bytes // 2, saved_bytes // 2 + param_bytes // 2
