"""Pictures of a simulated (or measured) run: a Gantt chart and a Chrome-trace JSON.

Both take the :class:`~planner.sim_engine.TraceEvent` intervals of a run recorded with
``record_trace=True``. The Gantt chart has one row per GPU (``VW v / stage s``) showing
forward (``F``), backward (``B``), the last stage's fused ``FB``, receiving (``recv``),
pushes to the parameter server (``push``) and WSP waiting (``wait``: the VW's admission is
blocked, drawn as a hatched band behind all of the VW's rows). The Chrome trace opens in
https://ui.perfetto.dev or chrome://tracing: one process per VW, one thread per stage.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.sim_engine import TraceEvent
from profiler.errors import ConfigError
from profiler.files import atomic_write_text

__all__ = ["COLORS", "chrome_trace", "write_chrome_trace", "write_gantt"]

COLORS: dict[str, str] = {
    "F": "#f2c12e",  # forward: yellow, as in the paper's Fig. 1
    "B": "#3aa655",  # backward: green
    "FB": "#e07b39",  # last stage's forward+backward
    "recv": "#4a90d9",  # receiving activations/gradients
    "push": "#8e6bbf",  # pushing the wave's update
    "wait": "#d9534f",  # WSP: admission blocked
}


def _rows(
    trace: Sequence[TraceEvent], labels: Sequence[Sequence[str]] | None
) -> list[tuple[int, int, str]]:
    keys = sorted({(e.vw, e.stage) for e in trace if e.stage >= 0})
    out = []
    for v, s in keys:
        gpu = labels[v][s] if labels is not None and v < len(labels) and s < len(labels[v]) else ""
        out.append((v, s, f"VW{v} s{s}" + (f" {gpu}" if gpu else "")))
    return out


def write_gantt(
    trace: Sequence[TraceEvent],
    path: str | os.PathLike[str],
    labels: Sequence[Sequence[str]] | None = None,
    max_rows: int = 32,
    until_ms: float | None = None,
    title: str = "hetpipe simulated pipeline",
) -> Path:
    """Draw a Gantt chart (PNG or SVG, by the file suffix) of ``trace``.

    Args:
        trace: recorded intervals.
        path: output file, ``.png`` or ``.svg``.
        labels: per VW, per stage GPU label (e.g. ``V:0``) shown beside each row.
        max_rows: draw at most this many GPU rows (the first VWs); large clusters stay legible.
        until_ms: draw only up to this time (default: the whole run).
        title: chart title.

    Raises:
        ConfigError: unknown suffix or an empty trace.
    """
    p = Path(path)
    if p.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"{p}: the Gantt chart must be a .png or .svg file")
    if not trace:
        raise ConfigError(f"{p}: nothing to draw (the run recorded no trace)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _rows(trace, labels)[:max_rows]
    index = {(v, s): i for i, (v, s, _) in enumerate(rows)}
    vws = {v for v, _, _ in rows}
    end = until_ms if until_ms is not None else max(e.end_ms for e in trace)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in trace:
        if e.start_ms >= end:
            continue
        span = (e.start_ms, min(e.end_ms, end) - e.start_ms)
        if e.cat == "wait":
            if e.vw in vws:
                for (v, _s), i in index.items():
                    if v == e.vw:
                        bars[(i, "wait")].append(span)
        elif (e.vw, e.stage) in index:
            bars[(index[(e.vw, e.stage)], e.cat)].append(span)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.35 * len(rows)))
    for (i, cat), spans in bars.items():
        y = len(rows) - 1 - i
        if cat == "wait":
            ax.broken_barh(
                spans,
                (y - 0.45, 0.9),
                facecolors="none",
                edgecolors=COLORS[cat],
                hatch="//",
                linewidth=0.0,
            )
        elif cat in ("recv", "push"):
            ax.broken_barh(spans, (y - 0.4, 0.25), facecolors=COLORS[cat])
        else:
            ax.broken_barh(
                spans, (y - 0.1, 0.5), facecolors=COLORS[cat], edgecolors="black", linewidth=0.2
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for _, _, name in reversed(rows)], fontsize=7)
    ax.set_xlim(0, end)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    used = sorted({cat for _, cat in bars}, key=list(COLORS).index)
    handles = [
        Patch(
            facecolor="none" if c == "wait" else COLORS[c],
            edgecolor=COLORS[c],
            hatch="//" if c == "wait" else None,
            label=c,
        )
        for c in used
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
    fig.tight_layout()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{p.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, p)
    return p


def chrome_trace(
    trace: Sequence[TraceEvent], labels: Sequence[Sequence[str]] | None = None
) -> dict[str, Any]:
    """The trace as a Chrome Trace Event Format document (``ph: X`` events, microseconds)."""
    events: list[dict[str, Any]] = []
    for v, s, name in _rows(trace, labels):
        events.append(
            {"ph": "M", "name": "process_name", "pid": v, "tid": 0, "args": {"name": f"VW {v}"}}
        )
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
                "args": {"mb" if e.cat != "wait" else "wave": e.mb},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    trace: Sequence[TraceEvent],
    path: str | os.PathLike[str],
    labels: Sequence[Sequence[str]] | None = None,
) -> Path:
    """Write :func:`chrome_trace` as JSON (atomically)."""
    return atomic_write_text(Path(path), json.dumps(chrome_trace(trace, labels)))
