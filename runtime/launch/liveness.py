"""Liveness of a launch's ranks and of launchers: heartbeats, rendezvous folders, leftovers.

A rank that is alive but frozen (``SIGSTOP``, a wedged machine) is found by its missing
heartbeats (:class:`Heartbeats`) before its peers time out. The launcher's rendezvous folder
carries its pid (``hetpipe-rdzv-<pid>-*``); folders of dead launchers (with the node card
files of :mod:`runtime.send_queues` in them) are removed by the next launch
(:func:`rendezvous_dir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["Heartbeats", "alive", "keep_beating", "rendezvous_dir"]


def alive(pid: int) -> bool:
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


class Heartbeats:
    """Liveness of the ranks of one launch: each rank touches ``beat-<rank>`` in the
    rendezvous folder every ``period_s`` (a thread started by
    :func:`runtime.launch.child.run_rank`); the launcher
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


def keep_beating(path: Path) -> None:
    """A rank's heartbeat thread: touch ``path`` every ``period_s`` until its folder is gone."""
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


STALE_AFTER_S = 5.0
"""A rendezvous folder younger than this (s, by its mtime) is never removed, whatever its pid
says (a launcher in another pid namespace sharing the temp folder looks dead from here)."""


def _dead_launchers_dir(d: Path, uid: int, now_s: float) -> bool:
    """Whether ``d`` (a ``hetpipe-rdzv-<pid>-*`` name) is a rendezvous folder a dead launcher
    left: a folder itself (a link is never followed), ours, older than
    :data:`STALE_AFTER_S`, and its launcher's pid no longer runs."""
    pid = d.name.split("-")[2]
    try:
        st = d.lstat()
    except OSError:
        return False  # gone: another launch reaped it meanwhile
    return (
        pid.isdigit()
        and stat.S_ISDIR(st.st_mode)
        and st.st_uid == uid
        and now_s - st.st_mtime > STALE_AFTER_S
        and not alive(int(pid))
    )


def _sweep_temp(base: Path) -> None:
    """Remove what killed launchers left in the temp folder: their rendezvous folders
    (:func:`_dead_launchers_dir`) and their multiprocessing ``pymp-*`` folders (forkserver
    socket unbound). Another launch may sweep at the same time: what it removed first is
    skipped."""
    uid, now = os.getuid(), time.time()
    for d in base.glob("hetpipe-rdzv-*-*"):
        if _dead_launchers_dir(d, uid, now):
            shutil.rmtree(d, ignore_errors=True)  # never follows links inside either
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
