"""The runtime's own cost per task and per wave, as the planner predicts it (issue #22's
"model of what remains").

Measured with ``hetpipe run --profile-runtime`` (:mod:`runtime.results.breakdown`) and fitted by
``benchmarks/fit_overhead.py``: every task costs the runtime ``ms_per_task`` of host CPU
(messages, Python, bookkeeping), and under a parameter-server rule every stage's wave costs it
``ms_per_wave`` plus ``ms_per_mb`` per MB (10^6 bytes) of the stage's parameters (the push and
pull of its update: the difference, the messages, folding the pulled weights into every stashed
version), charged to the wave's last backward, where the runtime pushes. Every term is
stretched when the plan's processes share fewer host cores than there are processes (an
emulated cluster: every device, parameter server shard and AllReduce worker is a process on one
host). On real GPU hosts each rank has its own core (``cores = 0``): the stretch vanishes. The
planner records the stretched terms it assumed in the plan (``predicted.overhead_ms_per_task``,
``overhead_ms_per_wave``, ``overhead_ms_per_mb``) and the simulator charges them
(:func:`wave_overhead_ms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from profiler.errors import ConfigError

if TYPE_CHECKING:  # the cluster (which the plan holds) holds a RuntimeOverhead
    from planner.plan import Plan

__all__ = [
    "NO_OVERHEAD",
    "RuntimeOverhead",
    "plan_overhead_ms",
    "plan_processes",
    "plan_wave_overhead_ms",
    "wave_overhead_ms",
]

MB = 1e6
"""Bytes per MB of the ``ms_per_mb`` term."""


@dataclass(frozen=True)
class RuntimeOverhead:
    """The runtime-overhead model: ``ms_per_task * max(1, processes / cores)`` per task, and
    ``(ms_per_wave + ms_per_mb * MB of the stage's parameters)`` stretched alike per stage per
    wave through parameter servers.

    Attributes:
        ms_per_task: the runtime's own milliseconds per task with a core per process (0: none).
        cores: host cores the plan's processes share (0: a core per process, no stretch).
        ms_per_wave: milliseconds per stage per wave pushed to parameter servers (0: none).
        ms_per_mb: milliseconds per MB of the stage's parameters per wave pushed (0: none).
    """

    ms_per_task: float = 0.0
    cores: int = 0
    ms_per_wave: float = 0.0
    ms_per_mb: float = 0.0

    def validated(self, source: str = "runtime_overhead") -> RuntimeOverhead:
        """``self`` when its values are usable.

        Raises:
            ConfigError: a negative or non-finite term or negative ``cores``.
        """
        for name in ("ms_per_task", "ms_per_wave", "ms_per_mb"):
            value = getattr(self, name)
            if not (0.0 <= value < math.inf):
                raise ConfigError(
                    f"{source}: {name} = {value}: give a finite number of milliseconds >= 0 "
                    "(0: none)"
                )
        if self.cores < 0:
            raise ConfigError(
                f"{source}: cores = {self.cores}: give the host cores the processes share, "
                ">= 0 (0: a core per process)"
            )
        return self

    def per_task_ms(self, processes: int) -> float:
        """Milliseconds each task costs the runtime when ``processes`` processes run.

        >>> RuntimeOverhead(0.5, cores=2).per_task_ms(8)
        2.0
        >>> RuntimeOverhead(0.5, cores=0).per_task_ms(8)
        0.5
        """
        return self.ms_per_task * self.stretch(processes)

    def stretch(self, processes: int) -> float:
        """How much longer the runtime's work takes when ``processes`` share the cores.

        >>> RuntimeOverhead(cores=2).stretch(8), RuntimeOverhead(cores=2).stretch(1)
        (4.0, 1.0)
        """
        return max(1.0, processes / self.cores) if self.cores > 0 else 1.0


NO_OVERHEAD = RuntimeOverhead()
"""No runtime overhead: the prediction is compute and links only (plans before the model)."""


def plan_processes(plan: Plan) -> int:
    """The processes a run of ``plan`` starts: one per stage, plus one per parameter-server
    shard under a shard rule (WSP and its kin), or one per GPU of the AllReduce baseline."""
    from planner.rules import layout

    stages = sum(len(vw.stages) for vw in plan.virtual_workers)
    kind = layout(plan.sync)
    if kind == "shards":
        return stages + len(plan.shards)
    if kind == "ddp":
        return sum(len(vw.gpus) for vw in plan.virtual_workers)
    return len(plan.virtual_workers[0].stages) if plan.virtual_workers else 0


def wave_overhead_ms(ms_per_wave: float, ms_per_mb: float, param_bytes: int) -> float:
    """Milliseconds a stage holding ``param_bytes`` of parameters costs the runtime per wave
    (stretched terms, as a plan records them): what the simulator adds to the stage's last
    backward of every wave.

    >>> wave_overhead_ms(2.0, 4.0, 500_000)
    4.0
    """
    return ms_per_wave + ms_per_mb * param_bytes / MB


def plan_wave_overhead_ms(plan: Plan) -> tuple[float, float]:
    """The per-wave terms the planner assumes for ``plan``, stretched for the processes it
    starts: ``(ms per wave, ms per MB per wave)``; ``(0, 0)`` unless the plan pushes to
    parameter-server shards."""
    from planner.rules import layout

    model = plan.cluster.runtime_overhead
    if layout(plan.sync) != "shards" or not plan.shards:
        return 0.0, 0.0
    stretch = model.stretch(plan_processes(plan))
    return model.ms_per_wave * stretch, model.ms_per_mb * stretch


def plan_overhead_ms(plan: Plan) -> float:
    """The overhead per task the planner assumes for ``plan``: its cluster's
    ``runtime_overhead`` for the processes the plan starts (0 for the AllReduce baseline,
    whose one task per step the model does not cover)."""
    from planner.rules import layout

    model = plan.cluster.runtime_overhead
    if model.ms_per_task == 0.0 or layout(plan.sync) == "ddp":
        return 0.0
    return model.per_task_ms(plan_processes(plan))
