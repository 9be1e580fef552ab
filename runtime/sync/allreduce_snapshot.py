"""Snapshots of the ``allreduce`` rule: a stage's part of each committed snapshot.

The rule has no parameter-server shards, so its stages hold the model: every VW's copy of a
stage holds the same weights and optimizer state (each step applies the same averaged
gradients). A snapshot at clock ``c`` (``c`` steps done; ``Nm = 1``, so a wave is a step)
has one part per stage process, written with the run's snapshot machinery
(:func:`runtime.persist.snapshot.write_part`, committed by the manifest once every part is
in): VW 0's parts carry the stage's weights and optimizer state, every part its process's
RNG state, data position and buffers (each copy's batch norm sees its own slice of the data).
A resumed copy loads the weights and optimizer state from VW 0's part of its stage, its RNG
state and buffers from its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from profiler.errors import HetPipeRuntimeError
from runtime.persist.snapshot import (
    SnapshotSpec,
    load_part,
    read_manifest,
    snapshot_dir,
    write_part,
)
from runtime.persist.stage_part import restore_buffers

__all__ = ["KIND", "StagePart"]

KIND = "hetpipe-allreduce-stage"


class StagePart:
    """One stage process's part of the ``allreduce`` rule's snapshots.

    Args:
        snapshots: the run's snapshots.
        vw, stage: the process's place (VW 0's parts hold the model).
        params: ``(global name, master parameter)`` of the stage.
        optimizer: the stage's local optimizer (``None``: a stage without parameters).
        first_clock: the clock this run starts at (a resumed run's snapshot clock).
        buffers: ``(global name, buffer)`` of the stage (batch-norm statistics).
    """

    def __init__(
        self,
        snapshots: SnapshotSpec,
        vw: int,
        stage: int,
        params: Sequence[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer | None,
        first_clock: int = 0,
        buffers: Sequence[tuple[str, Tensor]] = (),
    ) -> None:
        self.snapshots, self.vw, self.stage = snapshots, vw, stage
        self.params, self.optimizer = list(params), optimizer
        self.buffers = dict(buffers)
        self.written = first_clock  # the clock of the last part written (or resumed from)

    @property
    def name(self) -> str:
        """The part's name in a snapshot (``vw<k>-stage<s>``)."""
        return f"vw{self.vw}-stage{self.stage}"

    def load(self, clock: int) -> None:
        """Resume at ``clock``: the weights and optimizer state of VW 0's copy of this stage,
        this process's own RNG state.

        Raises:
            HetPipeRuntimeError: a part that is not this rule's, or of another position.
        """
        manifest = read_manifest(snapshot_dir(self.snapshots.directory, clock))
        model = self._checked(load_part(manifest, f"vw0-stage{self.stage}"), manifest.path, clock)
        own = self._checked(load_part(manifest, self.name), manifest.path, clock)
        weights = model["weights"]
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(weights[name])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(model["optimizer"])
        torch.set_rng_state(own["rng"])
        if "buffers" in own:  # a part written before buffers were: the initial ones
            restore_buffers(self.buffers, own["buffers"], manifest.path / f"{self.name}.pt")

    def _checked(self, part: Any, folder: Any, clock: int) -> dict[str, Any]:
        where = f"{folder}/{self.name}.pt"
        if not isinstance(part, dict) or part.get("kind") != KIND:
            raise HetPipeRuntimeError(f"{where}: not a hetpipe AllReduce stage checkpoint")
        if int(part["data_position"]) != clock:
            raise HetPipeRuntimeError(
                f"{where}: data position {part['data_position']}, expected {clock}"
            )
        return part

    def write(self, clock: int, final: bool = False) -> None:
        """Write this process's part of the snapshot at ``clock`` when it is due: every
        ``snapshots.every`` steps, and ``final`` (the run's last step) whatever the period."""
        every = self.snapshots.every
        if every <= 0 or (clock % every and not final) or clock <= self.written:
            return  # never rewrite a part a committed manifest may already vouch for
        payload: dict[str, Any] = {
            "kind": KIND,
            "clock": clock,
            "data_position": clock,  # global minibatches consumed (Nm = 1)
            "rng": torch.get_rng_state(),
            "buffers": {n: b.detach().clone() for n, b in self.buffers.items()},
        }
        if self.vw == 0:  # every copy holds the same model: VW 0's part carries it
            payload["weights"] = {n: p.detach().clone() for n, p in self.params}
            payload["optimizer"] = self.optimizer.state_dict() if self.optimizer else {}
        write_part(self.snapshots, clock, self.name, payload)
        self.written = clock
