"""Blaming the right process when a multi-process run fails, and stopping the rest.

When one rank dies, its peers fail soon after with broken connections or timeouts. The
launcher collects failures for a short grace period and blames the first *cause*, never a
peer that only saw the consequence (:func:`root_cause_rank`); :func:`watch` is its one event
loop, :func:`stop_all` stops what is left. A rank's own life (set-up, no orphans, its report)
is :mod:`runtime.launch.child`; heartbeats and rendezvous folders are
:mod:`runtime.launch.liveness`.
"""

from __future__ import annotations

import queue
import re
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from profiler.errors import HetPipeRuntimeError
from runtime.stage.nonfinite import Diverged

__all__ = [
    "GRACE_S",
    "SECONDARY",
    "Interrupted",
    "diverged",
    "reported",
    "root_cause_rank",
    "stop_all",
    "watch",
]

GRACE_S = 3.0  # between SIGTERM and SIGKILL when stopping the other ranks

# Error texts that are consequences of another rank's failure, not causes.
SECONDARY = (
    "receive failed",
    "no message from a neighbour",
    "Connection closed",
    "connection closed",
    "Connection reset",
    "Broken pipe",
    "lost client",
    "did not answer",
    "Timed out",
    "timed out",
    "Wait timeout",  # a store wait for a peer that never came (e.g. lost at start-up)
)


def root_cause_rank(
    procs: Mapping[int, Any],
    events: Any,
    errors: dict[int, str],
    results: Mapping[int, Any],
    grace_s: float = 1.0,
) -> int:
    """Collect failures for ``grace_s`` seconds and return the rank to blame.

    Args:
        procs: rank -> ``multiprocessing.Process``.
        events: queue of ``("error", rank, message)`` (other events are ignored).
        errors: rank -> error message, completed in place (exit codes of dead ranks too).
        results: ranks that finished normally, or that the run already went on without (a
            VW evicted earlier): never blamed for this failure.
        grace_s: how long to wait for the peers' reports.

    Returns:
        The lowest rank whose error is not a consequence of another's; if every error is
        one, the lowest failed rank.
    """
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            msg = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if msg[0] == "error":
            errors.setdefault(msg[1], str(msg[2]))
    for rank, p in procs.items():
        code = p.exitcode
        if rank not in errors and rank not in results and code not in (None, 0):
            errors[rank] = (
                f"killed by signal {signal.Signals(-code).name}"
                if code < 0
                else f"exited with code {code}"
            )
    live = {r: m for r, m in errors.items() if r not in results} or errors
    primary = [r for r, m in live.items() if not any(s in m for s in SECONDARY)]
    return min(primary) if primary else min(live)


def watch(  # long by its docstring (10 arguments, documented); the body is ~40 lines
    procs: Mapping[int, Any],
    events: Any,
    n_results: int,
    on_progress: Callable[[Any], None],
    fail: Callable[[dict[int, str], dict[int, bytes]], BaseException],
    stall_s: float = 120.0,
    tick: Callable[[float], None] | None = None,
    first_event_s: float = 0.0,
    frozen: Callable[[], dict[int, str]] | None = None,
    absorb: Callable[[dict[int, str]], set[int] | None] | None = None,
    without: set[int] | None = None,
) -> dict[int, bytes]:
    """Watch a launcher's children until ``n_results`` of them delivered their result.

    Children put ``("result" | "shard", rank, payload)`` when done, ``("error", rank, text)``
    when they fail, anything else is progress.

    Args:
        procs: rank -> ``multiprocessing.Process``.
        events: the children's event queue.
        n_results: results to collect.
        on_progress: called with every progress event.
        fail: builds the exception to raise from the errors seen so far and the results
            (called on the first error message or the first child that died silently).
        stall_s: raise when no event arrived for this long (s) after the first one.
        tick: called about every 0.2 s with the seconds since the first event (training
            started), once training started (the time limit of a multi-VW run).
        first_event_s: raise when no event at all arrived this long after the call (s); 0 =
            wait for the first one forever (children that report progress, whose start-up
            may be long: their stall clock starts at their first event).
        frozen: returns the ranks that stopped responding (rank -> why), checked every tick;
            any such rank fails the run at once, blamed (:class:`Heartbeats`).
        absorb: given failed ranks (rank -> why), the ranks the run goes on without (it
            stopped them; ``--on-failure continue``; none when it restarted them), or
            ``None``: the run fails.
        without: ranks the run goes on without from the start (an absent VW's: they send no
            result, and their errors are nobody's cause).

    Returns:
        rank -> result payload (as sent), without the absorbed ranks.

    Raises:
        HetPipeRuntimeError: no progress for ``stall_s``; whatever ``fail`` builds.
    """
    results: dict[int, bytes] = {}
    gone = set(without or ())  # ranks the run goes on without (absorbed failures)
    first_event = last_event = 0.0  # wall times (0 = training not started)
    started = time.time()

    def settled() -> dict[int, bytes]:  # finished, or absorbed: not the cause of a new failure
        return {**results, **dict.fromkeys(gone, b"")}

    def absorbed(errors: dict[int, str]) -> bool:
        errors = {r: m for r, m in errors.items() if r not in gone}
        if not errors:
            return True
        more = absorb(errors) if absorb is not None else None
        gone.update(more or ())
        return more is not None

    while len(set(results) - gone) < n_results - len(gone):
        # exit codes before the read: a child that died after reporting its error has its
        # report read first (the cause), and is judged "died" only if it said nothing
        dead = {
            r: "died" for r, p in procs.items() if p.exitcode not in (None, 0) and r not in results
        }
        try:
            msg = events.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            last_event = time.time()
            first_event = first_event or last_event
        else:
            _check_stall(started, last_event, stall_s, first_event_s)
        if tick is not None and first_event:
            tick(time.time() - first_event)
        if msg is not None and msg[0] in ("result", "shard"):
            results[msg[1]] = msg[2]
        elif msg is not None and msg[0] == "error":
            if not absorbed({msg[1]: str(msg[2])}):
                raise fail({msg[1]: str(msg[2])}, settled())
        elif msg is not None:
            on_progress(msg)
        elif dead and not absorbed(dead):
            raise fail({}, settled())
        elif frozen is not None and (stuck := frozen()) and not absorbed(stuck):
            raise fail(stuck, settled())
    return {r: v for r, v in results.items() if r not in gone}


def _check_stall(started: float, last_event: float, stall_s: float, first_event_s: float) -> None:
    """Raise when no event came for ``stall_s`` since the last one, or, before any, for
    ``first_event_s`` since ``started`` (0: no limit) (:func:`watch`).

    Raises:
        HetPipeRuntimeError: the run stalled.
    """
    if last_event and time.time() - last_event > stall_s:
        raise HetPipeRuntimeError(
            f"no progress from any process for {stall_s:.0f} s (one is stuck in a task or "
            "a wait); stopping every rank"
        )
    if first_event_s and not last_event and time.time() - started > first_event_s:
        raise HetPipeRuntimeError(
            f"no progress from any process in the {first_event_s:g} s since the launch "
            "(none reported anything); stopping every rank"
        )


def stop_all(procs: Mapping[int, Any], grace_s: float = GRACE_S) -> None:
    """Terminate every process still running, kill the ones that ignore it, reap all."""
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def diverged(report: str) -> bool:
    """Whether a rank's error report (``Type: message (file:line)``, from
    :func:`runtime.launch.child.run_rank`) says the run diverged
    (:class:`runtime.stage.nonfinite.Diverged`): a cause that a restart would only repeat."""
    return report.startswith(f"{Diverged.__name__}: ")


def reported(report: str) -> str:
    """The message of a rank's error report, without its type and source location."""
    text = report.split(": ", 1)[1] if ": " in report else report
    return re.sub(r" \([\w.]+:\d+\)$", "", text)


class Interrupted(HetPipeRuntimeError):
    """The user stopped the run (Ctrl-C): never restarted by ``--on-failure restart``."""
