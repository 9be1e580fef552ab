"""The life of one spawned rank: set-up, no orphans, the process group, the report.

No orphans: every child dies with its parent (``PR_SET_PDEATHSIG`` on Linux) and also polls
the launcher, which it treats as gone once it is dead *or a zombie* (a killed launcher whose
own parent does not reap it). A failure is posted to the launcher's :func:`watch
<runtime.launch.failures.watch>` as ``("error", rank, "Type: message (file:line)")``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from runtime.launch.liveness import Heartbeats, alive, keep_beating

__all__ = ["die_with_parent", "proc_name", "run_rank", "setup_child"]


def _watch_parent(parent: int, ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if not alive(parent) or os.getppid() != ppid:  # never linger as an orphan
            os._exit(3)


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def proc_name(where: str) -> str:
    """The rank's short process name (``/proc/<pid>/comm``, 15 bytes): its role, so that ``ps``
    and the soak's memory sampler (``benchmarks/bench_soak.py``) tell a restarted rank's new pid
    by role.

    >>> proc_name("vw 1 | stage 2 | rank 5")
    'hp vw1 s2'
    >>> proc_name("shard 0 | rank 0 | node A")
    'hp shard0'
    """
    fields = dict(part.strip().split(" ", 1) for part in where.split("|") if " " in part.strip())
    if "shard" in fields:
        return f"hp shard{fields['shard']}"[:15]
    return f"hp vw{fields.get('vw', '?')} s{fields.get('stage', '?')}"[:15]


def _set_proc_name(name: str) -> None:
    """Linux: set ``/proc/self/comm`` (``PR_SET_NAME``); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME


def _quiet_thread_error(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(__name__).debug(
        "thread %s ended with %s: %s", name, args.exc_type.__name__, args.exc_value
    )


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock before torch.fx's ``Interpreter`` opens its first bar.

    tqdm otherwise creates a ``multiprocessing.RLock``, a named semaphore registered with the
    launcher's resource tracker; a rank does not unlink it on its way out, and the launcher
    printed ``resource_tracker: There appear to be N leaked semaphore objects`` at the end of
    every run, one per rank. tqdm is optional (torch falls back to a stub without it).
    """
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


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

    die_with_parent()
    _set_proc_name(proc_name(where))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops every rank
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("HETPIPE_DEBUG") else level,
        format=f"%(asctime)s [{where}] %(levelname)s %(message)s",
        force=True,
    )
    threading.Thread(target=_watch_parent, args=(parent, os.getppid()), daemon=True).start()
    _thread_lock_for_tqdm()
    if quiet_threads:
        threading.excepthook = _quiet_thread_error


def _attempt_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    """Under torchrun (``env://`` with ``TORCHELASTIC_RESTART_COUNT``): the rendezvous store
    with a prefix per restart of the worker group. torchrun's agent keeps one store for every
    restart, so without it a restarted rank reads the dead group's addresses (gloo: "connection
    refused") and its stop wave. ``None``: use ``init_method`` as it is."""
    from torch._C._distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    restart = os.environ.get("HETPIPE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    if init_method != "env://" or restart is None:  # HETPIPE_ATTEMPT: python -m runtime's count
        return None
    store, _, _ = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    return PrefixStore(f"hetpipe/attempt-{restart}/", store)


def run_rank(
    rank: int,
    events: Any,
    init_method: str,
    world_size: int,
    timeout_s: float,
    body: Callable[[], tuple[str, bytes]],
    backend: str = "gloo",
    join: bool = True,
    hold: Callable[[], None] | None = None,
) -> NoReturn:
    """The life of one spawned rank after :func:`setup_child`, then exit (code 0 or 1).

    Joins the process group (gloo, or ``backend``; every operation times out after ``timeout_s``), runs
    ``body`` and posts its ``(kind, payload)`` as ``(kind, rank, payload)`` on ``events``; if
    anything fails (also ``KeyboardInterrupt``), posts ``("error", rank, "Type: message
    (file:line)")`` instead, for the launcher's :func:`watch`. ``join=False``: ``body`` builds
    its own groups (a restarted VW's rank, :mod:`runtime.launch.restart_vw`). ``hold``: a
    test fault's wait, once the heartbeats run and before the rank joins
    (:class:`runtime.faults.StageFault` ``after_s``).
    """
    import torch.distributed as dist

    if init_method.startswith("file://"):  # one host: heartbeats beside the rendezvous file
        beat = Heartbeats.path(Path(init_method.removeprefix("file://")).parent, rank)
        threading.Thread(target=keep_beating, args=(beat,), daemon=True, name="heartbeat").start()
    code = 0
    try:
        if hold is not None:
            hold()
        if join:
            timeout = timedelta(seconds=timeout_s)
            store = _attempt_store(init_method, rank, world_size, timeout)
            dist.init_process_group(
                backend, init_method=None if store else init_method, store=store, rank=rank,
                world_size=world_size, timeout=timeout,
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
