"""Held-out evaluation: a seeded train/test split and top-1 accuracy of a whole module.

Used by the launcher (:mod:`runtime.launch.launcher`: every rule of several VWs, the AllReduce
baseline included) for the final test accuracy, on the same samples, and by the benchmarks
that evaluate checkpoints offline (``benchmarks/convergence.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from profiler.errors import ConfigError

__all__ = ["accuracy", "evaluate_module", "shard_dataset", "split_dataset"]

log = logging.getLogger(__name__)


def split_dataset(
    dataset: Dataset[Any], test_fraction: float = 0.2, seed: int = 0
) -> tuple[Subset[Any], Subset[Any]]:
    """A seeded, disjoint ``(train, test)`` split of ``dataset``: the one split every run uses
    (WSP, one VW, AllReduce), so a seed holds out the same test samples whatever trains.

    Raises:
        ConfigError: ``test_fraction`` outside (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in (0, 1), got {test_fraction}")
    n = len(dataset)  # type: ignore[arg-type]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_007 + seed)).tolist()
    n_test = max(1, round(n * test_fraction))
    return Subset(dataset, perm[n_test:]), Subset(dataset, perm[:n_test])


def shard_dataset(train: Subset[Any], parts: int) -> list[Subset[Any]]:
    """``parts`` disjoint shards of a training split (one per VW), interleaved: shard ``k`` has
    the split's samples ``k, k + parts, ...``."""
    return [Subset(train.dataset, train.indices[k::parts]) for k in range(parts)]


@torch.no_grad()
def evaluate_module(
    module: nn.Module,
    dataset: Dataset[Any],
    batch_size: int,
    loss_fn: Callable[[Any, Tensor], Tensor] | None = None,
) -> tuple[float, float]:
    """Top-1 accuracy (fraction) and mean loss of ``module`` over ``dataset``.

    Full minibatches of ``batch_size`` in dataset order (the module is traced for a fixed batch
    shape, so a last incomplete one is dropped): every system is evaluated on the same samples.
    Accuracy is NaN when the outputs are not ``(batch, classes)`` logits, the loss NaN without
    ``loss_fn`` or when it does not apply.
    """
    module.eval()
    correct = total = 0
    loss_sum, batches = 0.0, 0
    classifier = True
    for batch in DataLoader(dataset, batch_size=batch_size, drop_last=True):
        xs, y = (
            (batch, batch.get("labels", torch.zeros(0))) if isinstance(batch, Mapping) else batch
        )
        if isinstance(xs, Mapping) and not hasattr(module, "input_names"):
            out = module(**xs)  # the user's own module: keyword inputs by name
        else:
            if isinstance(xs, Mapping):  # keyword inputs, in the order the stage module takes them
                inputs = tuple(xs[n] for n in getattr(module, "input_names", xs))
            else:
                inputs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
            out = module(*inputs)
        logits = isinstance(out, Tensor) and out.dim() == 2
        if loss_fn is not None:
            try:
                loss_sum += float(loss_fn(out, y.reshape(-1) if logits else y))
                batches += 1
            except RuntimeError as exc:
                log.info("test loss not computed: %s", exc)
        if logits and out.shape[0] == y.numel():
            correct += int((out.argmax(dim=1) == y.reshape(-1)).sum())
            total += y.numel()
        else:
            classifier = False
    accuracy = correct / total if classifier and total else float("nan")
    return accuracy, loss_sum / batches if batches else float("nan")


def accuracy(module: nn.Module, dataset: Dataset[Any], batch_size: int) -> float:
    """Top-1 accuracy (fraction) of ``module`` over ``dataset`` (:func:`evaluate_module`)."""
    return evaluate_module(module, dataset, batch_size)[0]
