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
    route = None  # the receiver paces it

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
