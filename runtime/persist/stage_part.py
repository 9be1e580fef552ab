"""A stage's part of a snapshot: what a resumed stage needs to go on exactly as if it had not
stopped, with ``Nm`` minibatches in flight.

A stage writes its part at the end of wave ``C - 1`` (right after the update of minibatch
``C*Nm``, before its push), when the pipeline may already hold forwards of wave ``C``.
Minibatch ``C*Nm + j`` runs on weight version ``(C-1)*Nm + j`` (local staleness, paper
Sec. 4), so the first ``Nm - 1`` minibatches of wave ``C`` need versions from *inside* wave
``C - 1``, which exist only on this stage. The part therefore holds:

- ``master``: the stage's master weights after that update, before the WSP pull of clock
  ``C`` is folded in (a resumed stage folds the same pull into them with the same arithmetic);
- ``versions``: the ``Nm - 1`` weight versions in flight, by offset ``-(Nm-1) .. -1`` from the
  master (:meth:`runtime.stage.weights.VersionedWeights.in_flight_versions`);
- ``optimizer``: the local optimizer's state after the update; ``data_position``: ``C*Nm``;
- ``rng`` and ``buffers``: the RNG state and the module's buffers (batch-norm statistics)
  just before the forward of minibatch ``C*Nm + 1``, taken at that forward when it already
  ran (:class:`ForwardState`), so dropout masks and running statistics continue exactly.

The minibatches in flight are not saved: a resumed pipeline recomputes their forwards on the
same versions from the same inputs, which gives the same bits (a task's arithmetic does not
depend on when it runs, only on its version and inputs). Parts written before this format
(no ``master``) still load; a stage resumed from one starts from the global weights alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from profiler.errors import HetPipeRuntimeError
from runtime.stage.weights import VersionedWeights

__all__ = [
    "KIND",
    "ForwardState",
    "StagePart",
    "restore_buffers",
    "stage_from_payload",
    "stage_payload",
]

KIND = "hetpipe-stage"


@dataclass(frozen=True)
class ForwardState:
    """The RNG state and the module buffers at one point of a stage's forwards.

    Attributes:
        rng: ``torch.get_rng_state()``.
        buffers: the stage module's buffers by original name (copies).
    """

    rng: Tensor
    buffers: dict[str, Tensor]

    @classmethod
    def capture(cls, buffers: dict[str, Tensor]) -> ForwardState:
        """The current RNG state and copies of ``buffers``."""
        return cls(torch.get_rng_state(), {n: b.detach().clone() for n, b in buffers.items()})

    def restore(self, buffers: dict[str, Tensor], where: str | os.PathLike[str]) -> None:
        """Set the RNG state and copy the recorded values into ``buffers`` (in place).

        Raises:
            HetPipeRuntimeError: a buffer missing or misshapen (a snapshot of another model).
        """
        torch.set_rng_state(self.rng)
        restore_buffers(buffers, self.buffers, where)


def restore_buffers(
    buffers: dict[str, Tensor], saved: dict[str, Tensor], where: str | os.PathLike[str]
) -> None:
    """Copy ``saved`` into the stage's ``buffers`` (both by original name), in place.

    Raises:
        HetPipeRuntimeError: a buffer missing or misshapen (a snapshot of another model).
    """
    for name, b in buffers.items():
        value = saved.get(name)
        if value is None or value.shape != b.shape:
            raise HetPipeRuntimeError(
                f"{where}: buffer {name!r} missing or misshapen (a snapshot of another model, "
                "or of a hetpipe that named buffers by stage)"
            )
        with torch.no_grad():
            b.copy_(value)


@dataclass(frozen=True)
class StagePart:
    """A stage's part of the snapshot at ``clock`` (see the module doc).

    Attributes:
        clock: the snapshot's global clock.
        optimizer: the local optimizer's ``state_dict``.
        forward: RNG state and buffers before the forward of minibatch ``clock*Nm + 1``.
        master: master weights by local name (``None``: an older part; resumes inexactly).
        versions: the weight versions in flight by offset from the master.
    """

    clock: int
    optimizer: dict[str, Any]
    forward: ForwardState
    master: dict[str, Tensor] | None
    versions: dict[int, dict[str, Tensor]]

    def restore_weights(self, weights: VersionedWeights) -> None:
        """Set ``weights``' master and its versions in flight to the recorded ones.

        Raises:
            HetPipeRuntimeError: a weight missing or misshapen.
        """
        if self.master is None:
            return
        for name, p in weights.master.items():
            saved = self.master.get(name)
            if saved is None or saved.shape != p.shape:
                raise HetPipeRuntimeError(
                    f"stage part at clock {self.clock}: weight {name!r} missing or misshapen"
                )
            with torch.no_grad():
                p.data.copy_(saved)
        weights.restore_versions(self.versions)


def stage_payload(
    clock: int, nm: int, weights: VersionedWeights, forward: ForwardState
) -> dict[str, Any]:
    """The plain-data part of a stage at the end of wave ``clock - 1`` (see the module doc)."""
    opt = weights.optimizer
    return {
        "kind": KIND,
        "clock": clock,
        "data_position": clock * nm,  # minibatches of this VW's data consumed
        "optimizer": opt.state_dict() if opt is not None else {},
        "rng": forward.rng,
        "buffers": forward.buffers,
        "master": {n: p.detach().clone() for n, p in weights.master.items()},
        "versions": weights.in_flight_versions(),
    }


def stage_from_payload(d: Any, where: str | os.PathLike[str], clock: int, nm: int) -> StagePart:
    """The :class:`StagePart` of a payload written by :func:`stage_payload` at ``clock``.

    Raises:
        HetPipeRuntimeError: not a stage part, another Nm's or malformed.
    """
    if not isinstance(d, dict) or d.get("kind") != KIND:
        raise HetPipeRuntimeError(f"{where}: not a hetpipe stage checkpoint")
    try:
        if int(d["data_position"]) != clock * nm:
            raise HetPipeRuntimeError(
                f"{where}: data position {d['data_position']}, expected {clock * nm} "
                "(a snapshot of another Nm)"
            )
        master = d.get("master")
        versions = {int(k): dict(v) for k, v in d.get("versions", {}).items()}
        return StagePart(clock, dict(d["optimizer"]), ForwardState(d["rng"], dict(d.get("buffers", {}))),
                         None if master is None else dict(master), versions)  # fmt: skip
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise HetPipeRuntimeError(f"{where}: malformed stage checkpoint ({exc})") from None
