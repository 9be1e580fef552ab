"""``metrics.csv`` as a run's history: one row per minibatch a VW trained, appended while it runs.

The launcher writes a row as soon as the stages report a minibatch (the last stage its loss,
stage 0 its completion), so a process killed later, a VW restarted alone
(``--on-failure restart``), a whole-job restart from the last snapshot and a ``--resume``
all keep the rows written before them and append theirs after. Each row says which
``attempt`` (0: the first launch; one more for each whole-job restart or resume that
trained) and which ``incarnation`` of its VW (0; one more for each restart of the VW alone)
trained it, and its ``minibatch`` is the VW's global position (a resumed run numbers on).
A minibatch recomputed after a cut appears again under its new attempt or incarnation, never
twice within one.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profiler.errors import HetPipeRuntimeError

__all__ = [
    "HEADER",
    "MetricsLog",
    "RankRole",
    "has_history",
    "history",
    "metrics_paths",
    "next_attempt",
    "reset_history",
    "start_log",
]

HEADER = ("attempt", "incarnation", "minibatch", "loss", "done_s", "samples", "skipped")


@dataclass(frozen=True)
class RankRole:
    """What one stage process reports for the metrics.

    Attributes:
        rank: its rank (the reports' sender).
        vw: its VW.
        first: it is the VW's stage 0 (reports each minibatch's completion).
        last: it is the VW's last stage (reports each minibatch's loss).
        first_mb: minibatches the VW trained before this attempt (its numbering's offset).
        batch_size: samples per minibatch.
    """

    rank: int
    vw: int
    first: bool
    last: bool
    first_mb: int
    batch_size: int


@dataclass(frozen=True)
class History:
    """What a ``metrics.csv`` holds: its ``rows`` (every attempt and incarnation), the distinct
    ``minibatches`` they trained, the ``attempts`` that wrote rows."""

    rows: int = 0
    minibatches: int = 0
    attempts: int = 0


def metrics_paths(run_dir: Path, vws: Iterable[int], alone: bool) -> dict[int, Path]:
    """Each VW's ``metrics.csv``: ``vw<k>/metrics.csv``, or the run directory's own for one
    VW alone."""
    return {
        k: run_dir / "metrics.csv" if alone else run_dir / f"vw{k}" / "metrics.csv" for k in vws
    }


def _rows(path: Path) -> list[dict[str, str]]:
    """The history rows of ``path`` (none: no file, or one without the history columns)."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != HEADER:
                return []
            return list(reader)
    except FileNotFoundError:
        return []


def history(path: Path) -> History:
    """Count what ``path`` (a ``metrics.csv``) holds."""
    rows = _rows(path)
    return History(
        len(rows), len({r["minibatch"] for r in rows}), len({r["attempt"] for r in rows})
    )


def next_attempt(paths: Iterable[Path]) -> int:
    """The attempt number of a new attempt: one past the highest in ``paths`` (0 for none)."""
    return 1 + max((int(r["attempt"]) for p in paths for r in _rows(p)), default=-1)


class MetricsLog:
    """Appends the rows of one attempt as the stages report (the launcher's event hook).

    Args:
        paths: each VW's ``metrics.csv`` (:func:`metrics_paths`); a file without the history
            header (none yet, or an older layout) is started with it.
        roles: every stage process of the attempt.
        attempt: this attempt's number (:func:`next_attempt`).
        start: the attempt's start (seconds since the epoch): ``done_s`` counts from it.
    """

    def __init__(
        self, paths: dict[int, Path], roles: Sequence[RankRole], attempt: int, start: float
    ) -> None:
        self.paths, self.attempt, self.start = paths, attempt, start
        self.roles = {r.rank: r for r in roles}
        self.incarnation = dict.fromkeys(self.roles, 0)
        self.offset = {r.rank: r.first_mb for r in roles}  # a rank's minibatch 0, globally
        self._loss: dict[tuple[int, int, int], float] = {}  # (vw, inc, minibatch) -> loss
        self._done: dict[tuple[int, int, int], float] = {}  # (vw, inc, minibatch) -> time
        self._skipped: dict[tuple[int, int, int], bool] = {}  # stage 0 skipped its update
        self._written: set[tuple[int, int, int]] = set()
        for p in paths.values():
            if not has_history(p):
                p.parent.mkdir(parents=True, exist_ok=True)
                _append(p, HEADER, "w")

    def event(self, msg: tuple[Any, ...]) -> None:
        """A stage's ``loss`` / ``done`` report, or the ``incarnation`` report a restarted
        stage sends before any other (its rank, its incarnation, the VW's minibatches before
        its cut): the rank's later reports are that incarnation's, numbered on from the cut."""
        kind, rank = msg[0], int(msg[1])
        role = self.roles.get(rank)
        if role is None:
            return
        if kind == "incarnation":
            self.incarnation[rank], self.offset[rank] = int(msg[2]), int(msg[3])
            return
        key = (role.vw, self.incarnation[rank], self.offset[rank] + int(msg[2]))
        if key in self._written:
            return
        if kind == "loss" and role.last:
            self._loss[key] = float(msg[3])
        elif kind == "done" and role.first:  # stage 0 skips what every stage skips
            self._done[key] = float(msg[3])
            self._skipped[key] = bool(msg[4]) if len(msg) > 4 else False
        else:
            return
        if key in self._loss and key in self._done:
            self._write(key, role.batch_size)

    def _write(self, key: tuple[int, int, int], batch_size: int) -> None:
        vw, inc, mb = key
        self._written.add(key)
        loss, done = self._loss.pop(key), self._done.pop(key)
        skipped = int(self._skipped.pop(key, False))
        t = f"{done - self.start:.6f}"
        row = (self.attempt, inc, mb, f"{loss:.6f}", t, mb * batch_size, skipped)
        _append(self.paths[vw], row)


def _append(path: Path, row: Sequence[object], mode: str = "a") -> None:
    """Write one CSV row to ``path``.

    Raises:
        HetPipeRuntimeError: it cannot be written (one line naming it; the snapshots go on
            from the last one, so ``--resume`` continues the run and its history).
    """
    try:
        with path.open(mode, newline="", encoding="utf-8") as f:
            csv.writer(f).writerow(row)
    except OSError as exc:
        raise HetPipeRuntimeError(
            f"{path}: cannot write the run's metrics ({exc.strerror or exc}); free disk space, "
            "then go on from the last snapshot with --resume and the run's --out folder"
        ) from None


def has_history(path: Path) -> bool:
    """Whether ``path`` starts with the history header (it may have no rows yet)."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            return tuple(next(csv.reader(f), ())) == HEADER
    except FileNotFoundError:
        return False


def reset_history(run_dir: Path | None) -> None:
    """A fresh run in ``run_dir`` (not a resume): the metrics of a run it replaces go."""
    if run_dir is None:
        return
    for p in [run_dir / "metrics.csv", *run_dir.glob("vw*/metrics.csv")]:
        p.unlink(missing_ok=True)


def start_log(paths: dict[int, Path], roles: Sequence[RankRole]) -> MetricsLog:
    """A new attempt's log: numbered after the attempts ``paths`` already hold."""
    return MetricsLog(paths, roles, next_attempt(paths.values()), time.time())
