"""When a stage's wave push leaves, relative to its update's paced window (one process, fakes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from planner.nonfinite import Verdict
from planner.schedule import Kind, Task
from runtime.results.metrics import StageResult
from runtime.stage import worker as worker_module
from runtime.stage.timers import lap_timer
from runtime.stage.worker import StageWorker
from runtime.sync.rule import StageSync

MB = 2  # the update that ends a wave of Nm = 2


class _Sync(StageSync):
    """A rule that records its hooks (the push goes out at ``post_update``)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def after_update(self, mb: int) -> None:
        self.log.append(f"after_update {mb}")

    def post_update(self, mb: int) -> None:
        self.log.append(f"push {mb}")


class _Weights:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def park_grads(self, grads: dict[str, Any]) -> dict[str, Any]:
        return grads

    def update(self, mb: int, grads: dict[str, Any], apply: bool) -> None:
        self.log.append(f"step {mb}")


class _Channel:
    route: Any = None  # the receiver paces it

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send_grads(self, mb: int, grads: Any, not_before_s: float = 0.0) -> None:
        self.log.append(f"grads {mb}")


def _worker(log: list[str], emulate: bool) -> StageWorker:
    """A stage 1 of 2 whose backward is free and whose emulated backward takes 50 ms."""
    w = object.__new__(StageWorker)
    w.ctx = SimpleNamespace(  # type: ignore[assignment]
        stage=1, vw=0, nm=2, speed=1.0, where="vw0-stage1",
        straggle=SimpleNamespace(slowdown=lambda vw, wave: 1.0),
    )  # fmt: skip
    w.run_cfg = SimpleNamespace(emulate=emulate)  # type: ignore[assignment]
    w.calibration = SimpleNamespace(task_s=lambda stage, kind: 0.05)  # type: ignore[assignment]
    w.timer = lap_timer(False)
    w.result = StageResult(1, 0, 1, "cpu")
    w.tied = None  # type: ignore[assignment]
    w.offload = w.fault = None
    w.sync = _Sync(log)
    w.weights = _Weights(log)  # type: ignore[assignment]
    w._backward = lambda mb: ({}, [])  # type: ignore[method-assign]
    w._judge = lambda mb, gw, gx: Verdict.APPLY  # type: ignore[method-assign]
    return w


@pytest.mark.parametrize(
    ("emulate", "order"),
    [
        # an emulated device: the push leaves once the backward's paced window ended
        (True, ["step 2", "after_update 2", "paced", "grads 2", "push 2"]),
        # a real device: the gradients first, the push right after the step
        (False, ["grads 2", "step 2", "after_update 2", "push 2"]),
    ],
)
def test_push_leaves_after_the_update_s_paced_window(
    monkeypatch: pytest.MonkeyPatch, emulate: bool, order: list[str]
) -> None:
    log: list[str] = []

    def pace_until(deadline: float, clock: Any = None) -> float:
        log.append("paced")
        return 0.0

    monkeypatch.setattr(worker_module, "pace_until", pace_until)
    w = _worker(log, emulate)
    w._execute(Task(1, Kind.B, MB), None, _Channel(log), None)  # type: ignore[arg-type]
    assert log == order


class _Clock:
    """``time`` for the worker: ``perf_counter`` moves only when a fake wait moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class _FoldSync(_Sync):
    """D = 0: the update of the first minibatch after a push waits for the pull it folds,
    arriving at ``arrives`` (``before_update``, as ``WaveSync`` does)."""

    def __init__(self, log: list[str], clock: _Clock, result: StageResult, arrives: float):
        super().__init__(log)
        self.clock, self.result, self.arrives = clock, result, arrives

    def update_may_wait(self, mb: int) -> bool:
        return True

    def before_update(self, mb: int) -> None:
        waited = max(0.0, self.arrives - self.clock.now)
        self.clock.now += waited
        self.result.wait_s += waited
        self.log.append(f"folded {mb}")


class _Queued(_Channel):
    route: Any = object()  # a sender-side queue: the slot starts at ``not_before_s``

    def send_grads(self, mb: int, grads: Any, not_before_s: float = 0.0) -> None:
        self.log.append(f"grads {mb} from {not_before_s:.2f}")


@pytest.mark.parametrize(
    ("arrives", "queued", "order"),
    [
        # the pull arrives after the backward's 50 ms: the stage ends with the wait (100.08),
        # not the wait after the backward (100.13); the gradients leave at the deadline
        (100.08, True, ["grads 3 from 100.05", "folded 3", "step 3", "after_update 3", "paced 100.08"]),
        # the pull arrives within the backward: the stage ends at the deadline (not 100.07)
        (100.02, True, ["grads 3 from 100.05", "folded 3", "step 3", "after_update 3", "paced 100.05"]),
        # paced by the receiver: the gradients are sent at the deadline, before the wait
        (100.08, False, ["paced 100.05", "grads 3", "folded 3", "step 3", "after_update 3", "paced 100.08"]),
    ],
)  # fmt: skip
def test_a_fold_wait_overlaps_the_emulated_backward(
    monkeypatch: pytest.MonkeyPatch, arrives: float, queued: bool, order: list[str]
) -> None:
    """D = 0: an emulated stage's update that waits for the pull it folds ends at the later
    of the backward's end and the wait's (a GPU computes its backward meanwhile), and its
    gradients leave at the backward's end."""
    log: list[str] = []
    clock = _Clock()

    def pace_until(deadline: float, clock_: Any = None) -> float:
        log.append(f"paced {deadline:.2f}")
        clock.now = max(clock.now, deadline)
        return 0.0

    monkeypatch.setattr(worker_module, "pace_until", pace_until)
    monkeypatch.setattr(worker_module, "time", clock)
    w = _worker(log, emulate=True)
    w.sync = _FoldSync(log, clock, w.result, arrives)
    channel = _Queued(log) if queued else _Channel(log)
    w._execute(Task(1, Kind.B, 3), None, channel, None)  # type: ignore[arg-type]
    assert log == [*order, "push 3"]
