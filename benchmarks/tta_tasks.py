"""The time-to-accuracy benchmark's models and data, as ``hetpipe run`` factories (offline).

``digits_cnn`` is a small ResNet-like CNN (3x3 convolutions, batch norm, residual blocks)
on scikit-learn's digits as 1 x 8 x 8 images (``digits_images``); ``lm_data`` is
``benchmarks/lm_task.py``'s Markov-chain token data for ``examples.gpt2_lm:tiny``, as keyword
samples (``lm_wide_data`` and ``lm_branchy_data``: the chain variants of the same name, whose
gradient noise scale is 30-200x the default's; docs/convergence.md). Named on the
command line as ``benchmarks.tta_tasks:digits_cnn`` and ``--data benchmarks.tta_tasks:...``
from the repository root.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from profiler.builtin_models import BasicBlock

__all__ = [
    "DIGITS_TEST",
    "Keyword",
    "digits_cnn",
    "digits_images",
    "lm_branchy_data",
    "lm_data",
    "lm_wide_data",
]

DIGITS_TEST = 0.2  # share of the 1,797 digits held out as the test set
LM_TRAIN, LM_TEST = 8192, 512  # token sequences (32 tokens each)


class DigitsResNet(nn.Module):
    """A ResNet for 8 x 8 images: a 3x3 stem, three basic blocks (32, 64, 128 channels, the
    last two with stride 2), global average pooling and a linear classifier."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.block1 = BasicBlock(width, width)
        self.block2 = BasicBlock(width, 2 * width, stride=2)
        self.block3 = BasicBlock(2 * width, 4 * width, stride=2)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block3(self.block2(self.block1(self.stem(x))))  # (B, 4w, 2, 2)
        return self.head(h.mean(dim=(2, 3)))  # (B, classes)


def digits_cnn(batch_size: int = 32) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """``DigitsResNet`` and one sample minibatch ``(images (B, 1, 8, 8), labels (B,))``."""
    torch.manual_seed(0)
    x = torch.randn(batch_size, 1, 8, 8)
    y = torch.randint(0, 10, (batch_size,))
    return DigitsResNet(), (x, y)


def digits_images(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as ``(1, 8, 8)`` images scaled to ``[0, 1]``, split into a training
    and a test set (a fifth, the same for every ``seed``: the systems and seeds are compared
    on one test set)."""
    from sklearn.datasets import load_digits

    del seed  # the split is fixed; the run's seed orders the training data
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.int64)  # (N,)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_test = int(len(y) * DIGITS_TEST)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Keyword(Dataset[dict[str, Tensor]]):
    """Token sequences as the keyword samples GPT-2 takes: ``{"input_ids": (T,), "labels":
    (T,)}`` (the same ids: the model shifts the labels)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids  # (N, T)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lm_data(seed: int = 0) -> tuple[Keyword, Keyword]:
    """``LM_TRAIN`` training and ``LM_TEST`` test sequences of the Markov chain of
    ``benchmarks/lm_task.py``."""
    from benchmarks.lm_task import markov_tokens

    del seed  # the data are fixed; the run's seed orders them
    train, test = markov_tokens(LM_TRAIN, 0), markov_tokens(LM_TEST, 1)
    return Keyword(train.tensors[0]), Keyword(test.tensors[0])


def _lm_chain_data(chain: str) -> tuple[Keyword, Keyword]:
    """:func:`lm_data` drawn from ``benchmarks/lm_task.py``'s chain ``CHAINS[chain]``."""
    from benchmarks.lm_task import CHAINS, markov_tokens

    train = markov_tokens(LM_TRAIN, 0, CHAINS[chain])
    test = markov_tokens(LM_TEST, 1, CHAINS[chain])
    return Keyword(train.tensors[0]), Keyword(test.tensors[0])


def lm_wide_data(seed: int = 0) -> tuple[Keyword, Keyword]:
    """:func:`lm_data` over all 512 ids of the vocabulary (chain ``wide``: entropy 2.12 nats)."""
    del seed  # the data are fixed; the run's seed orders them
    return _lm_chain_data("wide")


def lm_branchy_data(seed: int = 0) -> tuple[Keyword, Keyword]:
    """:func:`lm_data` over 512 ids with 8 rule successors (chain ``branchy``: 2.81 nats)."""
    del seed  # the data are fixed; the run's seed orders them
    return _lm_chain_data("branchy")
