"""The runtime's own cost per task, as the planner predicts it (issue #22's "model of what remains").

Measured with ``hetpipe run --profile-runtime`` (:mod:`runtime.results.breakdown`) and fitted by
``benchmarks/fit_overhead.py``: every task costs the runtime ``ms_per_task`` of host CPU
(messages, Python, the optimizer and version bookkeeping), stretched when the plan's processes
share fewer host cores than there are processes (an emulated cluster: every device, parameter
server shard and AllReduce worker is a process on one host). On real GPU hosts each rank has its
own core (``cores = 0``): the stretch vanishes. The planner records the overhead it assumed in
the plan (``predicted.overhead_ms_per_task``) and the simulator charges it to every task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from profiler.errors import ConfigError

if TYPE_CHECKING:  # the cluster (which the plan holds) holds a RuntimeOverhead
    from planner.plan import Plan

__all__ = ["NO_OVERHEAD", "RuntimeOverhead", "plan_overhead_ms", "plan_processes"]


@dataclass(frozen=True)
class RuntimeOverhead:
    """The runtime-overhead model: ``ms_per_task * max(1, processes / cores)`` per task.

    Attributes:
        ms_per_task: the runtime's own milliseconds per task with a core per process (0: none).
        cores: host cores the plan's processes share (0: a core per process, no stretch).
    """

    ms_per_task: float = 0.0
    cores: int = 0

    def validated(self, source: str = "runtime_overhead") -> RuntimeOverhead:
        """``self`` when its values are usable.

        Raises:
            ConfigError: a negative or non-finite ``ms_per_task`` or negative ``cores``.
        """
        if not (0.0 <= self.ms_per_task < math.inf):
            raise ConfigError(
                f"{source}: ms_per_task = {self.ms_per_task}: give a finite number of "
                "milliseconds >= 0 (0: no runtime overhead)"
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
        stretch = max(1.0, processes / self.cores) if self.cores > 0 else 1.0
        return self.ms_per_task * stretch


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


def plan_overhead_ms(plan: Plan) -> float:
    """The overhead per task the planner assumes for ``plan``: its cluster's
    ``runtime_overhead`` for the processes the plan starts (0 for the AllReduce baseline,
    whose one task per step the model does not cover)."""
    from planner.rules import layout

    model = plan.cluster.runtime_overhead
    if model.ms_per_task == 0.0 or layout(plan.sync) == "ddp":
        return 0.0
    return model.per_task_ms(plan_processes(plan))
