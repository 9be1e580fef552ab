"""A small language-model task for the convergence references (``sync_convergence.py --task lm``).

The model is ``examples/gpt2_lm.py``'s ``tiny`` GPT-2 (2 layers, 64 wide, 32 tokens, random
init), trained on synthetic token sequences with structure to learn: a Markov chain over
``SYMBOLS`` tokens where the next token is ``(5 x + 3) mod SYMBOLS`` with probability
``STICK`` and uniform otherwise. A model that only learns the token frequencies reaches a
loss of ``ln SYMBOLS`` (4.16); one that learns the rule approaches the chain's entropy
(1.578 nats, :func:`entropy_nats`). The figure of merit is the test loss (lower is better).

:class:`Chain` makes the chain a parameter (the default is the one above): more symbols, a
lower ``stick`` or ``branch`` rule successors raise the entropy and the gradient noise
(:data:`CHAINS`: the named variants of ``lm_staleness.py --chain``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import TensorDataset

from profiler.errors import ConfigError

SYMBOLS = 64  # token ids used (below the model's vocabulary of 512)
STICK = 0.75  # probability that the next token follows the rule
SEQ = 32  # tokens per sequence (the tiny model's context)
VOCAB = 512  # the tiny model's vocabulary (examples/gpt2_lm.py)


@dataclass(frozen=True)
class Chain:
    """A Markov chain over token ids: from token ``x`` the next one is, with probability
    ``stick``, one of the ``branch`` rule successors ``(5 x + 3 + j (symbols // branch)) mod
    symbols`` (``j`` uniform), and otherwise uniform over the ``symbols`` ids.

    Attributes:
        symbols: token ids used, ``0 .. symbols - 1`` (at most the model's :data:`VOCAB`).
        stick: probability of a rule successor.
        branch: rule successors per token (1: a deterministic rule).

    Raises:
        ConfigError: a field out of its range.
    """

    symbols: int = SYMBOLS
    stick: float = STICK
    branch: int = 1

    def __post_init__(self) -> None:
        if not 2 <= self.symbols <= VOCAB:
            raise ConfigError(f"Chain symbols {self.symbols}: give 2 to {VOCAB} (the vocabulary)")
        if not 0.0 <= self.stick <= 1.0:
            raise ConfigError(f"Chain stick {self.stick}: give a probability, 0 to 1")
        if not 1 <= self.branch <= self.symbols:
            raise ConfigError(f"Chain branch {self.branch}: give 1 to symbols ({self.symbols})")

    def entropy_nats(self) -> float:
        """The next-token entropy: the best loss on tokens after the first."""
        p_rule = self.stick / self.branch + (1 - self.stick) / self.symbols
        p_other = (1 - self.stick) / self.symbols
        rule = self.branch * p_rule * math.log(p_rule)
        rest = (self.symbols - self.branch) * p_other * math.log(p_other) if p_other else 0.0
        return -(rule + rest)


CHAINS = {
    "default": Chain(),
    "wide": Chain(symbols=VOCAB),
    "branchy": Chain(symbols=VOCAB, stick=0.9, branch=8),
    "loose": Chain(stick=0.5),
}
"""Named chains (``lm_staleness.py --chain``): ``default`` (bench_tta's lm), ``wide`` (every
id of the vocabulary: no unused ids whose logits the first updates push down), ``branchy``
(8 successors: more entropy left after learning the rule), ``loose`` (the rule half the time)."""


def markov_tokens(n: int, seed: int, chain: Chain = CHAINS["default"]) -> TensorDataset:
    """``n`` sequences ``(ids, ids)`` of ``SEQ`` tokens (input and label: the model shifts)."""
    g = torch.Generator().manual_seed(seed)
    v = chain.symbols
    ids = torch.empty(n, SEQ, dtype=torch.int64)  # (N, T)
    ids[:, 0] = torch.randint(0, v, (n,), generator=g)
    for t in range(1, SEQ):
        follow = torch.rand(n, generator=g) < chain.stick
        rand = torch.randint(0, v, (n,), generator=g)
        rule = 5 * ids[:, t - 1] + 3  # (N,)
        if chain.branch > 1:  # drawn only then: the default chain's stream is unchanged
            rule = rule + torch.randint(0, chain.branch, (n,), generator=g) * (v // chain.branch)
        ids[:, t] = torch.where(follow, rule % v, rand)
    return TensorDataset(ids, ids)


def entropy_nats(chain: Chain = CHAINS["default"]) -> float:
    """The chain's next-token entropy: the best loss on tokens after the first."""
    return chain.entropy_nats()


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


def lm_split(train: int = 2048, test: int = 256, seed: int = 0,
             chain: Chain = CHAINS["default"]) -> tuple[Any, TensorDataset]:  # fmt: skip
    """The training split (as a ``Subset`` like the digits split) and the test set."""
    from torch.utils.data import Subset

    full = markov_tokens(train, seed, chain)
    return Subset(full, list(range(train))), markov_tokens(test, seed + 1, chain)
