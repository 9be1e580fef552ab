"""Where each stage's wall time went (``--profile-runtime``): categories, JSON and a table.

The categories (milliseconds per stage, split by the task kind running):

- ``real_compute``: the forward, backward and loss computations themselves;
- ``paced``: waiting until the emulated device's planned task time is over (pacing);
- ``optimizer``: parking gradients, the optimizer step, tied-weight exchange;
- ``wait_neighbour``: blocked waiting for activations or gradients from a neighbour stage;
- ``send_recv``: posting sends to neighbours and handing received messages to the queue;
- ``ps``: the synchronisation rule's own work (push/pull posting, folding a pull, snapshots);
- ``wsp_wait``: blocked waiting for the parameter servers' global clock (pulls);
- ``bookkeeping``: reports to the launcher, the timeline, loss/gradient checks, admission;
- ``data``: stage 0 loading a minibatch;
- ``other``: the rest (Python between the timed steps): wall time minus every other category.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.table import Table

if TYPE_CHECKING:
    from runtime.results.metrics import StageResult

__all__ = [
    "CATEGORIES",
    "LOOP",
    "Breakdown",
    "breakdown_json",
    "breakdown_table",
    "mean_overhead_ms_per_task",
]

CATEGORIES = (
    "real_compute",
    "paced",
    "optimizer",
    "wait_neighbour",
    "send_recv",
    "ps",
    "wsp_wait",
    "bookkeeping",
    "data",
    "other",
)
"""Every category, in the order the summary shows them."""

LOOP = "loop"
"""The task kind of the time between tasks (the stage's loop)."""

_WAITS = ("wait_neighbour", "wsp_wait")
"""Waiting for other processes: the simulator models these itself."""


@dataclass(frozen=True)
class Breakdown:
    """One stage's measured time by task kind and category.

    Attributes:
        wall_ns: from the stage's start to its end, nanoseconds (the sum of ``ns``).
        ns: ``(task kind, category, nanoseconds)``; kinds ``F``, ``B``, ``FB`` and ``loop``.
        tasks: ``(task kind, tasks executed)``.
        planned_ns: an emulated device's planned time of every task, summed (what pacing
            stretched them to; 0: not paced).
    """

    wall_ns: int
    ns: tuple[tuple[str, str, int], ...]
    tasks: tuple[tuple[str, int], ...]
    planned_ns: int = 0

    def total_ms(self, category: str) -> float:
        """Milliseconds of ``category`` over every task kind."""
        return sum(ns for _, c, ns in self.ns if c == category) / 1e6

    def by_kind_ms(self) -> dict[str, dict[str, float]]:
        """Milliseconds per task kind per category (categories without time left out)."""
        out: dict[str, dict[str, float]] = {}
        for kind, category, ns in self.ns:
            out.setdefault(kind, {})[category] = ns / 1e6
        return out

    @property
    def task_count(self) -> int:
        """Tasks executed."""
        return sum(n for _, n in self.tasks)

    def overhead_ms_per_task(self) -> float:
        """The runtime's own time per task, in milliseconds: the stage's time not spent
        waiting for other processes, less the work the simulator already counts (an emulated
        device's planned task times; else the real computation). On an emulated device the
        optimizer step and a wave's push run inside the planned window (device work): they
        count only where they make a task late."""
        n = self.task_count
        if not n:
            return 0.0
        busy_ms = self.wall_ns / 1e6 - sum(self.total_ms(c) for c in _WAITS)
        work_ms = self.planned_ns / 1e6 if self.planned_ns else self.total_ms("real_compute")
        return max(0.0, busy_ms - work_ms) / n


def _profiled(stages: Sequence[StageResult]) -> list[tuple[StageResult, Breakdown]]:
    return [(s, s.breakdown) for s in stages if s.breakdown is not None]


def breakdown_json(stages: Sequence[StageResult]) -> list[dict[str, Any]]:
    """One entry per profiled stage for ``summary.json`` (``[]``: no ``--profile-runtime``)."""
    return [
        {
            "vw": s.vw,
            "stage": s.stage,
            "device": s.device,
            "wall_ms": b.wall_ns / 1e6,  # the sum of the categories
            "stage_wall_ms": s.wall_s * 1e3,  # the stage's own wall time, measured apart
            "tasks": dict(b.tasks),
            "planned_ms": b.planned_ns / 1e6,
            "ms": {c: b.total_ms(c) for c in CATEGORIES},
            "ms_by_kind": b.by_kind_ms(),
            "overhead_ms_per_task": b.overhead_ms_per_task(),
        }
        for s, b in _profiled(stages)
    ]


def breakdown_table(stages: Sequence[StageResult]) -> Table | None:
    """Per category (rows) and stage (columns), milliseconds per task and the share of the
    stage's wall time (``None``: nothing profiled)."""
    rows = _profiled(stages)
    if not rows:
        return None
    table = Table(title="where each stage's time went: ms per task (% of wall); --profile-runtime")
    table.add_column("category")
    for s, _ in rows:
        table.add_column(f"vw{s.vw} s{s.stage}", justify="right")
    for category in CATEGORIES:
        cells = []
        for _, b in rows:
            ms, wall = b.total_ms(category), b.wall_ns / 1e6 or 1.0
            cells.append(f"{ms / max(b.task_count, 1):.3f} ({100 * ms / wall:.0f}%)")
        table.add_row(category.replace("_", " "), *cells)
    table.add_row("tasks", *(str(b.task_count) for _, b in rows))
    table.add_row("wall s", *(f"{b.wall_ns / 1e9:.2f}" for _, b in rows))
    table.add_row("overhead ms/task", *(f"{b.overhead_ms_per_task():.3f}" for _, b in rows))
    return table


def mean_overhead_ms_per_task(stages: Sequence[StageResult]) -> float:
    """The runtime's own cost per task, averaged over the profiled stages (0: none): the one
    constant the simulator adds to every task (``overhead_ms_per_task``)."""
    rows = _profiled(stages)
    return sum(b.overhead_ms_per_task() for _, b in rows) / len(rows) if rows else 0.0
