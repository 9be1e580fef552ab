"""The plan predicted again with the runtime overhead a run measured (``--profile-runtime``).

The runtime measures (:mod:`runtime.results.breakdown`) and never reads the simulator; the
front end, which may, simulates the plan again with that overhead added to every task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.plan import Plan
    from runtime.results.metrics import StageResult

__all__ = ["overhead_note"]


def overhead_note(plan: Plan, stages: Sequence[StageResult], measured: float) -> str:
    """One line: the plan simulated again with the measured overhead per task added, next to
    the measured throughput (``plan``: as it ran, its Nm and D; samples/s)."""
    from planner.sim.simulator import simulate
    from runtime.results.breakdown import mean_overhead_ms_per_task

    over = mean_overhead_ms_per_task(stages)
    predicted = simulate(plan, overhead_ms_per_task=over).throughput
    ratio = f", ratio {measured / predicted:.2f}" if predicted > 0 else ""
    return (
        f"predicted with the measured runtime overhead ({over:.3f} ms per task, mean of the "
        f"stages): {predicted:.1f} samples/s (measured {measured:.1f}{ratio})"
    )
