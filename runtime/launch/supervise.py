"""Start a run's processes on this host, watch them, collect their results (every rule).

The first process that raises or dies ends the whole run: the others are terminated (then
killed), no process is left behind, and a :class:`HetPipeRuntimeError` names the root cause
(rank, role, error; not the peers that only lost their connection to it), within seconds; a
frozen rank is found by its missing heartbeats. Each child also exits on its own when the
launcher disappears, and every process-group operation has a timeout
(:mod:`runtime.launch.failures`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from profiler.errors import HetPipeRuntimeError
from runtime.config import RunConfig
from runtime.launch.evict import VWEvictor
from runtime.launch.failures import Interrupted, root_cause_rank, stop_all, watch
from runtime.launch.liveness import Heartbeats
from runtime.launch.procs import ShardJob, loads_result, process_context, shard_main, stage_main
from runtime.launch.reports import Reports
from runtime.persist.checkpoint import ShardState
from runtime.ps.outcome import ClockEvent
from runtime.results.metrics import ProgressBar, StageResult
from runtime.stage.job import StageJob

__all__ = ["spawn_and_watch"]

ShardOutcome = tuple[ShardState, list[ClockEvent]]


def spawn_and_watch(
    shards: Sequence[ShardJob],
    stages: Sequence[StageJob],
    run: RunConfig,
    progress_total: int,
    hint: str = "",
    evict: bool = False,
) -> tuple[list[StageResult], list[ShardOutcome], dict[int, str]]:
    """Start every process, watch them, return the stage results, the shards' final states and
    the VWs lost (``--on-failure continue``: VW -> cause; empty otherwise).

    Args:
        shards: the shard processes' jobs (none for a rule without shards).
        stages: the stage processes' jobs (one rendezvous, ``stages[0].init_method``).
        run: run settings (timeout, progress bar).
        progress_total: minibatches the progress bar counts to (every VW's).
        hint: appended to a failure's message (``; resume with: ...``).
        evict: ``--on-failure continue``: a failed VW is stopped and the others go on
            (:class:`runtime.launch.evict.VWEvictor`); a failed shard still ends the run.

    Raises:
        HetPipeRuntimeError: a process failed, died, froze or stalled (names it).
        Interrupted: Ctrl-C (every process is stopped).
    """
    mpc = process_context()
    events = Reports(mpc)  # one pipe per child: a killed child cannot block the others' reports
    procs: dict[int, Any] = {}
    progress = ProgressBar(run.progress, progress_total, stages[0].ctx.batch_size)
    labels = {s.rank: s.where for s in shards} | {j.ctx.rank: j.ctx.where for j in stages}
    try:
        for sh in shards:
            channel, writer = events.channel()
            p = mpc.Process(target=shard_main, args=(sh, channel, os.getpid()),
                            name=f"hetpipe-shard{sh.spec.id}")  # fmt: skip
            p.start()
            events.started(writer)
            procs[sh.rank] = p  # only started processes: stop_all joins them
        for job in stages:
            ctx = job.ctx
            channel, writer = events.channel()
            p = mpc.Process(target=stage_main, args=(job, channel, os.getpid()),
                            name=f"hetpipe-vw{ctx.vw}-stage{ctx.stage}")  # fmt: skip
            p.start()
            events.started(writer)
            procs[ctx.rank] = p
        rendezvous = Path(stages[0].init_method.removeprefix("file://")).parent
        beats = Heartbeats(rendezvous, max(5.0, run.timeout_s / 2), labels)
        evictor = _evictor(stages, procs, labels) if evict else None
        results = _watch(labels, procs, events, progress, run, beats, hint, evictor)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted (Ctrl-C): every process stopped{hint}") from None
    finally:
        progress.stop()
        stop_all(procs)
        events.close()
    stage_results = [r for r in results if isinstance(r, StageResult)]
    states = [r for r in results if not isinstance(r, StageResult)]
    return stage_results, states, dict(evictor.lost) if evictor is not None else {}


def _evictor(
    stages: Sequence[StageJob], procs: dict[int, Any], labels: dict[int, str]
) -> VWEvictor:
    """The ``--on-failure continue`` policy over the VWs of ``stages``."""
    vw_ranks: dict[int, tuple[int, ...]] = {}
    for j in stages:
        vw_ranks[j.ctx.vw] = (*vw_ranks.get(j.ctx.vw, ()), j.ctx.rank)
    return VWEvictor(vw_ranks, procs, labels)


def _watch(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    progress: ProgressBar,
    run: RunConfig,
    beats: Heartbeats,
    hint: str,
    evictor: VWEvictor | None = None,
) -> list[Any]:
    """Every process's result, in rank order."""

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        frozen = beats.frozen()  # a frozen rank is the cause of its peers' timeouts
        rank = min(frozen) if frozen else root_cause_rank(procs, events, errors, done, grace_s=1.5)
        why = frozen.get(rank) or errors[rank]
        return HetPipeRuntimeError(f"rank {rank} ({labels[rank]}) failed: {why}{hint}")

    stall_s = max(120.0, 4 * run.timeout_s)
    results = watch(procs, events, len(labels), progress.event, fail, stall_s,
                    frozen=beats.frozen, absorb=evictor)  # fmt: skip
    return [loads_result(results[r]) for r in sorted(results)]
