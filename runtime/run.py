"""The one training entry: ``hetpipe run`` and ``hetpipe.train`` both execute a plan here.

The plan names how its virtual workers synchronise (``plan.sync``, :mod:`planner.sync`); the
one launcher (:func:`runtime.launch.launcher.launch`) trains it with that rule: ``wsp``
through the parameter-server shards, ``allreduce`` (the DDP baseline), or ``local`` for one
VW alone (a plan without shards and one VW, or ``vw >= 0``).

The runtime never plans: a plan comes from :mod:`planner` (``make_plan``,
``planner.baseline.allreduce_plan`` or ``planner.manual``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from planner.plan import Plan
from planner.rules import layout
from planner.sync import effective_rule
from profiler.errors import ConfigError
from runtime.config import ModelSource, RunConfig
from runtime.spec import RunSpec

if TYPE_CHECKING:
    from runtime.results.run_result import RunResult

__all__ = [
    "MAIN_JOB_EPOCHS",
    "default_length",
    "describe_training",
    "outputs",
    "rule_for",
    "run_plan",
    "settle",
    "steps_note",
]


def run_plan(
    plan: Plan, source: ModelSource, spec: RunSpec | None = None, dataset: Any = None
) -> RunResult:
    """Train ``plan`` with its synchronisation rule (see the module doc).

    Args:
        plan: the plan.
        source: the model.
        spec: how to run it (:class:`runtime.spec.RunSpec`, built by every entry from the
            options table: :func:`runtime.options.run_spec`); ``None``: the defaults.
        dataset: the user's data set (``None`` = the model's built-in one).

    Raises:
        ConfigError: the plan cannot be run as asked (says why and what to change).
        HetPipeRuntimeError: a process failed (names it).
    """
    from runtime.launch.launcher import launch

    return launch(plan, source, settle(spec or RunSpec(), plan), dataset)


def settle(spec: RunSpec, plan: Plan) -> RunSpec:
    """``spec`` with the plan's defaults filled in (one host and every torchrun rank alike):
    its length (:func:`default_length`) and the plan's precision.

    Raises:
        ConfigError: bf16 asked of the AllReduce baseline; several VWs without shards, or one
            VW of an AllReduce plan (:func:`rule_for`).
    """
    rule = rule_for(plan, spec.vw)
    run = default_length(spec.run, plan, rule)
    if not run.precision:
        run = replace(run, precision=plan.precision)
    if run.precision != "fp32" and layout(rule) == "ddp":
        raise ConfigError("--precision bf16 is for pipelines (hetpipe plans); AllReduce runs fp32")
    return replace(spec, run=run)


MAIN_JOB_EPOCHS = 40.0
"""Run length of several VWs trained together when none is given: each VW makes 40 passes
over its own shard of the data (the main job: a few minutes on a 2-core machine)."""


def default_length(run: RunConfig, plan: Plan, how: str) -> RunConfig:
    """``run``, or with ``epochs = MAIN_JOB_EPOCHS`` when it sets no length (no steps, epochs or
    time limit) and several VWs train together (WSP or AllReduce); one VW: one epoch."""
    if run.steps or run.epochs or run.time_limit_s:
        return run
    if len(plan.virtual_workers) > 1 and layout(how) != "alone":
        return replace(run, epochs=MAIN_JOB_EPOCHS)
    return run


def rule_for(plan: Plan, vw: int = -1) -> str:
    """The rule that trains ``plan``: ``wsp``, ``allreduce`` or ``local`` (see the module doc).

    Raises:
        ConfigError: several VWs without shards, or one VW of an AllReduce plan.
    """
    if layout(plan.sync) == "ddp" and vw >= 0:
        raise ConfigError("an AllReduce plan trains every device together; drop --vw")
    return effective_rule(plan.sync, len(plan.shards), len(plan.virtual_workers), vw)


def describe_training(plan: Plan, vw: int, nm: int, D: int | None) -> str:
    """One line saying what is about to train (the first thing ``hetpipe run`` prints)."""
    how = rule_for(plan, vw)
    workers = plan.virtual_workers
    if layout(how) == "ddp":
        return (
            f"training {plan.model} with AllReduce (BSP) on {len(workers)} devices "
            f"({' '.join(w.signature for w in workers)}) of {plan.cluster.name}; batch "
            f"{plan.batch_size} per device"
        )
    if layout(how) == "shards":  # a rule through the parameter-server shards
        from runtime.results.sync import describe_rule

        rule = describe_rule(how, plan.sync_params, plan.D if D is None else D)
        sigs = ", ".join(
            f"VW {k} {w.signature} ({len(w.stages)} stages)" for k, w in enumerate(workers)
        )
        return (
            f"training {plan.model} on {len(workers)} VWs through {len(plan.shards)} "
            f"parameter-server shards ({rule.replace('WSP D=', 'WSP, D=')}): {sigs}; batch "
            f"{plan.batch_size}, Nm {nm}"
        )
    k = max(vw, 0)
    w = workers[k] if k < len(workers) else None
    stages = f"{w.signature}, {len(w.stages)} stages" if w is not None else "no such VW"
    return f"training {plan.model} on VW {k} ({stages}), batch {plan.batch_size}, Nm {nm}"


def steps_note(plan: Plan, vw: int, steps: int, nm: int) -> str:
    """The line saying, before training, that ``--steps`` is rounded up to whole waves
    (:func:`planner.wsp.whole_waves`: under a rule through the parameter-server shards every
    VW pushes the same waves); ``""`` when ``steps`` is trained exactly (one VW alone and
    AllReduce train any number, ``--epochs`` and ``--time-limit`` say their own length)."""
    from planner.wsp import whole_waves

    how = rule_for(plan, vw)
    if steps <= 0 or layout(how) != "shards":
        return ""
    rounded = whole_waves(steps, nm)
    if rounded == steps:
        return ""
    return (
        f"--steps {steps} -> {rounded}: whole waves of Nm {nm} minibatches per VW (every VW "
        f"pushes the same waves to the parameter servers); a multiple of {nm} is trained exactly"
    )


def outputs(result: RunResult) -> list[str]:
    """The files a run with ``--out`` wrote, relative to its folder."""
    metrics = ["metrics.csv", "stages.csv"] if result.alone else ["vw*/metrics.csv"]
    return [*metrics, "summary.json", "weights.pt", "timeline.png", "trace.json"]
