"""Blaming the right process when a multi-process run fails.

When one rank dies, its peers fail soon after with broken connections or timeouts. The
launchers (one VW, many VWs, the DDP baseline) all collect failures for a short grace period
and blame the first *cause*, never a peer that only saw the consequence.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from profiler.errors import HetPipeRuntimeError

__all__ = [
    "GRACE_S",
    "SECONDARY",
    "root_cause_rank",
    "run_rank",
    "setup_child",
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
        results: ranks that finished normally.
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
    primary = [r for r, m in errors.items() if not any(s in m for s in SECONDARY)]
    return min(primary) if primary else min(errors)


def watch(
    procs: Mapping[int, Any],
    events: Any,
    n_results: int,
    on_progress: Callable[[Any], None],
    fail: Callable[[dict[int, str], dict[int, bytes]], BaseException],
    stall_s: float = 120.0,
    tick: Callable[[float], None] | None = None,
    first_event_s: float = 0.0,
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

    Returns:
        rank -> result payload (as sent).

    Raises:
        HetPipeRuntimeError: no progress for ``stall_s``; whatever ``fail`` builds.
    """
    results: dict[int, bytes] = {}
    first_event = last_event = 0.0  # wall times (0 = training not started)
    started = time.time()
    while len(results) < n_results:
        try:
            msg = events.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            last_event = time.time()
            first_event = first_event or last_event
        elif last_event and time.time() - last_event > stall_s:
            raise HetPipeRuntimeError(
                f"no progress from any process for {stall_s:.0f} s (one is stuck in a task or "
                "a wait); stopping every rank"
            )
        elif first_event_s and not last_event and time.time() - started > first_event_s:
            raise HetPipeRuntimeError(
                f"no progress from any process in the {first_event_s:g} s since the launch "
                "(none reported anything); stopping every rank"
            )
        if tick is not None and first_event:
            tick(time.time() - first_event)
        if msg is not None and msg[0] in ("result", "shard"):
            results[msg[1]] = msg[2]
        elif msg is not None and msg[0] == "error":
            raise fail({msg[1]: str(msg[2])}, results)
        elif msg is not None:
            on_progress(msg)
        elif any(p.exitcode not in (None, 0) and r not in results for r, p in procs.items()):
            raise fail({}, results)
    return results


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


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # the launcher died: never linger as an orphan
            os._exit(3)


def _quiet_thread_error(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(__name__).debug(
        "thread %s ended with %s: %s", name, args.exc_type.__name__, args.exc_value
    )


def setup_child(
    where: str, parent: int, level: int = logging.WARNING, quiet_threads: bool = False
) -> None:
    """First call of every spawned rank: one thread, ``[where]`` log prefix, no orphans.

    Args:
        where: log prefix, e.g. ``vw 1 | stage 0 | rank 3``.
        parent: the launcher's pid; the process exits (code 3) once the launcher is gone.
        level: log level (``HETPIPE_DEBUG`` in the environment turns on debug logging).
        quiet_threads: log helper-thread failures at debug level instead of printing their
            tracebacks (gloo receiver threads fail noisily once the process group is torn down
            after the real error was reported).
    """
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("HETPIPE_DEBUG") else level,
        format=f"%(asctime)s [{where}] %(levelname)s %(message)s",
        force=True,
    )
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if quiet_threads:
        threading.excepthook = _quiet_thread_error


def run_rank(
    rank: int,
    events: Any,
    init_method: str,
    world_size: int,
    timeout_s: float,
    body: Callable[[], tuple[str, bytes]],
    backend: str = "gloo",
) -> NoReturn:
    """The life of one spawned rank after :func:`setup_child`, then exit (code 0 or 1).

    Joins the process group (gloo, or ``backend``; every operation times out after ``timeout_s``), runs
    ``body`` and posts its ``(kind, payload)`` as ``(kind, rank, payload)`` on ``events``; if
    anything fails (also ``KeyboardInterrupt``), posts ``("error", rank, "Type: message
    (file:line)")`` instead, for the launcher's :func:`watch`.
    """
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        try:
            kind, payload = body()
            events.put((kind, rank, payload))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report anything to the launcher
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        loc = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
        events.put(("error", rank, f"{type(exc).__name__}: {exc}{loc}"))
        code = 1
    events.close()
    events.join_thread()
    sys.exit(code)
