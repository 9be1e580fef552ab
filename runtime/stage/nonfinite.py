"""A stage's check for a diverging run: a NaN or infinite loss or gradient stops the run with
:class:`Diverged`, or, under ``--on-nonfinite skip``, skips that minibatch's update at every
stage of the VW (the rule is :mod:`planner.nonfinite`; this module only looks at tensors)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from planner.nonfinite import Verdict, after_reduction, verdict
from profiler.errors import HetPipeRuntimeError

__all__ = ["REMEDY", "Diverged", "StageJudge", "all_finite", "mark"]

REMEDY = "; lower --lr"
"""Where a stage's :class:`Diverged` message turns from what happened to what to do (the
launcher replaces the rest by the snapshot to resume from)."""


class Diverged(HetPipeRuntimeError):
    """A loss or gradient became NaN or infinite: the run stops, and is never restarted
    (``--on-failure restart`` would only diverge again); the message names the VW, stage,
    minibatch and the last snapshot to resume from with a smaller learning rate."""


def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every floating-point tensor is finite (``None``: skipped).

    One fused pass per device, the check ``torch.amp.GradScaler`` makes: its kernel also
    multiplies the tensors in place by the scale, here exactly 1.0, which leaves every value
    bit for bit as it was (a per-tensor ``isfinite(t).all()`` cost several optimizer steps).
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t is not None and t.is_floating_point():
            by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        found = torch.zeros(1, device=device)  # (1,) 1.0 once a NaN or inf is found
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, torch.ones(1, device=device))
        if found.item():
            return False
    return True


def mark(tensors: Iterable[Tensor | None]) -> None:
    """Mark gradients of a skipped minibatch: every element NaN, in place (the next stage back,
    or a copy in the reduction, sees them and skips too)."""
    with torch.no_grad():
        for t in tensors:
            if t is not None and t.is_floating_point():
                t.fill_(math.nan)


@dataclass(frozen=True)
class StageJudge:
    """One stage's application of :mod:`planner.nonfinite`.

    Attributes:
        policy: ``stop`` or ``skip``.
        vw, stage: the stage's place (for the message).
        last: whether it is the pipeline's last stage.
        first_mb: minibatches before this run (a resumed run's position: messages number
            minibatches over the whole training).
        nm: minibatches per wave.
    """

    policy: str
    vw: int
    stage: int
    last: bool
    first_mb: int
    nm: int

    def local(
        self,
        mb: int,
        loss: float,
        grads_in: Iterable[Tensor | None],
        grads_w: Iterable[Tensor | None],
        grads_x: Iterable[Tensor | None],
    ) -> Verdict:
        """The verdict on minibatch ``mb`` (this run's numbering) after its backward, before
        its gradients leave (``loss``: the last stage's, else 0; ``grads_in``: what the next
        stage sent back). A skip marks ``grads_w`` and ``grads_x``.

        Raises:
            Diverged: the run must stop (names what was not finite and where).
        """
        grads_w, grads_x = list(grads_w), list(grads_x)
        grads_in = [] if self.last else list(grads_in)  # the last stage receives none
        if math.isfinite(loss) and all_finite([*grads_in, *grads_w, *grads_x]):
            return verdict(self.policy, True, False, self.last)  # the usual case: one pass
        skipped_after = not all_finite(grads_in)
        what = ""
        if not math.isfinite(loss):
            what = f"loss ({loss})"
        elif not all_finite(grads_w):
            what = "weight gradient"
        elif not all_finite(grads_x):
            what = "gradient sent to the previous stage"
        v = verdict(self.policy, not what, skipped_after, self.last)
        if v is Verdict.STOP:
            what = what or "gradient from the next stage"
            late = " (the later stages applied it already: it cannot be skipped)"
            raise Diverged(
                self._message(mb, f"non-finite {what}{late if self.policy == 'skip' else ''}")
            )
        if v is Verdict.SKIP:
            mark(grads_w)
            mark(grads_x)
        return v

    def reduced(self, mb: int, local: Verdict, grads: Iterable[Tensor | None]) -> Verdict:
        """The verdict once the gradients to apply are known (reduced over the VWs, tied
        copies summed; :func:`planner.nonfinite.after_reduction`).

        Raises:
            Diverged: the reduced gradients are not finite under ``stop``.
        """
        v = after_reduction(self.policy, local, local is not Verdict.APPLY or all_finite(grads))
        if v is Verdict.STOP:
            raise Diverged(self._message(mb, "non-finite gradient after the reduction"))
        return v

    def _message(self, mb: int, what: str) -> str:
        total = self.first_mb + mb
        return (
            f"{what} at vw {self.vw}, stage {self.stage}, minibatch {total} "
            f"(wave {(total - 1) // self.nm}): the run diverged{REMEDY}{skip_hint(self.policy)}"
        )


def skip_hint(policy: str) -> str:
    """The end of a :class:`Diverged` message: skipping such updates, unless they were."""
    return "" if policy == "skip" else " (or skip such updates: --on-nonfinite skip)"
