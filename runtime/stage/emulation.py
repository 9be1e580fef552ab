"""Emulated heterogeneous devices on CPU: pacing to a calibrated time, and a memory cap.

Pacing: a task (a stage's forward, backward, or the last stage's fused forward+backward)
runs its real computation, then waits until ``t_solo / speed`` has elapsed since it started.
``t_solo`` comes from ONE table shared by the planner, the simulator and every process: the
planner's single-threaded CPU profile of the model (``planner.profiles``, measured once per
machine and cached), summed over each stage's layers (:meth:`Calibration.from_plan`, and for
the AllReduce baseline over the whole model). An emulated device therefore takes exactly the
time the plan and the simulator assume for it; only the runtime's own costs (messages,
optimizer steps, Python) come on top, which is what measured-vs-predicted comparisons should
show. (Until 2026-11-23 each run re-measured its stages, 5 repetitions each: those tables moved
by up to 25 % between runs and differed from the planner's profile by up to 20 %, so measured
and predicted throughput disagreed for reasons that had nothing to do with the runtime.) The
wait sleeps until ~1 ms before the deadline and spins the rest, which reproduced target speed
ratios within 1-2 % on a 2-core machine when the total demand ``sum(speed)`` stays well under
the core count (plain sleeps or thread-count tricks were off by 8-50 %). A task whose real
computation takes longer than its target cannot be paced down; the stage reports that
overrun (:attr:`runtime.results.metrics.StageResult.overrun_s`). A plan without stage times (a
hand-made plan, e.g. the Python API's) is paced by a table measured before the run instead, in
one process, single threaded, one stage at a time (:func:`calibrate`).

Memory: :class:`MemoryMeter` accounts the bytes the planner's memory model counts
(weights, gradients, optimizer state, stashed weight versions, the activations autograd
saves for backward via ``saved_tensors_hooks`` and the received inputs of the minibatches
in flight) and raises an out-of-memory :class:`HetPipeRuntimeError` above the device's cap.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from profiler.errors import HetPipeRuntimeError
from profiler.memory import SavedTensorsHooks

__all__ = ["Calibration", "MemoryMeter", "SavedBytes", "calibrate", "pace_until"]

log = logging.getLogger(__name__)

_SPIN_S = 0.00025  # spin (instead of sleeping) for the last 0.25 ms before a deadline


def pace_until(deadline: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """Wait until ``clock() >= deadline`` (seconds): sleep, then spin the last millisecond.

    Returns:
        How late the call came (seconds past ``deadline`` on entry, 0 when on time): the
        task's real work took longer than its target.
    """
    remaining = deadline - clock()
    if remaining < 0:
        return -remaining
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while clock() < deadline:
        pass
    return 0.0


@dataclass(frozen=True)
class Calibration:
    """Solo (single-threaded, contention-free CPU) task times of every stage, in seconds; an
    emulated device of relative speed ``s`` takes ``time / s``.

    Attributes:
        key: where the table comes from (model, batch size, cuts), for the record.
        fwd_s: forward time of each stage (the last stage's includes the loss).
        bwd_s: backward time of each stage.
    """

    key: str
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]

    @classmethod
    def from_plan(
        cls, key: str, stage_ms: Sequence[tuple[float, float]], speeds: Sequence[float]
    ) -> Calibration:
        """The table of a planned pipeline: stage ``s`` takes ``stage_ms[s]`` (forward,
        backward milliseconds, the plan's ``StagePlan.fwd_ms``/``bwd_ms``) on its device of
        relative speed ``speeds[s]``, i.e. ``ms * speed / 1000`` solo seconds."""
        return cls(
            key,
            tuple(f * v / 1e3 for (f, _), v in zip(stage_ms, speeds, strict=True)),
            tuple(b * v / 1e3 for (_, b), v in zip(stage_ms, speeds, strict=True)),
        )

    def task_s(self, stage: int, kind: str) -> float:
        """Calibrated time of task ``kind`` (``F``, ``B`` or ``FB``) on ``stage``."""
        if kind == "F":
            return self.fwd_s[stage]
        if kind == "B":
            return self.bwd_s[stage]
        return self.fwd_s[stage] + self.bwd_s[stage]

    def save(self, path: Path) -> None:
        """Write the table as JSON."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read a table written by :meth:`save`."""
        d = json.loads(path.read_text(encoding="utf-8"))
        return cls(
            str(d["key"]), tuple(float(x) for x in d["fwd_s"]), tuple(float(x) for x in d["bwd_s"])
        )


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def calibrate(
    stages: Sequence[torch.nn.Module],
    first_inputs: tuple[Tensor, ...],
    targets: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    key: str,
    reps: int = 5,
) -> Calibration:
    """Measure every stage's forward and backward time, single threaded, one stage at a time.

    Args:
        stages: the stage modules in pipeline order.
        first_inputs: one minibatch of model inputs.
        targets: its targets (the last stage's forward includes the loss).
        loss_fn: the loss.
        key: identifies the measured configuration.
        reps: timed repetitions (the median is kept).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fwd, bwd = [], []
        inputs: tuple[Tensor, ...] = first_inputs
        for s, module in enumerate(stages):
            last = s == len(stages) - 1
            xs = tuple(x.detach().requires_grad_(x.is_floating_point() and s > 0) for x in inputs)

            def forward(
                module: torch.nn.Module = module, xs: tuple[Tensor, ...] = xs, last: bool = last
            ) -> Any:
                out = module(*xs)
                return loss_fn(out, targets) if last else out

            fwd.append(_median_s(forward, reps))
            out = forward()
            outs = [out] if last else [o for o in out if isinstance(o, Tensor) and o.requires_grad]
            grads = [torch.ones_like(o) for o in outs]

            def backward(outs: list[Tensor] = outs, grads: list[Tensor] = grads) -> None:
                if outs:
                    torch.autograd.backward(outs, grads, retain_graph=True)

            bwd.append(_median_s(backward, reps))
            if not last:
                inputs = tuple(o.detach() for o in out)
            module.zero_grad(set_to_none=True)
        return Calibration(key, tuple(fwd), tuple(bwd))
    finally:
        torch.set_num_threads(threads)


class SavedBytes(SavedTensorsHooks):
    """Context manager summing the bytes autograd saves for backward (excluding weights).

    Each storage is charged once; storages listed in ``exclude`` (the weight versions)
    never. References are not kept, so the counter leaks nothing between minibatches.
    """

    def __init__(self, exclude: Sequence[Tensor] = ()) -> None:
        self._seen = {t.untyped_storage().data_ptr() for t in exclude}
        self.nbytes = 0

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += int(storage.nbytes())
        return t


class MemoryMeter:
    """Byte accounting of one stage, the planner's memory model evaluated on live data.

    Args:
        where: who is measured, for messages (``vw 0 | stage 2 | device G:0``).
        cap_bytes: the device's memory; 0 = no cap (just measure).
        param_bytes: the stage's parameters.
        buffer_bytes: its buffers.
        optimizer_state_factor: optimizer state per parameter byte (1 SGD momentum, 2 Adam).
    """

    def __init__(
        self,
        where: str,
        cap_bytes: int,
        param_bytes: int,
        buffer_bytes: int,
        optimizer_state_factor: float,
    ) -> None:
        self.where = where
        self.cap_bytes = cap_bytes
        self.static_bytes = int(param_bytes * (2 + optimizer_state_factor) + buffer_bytes)
        self.held: dict[int, int] = {}  # minibatch -> saved + received bytes
        self.peak_bytes = self.static_bytes

    def check(self, mb: int, held_bytes: int, stashed_bytes: int) -> int:
        """Record minibatch ``mb``'s held bytes and check the total.

        Returns:
            The current total in bytes.

        Raises:
            HetPipeRuntimeError: the total exceeds the cap (the plan should have prevented it).
        """
        self.held[mb] = held_bytes
        return self._check_total(
            self.static_bytes + stashed_bytes + sum(self.held.values()), stashed_bytes
        )

    def _check_total(self, total: int, stashed_bytes: int) -> int:
        """Record a device total and raise above the cap (see :meth:`check`)."""
        self.peak_bytes = max(self.peak_bytes, total)
        if self.cap_bytes and total > self.cap_bytes:
            raise HetPipeRuntimeError(
                f"out of memory on {self.where}: {total / 2**20:.2f} MiB needed > cap "
                f"{self.cap_bytes / 2**20:.2f} MiB (weights+grads+optimizer {self.static_bytes / 2**20:.2f} MiB, "
                f"stashed versions {stashed_bytes / 2**20:.2f} MiB, {len(self.held)} minibatches in flight "
                f"{sum(self.held.values()) / 2**20:.2f} MiB); the plan should have prevented this: "
                "re-plan with a smaller --nm or batch size"
            )
        return total

    def release(self, mb: int) -> None:
        """Minibatch ``mb``'s backward finished: its activations are freed."""
        self.held.pop(mb, None)
