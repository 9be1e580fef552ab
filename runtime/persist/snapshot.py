"""One consistent, verified, atomically committed snapshot of a whole job per global clock.

Layout of a checkpoint folder::

    clock-12/
        shard-0.pt  shard-0.json       one part per shard: weights, ledger, server optimizer
        vw0-stage1.pt  vw0-stage1.json one part per stage: optimizer, data position, RNG state
        MANIFEST.json                  written last: run id, clock, settings, every part's
                                       size and sha256

Every process writes its own part (data first, then a small record with its size, sha256 and
the *attempt* that wrote it), each file atomically (:func:`runtime.persist.checkpoint.durable_write_bytes`).
Whichever writer completes the set (every expected part recorded by the current attempt) writes
``MANIFEST.json``, also atomically: a snapshot is **committed** exactly when its manifest
exists, so a crash at any moment leaves either a committed snapshot or an incomplete folder
that is never used. Two writers completing at once write the same manifest.

Retention counts committed snapshots only: after a commit the ``keep`` newest committed
snapshots stay, older ones go, and so do incomplete folders older than the oldest kept one
(never a folder newer than the newest commit: a VW running ahead under ``D > 0`` writes parts
of clocks the others have not reached). Loading verifies sizes and checksums; a corrupt or
incomplete snapshot is named and skipped (:func:`select`).

A VW evicted for good at wave ``c`` (``--on-failure continue``, or a restart budget spent)
writes no more parts: a shard records it once (:func:`leave_out`, a small
``left-out-<attempt>-vw<k>.json`` beside the snapshots), and the snapshots of this attempt
at clocks ``> c`` commit without that VW's stages' parts. A resume from such a snapshot
brings the VW back with fresh optimizer state at that clock (its data of waves ``c`` to the
clock is never trained).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.persist.checkpoint import durable_write_bytes, loads_checkpoint, torch_bytes

__all__ = [
    "MANIFEST",
    "Manifest",
    "SnapshotSpec",
    "WriteFault",
    "clean",
    "committed_clocks",
    "leave_out",
    "load_part",
    "prune",
    "read_manifest",
    "select",
    "snapshot_dir",
    "verify",
    "write_part",
]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "hetpipe-snapshot-1"
_CLOCK_DIR = re.compile(r"^clock-(\d+)$")


@dataclass(frozen=True)
class WriteFault:
    """Test hook: writing part ``part`` (any part when empty) at ``clock`` fails with ``errno``
    as a full disk would, or (``kill``) its writer dies half-way. Passed in
    :class:`SnapshotSpec`, never parsed from a string."""

    clock: int
    part: str = ""
    errno: int = errno.ENOSPC
    kill: bool = False  # instead: SIGKILL the writer after the data file, before its record

    def check(self, clock: int, part: str, path: Path) -> None:
        """Raise the injected ``OSError`` when ``(clock, part)`` matches."""
        if clock == self.clock and self.part in ("", part) and not self.kill:
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected)", str(path))

    def after_data(self, clock: int, part: str) -> None:
        """With ``kill``: die here when ``(clock, part)`` matches (a crash mid-snapshot)."""
        if clock == self.clock and self.part in ("", part) and self.kill:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class SnapshotSpec:
    """What every writer of one run's snapshots shares (pickled into each process).

    Attributes:
        directory: the checkpoint folder.
        run_id: the run the snapshots belong to.
        attempt: this launch of the run (a resumed run is a new attempt): a commit counts only
            parts this attempt wrote, never a leftover of a crashed one.
        parts: every part a snapshot needs (``shard-<id>``, ``vw<k>-stage<s>``).
        settings: the settings that change the result, recorded in each manifest.
        every: snapshot each time the global clock reaches a multiple of this (and at the end).
        keep: committed snapshots kept (0: every one).
        fault: test hook (:class:`WriteFault`).
    """

    directory: Path
    run_id: str
    attempt: str
    parts: tuple[str, ...]
    settings: tuple[tuple[str, str], ...]
    every: int
    keep: int = 2
    fault: WriteFault | None = None


@dataclass(frozen=True)
class Manifest:
    """A committed snapshot: where it is and what it holds.

    Attributes:
        path: its ``clock-<C>`` folder.
        run_id: the run that wrote it.
        clock: global clock: the weights hold waves ``0..clock-1`` of every VW.
        settings: the settings of the run (name -> value as text).
        parts: part name -> ``{"size": bytes, "sha256": hex}``.
    """

    path: Path
    run_id: str
    clock: int
    settings: dict[str, str]
    parts: dict[str, dict[str, Any]]


def snapshot_dir(directory: Path, clock: int) -> Path:
    """The folder of the snapshot at ``clock``."""
    return directory / f"clock-{clock}"


def _clock_dirs(directory: Path) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    out = {}
    for d in directory.iterdir():
        m = _CLOCK_DIR.match(d.name)
        if m and d.is_dir():
            out[int(m.group(1))] = d
    return out


def write_part(spec: SnapshotSpec, clock: int, name: str, payload: Any) -> None:
    """Write part ``name`` of the snapshot at ``clock``; commit the snapshot if it is complete.

    Raises:
        HetPipeRuntimeError: the write failed (the one-line message names the file).
    """
    d = snapshot_dir(spec.directory, clock)
    data = torch_bytes(payload)
    path = d / f"{name}.pt"
    if spec.fault is not None:
        try:
            spec.fault.check(clock, name, path)
        except OSError as exc:
            raise HetPipeRuntimeError(
                f"{path}: cannot write ({exc.strerror}); free disk space or choose a writable --out"
            ) from None
    durable_write_bytes(path, data)
    if spec.fault is not None:
        spec.fault.after_data(clock, name)
    record = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "attempt": spec.attempt,
    }
    durable_write_bytes(d / f"{name}.json", json.dumps(record).encode())
    _try_commit(spec, clock)


def leave_out(spec: SnapshotSpec, vw: int, wave: int) -> None:
    """VW ``vw`` was evicted for good at ``wave`` in this attempt: the snapshots at clocks
    after ``wave`` commit without its stages' parts (it writes none any more). Write this
    before any part of such a clock (a shard does, as it evicts the VW)."""
    data = json.dumps({"vw": vw, "wave": wave}).encode()
    durable_write_bytes(spec.directory / f"left-out-{spec.attempt}-vw{vw}.json", data)


def _needed(spec: SnapshotSpec, clock: int) -> list[str]:
    """The parts the snapshot at ``clock`` needs: every one but those of VWs left out."""
    gone = []
    for f in spec.directory.glob(f"left-out-{spec.attempt}-vw*.json"):
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # being written: its VW's parts are still expected
        if clock > int(rec["wave"]):
            gone.append(f"vw{int(rec['vw'])}-stage")
    return [p for p in spec.parts if not any(p.startswith(g) for g in gone)]


def _try_commit(spec: SnapshotSpec, clock: int) -> None:
    d = snapshot_dir(spec.directory, clock)
    parts = {}
    for name in _needed(spec, clock):
        try:
            rec = json.loads((d / f"{name}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # not written yet (or torn by a crash of an earlier attempt)
        if not isinstance(rec, dict) or rec.get("attempt") != spec.attempt:
            return
        parts[name] = {"size": rec["size"], "sha256": rec["sha256"]}
    manifest = {
        "format": FORMAT,
        "run_id": spec.run_id,
        "attempt": spec.attempt,
        "clock": clock,
        "settings": dict(spec.settings),
        "parts": parts,
    }
    durable_write_bytes(d / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    log.info("snapshot at clock %d committed: %s", clock, d)
    prune(spec.directory, spec.keep)


def committed_clocks(directory: Path) -> list[int]:
    """Clocks whose snapshot has a manifest (committed; not yet verified), ascending."""
    return sorted(c for c, d in _clock_dirs(directory).items() if (d / MANIFEST).is_file())


def prune(directory: Path, keep: int) -> None:
    """Keep the ``keep`` newest committed snapshots (0: every one); remove older ones and
    incomplete folders older than the oldest kept one (never the newest committed snapshot,
    never a folder newer than it)."""
    committed = committed_clocks(directory)
    if not committed:
        return
    kept = committed[-keep:] if keep > 0 else committed
    for clock, d in _clock_dirs(directory).items():
        if clock < kept[0] or (clock < kept[-1] and clock not in committed):
            shutil.rmtree(d, ignore_errors=True)


def read_manifest(clock_dir: Path) -> Manifest:
    """The manifest of the snapshot in ``clock_dir`` (not verified: see :func:`verify`).

    Raises:
        HetPipeRuntimeError: no manifest (incomplete snapshot) or a malformed one.
    """
    path = clock_dir / MANIFEST
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
        parts = {str(k): dict(v) for k, v in d["parts"].items()}
        for v in parts.values():
            int(v["size"]), str(v["sha256"])
        return Manifest(clock_dir, str(d["run_id"]), int(d["clock"]),
                        {str(k): str(v) for k, v in d["settings"].items()}, parts)  # fmt: skip
    except FileNotFoundError:
        raise HetPipeRuntimeError(f"{clock_dir}: incomplete snapshot (no {MANIFEST})") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HetPipeRuntimeError(f"{path}: malformed manifest ({exc})") from None


def _part_bytes(m: Manifest, name: str) -> bytes:
    rec = m.parts.get(name)
    path = m.path / f"{name}.pt"
    if rec is None:
        raise HetPipeRuntimeError(f"{m.path}: snapshot has no part {name!r} (a different job?)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HetPipeRuntimeError(f"{path}: unreadable ({exc.strerror})") from None
    if len(data) != int(rec["size"]):
        raise HetPipeRuntimeError(
            f"{path}: {len(data)} bytes, the manifest says {rec['size']} (truncated)"
        )
    if hashlib.sha256(data).hexdigest() != rec["sha256"]:
        raise HetPipeRuntimeError(f"{path}: checksum mismatch (corrupt)")
    return data


def verify(m: Manifest) -> None:
    """Check every part's size and sha256 against the manifest.

    Raises:
        HetPipeRuntimeError: the first bad part, named (missing, truncated or corrupt).
    """
    for name in m.parts:
        _part_bytes(m, name)


def load_part(m: Manifest, name: str) -> Any:
    """Part ``name`` of a committed snapshot, checksum verified, loaded with ``weights_only``."""
    return loads_checkpoint(_part_bytes(m, name), m.path / f"{name}.pt")


def select(directory: Path, clock: int | None = None) -> tuple[Manifest, list[str]]:
    """The snapshot to resume from: ``clock``'s, or the newest one that verifies.

    Returns:
        The manifest and one message per newer snapshot skipped (incomplete or corrupt).

    Raises:
        ConfigError: no such folder, ``clock`` has no good snapshot, or none verifies.
    """
    if not directory.is_dir():
        raise ConfigError(f"--resume {directory}: no such checkpoint directory")
    dirs = _clock_dirs(directory)
    if clock is not None:
        if clock not in dirs:
            have = ", ".join(map(str, committed_clocks(directory))) or "none"
            raise ConfigError(
                f"--resume {directory}@{clock}: no snapshot at clock {clock} (committed: {have})"
            )
        try:
            m = read_manifest(dirs[clock])
            verify(m)
        except HetPipeRuntimeError as exc:
            raise ConfigError(f"--resume {directory}@{clock}: {exc}") from None
        return m, []
    skipped: list[str] = []
    for c in sorted(dirs, reverse=True):
        try:
            m = read_manifest(dirs[c])
            verify(m)
        except HetPipeRuntimeError as exc:
            skipped.append(str(exc))
            continue
        for s in skipped:
            log.warning("skipping snapshot: %s", s)
        return m, skipped
    detail = f" ({skipped[0]})" if skipped else ""
    raise ConfigError(
        f"--resume {directory}: no committed snapshot verifies{detail}; start a fresh run instead"
    )


def clean(directory: Path, resume_clock: int | None) -> None:
    """Before a launch: remove leftover ``.tmp`` files, incomplete snapshot folders and, when
    resuming from ``resume_clock``, every snapshot after it (this attempt rewrites them);
    a fresh run (``None``) starts from an empty folder."""
    for c, d in _clock_dirs(directory).items():
        committed = (d / MANIFEST).is_file()
        if resume_clock is None or c > resume_clock or not committed:
            if committed and resume_clock is not None:
                log.warning(
                    "removing snapshot %s (newer than the resumed clock %d)", d, resume_clock
                )
            shutil.rmtree(d, ignore_errors=True)
    if directory.is_dir():
        for tmp in directory.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        for gone in directory.glob("left-out-*.json"):  # an earlier attempt's evictions
            gone.unlink(missing_ok=True)
