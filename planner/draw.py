"""Pictures of a pipeline's intervals, simulated or measured: a Gantt chart and a Chrome trace.

The one drawing code of predicted and measured runs: the simulator (:mod:`planner.sim`, a run
recorded with ``record_trace=True``) and the runtime's results (:mod:`runtime.results.timeline`,
a run's task log) both record :class:`TraceEvent` intervals and draw them here, so neither
reads the other; it sits in ``planner`` (beside the shared rules, ``schedule.py``,
``wsp.py``) because that is the lowest package both already import, and it imports only
``profiler``.

The Gantt chart has one row per GPU (``VW v s<stage>``): forward
(``F``), backward (``B``) and the last stage's fused ``FB`` as tall bars; receiving
(``recv``), pushes to the parameter server (``push``), offloaded data moving over the host
link ahead of its backward (``host``, a thin lane above) and a stage's own WSP wait in a thin lane
beneath them; and, above each VW's GPUs, a row of its own for the VW's WSP waits (``wait``:
admission blocked), so a wait never hides compute. The title names the time window drawn;
the legend sits outside the axes. The Chrome trace opens in https://ui.perfetto.dev or
chrome://tracing: one process per VW, one thread per stage, thread 0 for the VW's waits;
:func:`read_chrome_trace` reads it back (``hetpipe timeline`` redraws a run from it).
"""

from __future__ import annotations

import io
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profiler.errors import ConfigError
from profiler.files import atomic_write_bytes, atomic_write_text
from profiler.inputs import read_text

__all__ = [
    "COLORS",
    "TraceEvent",
    "chrome_trace",
    "read_chrome_trace",
    "write_chrome_trace",
    "write_gantt",
]

COLORS: dict[str, str] = {
    "F": "#f2c12e",  # forward: yellow, as in the paper's Fig. 1
    "B": "#3aa655",  # backward: green
    "FB": "#e07b39",  # last stage's forward+backward
    "recv": "#4a90d9",  # receiving activations/gradients
    "push": "#8e6bbf",  # pushing the wave's update
    "wait": "#d9534f",  # WSP: admission blocked
    "host": "#7f7f7f",  # offloaded data over the host link (planner.offload), prefetched
}
_LANE = ("recv", "push", "host")  # drawn thin, beneath the compute bars


@dataclass(frozen=True)
class TraceEvent:
    """One interval of a pipeline's timeline (simulated, or measured by a run).

    Attributes:
        vw, stage: where it happened (``stage`` -1 for a VW-wide interval such as ``wait``).
        cat: ``F``, ``B``, ``FB`` (compute), ``recv`` (receiving), ``push``, ``wait`` (WSP).
        mb: minibatch (for compute/recv) or wave (for push/wait).
        start_ms, end_ms: times in milliseconds (simulated, or since a run's first task).
    """

    vw: int
    stage: int
    cat: str
    mb: int
    start_ms: float
    end_ms: float


def _rows(
    trace: Sequence[TraceEvent], labels: Sequence[Sequence[str]] | None
) -> list[tuple[int, int, str]]:
    """``(vw, stage, name)`` of every GPU in the trace, in order."""
    keys = sorted({(e.vw, e.stage) for e in trace if e.stage >= 0})
    out = []
    for v, s in keys:
        gpu = labels[v][s] if labels is not None and v < len(labels) and s < len(labels[v]) else ""
        out.append((v, s, f"VW{v} s{s}" + (f" {gpu}" if gpu else "")))
    return out


def _chart_rows(
    trace: Sequence[TraceEvent], labels: Sequence[Sequence[str]] | None, max_rows: int
) -> list[tuple[int, int, str]]:
    """The Gantt's rows, top to bottom: per VW its wait row (``stage`` -1, when it waited)
    then its GPUs; whole VWs only, up to ``max_rows`` rows (at least one VW)."""
    waited = {e.vw for e in trace if e.stage < 0}
    by_vw: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for row in _rows(trace, labels):
        by_vw[row[0]].append(row)
    for v in waited:
        by_vw[v].insert(0, (v, -1, f"VW{v} WSP wait"))
    out: list[tuple[int, int, str]] = []
    for v in sorted(by_vw):
        if out and len(out) + len(by_vw[v]) > max_rows:
            break
        out += by_vw[v]
    return out


def _unit(span_ms: float) -> tuple[str, float]:
    return ("s", 1e3) if span_ms >= 2000 else ("ms", 1.0)


def _num(x: float) -> str:
    """A time for the title: ``1,500`` or ``11.35``, never ``1.5e+03``."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


Bars = dict[tuple[int, str], list[tuple[float, float]]]  # (row, category) -> (start, width)


def _window(
    p: Path, trace: Sequence[TraceEvent], from_ms: float, until_ms: float | None
) -> tuple[float, float]:
    """The trace's end and the window's end (ms); refuses an empty trace or window."""
    if not trace:
        raise ConfigError(f"{p}: nothing to draw (the run recorded no trace)")
    total = max(e.end_ms for e in trace)
    end = until_ms if until_ms is not None else total
    if not end > from_ms:
        raise ConfigError(
            f"{p}: empty time window {from_ms:g}-{end:g} ms (the run spans 0-{total:g} ms)"
        )
    return total, end


def _bars(
    trace: Sequence[TraceEvent],
    index: dict[tuple[int, int], int],
    from_ms: float,
    end: float,
    scale: float,
) -> Bars:
    """The intervals inside the window, clipped to it, by row and category (in ``scale`` units)."""
    bars: Bars = defaultdict(list)
    for e in trace:
        if e.start_ms >= end or e.end_ms <= from_ms or (e.vw, e.stage) not in index:
            continue
        a, b = max(e.start_ms, from_ms), min(e.end_ms, end)
        bars[(index[(e.vw, e.stage)], e.cat)].append((a / scale, (b - a) / scale))
    return bars


def _draw_bars(ax: Any, bars: Bars, rows: Sequence[tuple[int, int, str]]) -> None:
    """Draw the bars: compute on the row, its lanes (recv, push, host, wait) beside it."""
    for (i, cat), spans in bars.items():
        y = len(rows) - 1 - i
        if rows[i][1] < 0:  # the VW's own wait row
            ax.broken_barh(
                spans,
                (y - 0.3, 0.6),
                facecolors="#f6d5d4",
                edgecolors=COLORS[cat],
                hatch="//",
                linewidth=0.5,
            )
        elif cat == "wait":  # a stage's own wait: in the lane beneath, never over compute
            ax.broken_barh(
                spans,
                (y - 0.42, 0.27),
                facecolors="none",
                edgecolors=COLORS[cat],
                hatch="//",
                linewidth=0.0,
            )
        elif cat == "host":  # a thin lane just above the compute bars (recv is beneath)
            ax.broken_barh(spans, (y + 0.42, 0.12), facecolors=COLORS[cat], linewidth=0.0)
        elif cat in _LANE:
            ax.broken_barh(spans, (y - 0.42, 0.27), facecolors=COLORS[cat], linewidth=0.0)
        else:
            ax.broken_barh(
                spans, (y - 0.1, 0.5), facecolors=COLORS[cat], edgecolors="black", linewidth=0.2
            )


def _legend(ax: Any, bars: Bars) -> None:
    """A legend of the categories drawn, outside the axes (it never covers bars)."""
    from matplotlib.patches import Patch

    used = sorted({cat for _, cat in bars}, key=list(COLORS).index)
    handles = [
        Patch(
            facecolor="none" if c == "wait" else COLORS[c],
            edgecolor=COLORS[c],
            hatch="//" if c == "wait" else None,
            label={
                "wait": "WSP wait",
                "recv": "recv (lane)",
                "push": "push (lane)",
                "host": "host link (lane)",
            }.get(c, c),
        )
        for c in used
    ]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False
    )


def write_gantt(
    trace: Sequence[TraceEvent],
    path: str | os.PathLike[str],
    labels: Sequence[Sequence[str]] | None = None,
    max_rows: int = 32,
    until_ms: float | None = None,
    title: str = "hetpipe simulated pipeline",
    from_ms: float = 0.0,
) -> Path:
    """Draw a Gantt chart (PNG or SVG, by the file suffix) of ``trace``.

    Args:
        trace: recorded intervals.
        path: output file, ``.png`` or ``.svg``.
        labels: per VW, per stage GPU label (e.g. ``V:0``) shown beside each row.
        max_rows: draw at most this many rows (whole VWs, the first ones).
        until_ms, from_ms: the time window to draw (default: the whole run); the title names it.
        title: chart title (a second line names the window).

    Raises:
        ConfigError: unknown suffix, an empty trace or an empty window.
    """
    p = Path(path)
    if p.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"{p}: the Gantt chart must be a .png or .svg file")
    total, end = _window(p, trace, from_ms, until_ms)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _chart_rows(trace, labels, max_rows)
    index = {(v, s): i for i, (v, s, _) in enumerate(rows)}
    unit, scale = _unit(end - from_ms)
    bars = _bars(trace, index, from_ms, end, scale)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.35 * len(rows)))
    _draw_bars(ax, bars, rows)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for _, _, name in reversed(rows)], fontsize=7)
    ax.set_xlim(from_ms / scale, end / scale)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"time ({unit})")
    shown = f"{_num(from_ms / scale)}-{_num(end / scale)} {unit}"
    whole = f"{_num(total / 1e3)} s" if total >= 2000 else f"{_num(total)} ms"
    ax.set_title(f"{title}\ntime window {shown} of a {whole} trace", fontsize=9)
    _legend(ax, bars)
    buf = io.BytesIO()
    fig.savefig(buf, format=p.suffix.lstrip(".").lower() or "png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(p, buf.getvalue())


def chrome_trace(
    trace: Sequence[TraceEvent], labels: Sequence[Sequence[str]] | None = None, about: str = ""
) -> dict[str, Any]:
    """The trace as a Chrome Trace Event Format document (``ph: X`` events, microseconds).

    ``about`` (model, plan) is kept in ``otherData`` for :func:`read_chrome_trace`.
    """
    events: list[dict[str, Any]] = []
    for v in sorted({e.vw for e in trace}):
        events.append(
            {"ph": "M", "name": "process_name", "pid": v, "tid": 0, "args": {"name": f"VW {v}"}}
        )
        if any(e.vw == v and e.stage < 0 for e in trace):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": v, "tid": 0, "args": {"name": "WSP wait"}}
            )
    for v, s, name in _rows(trace, labels):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": v, "tid": s + 1, "args": {"name": name}}
        )
    for e in trace:
        events.append(
            {
                "name": f"wait for wave {e.mb}" if e.cat == "wait" else f"{e.cat}{e.mb}",
                "cat": e.cat,
                "ph": "X",
                "ts": e.start_ms * 1e3,
                "dur": (e.end_ms - e.start_ms) * 1e3,
                "pid": e.vw,
                "tid": e.stage + 1,  # tid 0 holds VW-wide intervals (WSP waits)
                "args": {"mb" if e.cat not in ("wait", "push") else "wave": e.mb},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"about": about}}


def write_chrome_trace(
    trace: Sequence[TraceEvent],
    path: str | os.PathLike[str],
    labels: Sequence[Sequence[str]] | None = None,
    about: str = "",
) -> Path:
    """Write :func:`chrome_trace` as JSON (atomically)."""
    return atomic_write_text(Path(path), json.dumps(chrome_trace(trace, labels, about)))


def read_chrome_trace(
    path: str | os.PathLike[str],
) -> tuple[list[TraceEvent], list[list[str]], str]:
    """Read a trace written by :func:`write_chrome_trace`: ``(intervals, GPU labels, about)``.

    Raises:
        ConfigError: the file is missing or is not such a trace.
    """
    p = Path(path)
    try:
        text = read_text(p, "the trace", ConfigError)  # bounded; any bytes: one line
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}; not a hetpipe trace.json? point at the trace a run wrote into --out"
        ) from None
    try:
        doc = json.loads(text)
        trace: list[TraceEvent] = []
        names: dict[tuple[int, int], str] = {}
        for ev in doc["traceEvents"]:
            if ev["ph"] == "M" and ev["name"] == "thread_name" and ev["tid"] > 0:
                words = str(ev["args"]["name"]).split(" ", 2)  # "VW0 s1 V:0"
                names[(int(ev["pid"]), int(ev["tid"]) - 1)] = words[2] if len(words) > 2 else ""
            elif ev["ph"] == "X":
                mb = ev["args"].get("mb", ev["args"].get("wave", 0))
                t0, dur = float(ev["ts"]) / 1e3, float(ev["dur"]) / 1e3
                trace.append(
                    TraceEvent(
                        int(ev["pid"]), int(ev["tid"]) - 1, str(ev["cat"]), int(mb), t0, t0 + dur
                    )
                )
        about = str(doc.get("otherData", {}).get("about", ""))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{p}: not a hetpipe trace.json ({type(exc).__name__}: {str(exc)[:80]}); "
            "point at the trace a run wrote into --out"
        ) from exc
    labels: list[list[str]] = []
    for (v, s), gpu in sorted(names.items()):
        while len(labels) <= v:
            labels.append([])
        while len(labels[v]) <= s:
            labels[v].append("")
        labels[v][s] = gpu
    return sorted(trace, key=lambda e: (e.start_ms, e.vw, e.stage)), labels, about
