"""Where a stage folds a WSP pull in (one process, a fake parameter-server client)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runtime.ps.pull import PullResult
from runtime.results.metrics import StageResult
from runtime.sync.wave import WaveSync

NM = 2


class _Handle:
    """A pull in flight: records when the stage waits for it."""

    def __init__(self, log: list[str], clock: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.log, self.clock, self.tensors = log, clock, tensors

    def wait(self) -> PullResult:
        self.log.append("wait")
        return PullResult(self.clock, (self.clock,), self.tensors)


class _Client:
    """A client whose pulls answer at once with the stage's weights plus one."""

    def __init__(self, params: list[nn.Parameter], log: list[str]) -> None:
        self.params, self.log = params, log
        self.dropped: list[tuple[int, int]] = []

    def update_buffers(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p) for p in self.params]

    def _reply(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach() + 1 for p in self.params)

    def pull(self, clock: int, out: Any = None) -> PullResult:
        return PullResult(clock, (clock,), self._reply())

    def push_pull(self, wave: int, delta: Any, need: int) -> _Handle:
        self.log.append(f"push {wave}")
        return _Handle(self.log, need, self._reply())

    def close(self) -> None:
        """Nothing to flush."""


class _Weights:
    """The stage's weight versions, as far as a fold touches them."""

    def __init__(self, params: dict[str, nn.Parameter], log: list[str]) -> None:
        self.master, self.log, self.optimizer = params, log, None

    def add_from(self, version: int, corrections: dict[str, torch.Tensor]) -> None:
        self.log.append(f"fold from {version}")


@pytest.mark.parametrize(
    ("in_order", "waits_at"),
    [(False, "update 3"), (True, "forward 4")],  # the last stage: at the forward that needs it
)
def test_d0_pull_is_folded_at_a_fixed_point_of_the_task_order(
    in_order: bool, waits_at: str
) -> None:
    log: list[str] = []
    w = nn.Parameter(torch.zeros(3))
    client = _Client([w], log)
    weights = _Weights({"w": w}, log)
    sync = WaveSync(
        client, [w], NM, 0, StageResult(0, 0, 0, "cpu"), weights=weights,  # type: ignore[arg-type]
        in_order=in_order,
    )  # fmt: skip
    sync.start(0)
    for mb in range(1, 2 * NM + 1):  # the last stage: forward, update, in minibatch order
        log.append(f"forward {mb}")
        sync.before_forward(mb)
        log.append(f"update {mb}")
        sync.before_update(mb)
        sync.after_update(mb)
        sync.post_update(mb)
    assert log[log.index("wait") - 1] == waits_at
    assert log[log.index("wait") + 1] == "fold from 2"  # the version its push left
