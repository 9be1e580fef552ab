"""``--on-failure restart`` of one VW: its stages start again, the other VWs go on.

When a stage of VW ``k`` dies or freezes, the launcher's evictor
(:class:`runtime.launch.evict.VWEvictor`) stops the VW's other stages and asks
:class:`VWRestarter`; the shards meanwhile agree on the VW's cut and drop its buffered pushes
from there once, exactly as ``--on-failure continue`` does, but keep waiting for the VW at
that wave (:mod:`runtime.ps.readmit`). While the restart budget lasts, the restarter tells the
shards ``restart`` (:mod:`runtime.ps.rejoin`) and starts every stage of ``k`` again as
incarnation ``n`` (:func:`rejoin_main`, same ranks): each new process waits for the cut
the shards publish, builds incarnation ``n``'s group, pulls the global weights at that
clock and trains the VW's minibatches from there (its data position is the cut times
``Nm``, so no minibatch is applied twice and none is skipped: the discarded waves are
trained again). Once the budget is spent it tells the shards ``release``: the VW stays
evicted at its cut, as with ``continue``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiler.errors import HetPipeRuntimeError
from runtime.launch.child import run_rank, setup_child
from runtime.launch.liveness import Heartbeats
from runtime.launch.procs import dumps_result
from runtime.ps.rejoin import RELEASE, RESTART, Rejoin
from runtime.stage.job import StageJob
from runtime.stage.worker import StageWorker

__all__ = ["AttemptFailed", "Restart", "VWRestarter", "rejoin_main", "rejoined_job"]

log = logging.getLogger(__name__)


class AttemptFailed(HetPipeRuntimeError):
    """An attempt failed (same message) after restarting single VWs: ``survived`` names those
    restarts, for the summary of the whole-job restart that follows."""

    def __init__(self, message: str, survived: Sequence[str]) -> None:
        super().__init__(message)
        self.survived = tuple(survived)


@dataclass(frozen=True)
class Restart:
    """One VW restarted during an attempt: ``vw``, its new ``incarnation``, the ``cause``."""

    vw: int
    incarnation: int
    cause: str


def rejoined_job(job: StageJob, wave: int) -> StageJob:
    """``job`` for a restarted VW's stage starting at ``wave``: the same last wave, its data
    going on at ``wave * Nm``; a test fault only if it repeats (:class:`runtime.faults.StageFault`)."""
    nm = job.ctx.nm
    last = job.sync.first_wave + job.ctx.total_steps // nm
    ctx = dataclasses.replace(job.ctx, total_steps=max(0, last - wave) * nm)
    sync = dataclasses.replace(job.sync, first_wave=wave, rejoined=True)
    fault = job.fault if job.fault is not None and job.fault.repeat else None
    return dataclasses.replace(job, ctx=ctx, sync=sync, fault=fault)


def rejoin_main(job: StageJob, rejoin: Rejoin, inc: int, events: Any, parent: int) -> None:
    """Entry point of a restarted VW's stage process (incarnation ``inc``)."""
    setup_child(job.ctx.where, parent, quiet_threads=True)
    ctx = job.ctx

    def body() -> tuple[str, bytes]:
        if job.fault is not None and job.fault.rejoin_delay_s > 0:
            time.sleep(job.fault.rejoin_delay_s)  # test hook: a slow restart
        store = rejoin.store()
        wave = int(rejoin.wait(store, Rejoin.wave_key(ctx.vw, inc)))
        log.warning("incarnation %d of vw %d starts at wave %d", inc, ctx.vw, wave)
        if ctx.stage == 0:  # the progress bar: the VW's minibatches kept before its cut
            events.put(("rejoined", ctx.rank, (wave - job.sync.first_wave) * ctx.nm))
        events.put(("incarnation", ctx.rank, inc, wave * ctx.nm))  # metrics.csv: rows number on
        group = rejoin.group(store, ctx.vw, inc, ctx.rank)
        worker = StageWorker(rejoined_job(job, wave), events, group)
        return "result", dumps_result(worker.run())

    run_rank(ctx.rank, events, job.init_method, job.world_size, job.run.timeout_s, body,
             join=False)  # fmt: skip


@dataclass
class VWRestarter:
    """The ``restart`` hook of :class:`runtime.launch.evict.VWEvictor`.

    Attributes:
        jobs: VW id -> its stages' jobs (as first launched).
        rejoin: the rendezvous of restarted VWs (shared with the shards).
        budget: restarts allowed in this attempt (``--max-restarts``).
        spawn: ``(job, incarnation) -> process``: start a restarted stage (its report channel
            replaces the old process's).
        procs: rank -> process, updated in place with the new processes.
        beats: the heartbeat folder (the old processes' files are removed), or ``None``.
        restarted: the restarts made, oldest first.
    """

    jobs: Mapping[int, tuple[StageJob, ...]]
    rejoin: Rejoin
    budget: int
    spawn: Callable[[StageJob, int], Any]
    procs: MutableMapping[int, Any]
    beats: Path | None = None
    restarted: list[Restart] = field(default_factory=list)
    _incs: dict[int, int] = field(default_factory=dict)
    _store: Any = None

    def __call__(self, vw: int, cause: str) -> bool:
        """VW ``vw`` failed (its processes are being killed): restart it if the budget
        allows (tells the shards either way); whether it was restarted."""
        inc = self._incs[vw] = self._incs.get(vw, 0) + 1
        if self._store is None:
            self._store = self.rejoin.store()
        key = Rejoin.decision_key(vw, inc)
        if len(self.restarted) >= self.budget:
            self._store.set(key, RELEASE)
            log.warning("vw %d not restarted: the %d restarts allowed are spent", vw, self.budget)
            return False
        for job in self.jobs[vw]:
            self.procs[job.ctx.rank].join(5.0)  # reap the killed process
            if self.beats is not None:
                Heartbeats.path(self.beats, job.ctx.rank).unlink(missing_ok=True)
        self._store.set(key, RESTART)
        for job in self.jobs[vw]:
            self.procs[job.ctx.rank] = self.spawn(job, inc)
        self.restarted.append(Restart(vw, inc, cause))
        log.warning("vw %d restarted (incarnation %d, restart %d of %d) after: %s",
                    vw, inc, len(self.restarted), self.budget, cause)  # fmt: skip
        return True

    def release(self, vw: int) -> None:
        """VW ``vw`` was lost at start-up (:mod:`runtime.launch.startup`): tell the shards,
        before they reopen it at wave 0, that it is not restarted (it stays evicted)."""
        inc = self._incs[vw] = self._incs.get(vw, 0) + 1
        if self._store is None:
            self._store = self.rejoin.store()
        self._store.set(Rejoin.decision_key(vw, inc), RELEASE)

    def notes(self) -> list[str]:
        """One line per restart made, with the wave the shards published for it (``?``: not
        yet), for an attempt that failed later (its shards' states are lost)."""
        out = []
        for r in self.restarted:
            key = Rejoin.wave_key(r.vw, r.incarnation)
            known = self._store is not None and self._store.check([key])
            wave = self._store.get(key).decode() if known else "?"
            out.append(f"{r.cause} (vw {r.vw} restarted alone at wave {wave})")
        return out
