"""The simulator's pictures say what they show: rows, window, title, legend, trace round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.draw import (
    TraceEvent,
    _chart_rows,
    read_chrome_trace,
    write_chrome_trace,
    write_gantt,
)
from planner.sim.engine import simulate_pipelines
from planner.sim.types import PipelineSpec
from profiler.errors import ConfigError


def _trace() -> tuple[TraceEvent, ...]:
    slow = PipelineSpec.from_times([3.0, 2.0], [6.0, 4.0], [0, 0.5], [0.5, 0], push_ms=1.0)
    fast = PipelineSpec.from_times([1.0, 1.0], [2.0, 2.0], [0, 0.5], [0.5, 0], push_ms=1.0)
    res = simulate_pipelines([fast, slow], nm=2, D=0, waves=6, record_trace=True)
    return res.trace


def test_each_vw_that_waited_gets_its_own_wait_row_above_its_gpus() -> None:
    trace = _trace()
    assert any(e.cat == "wait" and e.vw == 0 for e in trace)  # the fast VW waits for the slow
    rows = _chart_rows(trace, [["A:0", "A:1"], ["B:0", "B:1"]], max_rows=32)
    names = [name for _, _, name in rows]
    waited = {e.vw for e in trace if e.stage < 0}
    expect = []
    for v in (0, 1):
        expect += [f"VW{v} WSP wait"] if v in waited else []
        expect += [f"VW{v} s0 {'AB'[v]}:0", f"VW{v} s1 {'AB'[v]}:1"]
    assert names == expect
    # whole VWs only: a limit that would cut VW 1 in two leaves it out
    vw0_rows = sum(1 for n in expect if n.startswith("VW0"))
    assert [r[0] for r in _chart_rows(trace, None, max_rows=vw0_rows + 1)] == [0] * vw0_rows


def test_chrome_trace_round_trips_with_labels_and_about(tmp_path: Path) -> None:
    trace = _trace()
    labels = [["A:0", "A:1"], ["B:0", "B 1"]]  # a label with a space survives
    path = write_chrome_trace(trace, tmp_path / "t.json", labels, about="mlp, policy ed")
    back, got_labels, about = read_chrome_trace(path)
    assert about == "mlp, policy ed" and got_labels == labels
    key = lambda e: (e.start_ms, e.vw, e.stage, e.cat)  # noqa: E731
    assert [(e.vw, e.stage, e.cat, e.mb) for e in sorted(back, key=key)] == [
        (e.vw, e.stage, e.cat, e.mb) for e in sorted(trace, key=key)
    ]
    for a, b in zip(sorted(back, key=key), sorted(trace, key=key), strict=True):
        assert a.start_ms == pytest.approx(b.start_ms) and a.end_ms == pytest.approx(b.end_ms)


@pytest.mark.parametrize("content", [b"", b"\xff\xfe", b"[]", b'{"traceEvents": [{"ph": "X"}]}'])
def test_reading_a_bad_trace_is_the_one_line_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "trace.json"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=r"not a hetpipe trace\.json"):
        read_chrome_trace(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        read_chrome_trace(tmp_path / "missing.json")


def test_gantt_draws_a_window_and_rejects_an_empty_one(tmp_path: Path) -> None:
    trace = _trace()
    out = write_gantt(trace, tmp_path / "g.png", from_ms=10.0, until_ms=40.0, title="x")
    assert out.stat().st_size > 1000
    with pytest.raises(ConfigError, match="empty time window"):
        write_gantt(trace, tmp_path / "g.png", from_ms=40.0, until_ms=10.0)
    with pytest.raises(ConfigError, match=r"png or \.svg"):
        write_gantt(trace, tmp_path / "g.pdf")


def test_chrome_trace_names_the_wait_thread() -> None:
    from planner.draw import chrome_trace

    doc = chrome_trace(_trace())
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert names[(0, 0)] == "WSP wait"
    json.dumps(doc)  # serialisable


def test_a_huge_trace_is_refused_without_reading_it_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import profiler.inputs

    monkeypatch.setattr(profiler.inputs, "MAX_FILE_BYTES", 64)
    big = tmp_path / "trace.json"
    big.write_text('{"traceEvents": []}' + " " * 100)
    with pytest.raises(ConfigError, match=r"larger than .*not a hetpipe trace\.json"):
        read_chrome_trace(big)
