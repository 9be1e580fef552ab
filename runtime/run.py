"""The one training entry: ``hetpipe run`` and ``hetpipe.train`` both execute a plan here.

The plan says how its virtual workers synchronise (``plan.sync``) and whether it has
parameter-server shards; this picks the launcher that executes it:

- ``sync == "allreduce"``: the DDP baseline (:func:`runtime.launch.ddp.run_allreduce`);
- shards and every VW (``vw < 0``): WSP through the parameter servers
  (:func:`runtime.launch.wsp.launch_wsp`), one VW included;
- one VW of the plan alone, without parameter servers (``vw >= 0``, or a plan without shards
  and one VW): :func:`runtime.launch.single.launch`.

The runtime never plans: a plan comes from :mod:`planner` (``make_plan``,
``planner.baseline.allreduce_plan`` or ``planner.manual``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from planner.plan import Plan
from profiler.errors import ConfigError
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig

if TYPE_CHECKING:
    from rich.table import Table

    from runtime.launch.ddp import DDPResult
    from runtime.results.metrics import RunResult
    from runtime.results.wsp import WSPResult

__all__ = [
    "MAIN_JOB_EPOCHS",
    "default_length",
    "describe_training",
    "launcher_for",
    "outputs",
    "run_plan",
    "summary",
]


def run_plan(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    wsp: WSPConfig | None = None,
    dataset: Any = None,
    vw: int = -1,
) -> RunResult | WSPResult | DDPResult:
    """Train ``plan`` with the launcher its synchronisation rule needs (see the module doc).

    Args:
        plan: the plan.
        source: the model.
        optimizer: each worker's optimizer and schedule.
        run: run length, seed, out dir, timeout, emulation, progress.
        wsp: WSP settings (D, checkpoints, resume) for a plan with shards.
        dataset: the user's data set (``None`` = the model's built-in one).
        vw: train only this VW, without parameter servers (``-1`` = every VW).

    Raises:
        ConfigError: the plan cannot be run as asked (says why and what to change).
        HetPipeRuntimeError: a process failed (names it).
    """
    how = launcher_for(plan, vw)
    run = default_length(run or RunConfig(), plan, how)
    if not run.precision:
        run = replace(run, precision=plan.precision)
    if run.precision != "fp32" and how == "allreduce":
        raise ConfigError("--precision bf16 is for pipelines (hetpipe plans); AllReduce runs fp32")
    if how == "allreduce":
        from runtime.launch.ddp import run_allreduce

        return run_allreduce(plan, source=source, optimizer=optimizer, run=run, dataset=dataset)
    if how == "wsp":
        from runtime.launch.wsp import launch_wsp

        return launch_wsp(plan, source, optimizer, run, wsp, dataset)
    if wsp is not None and wsp.resume:
        raise ConfigError(
            "--resume needs parameter-server shards (they write the checkpoints); this run "
            "trains one VW without them (plan it with 'hetpipe plan', which places shards)"
        )
    from runtime.launch.single import launch

    overwrite = wsp is not None and wsp.overwrite
    return launch(plan, source, optimizer, run, dataset, vw=max(vw, 0), overwrite=overwrite)


MAIN_JOB_EPOCHS = 40.0
"""Run length of several VWs trained together when none is given: each VW makes 40 passes
over its own shard of the data (the main job: a few minutes on a 2-core machine)."""


def default_length(run: RunConfig, plan: Plan, how: str) -> RunConfig:
    """``run``, or with ``epochs = MAIN_JOB_EPOCHS`` when it sets no length (no steps, epochs or
    time limit) and several VWs train together (WSP or AllReduce); one VW: one epoch."""
    if run.steps or run.epochs or run.time_limit_s:
        return run
    if how in ("wsp", "allreduce") and len(plan.virtual_workers) > 1:
        return replace(run, epochs=MAIN_JOB_EPOCHS)
    return run


def launcher_for(plan: Plan, vw: int = -1) -> str:
    """Which launcher trains ``plan``: ``allreduce``, ``wsp`` or ``single`` (see the module doc).

    Raises:
        ConfigError: several VWs without shards, or one VW of an AllReduce plan.
    """
    if plan.sync == "allreduce":
        if vw >= 0:
            raise ConfigError("an AllReduce plan trains every device together; drop --vw")
        return "allreduce"
    if vw < 0 and plan.shards:
        return "wsp"
    n_vws = len(plan.virtual_workers)
    if vw < 0 and n_vws > 1:
        raise ConfigError(
            f"the {plan.model} plan has {n_vws} VWs but no parameter-server shards to "
            "synchronise them; re-plan with shards (hetpipe plan) or train one VW (vw=K)"
        )
    return "single"


def describe_training(plan: Plan, vw: int, nm: int, D: int | None) -> str:
    """One line saying what is about to train (the first thing ``hetpipe run`` prints)."""
    how = launcher_for(plan, vw)
    workers = plan.virtual_workers
    if how == "allreduce":
        return (
            f"training {plan.model} with DDP AllReduce (BSP) on {len(workers)} devices "
            f"({' '.join(w.signature for w in workers)}) of {plan.cluster.name}; batch "
            f"{plan.batch_size} per device"
        )
    if how == "wsp":
        sigs = ", ".join(
            f"VW {k} {w.signature} ({len(w.stages)} stages)" for k, w in enumerate(workers)
        )
        return (
            f"training {plan.model} on {len(workers)} VWs through {len(plan.shards)} "
            f"parameter-server shards (WSP, D={plan.D if D is None else D}): {sigs}; batch "
            f"{plan.batch_size}, Nm {nm}"
        )
    k = max(vw, 0)
    w = workers[k] if k < len(workers) else None
    stages = f"{w.signature}, {len(w.stages)} stages" if w is not None else "no such VW"
    return f"training {plan.model} on VW {k} ({stages}), batch {plan.batch_size}, Nm {nm}"


def outputs(result: RunResult | WSPResult | DDPResult) -> list[str]:
    """The files a run with ``--out`` wrote, relative to its folder."""
    from runtime.launch.ddp import DDPResult
    from runtime.results.metrics import RunResult

    if isinstance(result, DDPResult):
        return ["ddp.json", "weights.pt"]
    if isinstance(result, RunResult):
        return ["metrics.csv", "stages.csv", "weights.pt", "timeline.png", "trace.json"]
    return ["vw*/metrics.csv", "summary.json", "weights.pt", "timeline.png", "trace.json"]


def summary(result: RunResult | WSPResult | DDPResult) -> Table:
    """The summary table of any run (what ``hetpipe run`` prints)."""
    from runtime.results.metrics import RunResult, summary_table

    return summary_table(result) if isinstance(result, RunResult) else result.table()
