"""``--on-failure continue`` at the launcher: a failed VW is stopped, the others go on.

The parameter-server shards evict the VW themselves once its connections close
(:meth:`runtime.ps.core.ShardCore.lose`); the launcher's part is to stop the VW's remaining
stages (they would otherwise wait on their dead neighbour until a timeout), to blame the
rank that caused it, and to keep watching the survivors. With ``restart``
(``--on-failure restart``) the VW's stages are started again instead, while the budget lasts
(:class:`runtime.launch.restart_vw.VWRestarter`). A failed *shard* holds global weights no
one else has: the run stops (or restarts the whole job, ``--on-failure restart``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.launch.failures import SECONDARY, diverged

__all__ = ["VWEvictor"]

log = logging.getLogger(__name__)


@dataclass
class VWEvictor:
    """The ``absorb`` policy of :func:`runtime.launch.failures.watch` for a multi-VW run.

    Attributes:
        vw_ranks: VW id -> its stage ranks.
        procs: rank -> ``multiprocessing.Process``.
        labels: rank -> description for messages.
        lost: VW id -> why it was evicted (the rank blamed), filled as VWs fail.
        grace_s: longest wait for the death of the rank that caused a neighbour's error.
        restart: ``(vw, cause) -> restarted``: start the stopped VW's stages again (``False``:
            no budget left, it stays evicted); ``None``: never (``--on-failure continue``).
    """

    vw_ranks: Mapping[int, tuple[int, ...]]
    procs: Mapping[int, Any]
    labels: Mapping[int, str]
    lost: dict[int, str] = field(default_factory=dict)
    grace_s: float = 1.5
    restart: Callable[[int, str], bool] | None = None

    def __call__(self, errors: dict[int, str]) -> set[int] | None:
        """Stop the VWs of the failed ranks (and restart them when allowed); the ranks the
        run goes on without, or ``None`` when the run must stop (a shard failed, or no VW
        would survive)."""
        if any(diverged(m) for m in errors.values()):
            return None  # evicted or restarted, it would diverge again: the run stops
        vw_of = {r: k for k, ranks in self.vw_ranks.items() for r in ranks}
        vws = {vw_of.get(r, -1) for r in errors}
        if -1 not in vws and self._shard_died(vw_of, errors):
            return None  # the stages only lost their shard: the run (or the job) must stop
        if -1 in vws or (
            self.restart is None and len(self.lost.keys() | vws) >= len(self.vw_ranks)
        ):
            return None
        gone: set[int] = set()
        for k in sorted(vws):
            ranks = self.vw_ranks[k]
            if k in self.lost:
                gone.update(ranks)
                continue
            rank, why = self._culprit(ranks, errors)
            cause = f"rank {rank} ({self.labels[rank]}) failed: {why}"
            for r in ranks:  # SIGKILL: a frozen (SIGSTOPped) process ignores SIGTERM
                if self.procs[r].is_alive():
                    self.procs[r].kill()
            if self.restart is not None and self.restart(k, cause):
                continue  # new processes in the same ranks: nothing is gone
            self.lost[k] = cause
            log.warning("vw %d lost, the others go on: %s", k, cause)
            gone.update(ranks)
        return None if len(self.lost) >= len(self.vw_ranks) else gone

    def _shard_died(self, vw_of: Mapping[int, int], errors: dict[int, str]) -> bool:
        """Whether a shard died: at once when one did, else, when the stages' failures are
        all consequences (no stage killed by a signal, every error a lost connection or a
        timeout), after waiting up to ``grace_s`` for a shard's exit code to show."""
        shards = [r for r in self.procs if r not in vw_of]
        deadline = time.monotonic() + self.grace_s
        while True:
            if any(self.procs[r].exitcode not in (None, 0) for r in shards):
                return True
            vws = {vw_of[r] for r in errors}
            killed = any((self.procs[r].exitcode or 0) < 0 for r in vw_of if vw_of[r] in vws)
            primary = [m for m in errors.values() if m != "died" and not _secondary(m)]
            if killed or primary or time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # polls the shards' exit codes until the deadline

    def _culprit(self, ranks: tuple[int, ...], errors: dict[int, str]) -> tuple[int, str]:
        """The rank of the VW that caused the failure: one that is frozen, else one whose
        error is not a consequence of another's, else one that died without reporting (a
        neighbour's "connection closed" can arrive before the launcher learns of the death:
        up to ``grace_s`` is given for that), else the lowest rank that reported."""
        frozen = [r for r in ranks if "frozen" in errors.get(r, "")]
        if frozen:
            return frozen[0], errors[frozen[0]]
        mine = {r: m for r, m in errors.items() if r in ranks and m != "died"}
        primary = [r for r, m in mine.items() if not _secondary(m)]
        if primary:
            return min(primary), mine[min(primary)]
        deadline = time.monotonic() + self.grace_s
        while True:
            for r in ranks:
                code = self.procs[r].exitcode
                if code not in (None, 0) and r not in mine:
                    how = f"exited with code {code}"
                    return r, f"killed by signal {signal.Signals(-code).name}" if code < 0 else how
            if time.monotonic() > deadline or not mine:
                break
            time.sleep(0.05)  # polls the exit codes until the deadline
        r = min(mine) if mine else min(r for r in errors if r in ranks)
        return r, errors[r]


def _secondary(message: str) -> bool:
    """Whether an error is a consequence of another rank's failure (a lost connection, a
    timeout), not a cause."""
    return any(s in message for s in SECONDARY)
