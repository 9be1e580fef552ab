"""Run defaults shared by every way to start a run (``hetpipe run``, ``hetpipe.train``,
``python -m runtime`` under torchrun). Plain numbers, no imports: the CLI reads them at start-up
without loading torch."""

from __future__ import annotations

__all__ = ["CHECKPOINT_EVERY", "TIMEOUT_S", "neighbour_wait_s", "vw_wait_s"]

TIMEOUT_S = 30.0
"""Seconds before a stuck process-group operation fails (every rank, every launcher)."""

CHECKPOINT_EVERY = 5
"""Snapshot period of a run with an out dir, in global clocks (the command lines' default; the
Python API checkpoints only when asked)."""


def vw_wait_s(timeout_s: float) -> float:
    """Longest a stage waits for something that waits on *other VWs*: a pull of the global
    clock under WSP (or a backup wave, an elastic exchange). A slower VW's wave, or a lost VW
    being restarted (its new processes wait up to ``4 x timeout`` for their cut, start, then
    train the wave again), is a legitimate wait, not a hang: a dead peer fails at once (its
    connection closes), a frozen one by its heartbeats, so this bound is only a last resort.
    """
    return 8 * timeout_s


def neighbour_wait_s(timeout_s: float) -> float:
    """Longest a stage waits for a message from a neighbour stage of its own VW: the
    neighbour may itself be blocked in a pull (:func:`vw_wait_s`) before it computes."""
    return vw_wait_s(timeout_s) + timeout_s
