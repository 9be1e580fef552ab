"""Tied parameters: one parameter held by several stages (GPT-2's input and output embedding).

Each stage that reads a tied parameter holds its own copy (:meth:`ModelGraph.shared_params`).
After every backward pass the holders all-reduce their gradients for it in a process group
of their own, so every copy takes the same optimizer step with the same gradient as the
single-process model (where autograd adds the two uses) and the copies stay bit-identical.
The later stage's backward of a minibatch always precedes the earlier stage's and sends its
input gradients first, so the all-reduce cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from profiler.graph import ModelGraph
from runtime.stage.device import to_host

__all__ = ["TiedGrads", "TiedParam", "tied_params"]


@dataclass(frozen=True)
class TiedParam:
    """Where a tied parameter lives in one virtual worker.

    Attributes:
        owner: the stage of the layer that owns it (first use): the one that pushes it to and
            pulls it from the parameter servers.
        holders: every stage holding a copy (the owner included), sorted.
    """

    owner: int
    holders: tuple[int, ...]


def tied_params(graph: ModelGraph, cuts: Sequence[int]) -> dict[str, TiedParam]:
    """Original name -> :class:`TiedParam` of every parameter held by several stages."""
    stage = graph.stage_of_layer(cuts)
    owner = {name: stage[lay.index] for lay in graph.layers for name in lay.params}
    return {n: TiedParam(owner[n], s) for n, s in graph.shared_params(cuts).items()}


class TiedGrads:
    """Sums a stage's tied-parameter gradients with the other holders' every minibatch.

    The holders of each tied parameter form their own process group (created with
    ``use_local_synchronization``, so no other rank takes part) and all-reduce its gradient:
    every holder gets the same sum, bit for bit.

    Args:
        stage: this stage.
        stage_rank0: global rank of stage 0 of this virtual worker (its stages are consecutive).
        shared: original parameter name -> where it lives (:func:`tied_params`).
        local: original parameter name -> this stage's parameter name.

    Attributes:
        held: original name -> :class:`TiedParam` of the tied parameters this stage holds.
    """

    def __init__(
        self,
        stage: int,
        stage_rank0: int,
        shared: dict[str, TiedParam],
        local: dict[str, str],
    ) -> None:
        self.stage, self.stage_rank0, self.local = stage, stage_rank0, local
        self.items: list[tuple[str, Any]] = []
        self.held = {n: t for n, t in sorted(shared.items()) if stage in t.holders}
        groups: dict[tuple[int, ...], Any] = {}
        for name, tied in self.held.items():
            stages = tied.holders
            if stages not in groups:
                ranks = [stage_rank0 + s for s in stages]
                groups[stages] = dist.new_group(ranks, use_local_synchronization=True)
            self.items.append((local[name], groups[stages]))

    def __bool__(self) -> bool:
        return bool(self.items)

    def exchange(
        self, grads: dict[str, Tensor | None], like: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        """Replace each tied gradient in ``grads`` by the sum over its holders.

        Args:
            grads: this stage's gradients by stage parameter name (``None`` = unused here).
            like: the stage's parameters (shape and dtype of a missing gradient).
        """
        out = dict(grads)
        for name, group in self.items:
            mine = grads.get(name)
            total = torch.zeros_like(like[name]) if mine is None else mine.detach().clone()
            host = to_host(total)  # the tied groups are gloo's: host tensors
            dist.all_reduce(host, dist.ReduceOp.SUM, group=group)
            out[name] = host.to(total.device)
        return out
