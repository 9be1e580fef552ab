"""The ``--on-nonfinite`` rule: what a stage does with a minibatch whose loss or gradients are
NaN or infinite (a diverging run), as plain functions the stage worker and any reference share.

Where a non-finite value shows: the last stage sees the loss; every stage sees the gradients of
its weights and the gradients it sends back to the previous stage; under ``allreduce`` a stage
also sees the reduced gradients (another VW's copy may have skipped the step). A minibatch's
backward runs from the last stage to stage 0, and each stage updates its weights right after
its own backward, so when stage ``s`` judges minibatch ``p`` the stages after it have already
applied (or skipped) ``p``. Hence the rule, stage by stage in backward order:

1. the next stage skipped ``p`` (the gradients it sent back are marked: every element NaN):
   skip ``p`` here too, and mark what goes back to the previous stage (under ``stop``, where
   no stage skips, non-finite gradients from the next stage stop the run);
2. everything this stage sees is finite: apply ``p``;
3. something is not finite: under ``stop`` stop the run; under ``skip`` skip ``p`` only on the
   last stage, the first to judge ``p`` (nothing of the VW applied it yet), and mark the
   gradients it sends back, so every stage of the VW skips ``p``. A value that first turns
   non-finite on an earlier stage (a finite loss whose backward overflows in stage ``s``)
   cannot be skipped consistently any more, the later stages applied ``p`` already: the run
   stops, as under ``stop`` (:func:`verdict`);
4. ``allreduce``: a stage that skips still joins the step's reduction with marked gradients,
   so the mean is NaN at every copy and every VW skips ``p`` at that stage
   (:func:`after_reduction`).

A skipped update leaves the weights and the optimizer state as they were; the learning-rate
schedule still advances (as ``torch.amp.GradScaler`` leaves an lr scheduler stepping).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["POLICIES", "Verdict", "after_reduction", "verdict"]

POLICIES = ("stop", "skip")
"""The values of ``--on-nonfinite`` (``stop``: the default)."""


class Verdict(Enum):
    """What a stage does with one minibatch's update."""

    APPLY = "apply"
    SKIP = "skip"
    STOP = "stop"


def verdict(policy: str, finite: bool, skipped_after: bool, last: bool) -> Verdict:
    """A stage's verdict on minibatch ``p`` after its backward (see the module doc).

    Args:
        policy: ``stop`` or ``skip`` (:data:`POLICIES`).
        finite: whether everything this stage computed for ``p`` is finite (the last stage:
            the loss too; every stage: its weights' gradients and those it sends back).
        skipped_after: whether the next stage skipped ``p`` (the gradients it sent are marked).
        last: whether this is the last stage (no stage of the VW judged ``p`` yet).

    >>> verdict("skip", finite=False, skipped_after=False, last=True)
    <Verdict.SKIP: 'skip'>
    >>> verdict("skip", finite=False, skipped_after=False, last=False)
    <Verdict.STOP: 'stop'>
    >>> verdict("stop", finite=True, skipped_after=False, last=False)
    <Verdict.APPLY: 'apply'>
    >>> verdict("stop", finite=True, skipped_after=True, last=False)  # never skips
    <Verdict.STOP: 'stop'>
    """
    skip = Verdict.SKIP if policy == "skip" else Verdict.STOP
    if skipped_after:
        return skip
    if finite:
        return Verdict.APPLY
    return skip if last else Verdict.STOP


def after_reduction(policy: str, local: Verdict, reduced_finite: bool) -> Verdict:
    """The verdict once the gradients were reduced over the VWs (``allreduce``; the other
    rules reduce nothing and keep ``local``).

    A stage that applies ``p`` locally but whose reduced gradients are not finite met a copy
    that skipped ``p`` (its marked gradients): under ``skip`` it skips too. Under ``stop`` no
    copy skips, so a non-finite mean is an overflow of the reduction: stop.

    >>> after_reduction("skip", Verdict.APPLY, reduced_finite=False)
    <Verdict.SKIP: 'skip'>
    >>> after_reduction("stop", Verdict.APPLY, reduced_finite=False)
    <Verdict.STOP: 'stop'>
    >>> after_reduction("skip", Verdict.SKIP, reduced_finite=False)
    <Verdict.SKIP: 'skip'>
    """
    if local is not Verdict.APPLY or reduced_finite:
        return local
    return Verdict.SKIP if policy == "skip" else Verdict.STOP
