"""The measured timeline of a run: what each device did when, as a picture and a Chrome trace.

Every stage logs its tasks (``F``, ``B``, the last stage's ``FB``), its WSP pull waits and its
pushes of a wave's update with wall-clock start and end times
(:attr:`runtime.results.metrics.StageResult.task_log`, the first :data:`runtime.results.metrics.MAX_TASK_LOG`
entries of a run). :func:`measured_trace` turns them into
:class:`~planner.draw.TraceEvent` intervals, the ones the simulator records, so one drawing
code (:mod:`planner.draw`, not the simulator's) shows both the predicted and the measured pipeline: ``hetpipe simulate --gantt`` next to the
``timeline.png`` a run writes into ``--out``. Transfers are not logged by the runtime (they
overlap compute in background sends), so a measured chart has no ``recv`` lane.

A run saves every logged interval in ``trace.json``; ``timeline.png`` shows the first
minibatches, and :func:`draw_window` (``hetpipe timeline RUN_DIR --window a:b``) redraws
any other window from that file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from planner.draw import TraceEvent, read_chrome_trace, write_chrome_trace, write_gantt
from planner.plan import Plan
from profiler.errors import ConfigError
from runtime.results.metrics import StageResult

__all__ = ["describe_run", "draw_window", "measured_trace", "parse_window", "write_timeline"]


def describe_run(plan: Plan, vw: int | None = None) -> str:
    """One line naming the model and the plan (for the timeline's title), e.g.
    ``vgg19, policy ed: 2 VWs (VW0 QGRV, VW1 QGRV), Nm 8, D 0, batch 32``."""
    vws = plan.virtual_workers if vw is None else plan.virtual_workers[vw : vw + 1]
    sigs = ", ".join(f"VW{w.id} {w.signature}" for w in vws)
    which = f"{len(vws)} VWs" if vw is None else f"VW {vw} of {len(plan.virtual_workers)}"
    return (
        f"{plan.model}, policy {plan.policy}: {which} ({sigs}), Nm {plan.nm}, D {plan.D}, "
        f"batch {plan.batch_size}"
    )


def measured_trace(stages: Sequence[StageResult]) -> list[TraceEvent]:
    """The logged intervals of every stage, in ms since the earliest start.

    A stage-0 pull wait blocks its VW's admission, so it becomes a VW-wide ``wait`` interval
    (``stage = -1``, drawn on the VW's own wait row); other stages' waits are drawn in the
    lane beneath their own row.
    """
    starts = [t0 for s in stages for _, _, t0, _ in s.task_log]
    if not starts:
        return []
    origin = min(starts)
    out = []
    for s in stages:
        for cat, mb, t0, t1 in s.task_log:
            row = -1 if cat == "wait" and s.stage == 0 else s.stage
            out.append(TraceEvent(s.vw, row, cat, mb, (t0 - origin) * 1e3, (t1 - origin) * 1e3))
    return sorted(out, key=lambda e: (e.start_ms, e.vw, e.stage))


def write_timeline(
    stages: Sequence[StageResult], out_dir: Path, window_mb: int = 40, about: str = ""
) -> tuple[Path, Path] | None:
    """Write ``timeline.png`` (the first ``window_mb`` minibatches of VW 0, enough to see the
    pipeline fill and its steady state) and ``trace.json`` (every logged interval, for
    https://ui.perfetto.dev and ``hetpipe timeline``). ``about`` (:func:`describe_run`) names
    the model and plan in both. ``None`` when nothing was logged."""
    trace = measured_trace(stages)
    if not trace:
        return None
    labels: dict[int, dict[int, str]] = {}
    for s in stages:
        labels.setdefault(s.vw, {})[s.stage] = s.device
    rows = [[names[k] for k in sorted(names)] for _, names in sorted(labels.items())]
    ends = sorted(e.end_ms for e in trace if e.vw == 0 and e.cat in ("B", "FB") and e.stage == 0)
    until = ends[min(window_mb, len(ends)) - 1] if ends else None
    title = f"measured: {about}" if about else "hetpipe measured pipeline"
    shown = min(window_mb, len(ends))
    png = write_gantt(
        trace,
        out_dir / "timeline.png",
        rows,
        until_ms=until,
        title=f"{title}\nfirst {shown} minibatches of VW 0 ('hetpipe timeline DIR --window a:b' for others)",
    )
    return png, write_chrome_trace(trace, out_dir / "trace.json", rows, about)


def parse_window(text: str) -> tuple[float, float | None]:
    """``"a:b"`` seconds -> ``(a, b)``; ``"a:"`` means from ``a`` to the end.

    Raises:
        ConfigError: not two numbers with ``0 <= a < b``.
    """
    a, sep, b = text.partition(":")
    try:
        lo = float(a) if a.strip() else 0.0
        hi = float(b) if b.strip() else None
    except ValueError:
        lo, hi = float("nan"), None
    if not sep or not 0.0 <= lo < float("inf") or (hi is not None and not lo < hi < float("inf")):
        raise ConfigError(
            f"--window {text[:40]!r}: give START:END in seconds from the run's first task, "
            "0 <= START < END (e.g. 2:2.5, or 2: for the rest)"
        )
    return lo, hi


def draw_window(
    run_dir: Path, window_s: tuple[float, float | None], out: Path | None = None
) -> Path:
    """Redraw a run's timeline for ``window_s`` (seconds) from its ``trace.json``.

    Args:
        run_dir: the run's ``--out`` directory (or its ``trace.json``).
        window_s: ``(start, end)`` seconds since the run's first logged task; ``end`` None:
            to the end of the log.
        out: the picture (.png or .svg); default ``RUN_DIR/timeline-<start>-<end>s.png``.

    Raises:
        ConfigError: no readable trace, or nothing logged in the window.
    """
    path = run_dir / "trace.json" if run_dir.is_dir() else run_dir
    trace, labels, about = read_chrome_trace(path)
    if not trace:
        raise ConfigError(f"{path}: the run logged no task")
    last = max(e.end_ms for e in trace)
    lo, hi = window_s[0] * 1e3, (window_s[1] * 1e3 if window_s[1] is not None else last)
    if lo >= last:
        raise ConfigError(
            f"--window starts at {window_s[0]:g} s but the log ends at {last / 1e3:.3f} s "
            "(a stage logs its first tasks only: see runtime.results.metrics.MAX_TASK_LOG)"
        )
    if out is None:
        out = path.parent / f"timeline-{window_s[0]:g}-{hi / 1e3:g}s.png"
    title = f"measured: {about}" if about else f"measured: {path.parent.name}"
    return write_gantt(trace, out, labels, until_ms=hi, from_ms=lo, title=title)
