"""The process side of synchronous SGD with backup workers (``--sync backup``, :mod:`planner.backup`).

A stage does what WSP does at ``D = 0`` (:class:`runtime.sync.wave.WaveSync`): push the wave's
update, pull the global weights of the next clock before the first minibatch that needs them.
The shards (:class:`runtime.ps.core.ShardCore` with ``backups = b``) close a wave at the first
``VWs - b`` complete pushes and acknowledge a late push ``DROPPED`` (the client counts it in
``PSClient.dropped``). What this module adds is the late VW's numbering (:class:`WaveNumbers`):

- the pull after pushing wave ``c`` returns the global clock ``G``; the VW continues at wave
  :func:`planner.backup.continue_at` ``(c, G)``, on the global weights of that clock, instead
  of pushing waves that closed without it. Its data position goes on (the next minibatch of
  its own data, whatever the wave's number), so a VW that fell behind trains fewer samples;
- the stages of a VW pull at slightly different times and may see different clocks, so they
  agree on the jump through a store (first writer wins, like the time limit's stop wave,
  :mod:`runtime.sync.stop`); a stage whose pull is older than the agreed clock pulls again;
- the run ends at global clock ``last_wave``: stage 0 admits
  :func:`planner.backup.vw_minibatches` minibatches in all and no stage pushes a wave
  numbered ``last_wave`` or more (a wave in progress when the VW jumped that far is
  finished and not pushed), so the last pull of every VW is for a wave that closes.
"""

from __future__ import annotations

import dataclasses
import logging

from torch._C._distributed_c10d import Store

from planner.backup import continue_at, vw_minibatches
from planner.sync import param
from runtime.sync.rule import StageView, SyncSpec
from runtime.sync.stop import stop_store
from runtime.sync.wave import WaveSync

__all__ = ["WaveNumbers", "create", "shard_backups"]

log = logging.getLogger(__name__)


class WaveNumbers:
    """One stage's wave numbering under backup workers (every stage of a VW agrees on it).

    Args:
        vw: the stage's VW.
        nm: minibatches per wave.
        first_wave: the wave the run starts at (a resumed run's clock).
        last_wave: the global clock the run ends at.
        init_method: the run's rendezvous; the jump agreement's store lives beside it
            (opened on the first jump decision).
    """

    def __init__(self, vw: int, nm: int, first_wave: int, last_wave: int, init_method: str) -> None:
        self.vw, self.nm = vw, nm
        self.first_wave, self.last_wave = first_wave, last_wave
        self.skipped = 0  # waves this VW jumped over
        self._init_method = init_method
        self._store: Store | None = None

    def number(self, data_wave: int) -> int:
        """The global number of this run's data wave ``data_wave`` (0-based)."""
        return self.first_wave + data_wave + self.skipped

    def pushes(self, wave: int) -> bool:
        """Whether wave ``wave`` is pushed (the run ends at ``last_wave``)."""
        return wave < self.last_wave

    def agree(self, pushed: int, clock: int) -> int:
        """The wave the VW continues at after pushing ``pushed`` when this stage's pull saw
        ``clock``: the first stage of the VW to get here decides; its jump is recorded."""
        mine = continue_at(pushed, clock)
        if self._store is None:
            self._store = stop_store(self._init_method)
        key = f"hetpipe/backup/vw{self.vw}/after{pushed}"
        agreed = int(self._store.compare_set(key, "", str(mine)))
        if agreed > pushed + 1:
            log.info("vw %d: waves %d..%d closed without it; continuing at wave %d",
                     self.vw, pushed + 1, agreed - 1, agreed)  # fmt: skip
        self.skipped += agreed - pushed - 1
        return agreed

    def minibatches(self, total: int, admitted: int) -> int:
        """This run's minibatches for the VW (at most ``total``), given its jumps so far."""
        waves = self.last_wave - self.first_wave
        return min(total, vw_minibatches(waves, self.skipped, admitted, self.nm))


def create(spec: SyncSpec, view: StageView) -> WaveSync:
    """The ``backup`` rule's stage hooks: WSP's at ``D = 0``, numbered by :class:`WaveNumbers`."""
    numbers = WaveNumbers(view.vw, view.nm, spec.first_wave, spec.last_wave, view.init_method)
    return WaveSync.create(dataclasses.replace(spec, D=0), view, numbers)


def shard_backups(spec: SyncSpec) -> int:
    """``b``: how many VWs' pushes each wave does not wait for."""
    return int(param(spec.params, "backups"))
