"""The one result type of every rule (:class:`runtime.results.run_result.RunResult`): the run's
loss, the summary table and ``summary.json``, one VW alone, a lost VW's row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from runtime.results.metrics import StageResult, VWResult
from runtime.results.run_result import RunResult


def _vw(vw: int, losses: list[float], devices: tuple[str, ...] = ()) -> VWResult:
    stage = StageResult(rank=vw, vw=vw, stage=0, device=f"N{vw}:0", steps=len(losses))
    stage.losses = [(mb, loss) for mb, loss in enumerate(losses, 1)]
    return VWResult((stage,), batch_size=8, nm=1, devices=devices or (f"N{vw}:0",))


def _result(vws: tuple[VWResult, ...], sync: str) -> RunResult:
    return RunResult(vws, 1, 0, (), (), (), 1.0, sync=sync)


def _text(result: RunResult) -> str:
    console = Console(width=300, record=True)
    console.print(result.table())
    return console.export_text()


def test_allreduce_reports_one_loss_the_global_minibatchs(tmp_path: Path) -> None:
    """Every VW trains an equal slice of one global minibatch: the run's loss at a step is the
    mean of the slices' losses, shown once, not per VW."""
    result = _result((_vw(0, [1.0, 2.0]), _vw(1, [3.0, 6.0])), "allreduce")
    assert result.losses == [2.0, 4.0]
    table = result.table()
    assert "last loss" not in [str(c.header) for c in table.columns]
    assert "loss of the global minibatch: first 2.0000, last 4.0000" in str(table.caption)
    result.save(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == 4.0


def test_wsp_rows_keep_each_vws_own_loss() -> None:
    result = _result((_vw(0, [1.0, 2.0]), _vw(1, [3.0, 6.0])), "wsp")
    table = result.table()
    assert "last loss" in [str(c.header) for c in table.columns]
    text = _text(result)
    assert "2.0000" in text and "6.0000" in text


def test_one_vw_alone_is_a_run_result_with_its_stage_table(tmp_path: Path) -> None:
    result = _result((_vw(0, [5.0, 4.0]),), "local")
    assert result.alone and result.losses == [5.0, 4.0] and result.steps == 2
    assert [s.device for s in result.stages] == ["N0:0"]
    assert str(result.table().caption) == "loss: first 5.0000, last 4.0000"  # its stage table
    result.save(tmp_path)
    assert (tmp_path / "metrics.csv").exists() and (tmp_path / "summary.json").exists()


def test_a_lost_vws_row_shows_its_devices() -> None:
    lost = VWResult((), batch_size=8, nm=1, devices=("N1:0", "N2:0"))  # it reported nothing
    result = _result((_vw(0, [1.0]), lost), "wsp")
    text = _text(result)
    assert re.search(r"│\s+1 │ N1:0 N2:0 │", text), text
    assert result.losses == [1.0]  # only the VWs that reported


@pytest.mark.parametrize("name", ["RunResult", "StageModule", "train", "plan", "ModelGraph"])
def test_the_public_api_names_resolve(name: str) -> None:
    import hetpipe

    assert getattr(hetpipe, name) is not None
    assert name in hetpipe.__all__


def test_the_summary_shows_both_predictions(tmp_path: Path) -> None:
    """A plan whose planner assumed a runtime overhead: measured against the prediction with
    it and against compute and links alone (``predicted_without_overhead``)."""
    vws = (_vw(0, [1.0, 2.0]), _vw(1, [3.0, 6.0]))
    result = RunResult(
        vws, 1, 0, (), (), (), 1.0, 10.0, sync="wsp", predicted_without_overhead=20.0
    )
    ratio = result.throughput
    title = str(result.table().title)
    assert f"(predicted 10.0, ratio {ratio / 10:.2f})" in title
    assert f"without the runtime overhead 20.0 ({ratio / 20:.2f})" in title
    result.save(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["predicted_without_overhead"] == 20.0
    assert "without the runtime" not in str(_result(vws, "wsp").table().title)
