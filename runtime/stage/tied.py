"""Tied parameters: one parameter held by several stages (GPT-2's input and output embedding).

Each stage that reads a tied parameter holds its own copy (:meth:`ModelGraph.shared_params`).
After every backward pass the holders all-reduce their gradients for it in a process group
of their own, so every copy takes the same optimizer step with the same gradient as the
single-process model (where autograd adds the two uses) and the copies stay bit-identical.
The later stage's backward of a minibatch always precedes the earlier stage's and sends its
input gradients first, so the all-reduce cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from planner.plan import Plan
from profiler.errors import ConfigError
from profiler.graph import ModelGraph

__all__ = ["TiedGrads", "check_untied_for_ps"]


def check_untied_for_ps(graph: ModelGraph, plan: Plan) -> None:
    """Parameter servers keep one copy of each parameter per VW stage that owns it: a tied
    parameter split over two stages cannot go through them yet.

    Raises:
        ConfigError: a virtual worker's cuts put a tied parameter on two stages.
    """
    for k, worker in enumerate(plan.virtual_workers):
        cuts = tuple(st.first_index for st in worker.stages[1:])
        shared = graph.shared_params(cuts)
        if shared:
            name, stages = next(iter(sorted(shared.items())))
            raise ConfigError(
                f"plan: VW {k} holds the tied parameter {name!r} on stages {list(stages)}; "
                "several VWs (parameter servers) need each parameter on one stage: untie it "
                "(e.g. config.tie_word_embeddings=False) or train one VW (--vw 0)"
            )


class TiedGrads:
    """Sums a stage's tied-parameter gradients with the other holders' every minibatch.

    The holders of each tied parameter form their own process group (created with
    ``use_local_synchronization``, so no other rank takes part) and all-reduce its gradient:
    every holder gets the same sum, bit for bit.

    Args:
        stage: this stage.
        stage_rank0: global rank of stage 0 of this virtual worker (its stages are consecutive).
        shared: original parameter name -> stages holding it.
        local: original parameter name -> this stage's parameter name.
    """

    def __init__(
        self,
        stage: int,
        stage_rank0: int,
        shared: dict[str, tuple[int, ...]],
        local: dict[str, str],
    ) -> None:
        self.items: list[tuple[str, Any]] = []
        groups: dict[tuple[int, ...], Any] = {}
        for name, stages in sorted(shared.items()):
            if stage not in stages:
                continue
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
            dist.all_reduce(total, dist.ReduceOp.SUM, group=group)
            out[name] = total
        return out
