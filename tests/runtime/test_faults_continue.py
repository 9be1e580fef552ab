"""``--on-failure continue``: a killed or frozen stage evicts its VW, the survivors finish,
the summary names the loss, and the shards' ledgers hold the lost VW's waves wholly in below
the cut and wholly out from it (the same cut at every shard)."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from profiler.errors import HetPipeRuntimeError
from runtime.config import RunConfig
from runtime.faults import ShardFault, StageFault
from runtime.launch.launcher import launch
from runtime.persist.checkpoint import ShardState
from tests.runtime._spec import spec
from tests.runtime.test_faults import SOURCE, _children, _plan

pytestmark = pytest.mark.timeout(300)


def _ledger_with_a_cut(states: tuple[ShardState, ...], lost: int, cut: int) -> None:
    """Survivors: every wave once. VW ``lost``: waves below ``cut`` once, none from it."""
    for state in states:
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}, state.shard_id
        for vw in {t[0] for t in tags}:
            for stage in {t[1] for t in tags if t[0] == vw}:
                waves = {t[2] for t in tags if t[:2] == (vw, stage)}
                assert waves == set(range(cut if vw == lost else state.clock)), (vw, stage)


@pytest.mark.parametrize(
    ("signum", "at_mb"), [(signal.SIGKILL, 5), (signal.SIGSTOP, 3)], ids=["kill", "freeze"]
)
def test_a_lost_vw_is_evicted_and_the_survivor_finishes(
    tmp_path: Path, signum: int, at_mb: int
) -> None:
    run = RunConfig(steps=12, timeout_s=8.0, emulate=False, out_dir=tmp_path / "run")
    fault = StageFault(stage=1, at_mb=at_mb, vw=1, signum=int(signum))
    result = launch(
        _plan(D=0, nm=2), SOURCE, spec(None, run, stage_fault=fault, on_failure="continue")
    )
    (lost,) = result.lost
    why = "SIGKILL" if signum == signal.SIGKILL else "frozen: no heartbeat"
    assert lost.vw == 1 and "(vw 1 | stage 1 |" in lost.cause and why in lost.cause, lost
    assert 1 <= lost.wave <= at_mb // 2 and lost.waves_lost == 6 - lost.wave
    assert {s.clock for s in result.states} == {6}  # the survivor trained every wave
    assert [e[:2] for s in result.states for e in s.evictions] == [(1, lost.wave)] * 2
    _ledger_with_a_cut(result.states, 1, lost.wave)
    assert result.vws[0].steps == 12 and result.vws[1].steps == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lost"][0]["vw"] == 1 and summary["lost"][0]["wave"] == lost.wave
    assert not _children()


def test_a_lost_shard_still_stops_the_run(tmp_path: Path) -> None:
    # long enough that shard 1's 4 s timer always fires first, however fast the machine
    run = RunConfig(steps=100_000, timeout_s=8.0, emulate=False)
    with pytest.raises(HetPipeRuntimeError, match=r"\(shard 1 \|.*SIGKILL"):
        launch(
            _plan(), SOURCE, spec(None, run, on_failure="continue", shard_fault=ShardFault(1, 4.0))
        )
    assert not _children()


def test_cli_continue_without_a_failure_loses_nothing(tmp_path: Path) -> None:
    from tests.runtime.test_faults import _cli

    plan = _plan(D=1, nm=2).save(tmp_path / "plan.yaml")
    code, output = _cli(str(plan), "--on-failure", "sometimes")
    assert code == 2 and "--on-failure 'sometimes': use one of stop, restart, continue" in output
    out = tmp_path / "run"
    code, output = _cli(str(plan), "--steps", "8", "--out", str(out), "--on-failure", "continue")
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost"] == [] and summary["global_clock"] == 4
    assert not _children()
