"""The ``allreduce`` rule: BSP data parallelism, the paper's Horovod baseline (Sec. 8).

Every VW holds the same stages; after each backward, every VW's copy of a stage averages its
gradients with the others' (one flat ``all_reduce`` over that stage position's ranks,
``SyncSpec.groups``), so every copy takes the same step and the run equals SGD on the combined
minibatch. The data rule (each rank's slice of a global minibatch) is
:func:`planner.sync.global_slice`; the prediction :func:`planner.predict.simulate_allreduce`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.sync.rule import Grads, StageSync, StageView, SyncSpec

__all__ = ["AllReduceSync"]


class AllReduceSync(StageSync):
    """A stage's side of the ``allreduce`` rule.

    A time limit ends every copy after the same step: each step's collective also carries a
    "my time is up" flag (the last element), so all learn it together.

    Args:
        group: the process group of this stage position (``None``: the default group).
        size: ranks in that group.
    """

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group, self.size = group, size
        self._up = False  # this copy's own time is up (stage 0 says so in agreed_total)
        self._last: int | None = None  # the agreed last minibatch, once a flag came back

    @classmethod
    def create(cls, spec: SyncSpec, view: StageView) -> AllReduceSync:
        """The rule's factory (:mod:`runtime.sync.rule`): one group per stage position when
        the VWs have several stages (every stage process creates every group, in order)."""
        groups = spec.groups
        if len(groups) <= 1:
            size = len(groups[0]) if groups else dist.get_world_size()
            return cls(None, size)
        handles = [dist.new_group(list(g)) for g in groups]
        return cls(handles[view.stage], len(groups[view.stage]))

    def reduce_grads(self, mb: int, grads: Grads) -> Grads:
        """The mean of every copy's gradients (one flat ``all_reduce``; a gradient that is
        ``None`` on this stage is ``None`` on every copy: same module, same inputs' kinds)."""
        present = [(n, g) for n, g in grads.items() if g is not None]
        flag = torch.tensor([1.0 if self._up else 0.0])
        flat = torch.cat([*(g.reshape(-1) for _, g in present), flag])  # (sum of numels + 1,)
        dist.all_reduce(flat, group=self.group)
        if flat[-1] > 0 and self._last is None:
            self._last = mb
        flat /= self.size
        out: Grads = dict(grads)
        pos = 0
        for name, g in present:
            out[name] = flat[pos : pos + g.numel()].view_as(g)
            pos += g.numel()
        return out

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """The step after which some copy's time was up (every copy learnt it in the same
        collective); ``None`` until then."""
        self._up = self._up or time_up
        return self._last
