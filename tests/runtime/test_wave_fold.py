"""Where a stage folds a WSP pull in (one process, a fake parameter-server client)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from planner.wsp import required_global_clock
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


class _LeadClient(_Client):
    """Replies ``lead`` clocks above the one asked for (faster VWs pushed meanwhile)."""

    def __init__(self, params: list[nn.Parameter], log: list[str], lead: int) -> None:
        super().__init__(params, log)
        self.lead = lead

    def push(self, wave: int, delta: Any) -> None:
        self.log.append(f"push {wave}")

    def push_pull(self, wave: int, delta: Any, need: int) -> _Handle:
        self.log.append(f"push {wave}")
        return _Handle(self.log, need + self.lead, self._reply())


@pytest.mark.parametrize(("lead", "waits"), [(0, [9, 12, 15, 18, 21]), (1, [9, 15, 21])])
def test_d1_forward_waits_only_when_wsp_requires_the_pull(lead: int, waits: list[int]) -> None:
    """A push asks for the clock the first forward on its weights needs, and only when the
    held clock is below it: a forward that waits is one WSP requires to (the simulator's
    admission rule), so at D > 0 there is no wait a satisfied clock could skip."""
    nm, log = 3, list[str]()
    w = nn.Parameter(torch.zeros(3))
    sync = WaveSync(
        _LeadClient([w], log, lead), [w], nm, 1, StageResult(0, 0, 0, "cpu"),  # type: ignore[arg-type]
        weights=_Weights({"w": w}, log),  # type: ignore[arg-type]
    )  # fmt: skip
    sync.start(0)
    waited: list[int] = []
    order = [("F", mb) for mb in range(1, nm + 1)]
    order += [t for k in range(1, 6 * nm + 1) for t in (("B", k), ("F", k + nm))]
    for kind, mb in order:  # stage 0: Nm forwards, then one backward and one forward
        if kind == "B":
            sync.before_update(mb)
            sync.after_update(mb)
            sync.post_update(mb)
            continue
        held, before = sync.pulled_clock, log.count("wait")
        sync.before_forward(mb)
        if log.count("wait") > before:
            waited.append(mb)
            assert held < required_global_clock(mb, nm, 1)
    assert waited == waits
