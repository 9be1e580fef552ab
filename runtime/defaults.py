"""Run defaults shared by every way to start a run (``hetpipe run``, ``hetpipe.train``,
``python -m runtime`` under torchrun). Plain numbers, no imports: the CLI reads them at start-up
without loading torch."""

from __future__ import annotations

__all__ = ["CHECKPOINT_EVERY", "TIMEOUT_S"]

TIMEOUT_S = 30.0
"""Seconds before a stuck process-group operation fails (every rank, every launcher)."""

CHECKPOINT_EVERY = 5
"""Snapshot period of a run with an out dir, in global clocks (the command lines' default; the
Python API checkpoints only when asked)."""
