"""The ``allreduce`` rule: BSP data parallelism, the paper's Horovod baseline (Sec. 8).

Every VW holds the same stages; after each backward, every VW's copy of a stage averages its
gradients with the others' (one flat ``all_reduce`` over that stage position's ranks,
``SyncSpec.groups``), so every copy takes the same step and the run equals SGD on the combined
minibatch. The data rule (each rank's slice of a global minibatch) is
:func:`planner.sync.global_slice`; the prediction :func:`planner.predict.simulate_allreduce`.
Snapshots (``--checkpoint-every``, ``--resume``, ``--on-failure restart``) are
:mod:`runtime.sync.allreduce_snapshot`'s, committed by the run's manifest like WSP's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from runtime.link_pacing import NO_LINKS, REAL_PACE, Pace, StageLinks
from runtime.results.metrics import StageResult
from runtime.sync.allreduce_snapshot import StagePart
from runtime.sync.rule import Grads, StageSync, StageView, SyncSpec

__all__ = ["AllReduceSync"]


class AllReduceSync(StageSync):
    """A stage's side of the ``allreduce`` rule.

    A time limit ends every copy after the same step: each step's collective also carries a
    "my time is up" flag (the last element), so all learn it together.

    Args:
        group: the process group of this stage position (``None``: the default group).
        size: ranks in that group.
        part: the stage's part of the run's snapshots (``None``: no snapshots).
        first_clock: the step this run starts after (a resumed run's snapshot clock).
        links: the emulated ring (:mod:`runtime.link_pacing`): each collective, which blocks
            in the real runtime too, lasts at least the ring all-reduce the prediction
            charges (:func:`planner.cluster.allreduce_s`); none by default.
        result: where a paced collective is recorded as waiting, not device time, so it
            extends the emulated backward's window (as a WSP pull does) instead of hiding
            in it; the prediction adds it to the step.
        pace: the pacing's clock and wait (tests inject them).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        size: int,
        part: StagePart | None = None,
        first_clock: int = 0,
        links: StageLinks = NO_LINKS,
        pace: Pace = REAL_PACE,
        result: StageResult | None = None,
    ) -> None:
        self.group, self.size = group, size
        self.links, self.pace = links, pace  # an emulated ring: paced to its charge
        self.result = result
        self._up = False  # this copy's own time is up (stage 0 says so in agreed_total)
        self._last: int | None = None  # the agreed last minibatch, once a flag came back
        self.part, self.first_clock = part, first_clock
        self._done = 0  # steps of this run whose update is applied

    @classmethod
    def create(cls, spec: SyncSpec, view: StageView) -> AllReduceSync:
        """The rule's factory (:mod:`runtime.sync.rule`): one group per stage position when
        the VWs have several stages (every stage process creates every group, in order)."""
        part = None
        if spec.snapshots is not None:
            part = StagePart(spec.snapshots, view.vw, view.stage, view.params,
                             view.weights.optimizer, spec.first_wave, view.buffers)  # fmt: skip
        groups = spec.groups
        if len(groups) <= 1:
            size = len(groups[0]) if groups else dist.get_world_size()
            return cls(None, size, part, spec.first_wave, view.links, result=view.result)
        handles = [dist.new_group(list(g)) for g in groups]
        group = handles[view.stage]
        size = len(groups[view.stage])
        return cls(group, size, part, spec.first_wave, view.links, result=view.result)

    def start(self, first_wave: int) -> None:
        """A resumed run: every copy loads its stage from the snapshot at ``first_wave``."""
        if first_wave > 0 and self.part is not None:
            self.part.load(first_wave)

    def reduce_grads(self, mb: int, grads: Grads) -> Grads:
        """The mean of every copy's gradients (one flat ``all_reduce``; a gradient that is
        ``None`` on this stage is ``None`` on every copy: same module, same inputs' kinds)."""
        present = [(n, g) for n, g in grads.items() if g is not None]
        device = present[0][1].device if present else None  # CUDA grads: NCCL (launch.backend)
        flag = torch.tensor([1.0 if self._up else 0.0], device=device)
        flat = torch.cat([*(g.reshape(-1) for _, g in present), flag])  # (sum of numels + 1,)
        start = self.pace.clock()
        dist.all_reduce(flat, group=self.group)
        nbytes = sum(g.numel() * g.element_size() for _, g in present)  # the gradients
        self._paced(mb, start, self.links.allreduce_charge_s(nbytes))
        if flat[-1] > 0 and self._last is None:
            self._last = mb
        flat /= self.size
        out: Grads = dict(grads)
        pos = 0
        for name, g in present:
            out[name] = flat[pos : pos + g.numel()].view_as(g)
            pos += g.numel()
        return out

    def _paced(self, mb: int, start: float, charge_s: float) -> None:
        """An emulated ring: the collective that began at ``start`` lasts ``charge_s`` at least,
        recorded as waiting (the worker's paced window grows by it)."""
        if charge_s <= 0:
            return
        self.pace.since(start, charge_s)
        if self.result is not None:
            took = self.pace.clock() - start
            end = time.time()
            self.result.log_interval("wait", mb, end - took, end)
            self.result.wait_s += took
            self.result.busy_s -= took  # the hook runs inside a timed task: waiting is not work

    def after_update(self, mb: int) -> None:
        """After step ``mb``: this process's snapshot part when the clock is due."""
        self._done = mb
        if self.part is not None:
            self.part.write(self.first_clock + mb)

    def close(self) -> None:
        """After the last step: the final snapshot part (whatever the period)."""
        if self.part is not None and self._done:
            self.part.write(self.first_clock + self._done, final=True)

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """The step after which some copy's time was up (every copy learnt it in the same
        collective); ``None`` until then."""
        self._up = self._up or time_up
        return self._last
