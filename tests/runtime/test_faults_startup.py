"""A stage lost at start-up (before its first wave, possibly before every rank joined the
process group) is survived like a later loss: restarted within ``--max-restarts`` or evicted
under ``continue``, the message naming the rank that died, never a healthy peer that timed
out waiting for it (:mod:`runtime.launch.startup`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from runtime.config import RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from tests.runtime._spec import spec
from tests.runtime.test_faults import SOURCE, _children, _plan

pytestmark = pytest.mark.timeout(300)

STEPS = 4  # two waves of Nm 2 per VW: the run is the start-up


@pytest.mark.parametrize(
    ("after_s", "joined"),
    [(0.5, False), (2.0, False), (5.0, False), (2.0, True)],
    ids=["0.5s-joining", "2s-joining", "5s-joining", "2s-joined"],
)
@pytest.mark.parametrize("mode", ["restart", "continue"])
def test_a_stage_killed_at_start_up_is_restarted_or_evicted(
    tmp_path: Path, mode: str, after_s: float, joined: bool
) -> None:
    # killed before it joins the group (the others wait in the rendezvous), or once joined,
    # at its first minibatch (no wave pushed: the shards cut it at wave 0)
    out = tmp_path / "run"
    run = RunConfig(steps=STEPS, timeout_s=8.0, emulate=False, out_dir=out)
    fault = StageFault(stage=1, at_mb=0, vw=1, after_s=after_s, joined=joined)  # SIGKILL
    if mode == "restart":
        cfg = dict(stage_fault=fault, on_failure="restart", max_restarts=1)
    else:
        cfg = dict(stage_fault=fault, on_failure="continue")
    result = launch(_plan(D=0, nm=2), SOURCE, spec(None, run, **cfg))
    summary = json.loads((out / "summary.json").read_text())
    culprit = "rank 5 (vw 1 | stage 1 |"  # ranks 0-1 shards, 2-3 VW 0, 4-5 VW 1
    if mode == "restart":
        assert result.lost == () and summary["lost"] == []
        (note,) = summary["restarts"]  # one restart, alone or of the job, never two
        assert note.startswith(culprit) and "SIGKILL" in note, note
        how = "restarted alone at wave 0" if joined else "before every rank joined"
        assert how in note, note
        assert result.vws[0].steps == STEPS and result.vws[1].steps == STEPS
    else:
        assert summary["restarts"] == []
        (lost,) = result.lost
        assert lost.vw == 1 and lost.wave == 0, lost
        assert lost.cause.startswith(culprit) and "SIGKILL" in lost.cause, lost.cause
        assert result.vws[0].steps == STEPS and result.vws[1].steps == 0
    for state in result.states:  # every wave trained is applied once; VW 1's only if kept
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}
        kept = {0, 1} if mode == "restart" else {0}
        assert {t[0] for t in tags} == kept
        assert {t[2] for t in tags} == set(range(STEPS // 2))
    assert not _children()
