"""Pipeline schedules (paper Sec. 4) as pure data: task order, admission and memory bound.

One source of truth for the simulator (which predicts), the runtime (which executes) and the
planner's memory model (which sizes stages). A :class:`Schedule` is a named object, looked up in
:data:`SCHEDULES` by the name a plan records (``schedule: hetpipe``); it owns the task order
(:meth:`Schedule.queue`), the admission of minibatches into a VW's pipeline
(:meth:`Schedule.admissible`) and the in-flight memory bound (:meth:`Schedule.in_flight_bound`).
:func:`actions` runs a schedule alone into a printable action list per stage. The schedules:

- ``hetpipe`` (the default): minibatch ``p`` enters once ``p - Nm`` completed its first-stage
  backward: ``Nm`` in flight, one in as one completes;
- ``flush`` (the GPipe / 1F1B baseline): a wave of ``Nm`` enters once every admitted
  minibatch completed, so the pipeline drains between waves.

Both hold at most ``Nm`` minibatches on a stage, one on the last.

Task order. Every GPU of a virtual worker (VW) owns one :class:`StageQueue`. The caller tells
it which tasks have their inputs (:meth:`StageQueue.ready`), asks for the task to run now
(:meth:`StageQueue.next`) and reports completion (:meth:`StageQueue.done`). The rules:

1. a forward task ``F(p)`` runs only after ``F(p-1)`` is done on this stage;
2. a backward task ``B(p)`` runs only after ``B(p-1)`` is done on this stage;
3. among the tasks allowed by rules 1 and 2, the one whose inputs arrived first runs (FIFO);
4. the last stage runs forward immediately followed by backward as one task ``FB(p)``.

A stage executes one task at a time: :meth:`StageQueue.next` returns ``None`` while a task
it handed out is not yet ``done``. Minibatches are numbered from 1.

Example:
    >>> q = StageQueue(stage=0, n_stages=2)
    >>> q.ready(Task(0, Kind.F, 1)); str(q.next())
    '0F1'
    >>> print(format_actions(actions(SCHEDULES["hetpipe"], n_stages=2, nm=2, total=4)))
    stage 0: F1 F2 B1 F3 B2 F4 B3 B4
    stage 1: FB1 FB2 FB3 FB4
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import count
from types import MappingProxyType

from profiler.errors import PlanError, shown

__all__ = [
    "DEFAULT_SCHEDULE",
    "FLUSH",
    "HETPIPE",
    "SCHEDULES",
    "FlushSchedule",
    "Kind",
    "Schedule",
    "StageQueue",
    "Task",
    "actions",
    "format_actions",
    "schedule_named",
]


class Kind(str, Enum):
    """Task kind: forward, backward, or the last stage's fused forward+backward."""

    F = "F"
    B = "B"
    FB = "FB"


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work of a stage.

    Attributes:
        stage: 0-based stage index in the pipeline.
        kind: forward, backward or fused (last stage only).
        mb: 1-based minibatch number (local to the virtual worker).
    """

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"


class StageQueue:
    """The task queue of one stage, applying rules 1-4 of the module docstring.

    Each call is O(1): by rules 1 and 2 at most one forward and one backward task can be
    runnable, so the queue only compares their readiness order.

    Args:
        stage: 0-based stage index.
        n_stages: number of stages of the pipeline (``stage == n_stages - 1`` is the last).
    """

    __slots__ = (
        "_forward_kind",
        "_in_flight",
        "_next_b",
        "_next_f",
        "_ready",
        "_running",
        "_seq",
        "is_last",
        "n_stages",
        "stage",
    )

    def __init__(self, stage: int, n_stages: int) -> None:
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
        self.stage = stage
        self.n_stages = n_stages
        self.is_last = stage == n_stages - 1
        self._forward_kind = Kind.FB if self.is_last else Kind.F
        self._seq = 0  # readiness counter (FIFO order)
        # (kind, mb) -> (readiness sequence number, the task as made ready)
        self._ready: dict[tuple[Kind, int], tuple[int, Task]] = {}
        self._next_f = 1  # next forward (or fused) minibatch allowed by rule 1
        self._next_b = 1  # next backward minibatch allowed by rule 2
        self._running: Task | None = None
        self._in_flight = 0

    @property
    def running(self) -> Task | None:
        """The task handed out by :meth:`next` and not yet done, if any."""
        return self._running

    @property
    def in_flight(self) -> int:
        """Minibatches this stage holds: forward started, backward not yet done."""
        if self.is_last:
            return int(self._running is not None)
        return self._in_flight

    @property
    def forward_kind(self) -> Kind:
        """``Kind.FB`` on the last stage, else ``Kind.F``."""
        return self._forward_kind

    def ready(self, task: Task) -> None:
        """Record that ``task``'s inputs arrived (activations for F/FB, gradients for B).

        Raises:
            ValueError: the task belongs to another stage, has the wrong kind for this stage
                (``F``/``B`` on the last stage, ``FB`` elsewhere), is already done, or is
                already ready.
        """
        if task.stage != self.stage:
            raise ValueError(f"task {task} belongs to stage {task.stage}, not {self.stage}")
        if task.mb < 1:
            raise ValueError(f"task {task}: minibatches are numbered from 1")
        if self.is_last != (task.kind is Kind.FB):
            raise ValueError(
                f"task {task}: the last stage runs FB tasks only, other stages F and B"
            )
        key = (task.kind, task.mb)
        done_before = self._next_b if task.kind is Kind.B else self._next_f
        if task.mb < done_before or key in self._ready:
            raise ValueError(f"task {task} was already made ready")
        self._ready[key] = (self._seq, task)
        self._seq += 1

    def next(self) -> Task | None:
        """The task to run now (and mark it running), or ``None`` if none may run yet."""
        if self._running is not None:
            return None
        ready = self._ready
        f_key = (self._forward_kind, self._next_f)
        f = ready.get(f_key)
        b = None if self.is_last else ready.get((Kind.B, self._next_b))
        if f is None and b is None:
            return None
        if b is not None and (f is None or b[0] < f[0]):
            key = (Kind.B, self._next_b)
        else:
            key = f_key
            if not self.is_last:
                self._in_flight += 1
        self._running = ready.pop(key)[1]
        return self._running

    def done(self, task: Task) -> None:
        """Record that the running ``task`` finished.

        Raises:
            ValueError: ``task`` is not the running task.
        """
        if task is not self._running and task != self._running:
            raise ValueError(
                f"task {task} is not running on stage {self.stage} (running: {self._running})"
            )
        self._running = None
        if task.kind is Kind.B:
            self._next_b += 1
            self._in_flight -= 1
        else:
            self._next_f += 1
            if task.kind is Kind.FB:
                self._next_b += 1


# ---------------------------------------------------------------- named schedules


@dataclass(frozen=True, slots=True)
class Schedule:
    """A pipeline schedule; this class is HetPipe's (``Nm`` in flight, one in as one completes),
    and a schedule that admits, orders or bounds otherwise overrides that method.

    Attributes:
        name: the name a plan records (``schedule:``) and :data:`SCHEDULES` is keyed by.
    """

    name: str

    def queue(self, stage: int, n_stages: int) -> StageQueue:
        """The task order of stage ``stage`` of ``n_stages`` (rules 1-4 of the module docstring)."""
        return StageQueue(stage, n_stages)

    def admissible(self, admitted: int, completed: int, nm: int, total: int) -> int:
        """How many more minibatches may enter the VW's first stage now.

        Args:
            admitted: minibatches admitted so far.
            completed: of those, minibatches whose first-stage backward (or ``FB``) is done.
            nm: minibatches per wave (most in flight).
            total: minibatches to run in all (never admits beyond it).

        Raises:
            ValueError: ``completed`` outside ``[0, admitted]`` or ``nm < 1``.

        Example:
            >>> HETPIPE.admissible(admitted=4, completed=1, nm=4, total=10)
            1
        """
        _check_counts(admitted, completed, nm)
        return max(0, min(nm - (admitted - completed), total - admitted))

    def in_flight_bound(self, stage: int, n_stages: int, nm: int) -> int:
        """Most minibatches stage ``stage`` of ``n_stages`` can hold at once with ``nm`` in flight.

        A stage holds a minibatch (its saved activations and received inputs) from the start
        of its forward task until its backward task ends. Every stage but the last can, in the
        worst case over all timings, hold every in-flight minibatch (``nm``); the last stage
        runs the fused ``FB`` task and holds exactly one. The planner's memory model sizes
        stages with it.

        Raises:
            ValueError: ``stage`` outside ``[0, n_stages)`` or ``nm < 1``.
        """
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
        if nm < 1:
            raise ValueError(f"nm must be >= 1, got {nm}")
        return 1 if stage == n_stages - 1 else nm


@dataclass(frozen=True, slots=True)
class FlushSchedule(Schedule):
    """The flushing baseline (GPipe / 1F1B style): the next wave of ``Nm`` minibatches enters
    only when the whole previous wave completed; task order and memory bound as HetPipe's."""

    def admissible(self, admitted: int, completed: int, nm: int, total: int) -> int:
        """``min(nm, total - admitted)`` once every admitted minibatch completed, else 0.

        Example:
            >>> FLUSH.admissible(admitted=4, completed=3, nm=4, total=10)
            0
        """
        _check_counts(admitted, completed, nm)
        return 0 if completed < admitted else max(0, min(nm, total - admitted))


def _check_counts(admitted: int, completed: int, nm: int) -> None:
    if not 0 <= completed <= admitted:
        raise ValueError(f"completed must be within 0..admitted={admitted}, got {completed}")
    if nm < 1:
        raise ValueError(f"nm must be >= 1, got {nm}")


HETPIPE = Schedule("hetpipe")
FLUSH = FlushSchedule("flush")
SCHEDULES: Mapping[str, Schedule] = MappingProxyType({s.name: s for s in (HETPIPE, FLUSH)})
"""Every pipeline schedule by name."""
DEFAULT_SCHEDULE = HETPIPE.name


def schedule_named(name: object, where: str = "schedule") -> Schedule:
    """The schedule called ``name``.

    Raises:
        PlanError: no such schedule; the message names ``where`` (the field) and the choices.
    """
    found = SCHEDULES.get(name) if isinstance(name, str) else None
    if found is None:
        raise PlanError(
            f"{where}: unknown pipeline schedule {shown(name, 40)}; "
            f"choose one of {', '.join(SCHEDULES)}"
        )
    return found


# ---------------------------------------------------------------- action lists


def actions(
    schedule: Schedule, n_stages: int, nm: int, total: int, fwd: float = 1.0, bwd: float = 2.0
) -> tuple[tuple[Task, ...], ...]:
    """The tasks every stage runs, in order, when ``schedule`` runs one VW alone.

    Every forward takes ``fwd`` and every backward ``bwd`` time units (the last stage's ``FB``
    both), transfers take none, ties go in the order events were scheduled: the same rules
    the simulator and the runtime execute, without clocks, links or parameter servers.
    """
    queues = [schedule.queue(s, n_stages) for s in range(n_stages)]
    out: list[list[Task]] = [[] for _ in range(n_stages)]
    heap: list[tuple[float, int, Task]] = []
    seq = count()
    admitted = completed = 0

    def start(s: int, now: float) -> None:
        t = queues[s].next()
        if t is not None:
            out[s].append(t)
            cost = fwd if t.kind is Kind.F else bwd if t.kind is Kind.B else fwd + bwd
            heapq.heappush(heap, (now + cost, next(seq), t))

    def admit(now: float) -> None:
        nonlocal admitted
        for _ in range(schedule.admissible(admitted, completed, nm, total)):
            admitted += 1
            queues[0].ready(Task(0, queues[0].forward_kind, admitted))
        start(0, now)

    admit(0.0)
    while heap:
        now, _, t = heapq.heappop(heap)
        s = t.stage
        queues[s].done(t)
        if t.kind is Kind.F:
            queues[s + 1].ready(Task(s + 1, queues[s + 1].forward_kind, t.mb))
            start(s + 1, now)
        elif s > 0:
            queues[s - 1].ready(Task(s - 1, Kind.B, t.mb))
            start(s - 1, now)
        if s == 0 and t.kind is not Kind.F:
            completed += 1
            admit(now)
        else:
            start(s, now)
    return tuple(tuple(tasks) for tasks in out)


def format_actions(per_stage: Sequence[Sequence[Task]]) -> str:
    """One line per stage, ``stage 0: F1 F2 B1 F3 ...`` (kind and minibatch of each task)."""
    return "\n".join(
        f"stage {s}: " + " ".join(f"{t.kind.value}{t.mb}" for t in tasks)
        for s, tasks in enumerate(per_stage)
    )
