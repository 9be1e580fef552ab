"""Per-stage task rules of pipelined model parallelism (paper Sec. 4), as pure data.

One source of truth for the simulator (which predicts) and the runtime (which executes).
Every GPU of a virtual worker (VW) owns one :class:`StageQueue`. The caller tells it which
tasks have their inputs (:meth:`StageQueue.ready`), asks for the task to run now
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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Kind", "StageQueue", "Task", "in_flight_bound"]


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


def in_flight_bound(stage: int, n_stages: int, nm: int) -> int:
    """Most minibatches stage ``stage`` of ``n_stages`` can hold at once with ``nm`` in flight.

    A stage holds a minibatch (its saved activations and received inputs) from the start of
    its forward task until its backward task ends. Every stage but the last can, in the worst
    case over all timings, hold every in-flight minibatch (``nm``); the last stage runs the
    fused ``FB`` task and holds exactly one.

    Raises:
        ValueError: ``stage`` outside ``[0, n_stages)`` or ``nm < 1``.
    """
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
    if nm < 1:
        raise ValueError(f"nm must be >= 1, got {nm}")
    return 1 if stage == n_stages - 1 else nm


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
