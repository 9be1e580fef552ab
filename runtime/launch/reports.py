"""How a launcher's children report to it: one pipe per child, no lock shared between them.

A ``multiprocessing.Queue`` shared by every child serialises their writes with one lock; a
child killed while it holds that lock (``SIGKILL`` during a report: a killed stage, a VW the
launcher evicts with ``--on-failure continue``) blocks every other child's reports for good,
and the run fails with "no progress" instead of going on. Here each child writes to its own
pipe: a child that dies mid-message only cuts its own pipe, which the launcher sees as that
child's end (its exit code names the cause).

The launcher's :class:`Reports` has the ``get(timeout)`` of a queue (what
:func:`runtime.launch.failures.watch` reads); each child gets a :class:`Channel` with the
``put``/``close``/``join_thread`` of one (what :func:`runtime.launch.child.run_rank` and
the stage worker write to).

A stage sends its per-minibatch progress reports (``loss``, ``done``) a wave at a time, as one
``(REPORTS, rank, (report, ...))`` message (:data:`runtime.messages.REPORTS`): each pipe write wakes the launcher up, and on a
loaded machine a wake-up costs the writer about a millisecond, as much as a whole task of a
small model. :meth:`Reports.get` hands the reports inside one by one, in order, so nothing
reading them knows they travelled together.
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from runtime.messages import REPORTS

__all__ = ["Channel", "Reports"]


class Channel:
    """A child's end: ``put`` sends one report (blocks only while the launcher reads it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def put(self, msg: Any) -> None:
        """Send ``msg`` (picklable) to the launcher; if the launcher is gone (the pipe is
        broken: it was killed, or it stopped reading this child), exit at once, quietly: a
        traceback would only say that the launcher is gone, once per rank and thread."""
        try:
            self._conn.send(msg)
        except BrokenPipeError:
            os._exit(3)  # as a rank does when it finds its launcher dead (runtime.launch.child)

    def close(self) -> None:
        """Close this end (the launcher sees the end of this child's reports)."""
        self._conn.close()

    def join_thread(self) -> None:
        """Nothing to wait for: ``put`` has sent every report by the time it returns."""


class Reports:
    """The launcher's end: every child's pipe, read as one queue."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._readers: list[Connection] = []
        self._pending: deque[tuple[Connection, Any]] = deque()
        self._keyed: dict[int, Connection] = {}

    def channel(self, key: int | None = None) -> tuple[Channel, Connection]:
        """A new child's channel, and the launcher's copy of its write end (close it with
        :meth:`started` once the child has started); ``key`` (its rank) allows :meth:`drop`."""
        reader, writer = self._ctx.Pipe(duplex=False)
        self._readers.append(reader)
        if key is not None:
            self._keyed[key] = reader
        return Channel(writer), writer

    def drop(self, key: int) -> None:
        """Forget the child of ``key`` and every report of it not read yet (a restarted
        rank's old process: what it said is stale)."""
        reader = self._keyed.pop(key, None)
        if reader is None:
            return
        self._pending = deque((r, m) for r, m in self._pending if r is not reader)
        if reader in self._readers:
            self._readers.remove(reader)
        reader.close()

    @staticmethod
    def started(writer: Connection) -> None:
        """The child holds its own copy of ``writer`` now: close the launcher's."""
        writer.close()

    def get(self, timeout: float) -> Any:
        """The next report, in arrival order per child.

        Raises:
            queue.Empty: none arrived within ``timeout`` seconds.
        """
        if not self._pending:
            if not self._readers:
                time.sleep(timeout)
                raise queue.Empty
            for ready in wait(self._readers, timeout):
                reader = cast(Connection, ready)  # wait returns some of what it was given
                try:
                    msg = reader.recv()
                except (EOFError, OSError):  # the child closed its end or died mid-report
                    self._readers.remove(reader)
                    reader.close()
                    continue
                if isinstance(msg, tuple) and msg and msg[0] == REPORTS:
                    self._pending.extend((reader, m) for m in msg[2])
                else:
                    self._pending.append((reader, msg))
        if not self._pending:
            raise queue.Empty
        return self._pending.popleft()[1]

    def close(self) -> None:
        """Close every child's pipe."""
        for reader in self._readers:
            reader.close()
        self._readers.clear()
