"""The run's timeline: named after model and plan, redrawn for any window from trace.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.draw import read_chrome_trace
from profiler.errors import ConfigError
from runtime.results.metrics import StageResult
from runtime.results.timeline import draw_window, parse_window, write_timeline


def _stages() -> list[StageResult]:
    s0 = StageResult(rank=1, vw=0, stage=0, device="V:0")
    s1 = StageResult(rank=2, vw=0, stage=1, device="Q:0")
    t = 100.0
    for mb in range(1, 31):  # 3 s of a two-stage pipeline, a push and a wait per wave of 3
        s0.task_log.append(("F", mb, t, t + 0.02))
        s1.task_log.append(("FB", mb, t + 0.03, t + 0.07))
        s0.task_log.append(("B", mb, t + 0.08, t + 0.09))
        if mb % 3 == 0:
            s0.task_log.append(("push", mb // 3 - 1, t + 0.09, t + 0.095))
            s0.task_log.append(("wait", mb // 3, t + 0.095, t + 0.099))
        t += 0.1
    return [s0, s1]


def test_run_timeline_names_model_plan_and_saves_pushes(tmp_path: Path) -> None:
    png, js = write_timeline(_stages(), tmp_path, window_mb=5, about="mlp, policy hd") or (
        None,
        None,
    )
    assert png is not None and png.stat().st_size > 1000
    trace, labels, about = read_chrome_trace(js)
    assert about == "mlp, policy hd" and labels == [["V:0", "Q:0"]]
    assert {e.cat for e in trace} == {"F", "B", "FB", "push", "wait"}
    assert all(e.stage == -1 for e in trace if e.cat == "wait")  # stage 0 waits block the VW


def test_window_is_redrawn_from_the_saved_trace(tmp_path: Path) -> None:
    write_timeline(_stages(), tmp_path, window_mb=5)
    out = draw_window(tmp_path, (1.0, 1.5))
    assert out == tmp_path / "timeline-1-1.5s.png" and out.stat().st_size > 1000
    with pytest.raises(ConfigError, match=r"log ends at 2\.99"):
        draw_window(tmp_path, (10.0, None))
    result = CliRunner().invoke(app, ["timeline", str(tmp_path), "--window", "2:"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "timeline-2-2.999s.png").exists()
    bad = CliRunner().invoke(app, ["timeline", str(tmp_path / "nowhere"), "--window", "1:2"])
    assert bad.exit_code == 2 and "cannot read the trace" in bad.output


@pytest.mark.parametrize("text", ["", "3", "a:b", "2:1", "-1:2", "1:1", "nan:2", "0:inf"])
def test_bad_windows_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="START:END"):
        parse_window(text)


def test_good_windows() -> None:
    assert parse_window("2:2.5") == (2.0, 2.5)
    assert parse_window("2:") == (2.0, None)
    assert parse_window(":1") == (0.0, 1.0)
