"""Checkpoint files: durable atomic writes and the payloads of shards and stages.

A file is written next to its final name, ``fsync``-ed and moved into place with
``os.replace``, so a crash leaves either the previous file or the new one, never a torn file.
Payloads hold only tensors, numbers, strings, lists and dicts and are read back with
``torch.load(weights_only=True)``: loading a checkpoint never executes pickled code.

The files of one clock are grouped into one verified snapshot by :mod:`runtime.persist.snapshot`:
that module decides what is committed, this one what a part holds.

``torch.distributed.checkpoint`` is not used: each shard is one process with one flat
tensor, which a single file stores exactly; DCP's multi-file directories have no atomic
commit of their own, which the snapshot's manifest provides.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from profiler.errors import HetPipeRuntimeError
from profiler.files import atomic_write_bytes

__all__ = [
    "CHECKPOINT_VERSION",
    "LedgerEntry",
    "ShardState",
    "atomic_torch_save",
    "durable_write_bytes",
    "load_checkpoint",
    "loads_checkpoint",
    "shard_from_payload",
    "shard_payload",
    "torch_bytes",
]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 2


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
    """Everything needed to resume a shard (what a snapshot's shard part stores).

    Attributes:
        shard_id: the shard.
        clock: global clock: ``weights`` hold waves ``0..clock-1`` of every VW.
        weights: flat global weights.
        ledger: every applied update.
        optimizer: server-side optimizer state (``momentum`` buffer when used).
        momentum: server-side momentum factor (0.0: plain ``w += sum of updates``).
        evictions: VWs left out (``--on-failure continue``): ``(vw, first wave left out,
            pushes discarded here)`` each; never in a snapshot (none is taken after one).
    """

    shard_id: int
    clock: int
    weights: torch.Tensor
    ledger: tuple[LedgerEntry, ...] = ()
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: float = 0.0
    evictions: tuple[tuple[int, int, int], ...] = ()


def durable_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably (:func:`profiler.files.atomic_write_bytes`
    with ``durable=True``: temporary file, fsync, ``os.replace``, fsync of the folder).

    Raises:
        HetPipeRuntimeError: the write failed (full disk, read-only folder, I/O error); the
            temporary file is removed and the previous file, if any, is untouched.
    """
    p = Path(path)
    try:
        return atomic_write_bytes(p, data, durable=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise HetPipeRuntimeError(
            f"{p}: cannot write ({why}); free disk space or choose a writable --out"
        ) from None


def torch_bytes(obj: Any) -> bytes:
    """``obj`` serialised by ``torch.save`` (in memory)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically and durably (:func:`durable_write_bytes`)."""
    return durable_write_bytes(path, torch_bytes(obj))


def loads_checkpoint(data: bytes, where: str | os.PathLike[str]) -> Any:
    """Deserialise checkpoint bytes with ``weights_only=True``; ``where`` names them in errors.

    Raises:
        HetPipeRuntimeError: not a plain-tensor checkpoint (corrupt, truncated, pickled code).
    """
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError...
        raise HetPipeRuntimeError(
            f"{where}: cannot load checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "use an older one"
        ) from None


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Read a checkpoint written by :func:`atomic_torch_save` with ``weights_only=True``.

    Raises:
        HetPipeRuntimeError: missing, unreadable or not a plain-tensor checkpoint.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise HetPipeRuntimeError(
            f"{p}: checkpoint not found; check the --resume directory"
        ) from None
    except OSError as exc:
        raise HetPipeRuntimeError(f"{p}: cannot read checkpoint ({exc.strerror})") from None
    return loads_checkpoint(data, p)


def shard_payload(state: ShardState) -> dict[str, Any]:
    """The plain-data form of a shard's state (one snapshot part)."""
    return {
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


def shard_from_payload(d: Any, where: str | os.PathLike[str]) -> ShardState:
    """The :class:`ShardState` of a payload written by :func:`shard_payload`.

    Raises:
        HetPipeRuntimeError: wrong kind/version, or malformed fields.
    """
    if not isinstance(d, dict) or d.get("kind") != "hetpipe-ps-shard":
        raise HetPipeRuntimeError(f"{where}: not a hetpipe parameter-server shard checkpoint")
    if d.get("version") != CHECKPOINT_VERSION:
        raise HetPipeRuntimeError(
            f"{where}: checkpoint version {d.get('version')!r} unsupported (expected {CHECKPOINT_VERSION})"
        )
    try:
        led = d["ledger"]
        if led.dim() != 2 or led.shape[1] != 4:
            raise HetPipeRuntimeError(
                f"{where}: ledger has shape {tuple(led.shape)}, expected (n, 4) (corrupt file)"
            )
        ledger = tuple(LedgerEntry(*(int(x) for x in row)) for row in led.tolist())
        return ShardState(
            int(d["shard_id"]),
            int(d["clock"]),
            d["weights"],
            ledger,
            dict(d["optimizer"]),
            float(d["momentum"]),
        )
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise HetPipeRuntimeError(
            f"{where}: malformed shard checkpoint ({exc}); use an older one"
        ) from None
