"""Tied parameters: one parameter held by several stages (GPT-2's input and output embedding,
ALBERT's one layer read by every block).

Each stage that reads a tied parameter holds its own copy (:meth:`ModelGraph.shared_params`).
After every backward pass the holders sum their gradients for it, so every copy takes the same
optimizer step with the same gradient as the single-process model (where autograd adds the
uses) and the copies stay bit-identical. The sum is point-to-point, whatever the number of
holders: each holder sends its gradient to the owner, the owner adds them in stage order and
sends the total back. Every exchange runs in three phases (post every send of a gradient; as
owner, receive, add and send each total; wait for each total), so a phase waits only on an
earlier phase of the other holders and no arrangement of who arrives first can cycle. The
later stage's backward of a minibatch precedes the earlier stage's and sends its input
gradients first, so every holder reaches the exchange.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from profiler.errors import HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.ps.wire import irecv, isend
from runtime.stage.device import to_host

__all__ = ["TAG", "TiedGrads", "TiedParam", "tied_params"]

TAG = 9_000_000  # + the parameter's index: far from the pipeline's, the shards' and the mirror's


@dataclass(frozen=True)
class TiedParam:
    """Where a tied parameter lives in one virtual worker.

    Attributes:
        owner: the stage of the layer that owns it (first use): the one that pushes it to and
            pulls it from the parameter servers, and sums the holders' gradients.
        holders: every stage holding a copy (the owner included), sorted.
    """

    owner: int
    holders: tuple[int, ...]


def tied_params(graph: ModelGraph, cuts: Sequence[int]) -> dict[str, TiedParam]:
    """Original name -> :class:`TiedParam` of every parameter held by several stages."""
    stage = graph.stage_of_layer(cuts)
    owner = {name: stage[lay.index] for lay in graph.layers for name in lay.params}
    return {n: TiedParam(owner[n], s) for n, s in graph.shared_params(cuts).items()}


@dataclass(frozen=True)
class _Item:
    """One tied parameter as this stage exchanges it: local name, tag, owner and other holders
    (global ranks, in stage order)."""

    local: str
    tag: int
    owner: int
    others: tuple[int, ...]


class TiedGrads:
    """Sums a stage's tied-parameter gradients with the other holders' every minibatch.

    Args:
        stage: this stage.
        stage_rank0: global rank of stage 0 of this virtual worker (its stages are consecutive).
        shared: original parameter name -> where it lives (:func:`tied_params`), the same
            table on every stage of the VW (it numbers the message tags).
        local: original parameter name -> this stage's parameter name.
        timeout_s: longest wait for another holder's message.

    Attributes:
        held: original name -> :class:`TiedParam` of the tied parameters this stage holds.
    """

    def __init__(
        self,
        stage: int,
        stage_rank0: int,
        shared: dict[str, TiedParam],
        local: dict[str, str],
        timeout_s: float,
    ) -> None:
        self.stage, self.stage_rank0, self.local = stage, stage_rank0, local
        self.rank, self.timeout_s = stage_rank0 + stage, timeout_s
        self.held = {n: t for n, t in sorted(shared.items()) if stage in t.holders}
        self.items = tuple(
            _Item(
                local[name],
                TAG + i,
                stage_rank0 + tied.owner,
                tuple(stage_rank0 + s for s in tied.holders if s != stage),
            )
            for i, (name, tied) in enumerate(sorted(shared.items()))
            if stage in tied.holders
        )

    def __bool__(self) -> bool:
        return bool(self.items)

    def exchange(
        self, grads: dict[str, Tensor | None], like: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        """Replace each tied gradient in ``grads`` by the sum over its holders (bit-equal on
        every holder: the owner's sum, in stage order).

        Args:
            grads: this stage's gradients by stage parameter name (``None`` = unused here).
            like: the stage's parameters (shape and dtype of a missing gradient).

        Raises:
            HetPipeRuntimeError: another holder sent nothing within ``timeout_s``.
        """
        mine = {}  # in host memory: the exchange is gloo's (a GPU stage's come back after)
        for it in self.items:
            g = grads.get(it.local)
            mine[it.local] = to_host(torch.zeros_like(like[it.local]) if g is None else g.detach())
        sends = [  # phase 1: every gradient leaves for its owner
            isend(mine[it.local].contiguous(), it.owner, None, it.tag)
            for it in self.items
            if it.owner != self.rank
        ]
        out = dict(grads)
        for it in self.items:  # phase 2: the owner adds them in stage order, sends the total
            if it.owner == self.rank:
                total = self._sum(it, mine[it.local])
                sends += [isend(total, r, None, it.tag) for r in it.others]
                out[it.local] = total.to(like[it.local].device)
        for it in self.items:  # phase 3: every other holder takes the owner's total
            if it.owner != self.rank:
                total = torch.empty_like(mine[it.local]).contiguous()
                self._wait(irecv(total, it.owner, None, it.tag), it.owner)
                out[it.local] = total.to(like[it.local].device)
        for work in sends:
            self._wait(work, -1)
        return out

    def _sum(self, it: _Item, own: Tensor) -> Tensor:
        """The owner's sum of ``it``'s gradients over its holders, in stage order."""
        bufs = {r: torch.empty_like(own).contiguous() for r in it.others}
        works = {r: irecv(b, r, None, it.tag) for r, b in bufs.items()}
        parts = {**bufs, self.rank: own}
        total = torch.zeros_like(own)
        for r in sorted(parts):
            if r in works:
                self._wait(works[r], r)
            total += parts[r]
        return total

    def _wait(self, work: dist.Work, rank: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            peer = f"the stage at rank {rank}" if rank >= 0 else "another holder"
            raise HetPipeRuntimeError(
                f"tied parameters: no gradient exchange with {peer} in {self.timeout_s:.0f} s "
                f"({str(exc).splitlines()[0][:120]})"
            ) from None
