"""Blaming the right process when a multi-process run fails.

When one rank dies, its peers fail soon after with broken connections or timeouts. The
launchers (one VW, many VWs, the DDP baseline) all collect failures for a short grace period
and blame the first *cause*, never a peer that only saw the consequence.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["GRACE_S", "SECONDARY", "root_cause_rank", "stop_all"]

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
