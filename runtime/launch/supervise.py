"""Start a run's processes on this host, watch them, collect their results (every rule).

The first process that raises or dies ends the whole run: the others are terminated (then
killed), no process is left behind, and a :class:`HetPipeRuntimeError` names the root cause
(rank, role, error; not the peers that only lost their connection to it), within seconds; a
frozen rank is found by its missing heartbeats. Each child also exits on its own when the
launcher disappears, and every process-group operation has a timeout
(:mod:`runtime.launch.failures`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from profiler.errors import HetPipeRuntimeError
from runtime.by_value import fileless_main_hidden, shipped
from runtime.config import RunConfig
from runtime.defaults import neighbour_wait_s
from runtime.launch.evict import VWEvictor
from runtime.launch.failures import (
    Interrupted,
    diverged,
    reported,
    root_cause_rank,
    stop_all,
    watch,
)
from runtime.launch.liveness import Heartbeats
from runtime.launch.procs import (
    ShardJob,
    absent_main,
    loads_result,
    process_context,
    shard_main,
    stage_main,
)
from runtime.launch.reports import Reports
from runtime.launch.restart_vw import AttemptFailed, Restart, VWRestarter, rejoin_main
from runtime.launch.startup import ABSENT, JOINED, StartUp, StartUpLoss
from runtime.persist.checkpoint import ShardState
from runtime.ps.outcome import ClockEvent
from runtime.results.metrics import ProgressBar, StageResult
from runtime.results.metrics_log import MetricsLog, RankRole, metrics_paths, start_log
from runtime.stage.job import StageJob
from runtime.stage.nonfinite import Diverged

__all__ = ["spawn_and_watch"]

ShardOutcome = tuple[ShardState, list[ClockEvent]]


def spawn_and_watch(
    shards: Sequence[ShardJob],
    stages: Sequence[StageJob],
    run: RunConfig,
    progress_total: int,
    hint: str = "",
    evict: bool = False,
    restarts: int = 0,
    absent: Mapping[int, str] | None = None,
) -> tuple[list[StageResult], list[ShardOutcome], dict[int, str], list[Restart]]:
    """Start every process, watch them, return the stage results, the shards' final states,
    the VWs lost (``--on-failure continue``: VW -> cause; empty otherwise) and the VWs
    restarted (``--on-failure restart``).

    Args:
        shards: the shard processes' jobs (none for a rule without shards).
        stages: the stage processes' jobs (one rendezvous, ``stages[0].init_method``).
        run: run settings (timeout, progress bar).
        progress_total: minibatches the progress bar counts to (every VW's).
        hint: appended to a failure's message (``; resume with: ...``).
        evict: ``--on-failure continue``: a failed VW is stopped and the others go on
            (:class:`runtime.launch.evict.VWEvictor`); a failed shard still ends the run.
        restarts: with ``evict`` and shards that readmit VWs (``ShardJob.rejoin``): a failed
            VW's stages are started again, at most this many times in all
            (:class:`runtime.launch.restart_vw.VWRestarter`); then failed VWs are evicted.
        absent: with ``evict``: VWs lost at start-up by an earlier attempt (VW -> cause):
            their stages only hold their ranks while the group forms
            (:func:`runtime.launch.procs.absent_main`), the shards evict them at wave 0.

    Raises:
        HetPipeRuntimeError: a process failed, died, froze or stalled (names it).
        StartUpLoss: with ``evict``, a stage was lost before the group formed
            (:mod:`runtime.launch.startup`).
        Interrupted: Ctrl-C (every process is stopped).
    """
    mpc = process_context()
    events = Reports(mpc)  # one pipe per child: a killed child cannot block the others' reports
    procs: dict[int, Any] = {}
    progress = ProgressBar(run.progress, progress_total, stages[0].ctx.batch_size)
    metrics = _metrics_log(run, stages)
    labels = {s.rank: s.where for s in shards} | {j.ctx.rank: j.ctx.where for j in stages}
    restarter: VWRestarter | None = None
    try:
        _start_shards(mpc, events, shards, procs)
        absent = dict(absent or {}) if evict else {}
        start = _stage_starter(mpc, events, procs)
        for job in stages:
            start(job, absent_main if job.ctx.vw in absent else stage_main)
        rendezvous = Path(stages[0].init_method.removeprefix("file://")).parent
        beats = Heartbeats(rendezvous, max(5.0, run.timeout_s / 2), labels)
        if evict:
            restarter = _restarter(shards, stages, events, start, restarts, procs, rendezvous)
            for k in absent:  # the shards reopen nothing for it: it stays out
                if restarter is not None:
                    restarter.release(k)
        evictor = _evictor(stages, procs, labels, restarter, absent) if evict else None
        without = {j.ctx.rank for j in stages if j.ctx.vw in absent}
        on_event = progress.event if metrics is None else _both(progress.event, metrics.event)
        results = _watch(labels, procs, events, on_event, run, beats, hint, evictor, without)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted (Ctrl-C): every process stopped{hint}") from None
    except HetPipeRuntimeError as exc:  # the VWs restarted before count as failures survived
        if restarter is None or not restarter.restarted or isinstance(exc, Diverged):
            raise
        raise AttemptFailed(str(exc), restarter.notes()) from exc
    finally:
        progress.stop()
        stop_all(procs)
        events.close()
    stage_results = [r for r in results if isinstance(r, StageResult)]
    states = [r for r in results if not isinstance(r, StageResult)]
    lost = dict(evictor.lost) if evictor is not None else {}
    return stage_results, states, lost, restarter.restarted if restarter is not None else []


def _start_shards(
    mpc: Any, events: Reports, shards: Sequence[ShardJob], procs: dict[int, Any]
) -> None:
    """Start the shard processes into ``procs`` (rank -> process)."""
    for sh in shards:
        with ctrl_c_deferred(), fileless_main_hidden():
            channel, writer = events.channel()
            p = mpc.Process(target=shard_main, args=(shipped(sh), channel, os.getpid()),
                            name=f"hetpipe-shard{sh.spec.id}")  # fmt: skip
            p.start()
            events.started(writer)
            procs[sh.rank] = p  # only started processes: stop_all joins them


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends: a process is started *and* entered in the
    launcher's table, or neither.

    A ``KeyboardInterrupt`` between ``Process.start()`` and the table entry leaves a running
    child that nobody stops, and at exit ``multiprocessing`` joins its non-daemon children: the
    launcher waits for a child that waits for the launcher. (In one CI run a Ctrl-C'd run went
    on for over 60 s; this window is the explanation found, not a proven one.) A Ctrl-C during
    the block is recorded and raised again right after it. Python
    runs signal handlers in the main thread only, so only there is it held (a thread mask
    would not do: the kernel hands the signal to any other thread that does not block it).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # now handled as it would have been


def _stage_starter(mpc: Any, events: Reports, procs: dict[int, Any]) -> Callable[..., Any]:
    """``start(job, target, *args)``: a started stage process running ``target`` for ``job``,
    entered in ``procs`` (rank -> process) before Ctrl-C can interrupt."""

    def start(job: StageJob, target: Any, *args: Any) -> Any:
        with ctrl_c_deferred(), fileless_main_hidden():
            channel, writer = events.channel(job.ctx.rank)
            p = mpc.Process(target=target, args=(shipped(job), *args, channel, os.getpid()),
                            name=f"hetpipe-vw{job.ctx.vw}-stage{job.ctx.stage}")  # fmt: skip
            p.start()
            events.started(writer)
            procs[job.ctx.rank] = p
        return p

    return start


def _restarter(
    shards: Sequence[ShardJob],
    stages: Sequence[StageJob],
    events: Reports,
    start: Callable[..., Any],
    restarts: int,
    procs: dict[int, Any],
    rendezvous: Path,
) -> VWRestarter | None:
    """The restarter of failed VWs when the shards readmit them (``ShardJob.rejoin``); a
    restarted stage process runs :func:`rejoin_main` (``None``: the shards do not)."""
    rejoin = shards[0].rejoin if shards else None
    if rejoin is None:
        return None

    def respawn(job: StageJob, inc: int) -> Any:
        events.drop(job.ctx.rank)  # the old process's reports are stale
        return start(job, rejoin_main, rejoin, inc)

    return VWRestarter(_by_vw(stages), rejoin, restarts, respawn, procs, rendezvous)


def _by_vw(stages: Sequence[StageJob]) -> dict[int, tuple[StageJob, ...]]:
    """VW id -> its stages' jobs."""
    out: dict[int, tuple[StageJob, ...]] = {}
    for j in stages:
        out[j.ctx.vw] = (*out.get(j.ctx.vw, ()), j)
    return out


def _evictor(
    stages: Sequence[StageJob],
    procs: dict[int, Any],
    labels: dict[int, str],
    restarter: VWRestarter | None = None,
    absent: Mapping[int, str] | None = None,
) -> VWEvictor:
    """The ``--on-failure continue`` policy over the VWs of ``stages`` (restarting them
    while the budget lasts with ``restarter``; the ``absent`` ones lost already)."""
    vw_ranks = {k: tuple(j.ctx.rank for j in jobs) for k, jobs in _by_vw(stages).items()}
    return VWEvictor(vw_ranks, procs, labels, dict(absent or {}), restart=restarter)


def _metrics_log(run: RunConfig, stages: Sequence[StageJob]) -> MetricsLog | None:
    """With ``--out``: the attempt's ``metrics.csv`` rows, appended as the stages report
    (:mod:`runtime.results.metrics_log`)."""
    if run.out_dir is None or not stages:
        return None
    roles = [
        RankRole(j.ctx.rank, j.ctx.vw, j.ctx.stage == 0, j.ctx.stage == j.ctx.n_stages - 1,
                 j.first_mb, j.ctx.batch_size)
        for j in stages
    ]  # fmt: skip
    vws = sorted({j.ctx.vw for j in stages})
    alone = stages[0].sync.layout == "alone" and len(vws) == 1
    return start_log(metrics_paths(run.out_dir, vws, alone), roles)


def _both(
    first: Callable[[tuple[Any, ...]], None], second: Callable[[tuple[Any, ...]], None]
) -> Callable[[tuple[Any, ...]], None]:
    """One event hook calling ``first`` then ``second``."""

    def both(msg: tuple[Any, ...]) -> None:
        first(msg)
        second(msg)

    return both


def _watch(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    on_event: Callable[[tuple[Any, ...]], None],
    run: RunConfig,
    beats: Heartbeats,
    hint: str,
    evictor: VWEvictor | None = None,
    without: set[int] | None = None,
) -> list[Any]:
    """Every process's result, in rank order (none from the ranks ``without``: an absent
    VW's). Before every rank joined the group, a failure is never absorbed: with an
    ``evictor`` a lost stage raises :class:`StartUpLoss` (:mod:`runtime.launch.startup`)."""
    startup = StartUp.of(labels)
    vw_of = {r: k for k, ranks in (evictor.vw_ranks if evictor else {}).items() for r in ranks}

    def frozen() -> dict[int, str]:  # an exited rank's beat file is stale, it is not frozen
        return {r: m for r, m in beats.frozen().items() if procs[r].exitcode is None}

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        stuck = frozen()  # a frozen rank is the cause of its peers' timeouts
        rank = min(stuck) if stuck else root_cause_rank(procs, events, errors, done, grace_s=1.5)
        why = stuck.get(rank) or errors[rank]
        if diverged(why):  # not a crash: the launcher names the snapshot, never restarts
            return Diverged(reported(why))
        cause = f"rank {rank} ({labels[rank]}) failed: {why}"
        if not startup.formed and rank in vw_of:
            return StartUpLoss(f"{cause} (before every rank joined){hint}", vw_of[rank], cause)
        return HetPipeRuntimeError(f"{cause}{hint}")

    def event(msg: tuple[Any, ...]) -> None:
        if msg[0] == JOINED:
            startup.joined(int(msg[1]))
        elif msg[0] != ABSENT:  # an absent VW's stage leaving: nothing to count
            on_event(msg)

    def absorb(errors: dict[int, str]) -> set[int] | None:
        return evictor(errors) if evictor is not None and startup.formed else None

    stall_s = max(120.0, neighbour_wait_s(run.timeout_s))  # a VW may wait on another's restart
    results = watch(procs, events, len(labels), event, fail, stall_s, frozen=frozen,
                    absorb=absorb, without=without)  # fmt: skip
    return [loads_result(results[r]) for r in sorted(results)]
