"""The measured timeline of a run: what each device did when, as a picture and a Chrome trace.

Every stage logs its tasks (``F``, ``B``, the last stage's ``FB``) and its WSP pull waits with
wall-clock start and end times (:attr:`runtime.metrics.StageResult.task_log`, the first
:data:`runtime.metrics.MAX_TASK_LOG` entries of a run). :func:`measured_trace` turns them into the simulator's
:class:`~planner.sim_types.TraceEvent` intervals, so one drawing code
(:mod:`planner.gantt`) shows both the predicted and the measured pipeline: ``hetpipe simulate
--gantt`` next to the ``timeline.png`` a run writes into ``--out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from planner.gantt import write_chrome_trace, write_gantt
from planner.sim_types import TraceEvent
from runtime.metrics import StageResult

__all__ = ["measured_trace", "write_timeline"]


def measured_trace(stages: Sequence[StageResult]) -> list[TraceEvent]:
    """The logged intervals of every stage, in ms since the earliest start.

    A stage-0 pull wait blocks its VW's admission, so it becomes a VW-wide ``wait`` interval
    (``stage = -1``, drawn behind all of the VW's rows); other stages' waits are drawn on
    their own row.
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
    stages: Sequence[StageResult], out_dir: Path, window_mb: int = 40
) -> tuple[Path, Path] | None:
    """Write ``timeline.png`` (the first ``window_mb`` minibatches of VW 0, enough to see the
    pipeline fill and its steady state) and ``trace.json`` (every logged interval, for
    https://ui.perfetto.dev). ``None`` when nothing was logged."""
    trace = measured_trace(stages)
    if not trace:
        return None
    labels: dict[int, dict[int, str]] = {}
    for s in stages:
        labels.setdefault(s.vw, {})[s.stage] = s.device
    rows = [[names[k] for k in sorted(names)] for _, names in sorted(labels.items())]
    ends = sorted(e.end_ms for e in trace if e.vw == 0 and e.cat in ("B", "FB") and e.stage == 0)
    until = ends[min(window_mb, len(ends)) - 1] if ends else None
    png = write_gantt(
        trace, out_dir / "timeline.png", rows, until_ms=until, title="hetpipe measured pipeline"
    )
    return png, write_chrome_trace(trace, out_dir / "trace.json", rows)
