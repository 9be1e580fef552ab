"""``--on-failure restart`` of the lost VW only: a killed stage's VW is restarted alone at
the shards' cut while the other VW waits there, every update is applied exactly once (the
dead incarnation's buffered pushes from the cut on wholly out), and once the restart budget
is spent a lost VW is evicted as with ``continue``."""

from __future__ import annotations

import csv
import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from runtime.config import RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.persist.checkpoint import ShardState
from runtime.persist.snapshot import committed_clocks, select
from tests.runtime._spec import spec
from tests.runtime.test_faults import SOURCE, _children, _plan

pytestmark = pytest.mark.timeout(300)


def _every_update_once(states: tuple[ShardState, ...], waves: int) -> None:
    """Every shard's ledger holds each (vw, stage, wave) of ``0..waves-1`` exactly once."""
    for state in states:
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}, state.shard_id
        clients = {t[:2] for t in tags}
        assert set(tags) == {(vw, st, w) for vw, st in clients for w in range(waves)}


@pytest.mark.parametrize(
    ("signum", "at_mb"), [(signal.SIGKILL, 5), (signal.SIGSTOP, 3)], ids=["kill", "freeze"]
)
def test_a_lost_vw_restarts_alone_and_rejoins_at_the_cut(
    tmp_path: Path, signum: int, at_mb: int
) -> None:
    run = RunConfig(steps=12, timeout_s=8.0, emulate=False, out_dir=tmp_path / "run")
    fault = StageFault(stage=1, at_mb=at_mb, vw=1, signum=int(signum))
    cfg = dict(stage_fault=fault, on_failure="restart", max_restarts=2, checkpoint_every=2)
    result = launch(_plan(D=0, nm=2), SOURCE, spec(None, run, **cfg))
    assert result.lost == ()
    # snapshots go on with the restarted VW's parts (written by its new incarnation)
    assert committed_clocks(tmp_path / "run" / "checkpoints") == [4, 6]
    final = select(tmp_path / "run" / "checkpoints")[0]
    assert {"vw1-stage0", "vw1-stage1"} <= set(final.parts)
    (note,) = result.restarts
    why = "SIGKILL" if signum == signal.SIGKILL else "frozen: no heartbeat"
    assert "(vw 1 | stage 1 |" in note and why in note, note
    evictions = [e for s in result.states for e in s.evictions]
    cut = evictions[0][1]
    assert [e[:2] for e in evictions] == [(1, cut)] * 2 and 1 <= cut <= at_mb // 2
    assert f"vw 1 restarted alone at wave {cut}" in note
    assert {s.clock for s in result.states} == {6}
    _every_update_once(result.states, 6)  # the new incarnation filled the waves from the cut
    assert result.vws[0].steps == 12 and result.vws[1].steps == 12  # the whole VW
    assert result.vws[1].stages[0].steps == 12 - 2 * cut and result.vws[1].earlier == 2 * cut
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lost"] == [] and "restarted alone" in summary["restarts"][0]
    # metrics.csv keeps the dead incarnation's rows and numbers the new one on from the cut
    rows = [_history(tmp_path / "run" / f"vw{k}" / "metrics.csv") for k in (0, 1)]
    assert rows[0] == [(0, 0, mb) for mb in range(1, 13)]
    first = [mb for a, inc, mb in rows[1] if (a, inc) == (0, 0)]
    assert first == list(range(1, len(first) + 1)) and len(first) < at_mb
    assert [r for r in rows[1] if r[1] != 0] == [(0, 1, mb) for mb in range(2 * cut + 1, 13)]
    assert summary["vws"][1]["metrics_rows"] == len(rows[1]) == len(first) + 12 - 2 * cut
    assert summary["vws"][1]["metrics_minibatches"] == 12
    assert not _children()


def _history(path: Path) -> list[tuple[int, int, int]]:
    """``(attempt, incarnation, minibatch)`` of every row of a ``metrics.csv``."""
    with path.open(newline="", encoding="utf-8") as f:
        return [(int(r["attempt"]), int(r["incarnation"]), int(r["minibatch"]))
                for r in csv.DictReader(f)]  # fmt: skip


def test_with_the_budget_spent_a_lost_vw_is_evicted(tmp_path: Path) -> None:
    run = RunConfig(steps=12, timeout_s=8.0, emulate=False, out_dir=tmp_path / "run")
    fault = StageFault(stage=1, at_mb=3, vw=1, signum=int(signal.SIGKILL), repeat=True)
    cfg = dict(stage_fault=fault, on_failure="restart", max_restarts=1)
    result = launch(_plan(D=0, nm=2), SOURCE, spec(None, run, **cfg))
    (lost,) = result.lost  # killed again after its one restart: evicted, the culprit named
    assert lost.vw == 1 and "(vw 1 | stage 1 |" in lost.cause and "SIGKILL" in lost.cause
    (note,) = result.restarts
    assert "vw 1 restarted alone" in note and {s.clock for s in result.states} == {6}
    assert [e[0] for s in result.states for e in s.evictions] == [1, 1] * 2
    assert result.vws[0].steps == 12 and result.vws[1].steps == 0
    for state in result.states:
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}
        assert {t[2] for t in tags if t[0] == 1} == set(range(lost.wave))
    assert not _children()


def test_a_restart_slower_than_the_timeout_does_not_fail_the_waiting_vw(tmp_path: Path) -> None:
    # VW 0 waits at the cut (D = 0) for longer than --timeout while VW 1's new processes
    # start: waiting on another VW is not a hang (a CI run lost VW 0 here on a loaded host)
    run = RunConfig(steps=8, timeout_s=3.0, emulate=False, out_dir=tmp_path / "run")
    fault = StageFault(stage=1, at_mb=3, vw=1, rejoin_delay_s=3 * run.timeout_s)
    cfg = dict(stage_fault=fault, on_failure="restart", max_restarts=1)
    result = launch(_plan(D=0, nm=2), SOURCE, spec(None, run, **cfg))
    assert result.lost == () and len(result.restarts) == 1
    assert result.vws[0].steps == 8 and result.vws[1].steps == 8
    _every_update_once(result.states, 4)
    assert not _children()


def test_snapshots_go_on_after_an_eviction_and_a_resume_brings_the_vw_back(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    run = RunConfig(steps=12, timeout_s=8.0, emulate=False, out_dir=out)
    fault = StageFault(stage=1, at_mb=5, vw=1, signum=int(signal.SIGKILL))
    cfg = dict(stage_fault=fault, on_failure="continue", checkpoint_every=2)
    (lost,) = launch(_plan(D=0, nm=2), SOURCE, spec(None, run, **cfg)).lost
    assert committed_clocks(out / "checkpoints") == [4, 6]  # after the cut: without VW 1
    final = select(out / "checkpoints")[0]
    assert not any(p.startswith("vw1-") for p in final.parts) and "vw0-stage0" in final.parts
    longer = RunConfig(steps=16, timeout_s=8.0, emulate=False, out_dir=out)
    result = launch(
        _plan(D=0, nm=2), SOURCE, spec(None, longer, resume=True, on_failure="continue")
    )
    assert {s.clock for s in result.states} == {8} and result.lost == ()
    assert result.vws[1].steps == 4  # back from clock 6, fresh optimizer state
    for state in result.states:  # the resumed ledger: VW 1 below its cut, then from clock 6
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}
        assert {t[2] for t in tags if t[0] == 1} == {*range(lost.wave), 6, 7}
    assert not _children()
