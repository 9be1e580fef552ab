"""Atomic checkpoints of parameter-server shard state (and any other tensor state).

A checkpoint is one ``torch.save`` file written next to its final name and moved into place
with ``os.replace`` after ``fsync``, so a crash leaves either the previous file or the new one,
never a torn file. It holds only tensors, numbers, strings, lists and dicts, and is read back
with ``torch.load(weights_only=True)``: loading a checkpoint never executes pickled code.

Shard files are named ``shard-<id>-clock-<clock>.pt``. A run can resume from global clock
``c`` when every shard has a file for ``c`` (:func:`resumable_clock`); a shard keeps its
newest ``keep`` files, so a crash while shards write clock ``c`` still leaves ``c - every``.

``torch.distributed.checkpoint`` is not used for shard state: each shard is one process with
one flat tensor, which a single atomic file stores exactly; DCP's multi-file directories have
no atomic commit of their own.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from profiler.errors import HetPipeRuntimeError

__all__ = [
    "CHECKPOINT_VERSION",
    "LedgerEntry",
    "ShardState",
    "atomic_torch_save",
    "load_checkpoint",
    "load_shard_state",
    "resumable_clock",
    "save_shard_state",
    "shard_checkpoint_path",
]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
_SHARD_FILE = re.compile(r"^shard-(\d+)-clock-(\d+)\.pt$")


@dataclass(frozen=True)
class LedgerEntry:
    """One applied update: proof that tag ``(vw, stage, wave)`` was folded in exactly once.

    Attributes:
        vw, stage, wave: the tag.
        seq: arrival order at the shard (0-based, over all accepted pushes).
    """

    vw: int
    stage: int
    wave: int
    seq: int


@dataclass(frozen=True)
class ShardState:
    """Everything needed to resume a shard (what :mod:`runtime.checkpoint` stores).

    Attributes:
        shard_id: the shard.
        clock: global clock: ``weights`` hold waves ``0..clock-1`` of every VW.
        weights: flat global weights.
        ledger: every applied update.
        optimizer: server-side optimizer state (``momentum`` buffer when used).
        momentum: server-side momentum factor (0.0: plain ``w += sum of updates``).
    """

    shard_id: int
    clock: int
    weights: torch.Tensor
    ledger: tuple[LedgerEntry, ...] = ()
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: float = 0.0


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically (temporary file, fsync, ``os.replace``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Read a checkpoint written by :func:`atomic_torch_save` with ``weights_only=True``.

    Raises:
        HetPipeRuntimeError: missing, unreadable or not a plain-tensor checkpoint.
    """
    p = Path(path)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise HetPipeRuntimeError(
            f"{p}: checkpoint not found; check the --resume directory"
        ) from None
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError...
        raise HetPipeRuntimeError(
            f"{p}: cannot load checkpoint ({type(exc).__name__}: {exc}); use an older one"
        ) from None


def shard_checkpoint_path(directory: str | os.PathLike[str], shard_id: int, clock: int) -> Path:
    """The file of shard ``shard_id`` at global clock ``clock`` inside ``directory``."""
    return Path(directory) / f"shard-{shard_id}-clock-{clock}.pt"


def _shard_files(directory: Path) -> dict[int, dict[int, Path]]:
    out: dict[int, dict[int, Path]] = {}
    if directory.is_dir():
        for f in directory.iterdir():
            m = _SHARD_FILE.match(f.name)
            if m:
                out.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    return out


def save_shard_state(state: ShardState, directory: str | os.PathLike[str], keep: int = 2) -> Path:
    """Write ``state`` atomically as ``shard-<id>-clock-<clock>.pt``; keep the newest ``keep`` files.

    Args:
        state: the shard snapshot.
        directory: checkpoint folder (created if needed).
        keep: how many files of this shard to keep (>= 1).

    Returns:
        The written path.
    """
    payload = {
        "version": CHECKPOINT_VERSION,
        "kind": "hetpipe-ps-shard",
        "shard_id": state.shard_id,
        "clock": state.clock,
        "weights": state.weights.detach().cpu(),
        # ledger as one int64 tensor [n, 4]: vw, stage, wave, seq
        "ledger": torch.tensor(
            [[e.vw, e.stage, e.wave, e.seq] for e in state.ledger], dtype=torch.int64
        ).reshape(-1, 4),
        "optimizer": {k: v.detach().cpu() for k, v in state.optimizer.items()},
        "momentum": float(state.momentum),
    }
    d = Path(directory)
    path = atomic_torch_save(payload, shard_checkpoint_path(d, state.shard_id, state.clock))
    old = sorted(_shard_files(d).get(state.shard_id, {}).items())
    for _, f in old[: max(0, len(old) - max(1, keep))]:
        f.unlink(missing_ok=True)
    log.info("[shard %d] checkpoint at clock %d -> %s", state.shard_id, state.clock, path)
    return path


def load_shard_state(path: str | os.PathLike[str]) -> ShardState:
    """Read a shard checkpoint written by :func:`save_shard_state`.

    Raises:
        HetPipeRuntimeError: unreadable, wrong kind/version, or malformed ledger.
    """
    d = load_checkpoint(path)
    if not isinstance(d, dict) or d.get("kind") != "hetpipe-ps-shard":
        raise HetPipeRuntimeError(f"{path}: not a hetpipe parameter-server shard checkpoint")
    if d.get("version") != CHECKPOINT_VERSION:
        raise HetPipeRuntimeError(
            f"{path}: checkpoint version {d.get('version')!r} unsupported (expected {CHECKPOINT_VERSION})"
        )
    try:
        led = d["ledger"]
        if led.dim() != 2 or led.shape[1] != 4:
            raise HetPipeRuntimeError(
                f"{path}: ledger has shape {tuple(led.shape)}, expected (n, 4) (corrupt file)"
            )
        ledger = tuple(LedgerEntry(*(int(x) for x in row)) for row in led.tolist())
        weights = d["weights"]
    except (KeyError, AttributeError, TypeError) as exc:
        raise HetPipeRuntimeError(
            f"{path}: malformed shard checkpoint ({exc}); use an older one"
        ) from None
    return ShardState(
        int(d["shard_id"]),
        int(d["clock"]),
        weights,
        ledger,
        dict(d["optimizer"]),
        float(d["momentum"]),
    )


def resumable_clock(directory: str | os.PathLike[str], n_shards: int) -> int | None:
    """The newest global clock for which all ``n_shards`` shards have a checkpoint, or ``None``."""
    files = _shard_files(Path(directory))
    common: set[int] | None = None
    for sid in range(n_shards):
        clocks = set(files.get(sid, {}))
        common = clocks if common is None else common & clocks
    return max(common) if common else None
