"""A run directory belongs to one run: its lock, its run id, and the settings a resume must keep.

While a launcher runs, it holds an exclusive ``flock`` on ``<dir>/.hetpipe.lock`` (the kernel
drops it when the process dies, however it dies, so a lock is never stale; the pid written in
the file only names the holder). ``<dir>/RUN.json`` records the run id. A fresh run refuses a
directory that holds another run (its ``RUN.json``, checkpoints or final weights) unless told
to overwrite it; a resume keeps the run id and checks the snapshot's settings
(:func:`check_settings`): every setting that changes the result must match, the number of
steps may grow.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.precision import dtype_name

__all__ = [
    "LOCK_FILE",
    "RUN_FILE",
    "RunDirectory",
    "RunOwner",
    "SharedRun",
    "check_settings",
    "elastic_resume",
    "first_difference",
    "job_settings",
    "resume_target",
]

RUN_FILE = "RUN.json"
LOCK_FILE = ".hetpipe.lock"
_OUTPUTS = (RUN_FILE, "checkpoints", "weights.pt", "summary.json")

# the command-line flag of each setting, for the message of a mismatched resume
_FLAGS = {
    "nm": "--nm", "D": "--D", "seed": "--seed", "model": "--model", "plan": "the plan file",
    "optimizer.name": "--optimizer", "optimizer.lr": "--lr", "optimizer.momentum": "--momentum",
    "optimizer.weight_decay": "--weight-decay", "optimizer.lr_schedule": "--lr-schedule",
    "optimizer.remedy": "--remedy", "optimizer.remedy_warmup": "--remedy-warmup",
    "schedule_horizon": "--steps/--epochs (the cosine schedule's horizon)",
    "precision": "--precision",
}  # fmt: skip
_RENAMED = {"optimizer.schedule": "optimizer.lr_schedule"}  # as older snapshots name them


class RunOwner(Protocol):
    """Who a run's snapshots belong to: :class:`RunDirectory` on one host, :class:`SharedRun`
    for the ranks of a torchrun job."""

    run_id: str
    attempt: str

    @property
    def tidies(self) -> bool:
        """Whether this process tidies the checkpoint folder before the run (one per job)."""
        ...

    def write_run_file(self, run_id: str | None = None) -> None:
        """Record ``run_id`` (a resume continues that run)."""


@dataclass
class SharedRun:
    """A torchrun job's identity on a file system every host shares: every rank knows it (from
    torchrun's run id and restart count), none locks the folder, rank 0 tidies it.

    Attributes:
        run_id: the run's id (empty when resuming: the snapshot's).
        attempt: this attempt's id (snapshot parts of other attempts are never mixed in).
        rank0: this process is rank 0.
    """

    run_id: str
    attempt: str
    rank0: bool

    @property
    def tidies(self) -> bool:
        """Rank 0 tidies the checkpoint folder (before the start barrier)."""
        return self.rank0

    def write_run_file(self, run_id: str | None = None) -> None:
        """Adopt ``run_id`` (nothing is written: the folder has no single owner)."""
        self.run_id = run_id or self.run_id


class RunDirectory:
    """Claims ``path`` for one launch (a context manager): lock, run id, ``RUN.json``.

    Args:
        path: the run directory (created if needed).
        resume: continue the run already there (keep its id) instead of starting one.
        overwrite: a fresh run may replace another run's outputs in ``path``.

    Raises (on entry):
        ConfigError: another live run holds the lock, or ``path`` holds another run.
        HetPipeRuntimeError: ``path`` cannot be created or written (read-only, full disk).
    """

    def __init__(self, path: Path, resume: bool, overwrite: bool = False) -> None:
        self.path, self.resume, self.overwrite = path, resume, overwrite
        self.run_id = ""  # set on entry ("" when resuming a directory without RUN.json)
        self.attempt = uuid.uuid4().hex[:12]
        self._fd: int | None = None

    def __enter__(self) -> RunDirectory:
        if self.resume and not self.path.is_dir():
            raise ConfigError(f"--resume {self.path}: no such run directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise HetPipeRuntimeError(
                f"{self.path}: cannot use the run directory ({exc.strerror}); choose a writable --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"{self.path}: another run (pid {holder}) is using this directory; wait for it "
                "to end or choose another --out"
            ) from None
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._claim()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def _claim(self) -> None:
        existing = self._read()
        if self.resume:  # RUN.json is rewritten once the snapshot is chosen (write_run_file)
            self.run_id = str(existing.get("run_id", "")) if existing else ""
            return
        held = [n for n in _OUTPUTS if (self.path / n).exists()]
        if held and not self.overwrite:
            who = f"run {existing['run_id']}" if existing else "another run's outputs"
            raise ConfigError(
                f"{self.path}: holds {who} ({', '.join(held)}); resume it with --resume "
                f"{self.path}, pass --overwrite to replace it, or choose another --out"
            )
        for n in held:
            p = self.path / n
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        self.run_id = uuid.uuid4().hex[:12]
        self.write_run_file()

    @property
    def tidies(self) -> bool:
        """The one launcher of a one-host run tidies its folder."""
        return True

    def write_run_file(self, run_id: str | None = None) -> None:
        """(Re)write ``RUN.json`` (with ``run_id`` when given: adopt a snapshot's run id)."""
        from runtime.persist.checkpoint import durable_write_bytes

        self.run_id = run_id or self.run_id
        info = {"run_id": self.run_id, "attempt": self.attempt, "pid": os.getpid(),
                "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        durable_write_bytes(self.path / RUN_FILE, json.dumps(info, indent=1).encode())

    def _read(self) -> dict[str, Any] | None:
        try:
            d = json.loads((self.path / RUN_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{self.path / RUN_FILE}: unreadable ({exc}); remove it or choose another --out"
            ) from None
        return d if isinstance(d, dict) else None


def job_settings(
    model: str,
    plan_json: str,
    nm: int,
    D: int,
    seed: int,
    test_fraction: float,
    data: str,
    optimizer: Any,
    horizon: int,
    precision: str = "fp32",
) -> tuple[tuple[str, str], ...]:
    """The settings that change a run's result, as text (recorded in every snapshot).

    Args:
        model: the model's name.
        plan_json: the plan as JSON (recorded by its sha256).
        nm, D, seed, test_fraction: the run's.
        data: the data set's identity (type and size).
        optimizer: the stages' :class:`runtime.config.OptimizerConfig`.
        horizon: minibatches per VW of the whole run (recorded only for the cosine schedule,
            whose learning rates depend on it; otherwise a longer run is a safe change).
        precision: ``fp32`` or ``bf16`` (recorded as ``float32``/``bfloat16``).
    """
    opt = {
        f"optimizer.{f.name}": repr(getattr(optimizer, f.name))
        for f in dataclasses.fields(optimizer)
        if f.name != "total_updates"
    }
    plan = hashlib.sha256(plan_json.encode()).hexdigest()[:16]
    out = {"model": model, "plan": plan, "nm": str(nm), "D": str(D), "seed": str(seed),
           "test_fraction": repr(test_fraction), "data": data, "precision": dtype_name(precision or "fp32"), **opt}  # fmt: skip
    if getattr(optimizer, "lr_schedule", "") == "cosine":
        out["schedule_horizon"] = str(optimizer.total_updates or horizon)
    return tuple(sorted(out.items()))


def check_settings(where: str, snapshot: dict[str, str], now: tuple[tuple[str, str], ...]) -> None:
    """Refuse a resume whose settings differ from the snapshot's, naming the first field.

    Raises:
        ConfigError: ``<where>: <field> is <now> but the snapshot was taken with <then>``.
    """
    snapshot = {_RENAMED.get(name, name): value for name, value in snapshot.items()}
    for name, value in now:
        then = snapshot.get(name)
        if then is not None and then != value:
            flag = _FLAGS.get(name, name)
            raise ConfigError(
                f"{where}: {name} is {value} but the snapshot was taken with {then} ({flag}); "
                "resume with the same setting, or start a new run in another --out"
            )
    missing = sorted(set(snapshot) - {n for n, _ in now})
    if missing:
        raise ConfigError(f"{where}: the snapshot records {missing[0]}, which this run lacks")


def first_difference(then: object, now: object, at: str = "") -> tuple[str, object, object] | None:
    """The first field where two plain documents (a plan's or a cluster's ``to_dict()``) differ:
    ``(path, then, now)``, or ``None`` when they are equal.

    >>> first_difference({"nodes": [{"speed": 0.2}]}, {"nodes": [{"speed": 0.5}]})
    ('nodes[0].speed', 0.2, 0.5)
    """
    if isinstance(then, dict) and isinstance(now, dict):
        for key in [*then, *(k for k in now if k not in then)]:
            found = first_difference(then.get(key), now.get(key), f"{at}.{key}" if at else str(key))
            if found is not None:
                return found
        return None
    if isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
        for i, (a, b) in enumerate(zip(then, now, strict=True)):
            found = first_difference(a, b, f"{at}[{i}]")
            if found is not None:
                return found
        return None
    return None if then == now else (at, then, now)


def resume_target(arg: str | os.PathLike[str]) -> tuple[Path, Path, int | None]:
    """``--resume DIR[@CLOCK]`` as ``(run directory, checkpoint folder, clock or None)``.

    ``DIR`` may be the run's ``--out`` directory or its ``checkpoints`` folder.
    """
    text, clock = str(arg), None
    m = re.fullmatch(r"(.+)@(\d+)", text)
    if m:
        text, clock = m.group(1), int(m.group(2))
    p = Path(text)
    if p.name == "checkpoints" and not (p / "checkpoints").is_dir():
        return p.parent, p, clock
    return p, p / "checkpoints", clock


def elastic_resume(resume: bool, restart_count: int, committed: Sequence[int]) -> bool:
    """Whether a rank under torchrun resumes: with ``--resume``, or when torchrun's elastic
    agent restarted the worker group (``TORCHELASTIC_RESTART_COUNT`` > 0, ``torchrun
    --max-restarts N``) and the run has a committed snapshot (``committed``: their clocks)
    to continue from; a restart before the first snapshot starts again from the beginning."""
    return resume or (restart_count > 0 and bool(committed))
