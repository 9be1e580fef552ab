"""`hetpipe run`: train a plan on this host: every VW through the WSP parameter servers, one VW
alone, or the DDP AllReduce baseline (``--sync allreduce``)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hetpipe._common import console, handle_errors
from hetpipe._rules import RuleValues, apply_rule, rule_params, sync_help, with_rule_options
from planner.on_the_fly import PlanRequest
from planner.plan import Plan
from planner.plan_file import load_plan, load_plan_or_cluster
from planner.rules import DEFAULT_RULE, get_rule, layout
from profiler.errors import ConfigError, shown
from runtime.options import OPTIONS, RENAMED, Range, check_number

if TYPE_CHECKING:
    from runtime.data_source import RunData
    from runtime.spec import RunSpec

HELP = (
    "Train with a plan: PLAN.yaml (from 'hetpipe plan'), or CLUSTER.yaml (planned on the fly; "
    "--model, default mlp; an emulated cluster of 4+ devices gets 2 VWs by policy hd). Several "
    "VWs train through WSP parameter-server shards (one process each, placed per the plan) with "
    "one process per GPU (CPU processes for emulated devices, paced to their speed), each "
    "pipeline with Nm minibatches in flight and exact local staleness; --vw K runs one VW alone; "
    "--sync allreduce runs the DDP baseline. Shows progress and a summary (throughput, waiting "
    "and idle time per VW, test accuracy), writes metrics, checkpoints and weights to --out; "
    "--resume DIR continues from checkpoints. "
    "Several hosts: run 'torchrun --nnodes N --node-rank I --master-addr HOST "
    "--nproc-per-node K -m runtime PLAN.yaml' on each host (see docs/runtime.md)."
)


def _load(path: Path, request: PlanRequest) -> Plan:
    """The plan in ``path`` (checked against its model), or the planner's plan for the
    cluster in ``path`` (:func:`hetpipe.planning.plan_on_the_fly`: the profiler's CPU profile
    of an emulated cluster, then :func:`planner.on_the_fly.plan_for_run`, the same defaults as
    ``hetpipe plan``); with ``--sync allreduce`` a pipeline plan file gives its cluster, model
    and batch to the AllReduce baseline's plan."""
    from hetpipe.planning import plan_on_the_fly

    doc = load_plan_or_cluster(path)
    if not isinstance(doc, Plan):
        return plan_on_the_fly(doc, request)
    if layout(request.sync) == "ddp" and layout(doc.sync) != "ddp":
        asked = replace(request, model=doc.model, batch_size=doc.batch_size)
        return plan_on_the_fly(doc.cluster, asked)
    _check_against_model(doc, path)
    return doc


def _check_against_model(plan: Plan, path: Path) -> None:
    """Refuse, before any process starts, a plan its model does not fit (the same checks as
    ``hetpipe simulate``: :func:`runtime.launch.admit.check_plan_model`)."""
    from runtime.launch.admit import check_plan_model

    check_plan_model(plan, str(path))


def _opt(name: str) -> typer.models.OptionInfo:
    """The typer option of run option ``name``: flag and help from :data:`runtime.options.OPTIONS`
    (``python -m runtime`` under torchrun takes the same)."""
    o = OPTIONS[name]
    flag = f"{o.flag}/--no-{o.flag[2:]}" if isinstance(o.default, bool) and o.default else o.flag
    return typer.Option(flag, help=o.help)  # type: ignore[no-any-return]


_PLANNING = {"--batch-size": Range(1), "--stages": Range(0), "--vws": Range(0)}
"""The ranges of the options only ``hetpipe run`` takes (planning on the fly)."""

OPT = OPTIONS  # the defaults below are the table's: one source for hetpipe run and torchrun


@with_rule_options
@handle_errors
def run(  # long only by its typer signature (the command's options); the body is ~15 lines
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="plan.yaml/plan.json, or cluster.yaml with --model")],
    model: Annotated[
        str | None, typer.Option(help="model for a cluster.yaml (built-in name or pkg.mod:factory)")
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="minibatch size when planning on the fly")
    ] = 32,
    stages: Annotated[
        int, typer.Option(help="stages when planning on the fly (0 = the planner's choice)")
    ] = 0,
    vws: Annotated[
        int,
        typer.Option(
            help="VWs when planning on the fly (0 = the policy's default, as 'hetpipe plan')"
        ),
    ] = 0,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="allocation policy when planning on the fly: np | ed | hd | auto (default: hd "
            "where it applies, else ed; the same as 'hetpipe plan')",
        ),
    ] = None,
    sync: Annotated[
        str | None, typer.Option(help=sync_help() + "; default: the plan's rule (wsp planning)")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="continue the run in DIR (its --out or its checkpoints folder) from its newest "
            "verified snapshot, or DIR@CLOCK from that one; on a finished run, write its "
            "weights.pt and summary.json from the last snapshot",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="run directory (metrics, summary, weights, checkpoints)"),
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    data: Annotated[str, _opt("data")] = OPT["data"].default,
    steps: Annotated[int, _opt("steps")] = OPT["steps"].default,
    epochs: Annotated[float, _opt("epochs")] = OPT["epochs"].default,
    time_limit: Annotated[float, _opt("time_limit")] = OPT["time_limit"].default,
    seed: Annotated[int, _opt("seed")] = OPT["seed"].default,
    nm: Annotated[int, _opt("nm")] = OPT["nm"].default,
    vw: Annotated[int, _opt("vw")] = OPT["vw"].default,
    staleness: Annotated[int | None, _opt("staleness")] = OPT["staleness"].default,
    checkpoint_every: Annotated[int, _opt("checkpoint_every")] = OPT["checkpoint_every"].default,
    keep: Annotated[int, _opt("keep")] = OPT["keep"].default,
    on_failure: Annotated[str, _opt("on_failure")] = OPT["on_failure"].default,
    max_restarts: Annotated[int, _opt("max_restarts")] = OPT["max_restarts"].default,
    overwrite: Annotated[bool, _opt("overwrite")] = OPT["overwrite"].default,
    optimizer: Annotated[str, _opt("optimizer")] = OPT["optimizer"].default,
    lr: Annotated[float, _opt("lr")] = OPT["lr"].default,
    momentum: Annotated[float, _opt("momentum")] = OPT["momentum"].default,
    weight_decay: Annotated[float, _opt("weight_decay")] = OPT["weight_decay"].default,
    lr_schedule: Annotated[str, _opt("lr_schedule")] = OPT["lr_schedule"].default,
    schedule: Annotated[str | None, typer.Option("--schedule", hidden=True)] = None,
    remedy: Annotated[str, _opt("remedy")] = OPT["remedy"].default,
    remedy_warmup: Annotated[int, _opt("remedy_warmup")] = OPT["remedy_warmup"].default,
    timeout: Annotated[float, _opt("timeout")] = OPT["timeout"].default,
    emulate: Annotated[bool, _opt("emulate")] = OPT["emulate"].default,
    precision: Annotated[str, _opt("precision")] = OPT["precision"].default,
    on_nonfinite: Annotated[str, _opt("on_nonfinite")] = OPT["on_nonfinite"].default,
    profile_runtime: Annotated[bool, _opt("profile_runtime")] = OPT["profile_runtime"].default,
    rule_values: RuleValues | None = None,
) -> None:
    """Train a plan (all its VWs through WSP, one VW, or the AllReduce baseline); print the
    summary. ``rule_values``: the rule options (:class:`hetpipe._rules.with_rule_options`)."""
    from runtime.data_source import named_data
    from runtime.options import check_values, run_spec
    from runtime.persist.run_dir import resume_target

    values = {name: value for name, value in locals().items() if name in OPTIONS or name in RENAMED}
    check_values(values)  # every number in range before anything is read, planned or started
    for flag, value in (("--batch-size", batch_size), ("--stages", stages), ("--vws", vws)):
        check_number(flag, value, _PLANNING[flag])
    given_sync, sync = sync, sync or DEFAULT_RULE  # None: the plan's rule
    rule = rule_params(sync, rule_values or {})
    if layout(sync) == "ddp":
        _refuse_pipeline_options(nm, staleness, vw, vws, stages, policy)
    target = resume_target(resume) if resume is not None else None
    spec = run_spec(values, out or (target[0] if target else None), progress, target,
                    _resume_hint(path))  # fmt: skip
    every = ctx.get_parameter_source("checkpoint_every")  # given, or its default
    given = every is not None and every.name != "DEFAULT"
    _check_before_planning(sync, vws, spec, given)
    request = PlanRequest(model or "mlp", batch_size, nm, stages, None, vws, policy,
                          staleness or 0, precision or "fp32", sync,
                          remedy=spec.optimizer.remedy)  # fmt: skip
    if layout(sync) == "ddp":  # the baseline's memory is this run's optimizer state
        request = replace(request, optimizer=spec.optimizer.memory_class)
    resumed = spec.run.out_dir if resume is not None else None
    plan = _plan(path, request, model, resumed)
    if resumed is not None and (resumed / "plan.json").exists():
        _check_resumed(path, apply_rule(plan, given_sync, rule), resumed, given_sync, rule)
    dataset = named_data(data, plan.model, plan.batch_size, spec.run.seed)
    _train(apply_rule(plan, given_sync, rule), spec, given, dataset)


def _check_before_planning(sync: str, vws: int, spec: RunSpec, every: bool) -> None:
    """The checks of :func:`_train` that the options decide without a plan, made before a
    cluster file is planned (12-40 s): one VW alone (``--vw K``) writes no snapshots, backup
    workers take no time limit, ``--vw`` names one of ``--vws``."""
    from planner.sync import check_time_limit
    from runtime.launch.jobs import check_alone

    vw = spec.vw
    if vw >= 0 and layout(sync) != "ddp":
        check_alone(spec, every)
    check_time_limit(sync, spec.run.time_limit_s)
    if vws and vw >= vws:
        raise ConfigError(f"--vw {vw}: --vws {vws} makes VWs 0..{vws - 1}; give one of them")


def _plan(path: Path, request: PlanRequest, model: str | None, resumed: Path | None) -> Plan:
    """The plan to train: a resumed run's own ``plan.json``, the plan file, or one made on the
    fly for a cluster file (the AllReduce baseline's with ``--sync allreduce``); ``model``:
    the ``--model`` given, checked against the plan's."""
    saved = resumed / "plan.json" if resumed is not None else None
    if saved is not None and saved.exists():
        plan = load_plan(saved)  # the plan the interrupted run used
    else:
        with console.status(
            f"reading {path.name}; planning on the fly if it is a cluster file (a new model's "
            "CPU profile is measured once, then cached)"
        ):
            plan = _load(path, request)
    if model is not None and model != plan.model:
        raise ConfigError(
            f"--model {model} does not match the plan's model {plan.model!r}; drop --model"
        )
    return plan


def _check_resumed(
    path: Path, saved: Plan, out: Path, sync: str | None, rule: dict[str, float]
) -> None:
    """Refuse ``--resume`` with a plan or cluster file other than the resumed run's (its
    ``plan.json``), naming the first field that differs; nothing is planned."""
    from runtime.persist.run_dir import first_difference

    doc = load_plan_or_cluster(path)
    if isinstance(doc, Plan):
        what, then, now = "plan", saved.to_dict(), apply_rule(doc, sync, rule).to_dict()
        for key in ("predicted", "profiles"):  # how it was made, not what trains
            then.pop(key, None)
            now.pop(key, None)
    else:
        what, then, now = "cluster", saved.cluster.to_dict(), doc.to_dict()
    found = first_difference(then, now)
    if found is not None:
        field, was, given = found
        raise ConfigError(
            f"--resume {out}: {path} is not the {what} of the run being resumed: {field} is "
            f"{shown(given, 60)} but the run's ({out / 'plan.json'}) is {shown(was, 60)}; resume "
            "with the run's own file, or start a new run in another --out"
        )


def _train(plan: Plan, spec: RunSpec, every: bool, dataset: RunData | None = None) -> None:
    """Say what trains, train it (:func:`runtime.run.run_plan`) on ``dataset`` (``None``: the
    model's own), print the summary (``every``: ``--checkpoint-every`` was given, which one
    VW alone refuses)."""
    from hetpipe.overhead import overhead_note
    from planner.plan_check import check_nm
    from planner.sync import check_time_limit
    from runtime.config import ModelSource
    from runtime.launch.jobs import check_alone
    from runtime.run import describe_training, outputs, rule_for, run_plan, steps_note

    run, vw = spec.run, spec.vw
    if layout(rule_for(plan, vw)) == "alone":
        check_alone(spec, every)
    check_time_limit(rule_for(plan, vw), run.time_limit_s)  # before the header prints
    if run.emulate:
        _check_pacing(plan, vw, os.cpu_count() or 1)
    check_nm(plan, run.nm, vw)

    nm = run.nm or plan.nm
    console.print(describe_training(plan, vw, nm, spec.sync.D))
    note = steps_note(plan, vw, run.steps, nm)
    if note:
        console.print(note, markup=False)
    result = run_plan(plan, ModelSource(ref=plan.model), spec, dataset)
    console.print(result.table())
    if (breakdown := result.breakdown_table()) is not None:
        console.print(breakdown)
        if vw < 0 and get_rule(rule_for(plan, vw)).simulated:
            ran = dataclasses.replace(plan, nm=nm, D=plan.D if spec.sync.D is None else spec.sync.D)
            console.print(overhead_note(ran, result.stages, result.throughput), markup=False)
    out = run.out_dir
    if out is not None:
        console.print(f"outputs: {', '.join(str(out / f) for f in outputs(result))}")


def _check_pacing(plan: Plan, vw: int, cores: int) -> None:
    """Refuse emulated devices that cannot be paced on ``cores`` cores when they run at once
    (:func:`planner.pacing.pacing_problem`): VW ``vw`` alone, else every VW of the plan."""
    from planner.pacing import pacing_problem
    from runtime.launch.roles import emulation

    workers = (
        [plan.virtual_workers[vw]] if 0 <= vw < len(plan.virtual_workers) else plan.virtual_workers
    )
    devices = []
    for worker in workers:
        for st in worker.stages:
            g = worker.gpus[st.gpu]
            speed, _ = emulation(plan, g.node, g.speed, g.memory_bytes)
            if speed > 0:
                devices.append((f"{g.node}:{g.index}", speed))
    problem = pacing_problem(devices, cores)
    if problem is not None:
        raise ConfigError(
            f"{problem}: lower the cluster's emulate.speed values (sum at most {cores}, each at "
            "most 1; well under for accurate pacing), use a machine with more cores, or pass "
            "--no-emulate"
        )


def _resume_hint(path: Path) -> str:
    """This command line (without ``--resume``), for the message of a failed run."""
    argv = sys.argv[1:]
    if not sys.argv or not Path(sys.argv[0]).name.startswith("hetpipe") or "run" not in argv:
        return f"hetpipe run {path}"
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip or a == "--resume":
            skip = not skip
            continue
        if not a.startswith("--resume=") and a != "--overwrite":  # --resume reuses the run
            kept.append(a)
    return "hetpipe " + " ".join(shlex.quote(a) for a in kept)


def _refuse_pipeline_options(
    nm: int,
    staleness: int | None,
    vw: int,
    vws: int,
    stages: int,
    policy: str | None,
) -> None:
    """AllReduce trains the whole model on every device: no pipeline options apply."""
    given = {
        "--nm": nm > 1,
        "--D": staleness is not None,
        "--vw": vw >= 0,
        "--vws": vws > 0,
        "--stages": stages > 0,
        "--policy": policy is not None,
    }
    for flag, is_given in given.items():
        if is_given:
            raise ConfigError(
                f"{flag} does not apply to --sync allreduce (whole-model data parallelism on "
                "every device that holds the model: no pipeline, no parameter servers); drop it"
            )
