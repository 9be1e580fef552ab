"""Where a stage computes: the one torch device chosen per stage, and the moves to and from it.

A stage on a real GPU (not emulated, not of type ``CPU``, with CUDA in its process) computes
on ``cuda:<index>`` (:func:`cuda_index` of its plan device): its module
(parameters and buffers), its minibatches and the activations and gradients it receives.
Everything else computes on ``cpu``, exactly as before this choice existed. Tensors leave the
device only where a transport needs host memory (gloo's point-to-point messages, the
parameter-server wire, gloo collectives); NCCL's collectives take the CUDA tensors as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["cuda_index", "on_device", "stage_device", "to_host"]


def cuda_index(device: str, cuda_devices: int) -> int:
    """The CUDA device of a stage whose plan device is ``device`` (``node:index``, e.g.
    ``R:1``): its index, wrapped to the ``cuda_devices`` this host has.

    >>> cuda_index("R:1", 4), cuda_index("R:5", 4)
    (1, 1)
    """
    return int(device.rsplit(":", 1)[1]) % max(1, cuda_devices)


def stage_device(label: str, gpu_type: str, emulated: bool, cuda_devices: int) -> str:
    """The torch device of a stage whose plan device is ``label`` (``node:index``).

    Args:
        label: the plan device, e.g. ``G:1``.
        gpu_type: the cluster's type of that device (``V100``, ``CPU``; ``""``: unknown).
        emulated: the stage emulates its device on CPU (paced or memory-capped).
        cuda_devices: ``torch.cuda.device_count()`` in the stage's process (0: no CUDA).

    >>> stage_device("G:1", "V100", emulated=False, cuda_devices=4)
    'cuda:1'
    >>> stage_device("G:5", "V100", emulated=False, cuda_devices=4)
    'cuda:1'
    >>> stage_device("G:1", "V100", emulated=True, cuda_devices=4)
    'cpu'
    >>> stage_device("C:0", "CPU", emulated=False, cuda_devices=4)
    'cpu'
    >>> stage_device("G:1", "V100", emulated=False, cuda_devices=0)
    'cpu'
    """
    if emulated or gpu_type.upper() == "CPU" or cuda_devices <= 0:
        return "cpu"
    return f"cuda:{cuda_index(label, cuda_devices)}"


def on_device(tensors: Iterable[Tensor], device: torch.device) -> tuple[Tensor, ...]:
    """``tensors`` on ``device`` (the same tensors when they are there already: the CPU path
    copies nothing)."""
    return tuple(t.to(device) for t in tensors)


def to_host(t: Tensor) -> Tensor:
    """``t`` in host memory for a transport that takes CPU tensors (``t`` itself on CPU)."""
    return t if t.device.type == "cpu" else t.cpu()
