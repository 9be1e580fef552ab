"""Atomic file writes: the one helper every package uses to write a file that must never be
seen half-written (plans, profiles, link tables, traces, checkpoints, rank results).

It lives in the lowest package so that planner, runtime and the CLI can all use it; it imports
nothing heavy (no torch, no pandas), so loading a plan stays cheap.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text"]


def atomic_write_bytes(path: Path, data: bytes, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``:
    a reader sees the old file or the whole new one, never a part.

    Args:
        path: the destination (its folder is created).
        data: the bytes.
        durable: also ``fsync`` the file and its folder, so the new file survives a power loss
            or a killed machine (checkpoints); off for files that can be made again.

    Raises:
        OSError: the write failed (the temporary file is removed; ``path`` is untouched).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def atomic_write_text(path: Path, text: str, durable: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable)
