"""A small language-model task for the convergence references (``sync_convergence.py --task lm``).

The model is ``examples/gpt2_lm.py``'s ``tiny`` GPT-2 (2 layers, 64 wide, 32 tokens, random
init), trained on synthetic token sequences with structure to learn: a Markov chain over
``SYMBOLS`` tokens where the next token is ``(5 x + 3) mod SYMBOLS`` with probability
``STICK`` and uniform otherwise. A model that only learns the token frequencies reaches a
loss of ``ln SYMBOLS`` (4.16); one that learns the rule approaches the chain's entropy
(about 1.4 nats). The figure of merit is the test loss (lower is better).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import TensorDataset

SYMBOLS = 64  # token ids used (below the model's vocabulary of 512)
STICK = 0.75  # probability that the next token follows the rule
SEQ = 32  # tokens per sequence (the tiny model's context)


def markov_tokens(n: int, seed: int) -> TensorDataset:
    """``n`` sequences ``(ids, ids)`` of ``SEQ`` tokens (input and label: the model shifts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, SEQ, dtype=torch.int64)  # (N, T)
    ids[:, 0] = torch.randint(0, SYMBOLS, (n,), generator=g)
    for t in range(1, SEQ):
        follow = torch.rand(n, generator=g) < STICK
        rand = torch.randint(0, SYMBOLS, (n,), generator=g)
        ids[:, t] = torch.where(follow, (5 * ids[:, t - 1] + 3) % SYMBOLS, rand)
    return TensorDataset(ids, ids)


def entropy_nats() -> float:
    """The chain's next-token entropy: the best loss on tokens after the first."""
    p_rule = STICK + (1 - STICK) / SYMBOLS
    p_other = (1 - STICK) / SYMBOLS
    return -(p_rule * math.log(p_rule) + (SYMBOLS - 1) * p_other * math.log(p_other))


class LMTrainer:
    """The tiny GPT-2 as a function of a flat weight vector: gradients and test loss."""

    def __init__(self, batch: int, seed: int, test: TensorDataset) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ (a script)
        from examples.gpt2_lm import tiny

        torch.manual_seed(seed)
        self.module, _ = tiny(batch)
        self.module.train()
        self.params = list(self.module.parameters())
        self.w0 = parameters_to_vector(self.params).detach().clone()
        self.test_ids = test.tensors[0]  # (N, T)
        self.batch = batch

    def grad(self, w: Tensor, xs: tuple[Tensor, ...], y: Tensor) -> Tensor:
        """Gradient of the minibatch's mean next-token loss at weights ``w`` (flat)."""
        vector_to_parameters(w, self.params)
        for p in self.params:
            p.grad = None
        self.module(input_ids=xs[0], labels=y).loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])

    def metric(self, w: Tensor) -> float:
        """Mean test loss (nats per token) at weights ``w``."""
        vector_to_parameters(w, self.params)
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(self.test_ids), 64):
                ids = self.test_ids[i : i + 64]
                total += float(self.module(input_ids=ids, labels=ids).loss) * len(ids)
                n += len(ids)
        return total / n


def lm_split(train: int = 2048, test: int = 256, seed: int = 0) -> tuple[Any, TensorDataset]:
    """The training split (as a ``Subset`` like the digits split) and the test set."""
    from torch.utils.data import Subset

    full = markov_tokens(train, seed)
    return Subset(full, list(range(train))), markov_tokens(test, seed + 1)
