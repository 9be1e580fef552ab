"""A tiny classifier and its data for calibration tests (``tests.calib_toy:model``, ``:data``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = ["data", "model"]


def model(batch_size: int = 16) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """8 features -> 16 hidden -> 2 classes, with a zero sample minibatch; its initial
    weights come from the global RNG, as a user's factory's do."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return net, (torch.zeros(batch_size, 8), torch.zeros(batch_size, dtype=torch.long))


def data() -> tuple[TensorDataset, None]:
    """512 samples whose class is the first feature's sign, with noisy labels (a finite
    gradient noise scale); no test set."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)  # (N, 8)
    y = (x[:, 0] + 0.5 * torch.randn(512, generator=gen) > 0).long()  # (N,)
    return TensorDataset(x, y), None
