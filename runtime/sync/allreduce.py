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

from runtime.sync.rule import Grads, StageView, SyncSpec

__all__ = ["AllReduceSync"]


class AllReduceSync:
    """A stage's side of the ``allreduce`` rule.

    Args:
        group: the process group of this stage position (``None``: the default group).
        size: ranks in that group.
    """

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group, self.size = group, size

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
        if not present or self.size == 1:
            return grads
        flat = torch.cat([g.reshape(-1) for _, g in present])  # (sum of numels,)
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        out: Grads = dict(grads)
        pos = 0
        for name, g in present:
            out[name] = flat[pos : pos + g.numel()].view_as(g)
            pos += g.numel()
        return out

    def start(self, first_wave: int) -> None:
        """Every copy starts from the same seeded weights: nothing to load."""

    def before_forward(self, mb: int) -> None:
        """Nothing to wait for."""

    def before_update(self, mb: int) -> None:
        """Nothing to wait for (the gradients are already the mean)."""

    def after_update(self, mb: int) -> None:
        """Nothing to push."""

    def close(self) -> None:
        """Nothing to flush."""
