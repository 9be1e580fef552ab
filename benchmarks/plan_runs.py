"""Shared by the memory benchmarks (``bench_whimpy.py``, ``bench_geeps.py``): train a plan on the
emulated cluster and report the run as one JSON row and one printed line."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from planner.offload import MemoryPlacement
from planner.plan import Plan

__all__ = ["run_row", "train_plan"]


def train_plan(plan: Plan, steps: int) -> tuple[Any, float]:
    """Train ``plan`` for ``steps`` minibatches per VW (paced, byte accounting on); the
    result and its wall-clock seconds."""
    from hetpipe.api import train

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = train(plan.model, plan=plan, steps=steps, out=tmp, return_state=False)
        return result, time.perf_counter() - t0


def run_row(label: str, plan: Plan, measured: float | None, **extra: Any) -> dict[str, Any]:
    """One run of ``plan`` as a row (Nm, placements, measured vs predicted samples/s, load
    average), printed as one line after ``label``; ``measured`` None: predicted only."""
    predicted = plan.predicted.throughput
    load = os.getloadavg()
    codes = [
        [MemoryPlacement.parse(s.memory).code for s in vw.stages] for vw in plan.virtual_workers
    ]
    row: dict[str, Any] = {
        **extra,
        "nm": plan.nm,
        "placements": [[s.memory for s in vw.stages] for vw in plan.virtual_workers],
        "predicted": predicted,
        "measured": measured,
        "measured_over_predicted": None if measured is None else measured / predicted,
        "loadavg": load,
    }
    seen = "" if measured is None else f"{measured:,.0f} measured, "
    ratio = "" if measured is None else f" ({measured / predicted:.2f})"
    print(
        f"  {label}: Nm {plan.nm}, {seen}{predicted:,.0f} predicted samples/s{ratio}, "
        f"WAOG {' | '.join(' '.join(c) for c in codes)}, load {load[0]:.1f}"
    )
    return row
