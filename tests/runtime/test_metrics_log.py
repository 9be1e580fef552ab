"""``metrics.csv`` keeps a run's history: rows are appended as the stages report, numbered by
the VW's global minibatch, tagged with the attempt and the VW's incarnation
(:mod:`runtime.results.metrics_log`); no process is spawned here."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from profiler.errors import HetPipeRuntimeError
from runtime.results.metrics import StageResult, VWResult, write_metrics
from runtime.results.metrics_log import (
    HEADER,
    MetricsLog,
    RankRole,
    history,
    metrics_paths,
    next_attempt,
    reset_history,
)

BATCH = 8


def _rows(path: Path) -> list[tuple[int, int, int]]:
    """``(attempt, incarnation, minibatch)`` of every row of ``path``, in file order."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == HEADER
        return [(int(r["attempt"]), int(r["incarnation"]), int(r["minibatch"])) for r in reader]


def _log(run: Path, first_mb: int, start: float = 0.0) -> MetricsLog:
    """VW 0 of 2 stages (ranks 1, 2), VW 1 of 1 stage (rank 3), from ``first_mb`` on."""
    roles = [
        RankRole(1, 0, first=True, last=False, first_mb=first_mb, batch_size=BATCH),
        RankRole(2, 0, first=False, last=True, first_mb=first_mb, batch_size=BATCH),
        RankRole(3, 1, first=True, last=True, first_mb=first_mb, batch_size=BATCH),
    ]
    paths = metrics_paths(run, (0, 1), alone=False)
    return MetricsLog(paths, roles, next_attempt(paths.values()), start)


def _train(log: MetricsLog, ranks: tuple[int, ...], mbs: range) -> None:
    """Each minibatch of ``mbs`` (local numbering): the last stage's loss, stage 0's done."""
    for mb in mbs:
        log.event(("loss", ranks[-1], mb, 1.0 / mb, 0.0))
        log.event(("done", ranks[0], mb, 10.0 + mb))


def test_a_row_needs_the_loss_and_the_completion_and_comes_once(tmp_path: Path) -> None:
    log = _log(tmp_path, first_mb=0, start=10.0)
    log.event(("done", 1, 1, 11.0))  # stage 0 may report first: no row yet
    assert _rows(tmp_path / "vw0" / "metrics.csv") == []
    log.event(("loss", 2, 1, 2.5, 0.0))
    log.event(("loss", 2, 1, 2.5, 0.0))  # a report seen twice is still one row
    log.event(("done", 1, 1, 11.0))
    log.event(("loss", 1, 2, 9.0, 0.0))  # stage 0 of a 2-stage VW has no loss: ignored
    log.event(("done", 9, 2, 0.0))  # not a stage of this attempt (a shard): ignored
    assert _rows(tmp_path / "vw0" / "metrics.csv") == [(0, 0, 1)]
    with (tmp_path / "vw0" / "metrics.csv").open(newline="", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["loss"] == "2.500000" and row["done_s"] == "1.000000" and row["samples"] == "8"


def test_a_restarted_vw_and_a_resume_append_and_number_on(tmp_path: Path) -> None:
    log = _log(tmp_path, first_mb=0)
    _train(log, (1, 2), range(1, 7))
    _train(log, (3,), range(1, 6))  # VW 1 trains 5, dies; the shards' cut is at wave 1
    log.event(("rejoined", 3, 2))  # for the progress bar only
    log.event(("incarnation", 3, 1, 2))  # (Nm = 2) its minibatches 1-2 are kept
    _train(log, (3,), range(1, 5))  # incarnation 1: minibatches 3..6
    vw1 = tmp_path / "vw1" / "metrics.csv"
    assert _rows(vw1) == [(0, 0, mb) for mb in range(1, 6)] + [(0, 1, mb) for mb in range(3, 7)]
    # the job is killed; a resume from the snapshot at minibatch 4 appends, numbered on
    again = _log(tmp_path, first_mb=4)
    assert again.attempt == 1
    _train(again, (1, 2), range(1, 5))
    _train(again, (3,), range(1, 5))
    assert _rows(tmp_path / "vw0" / "metrics.csv") == [(0, 0, mb) for mb in range(1, 7)] + [
        (1, 0, mb) for mb in range(5, 9)
    ]
    assert _rows(vw1)[-4:] == [(1, 0, mb) for mb in range(5, 9)] and len(_rows(vw1)) == 13
    h = history(vw1)
    assert (h.rows, h.minibatches, h.attempts) == (13, 8, 2)


def test_saving_a_result_keeps_the_history_and_a_fresh_run_starts_it_again(
    tmp_path: Path,
) -> None:
    log = _log(tmp_path, first_mb=0)
    _train(log, (1, 2), range(1, 4))
    stage = StageResult(0, 0, 0, "cpu", losses=[(1, 3.0)], done_times=[1.0])
    write_metrics(VWResult((stage,), BATCH, 2), tmp_path / "vw0")  # the final save
    assert _rows(tmp_path / "vw0" / "metrics.csv") == [(0, 0, mb) for mb in range(1, 4)]
    reset_history(tmp_path)
    assert not (tmp_path / "vw0" / "metrics.csv").exists()
    write_metrics(VWResult((stage,), BATCH, 2), tmp_path / "vw0")  # no history: its own rows
    assert _rows(tmp_path / "vw0" / "metrics.csv") == [(0, 0, 1)]


def test_a_metrics_file_that_cannot_be_written_is_one_line_naming_it(tmp_path: Path) -> None:
    log = _log(tmp_path, first_mb=0)
    path = tmp_path / "vw1" / "metrics.csv"
    path.unlink()
    path.mkdir()  # not a file any more: the append fails
    with pytest.raises(HetPipeRuntimeError, match=r"metrics.csv: cannot write the run's metrics"):
        _train(log, (3,), range(1, 2))
