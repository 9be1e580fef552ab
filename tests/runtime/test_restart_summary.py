"""The summary and progress of a run where one VW was restarted alone at the shards' cut
(``--on-failure restart``): the bar never passes its total, the row counts the whole VW, the
caption says where it rejoined and that nothing was restarted from a snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console

from runtime.persist.checkpoint import ShardState
from runtime.results.metrics import ProgressBar, StageResult, VWResult
from runtime.results.restarts import restart_notes, whole_vws
from runtime.results.run_result import RunResult

NM = 3


def _vw(vw: int, steps: int, start: float, end: float) -> VWResult:
    st = StageResult(rank=vw, vw=vw, stage=0, device=f"N{vw}:0", steps=steps, start_time=start)
    st.done_times = [start + (end - start) * (i + 1) / steps for i in range(steps)]
    st.losses = [(mb, 1.0) for mb in range(1, steps + 1)]
    return VWResult((st,), batch_size=8, nm=NM, devices=(f"N{vw}:0",))


def test_a_vw_restarted_alone_counts_whole_in_its_row_and_caption(tmp_path: Path) -> None:
    # VW 1 trained waves 0..201, died, its new incarnation trained waves 202..293 (276 mbs)
    states = (ShardState(0, 294, torch.zeros(1), evictions=((1, 202, 2),)),)
    back = [(1, 1, "rank 6 (vw1-stage0) failed: killed by signal SIGKILL")]
    vws = whole_vws((_vw(0, 882, 100.0, 110.0), _vw(1, 276, 107.0, 110.0)), back, states, 0)
    assert [v.steps for v in vws] == [882, 882]
    assert abs(vws[1].throughput - 882 * 8 / 10.0) < 1e-6  # over the attempt, not 3 s
    result = RunResult(vws, NM, 0, states, ((),), (), 10.0,
                       restarts=restart_notes(back, states))  # fmt: skip
    console = Console(width=400, record=True)
    console.print(result.table())
    text, caption = console.export_text(), str(result.table().caption)
    assert "from the last snapshot" not in caption
    assert "vw 1 restarted alone at wave 202; 2 buffered pushes discarded and recomputed" in caption
    assert " 276 " not in text and text.count(" 882 ") == 2
    result.save(tmp_path)
    assert [v["steps"] for v in json.loads((tmp_path / "summary.json").read_text())["vws"]] == [
        882,
        882,
    ]


def test_a_whole_job_restart_still_says_from_the_last_snapshot() -> None:
    result = RunResult((), NM, 0, (), (), (), 1.0, restarts=("x failed (restarted from clock 40)",))
    assert "the whole job restarted 1x from the last snapshot" in result._caption()
    assert "(clock 40: the table counts from there)" in result._caption()  # not the whole run


def test_the_progress_bar_does_not_count_a_restarted_vws_recomputed_minibatches() -> None:
    bar = ProgressBar(False, 2 * 9, 8)
    for mb in range(1, 10):
        bar.event(("done", 0, mb, float(mb)))
    for mb in range(1, 6):  # VW 1 (stage 0 = rank 3) trains 5, dies; the cut is at wave 1
        bar.event(("done", 3, mb, float(mb)))
    bar.event(("rejoined", 3, 1 * NM))
    for mb in range(1, 7):  # its new incarnation trains waves 1..2
        bar.event(("done", 3, mb, 10.0 + mb))
    assert bar.completed == 18


def test_the_progress_bar_shows_the_runs_loss_the_mean_over_the_vws() -> None:
    bar = ProgressBar(False, 4, 8)
    bar.event(("loss", 1, 1, 2.0, 0.0))
    bar.event(("loss", 3, 1, 4.0, 0.0))
    assert bar.loss == 3.0
