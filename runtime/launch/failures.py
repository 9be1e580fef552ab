"""Blaming the right process when a multi-process run fails, and leaving nothing behind.

When one rank dies, its peers fail soon after with broken connections or timeouts. The
launchers (one VW, many VWs, the DDP baseline) all collect failures for a short grace period
and blame the first *cause*, never a peer that only saw the consequence. A rank that is
alive but frozen (``SIGSTOP``, a wedged machine) is found by its missing heartbeats
(:class:`Heartbeats`) before its peers time out.

No orphans: every child dies with its parent (``PR_SET_PDEATHSIG`` on Linux) and also polls
the launcher, which it treats as gone once it is dead *or a zombie* (a killed launcher whose
own parent does not reap it). The launcher's rendezvous folder carries its pid
(``hetpipe-rdzv-<pid>-*``); folders of dead launchers are removed by the next launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from profiler.errors import HetPipeRuntimeError

__all__ = [
    "GRACE_S",
    "SECONDARY",
    "Heartbeats",
    "Interrupted",
    "rendezvous_dir",
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
    frozen: Callable[[], dict[int, str]] | None = None,
    absorb: Callable[[dict[int, str]], set[int] | None] | None = None,
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

    Returns:
        rank -> result payload (as sent), without the absorbed ranks.

    Raises:
        HetPipeRuntimeError: no progress for ``stall_s``; whatever ``fail`` builds.
    """
    results: dict[int, bytes] = {}
    gone: set[int] = set()  # ranks the run goes on without (absorbed failures)
    first_event = last_event = 0.0  # wall times (0 = training not started)
    started = time.time()

    def absorbed(errors: dict[int, str]) -> bool:
        errors = {r: m for r, m in errors.items() if r not in gone}
        if not errors:
            return True
        more = absorb(errors) if absorb is not None else None
        gone.update(more or ())
        return more is not None

    while len(set(results) - gone) < n_results - len(gone):
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
        dead = {
            r: "died" for r, p in procs.items() if p.exitcode not in (None, 0) and r not in results
        }
        if msg is not None and msg[0] in ("result", "shard"):
            results[msg[1]] = msg[2]
        elif msg is not None and msg[0] == "error":
            if not absorbed({msg[1]: str(msg[2])}):
                raise fail({msg[1]: str(msg[2])}, results)
        elif msg is not None:
            on_progress(msg)
        elif dead and not absorbed(dead):
            raise fail({}, results)
        elif frozen is not None and (stuck := frozen()) and not absorbed(stuck):
            raise fail(stuck, results)
    return {r: v for r, v in results.items() if r not in gone}


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


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it died and waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): trust kill(0)
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _watch_parent(parent: int, ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if not _alive(parent) or os.getppid() != ppid:  # never linger as an orphan
            os._exit(3)


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class Interrupted(HetPipeRuntimeError):
    """The user stopped the run (Ctrl-C): never restarted by ``--on-failure restart``."""


class Heartbeats:
    """Liveness of the ranks of one launch: each rank touches ``beat-<rank>`` in the
    rendezvous folder every ``period_s`` (a thread started by :func:`run_rank`); the launcher
    calls :meth:`frozen` to find ranks whose file went stale (stopped, frozen, wedged).

    Args:
        directory: the rendezvous folder (``None``: no heartbeats, e.g. under torchrun).
        stale_s: a rank that has not beaten for this long (s) is frozen.
        labels: rank -> description for the message.
    """

    period_s = 0.5

    def __init__(self, directory: Path | None, stale_s: float, labels: Mapping[int, str]) -> None:
        self.directory, self.stale_s, self.labels = directory, stale_s, dict(labels)

    @staticmethod
    def path(directory: Path, rank: int) -> Path:
        """The heartbeat file of ``rank``."""
        return directory / f"beat-{rank}"

    def frozen(self) -> dict[int, str]:
        """rank -> message, for every rank that beat once and then stopped for ``stale_s``."""
        if self.directory is None:
            return {}
        now, out = time.time(), {}
        for rank in self.labels:
            try:
                age = now - self.path(self.directory, rank).stat().st_mtime
            except OSError:
                continue  # not started yet, or finished
            if age > self.stale_s:
                out[rank] = (
                    f"frozen: no heartbeat for {age:.0f} s (stopped, e.g. SIGSTOP, or wedged)"
                )
        return out


def _beat(path: Path) -> None:
    while True:
        try:
            path.touch()
        except OSError:
            return  # the launcher removed its folder: the run is over
        time.sleep(Heartbeats.period_s)


def _dead_forkserver_dir(d: Path) -> bool:
    """Whether ``d`` (a ``pymp-*`` folder) holds only forkserver sockets nobody listens on
    any more (its launcher was killed before it could remove it). Linux only."""
    try:
        entries = list(d.iterdir())
        bound = Path("/proc/net/unix").read_text()
    except OSError:
        return False
    return bool(entries) and all(
        e.name.startswith("listener-") and e.is_socket() and f" {e}\n" not in bound for e in entries
    )


def _sweep_temp(base: Path) -> None:
    """Remove what killed launchers left in the temp folder: their rendezvous folders (their
    pid is dead) and their multiprocessing ``pymp-*`` folders (forkserver socket unbound)."""
    uid = os.getuid()
    for d in base.glob("hetpipe-rdzv-*-*"):
        pid = d.name.split("-")[2]
        with contextlib.suppress(OSError):
            if pid.isdigit() and d.stat().st_uid == uid and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
    for d in base.glob("pymp-*"):
        with contextlib.suppress(OSError):
            if d.stat().st_uid == uid and _dead_forkserver_dir(d):
                shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def rendezvous_dir() -> Iterator[Path]:
    """A fresh ``hetpipe-rdzv-<pid>-*`` temp folder for one launch, removed on exit; first
    removes what launchers killed by SIGKILL left behind (:func:`_sweep_temp`)."""
    base = Path(tempfile.gettempdir())
    _sweep_temp(base)
    tmp = Path(tempfile.mkdtemp(prefix=f"hetpipe-rdzv-{os.getpid()}-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops every rank
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("HETPIPE_DEBUG") else level,
        format=f"%(asctime)s [{where}] %(levelname)s %(message)s",
        force=True,
    )
    threading.Thread(target=_watch_parent, args=(parent, os.getppid()), daemon=True).start()
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
    join: bool = True,
) -> NoReturn:
    """The life of one spawned rank after :func:`setup_child`, then exit (code 0 or 1).

    Joins the process group (gloo, or ``backend``; every operation times out after ``timeout_s``), runs
    ``body`` and posts its ``(kind, payload)`` as ``(kind, rank, payload)`` on ``events``; if
    anything fails (also ``KeyboardInterrupt``), posts ``("error", rank, "Type: message
    (file:line)")`` instead, for the launcher's :func:`watch`. ``join=False``: ``body`` builds
    its own groups (a restarted VW's rank, :mod:`runtime.launch.restart_vw`).
    """
    import torch.distributed as dist

    if init_method.startswith("file://"):  # one host: heartbeats beside the rendezvous file
        beat = Heartbeats.path(Path(init_method.removeprefix("file://")).parent, rank)
        threading.Thread(target=_beat, args=(beat,), daemon=True, name="heartbeat").start()
    code = 0
    try:
        if join:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )  # fmt: skip
        try:
            kind, payload = body()
            events.put((kind, rank, payload))
        finally:
            if join:
                dist.destroy_process_group()
    except BaseException as exc:  # report anything to the launcher
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        loc = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
        events.put(("error", rank, f"{type(exc).__name__}: {exc}{loc}"))
        code = 1
    events.close()
    events.join_thread()
    sys.exit(code)
