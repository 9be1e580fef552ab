"""Held-out evaluation: a seeded train/test split and top-1 accuracy of a whole module.

Used by the AllReduce baseline (:mod:`runtime.ddp`) for its final test accuracy and by the
benchmarks that evaluate checkpoints offline (``benchmarks/convergence.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from profiler.errors import ConfigError
from runtime.data import MinibatchSource

__all__ = ["accuracy", "split_dataset"]


def split_dataset(
    dataset: Dataset[Any], test_fraction: float = 0.2, seed: int = 0
) -> tuple[Subset[Any], Subset[Any]]:
    """A seeded, disjoint ``(train, test)`` split of ``dataset``.

    Raises:
        ConfigError: ``test_fraction`` outside (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in (0, 1), got {test_fraction}")
    n = len(dataset)  # type: ignore[arg-type]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_007 + seed)).tolist()
    n_test = max(1, round(n * test_fraction))
    return Subset(dataset, perm[n_test:]), Subset(dataset, perm[:n_test])


@torch.no_grad()
def accuracy(module: nn.Module, dataset: Dataset[Any], batch_size: int) -> float:
    """Top-1 accuracy (fraction) of ``module`` over ``dataset`` in full minibatches of ``batch_size``.

    The module is traced for a fixed batch shape, so a last incomplete minibatch is dropped.
    """
    src = MinibatchSource(dataset, batch_size)
    correct = total = 0
    for p in range(1, src.steps_per_epoch + 1):
        xs, y = src.batch(p)
        out = module(*xs)
        pred = out.reshape(-1, out.shape[-1]).argmax(-1)
        correct += int((pred == y.reshape(-1)).sum())
        total += int(y.numel())
    return correct / total if total else 0.0
