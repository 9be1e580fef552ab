"""The run options, one table for every way to start a run: ``hetpipe run`` (typer) and
``python -m runtime`` under torchrun (argparse) take the same names, types, defaults and help
from here, and turn the values into the same :class:`runtime.spec.RunSpec` (:func:`run_spec`).

Plain data and no heavy imports: the CLI reads it at start-up without loading torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from planner.ranges import Range
from profiler.precision import PRECISIONS
from runtime.defaults import CHECKPOINT_EVERY, TIMEOUT_S

if TYPE_CHECKING:
    from pathlib import Path

    from runtime.spec import RunSpec

OPTIMIZERS = ("sgd", "adam")
"""The stages' optimizers (:class:`runtime.config.OptimizerConfig`)."""
LR_SCHEDULES = ("constant", "step", "cosine", "warmup")
"""The learning-rate schedules (:class:`runtime.config.OptimizerConfig`)."""

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OPTIONS",
    "PLAN_OPTIONS",
    "RENAMED",
    "Option",
    "Range",
    "add_arguments",
    "check_number",
    "check_values",
    "run_spec",
]


@dataclass(frozen=True)
class Option:
    """One run option.

    Attributes:
        flag: the command-line flag (``--time-limit``).
        default: its default (its type is the default's, ``None``: an int).
        help: one line for ``--help``.
        range: the values a numeric option takes (checked by :func:`check_values` before
            anything is planned or started); ``None`` for text and switches.
        choices: the values a text option takes (checked likewise); ``()``: any.
    """

    flag: str
    default: Any
    help: str
    range: Range | None = None
    choices: tuple[str, ...] = ()


OPTIONS: Mapping[str, Option] = MappingProxyType(
    {
        "steps": Option("--steps", 0, "minibatches each VW trains (per VW, not in total; 0 = from --epochs)", Range(0)),
        "epochs": Option("--epochs", 0.0, "passes over each VW's share of the data (default: 40 when several VWs train together, else 1; unused with --steps)", Range(0)),
        "time_limit": Option("--time-limit", 0.0, "stop admitting minibatches after SECONDS (several VWs: all stop at one agreed wave)", Range(0)),
        "seed": Option("--seed", 0, "seed of the initial weights and the data order", Range(0, 2**63)),
        "nm": Option("--nm", 0, "minibatches in flight (0 = the plan's Nm)", Range(0)),
        "vw": Option("--vw", -1, "run only this virtual worker of the plan (-1 = all, through its synchronisation rule)", Range(-1)),
        "staleness": Option("--D", None, "WSP clock-distance threshold D (default: the plan's)", Range(0)),
        "checkpoint_every": Option("--checkpoint-every", CHECKPOINT_EVERY, "checkpoint every K global clocks into --out/checkpoints (0 = never)", Range(0)),
        "keep": Option("--keep", 2, "committed snapshots kept in --out/checkpoints (0 = every one: weights at fixed clocks to evaluate after the run)", Range(0)),
        "on_failure": Option("--on-failure", "stop", "stop: a failed process ends the run; restart: restart a failed stage's VW alone where the shards cut it (the others wait there) and a failed shard's whole job from its last snapshot, up to --max-restarts times, then evict a failed VW (under torchrun: torchrun's own --max-restarts, whole group); continue: evict a failed VW and go on with the others (a failed shard still stops the run)", choices=("stop", "restart", "continue")),
        "max_restarts": Option("--max-restarts", 3, "restarts allowed with --on-failure restart", Range(0)),
        "overwrite": Option("--overwrite", False, "replace another run's outputs in --out"),
        "optimizer": Option("--optimizer", "sgd", "sgd or adam", choices=OPTIMIZERS),
        "lr": Option("--lr", 0.05, "learning rate", Range(0, open_low=True)),
        "momentum": Option("--momentum", 0.0, "SGD momentum", Range(0, 1)),
        "weight_decay": Option("--weight-decay", 0.0, "weight decay", Range(0)),
        "lr_schedule": Option("--lr-schedule", "constant", "learning-rate schedule: constant, step, cosine, warmup", choices=LR_SCHEDULES),
        "remedy": Option("--remedy", "none", "staleness remedy of each stage's update: none, predict (weight prediction, SGD) or pipemare (per-stage lr warm-up by the delay)", choices=("none", "predict", "pipemare")),
        "remedy_warmup": Option("--remedy-warmup", 100, "updates of PipeMare's lr warm-up (--remedy pipemare)", Range(0)),
        "timeout": Option("--timeout", TIMEOUT_S, "seconds before a stuck process-group operation fails", Range(0, 10**6, open_low=True)),
        "emulate": Option("--emulate", True, "pace emulated devices and enforce their memory caps"),
        "on_nonfinite": Option("--on-nonfinite", "stop", "a NaN or infinite loss or gradient (a diverging run): stop (the run ends naming the VW, stage, minibatch and the last snapshot) or skip (that minibatch's update is skipped at every stage of its VW, counted in the summary)", choices=("stop", "skip")),
        "precision": Option("--precision", "", "fp32 or bf16 (autocast, fp32 master weights; default: the plan's)", choices=("", *PRECISIONS)),
        "profile_runtime": Option("--profile-runtime", False, "time where each stage's wall time goes (compute, pacing, waits, messages, parameter servers, bookkeeping) into the summary and a table"),
        "data": Option("--data", "", "training and test data: pkg.mod:factory returning (train, test) torch Datasets of (input, target) samples (test may be None: a fifth of train is held out), or 'synthetic' (random inputs, targets below the model's output width); default: a built-in model's own data (digits for mlp, synthetic for the others); a pkg.mod:factory model needs it"),
    }
)  # fmt: skip
"""Every option both entries take, by parameter name (``hetpipe run`` adds the planning ones,
``--resume``, ``--out`` and ``--progress``; torchrun adds ``--calibration``)."""

PLAN_OPTIONS: Mapping[str, Option] = MappingProxyType(
    {
        "objective": Option("--objective", "throughput", "what the plan is chosen for: throughput (fastest samples/s) or time (fastest predicted time to target: throughput x statistical efficiency, AllReduce and each Nm, remedy and D compared; docs/planner.md)", choices=("throughput", "time")),
        "target_samples": Option("--target-samples", 0.0, "--objective time: samples sequential SGD needs to the target (0: relative times only)", Range(0)),
        "remedy": Option("--remedy", "none", "the run's staleness remedy, for the memory model (predict keeps more weight copies) and --objective time", choices=("none", "predict", "pipemare")),
        "d_values": Option("--d-values", "", "--objective time: the WSP thresholds D compared, whole numbers separated by commas (default: 0,1,2, or -D alone when given; docs/planner.md)"),
        "calibrate": Option("--calibrate-efficiency", "", "--objective time: measure the efficiency model's inputs (gradient noise scale, delay cost per remedy) in seconds of single-process SGD on DATA: builtin (the model's own data), synthetic or pkg.mod:factory (default: the defaults, said in the table)"),
        "calibrate_lr": Option("--calibrate-lr", "tuned", "--calibrate-efficiency's step size: tuned (each setting at its best of --lr x 1, 1/2, 1/4, 1/8, as systems tuned each to its best lr are compared) or fixed (every setting at --lr)", choices=("tuned", "fixed")),
    }
)  # fmt: skip
"""The planning options of ``hetpipe plan`` that are data too: plain values, checked by
:func:`check_values` with the table given, before anything is planned. They are not run
options (torchrun runs a plan, it does not choose one), so not in :data:`OPTIONS`."""
RENAMED: Mapping[str, str] = MappingProxyType({"schedule": "lr_schedule"})
"""Old parameter name -> its option's name now: both entries still parse the old flag
(``--schedule``, hidden) and :func:`check_values` refuses it naming the new one (``--schedule``
would now read as the pipeline schedule, the plan's ``schedule``)."""


def check_number(flag: str, value: float | None, allowed: Range, default: object = None) -> None:
    """Refuse a numeric option's value outside ``allowed`` (``None``: not given, fine).

    Raises:
        ConfigError: one line naming the flag, the value and the fix.
    """
    from profiler.errors import ConfigError

    if value is None or isinstance(value, bool):
        return
    problem = allowed.problem(value)
    if problem is not None:
        fix = "drop it" if default is None else f"drop it for the default {default}"
        raise ConfigError(f"{flag} {value}: {problem}; give such a value, or {fix}")


def check_values(values: Mapping[str, Any], table: Mapping[str, Option] = OPTIONS) -> None:
    """Check every option of ``table`` (:data:`OPTIONS`, or :data:`PLAN_OPTIONS`) in ``values``
    against its range or choices (before any planning or process starts, without importing
    torch).

    Raises:
        ConfigError: the first value out of range (as :func:`check_number` words it) or not
            among its choices.
    """
    from profiler.errors import ConfigError, shown

    for old, new in RENAMED.items():
        if values.get(old) is not None:
            flag = OPTIONS[new].flag
            raise ConfigError(
                f"--{old.replace('_', '-')} {shown(values[old], 40)}: the learning-rate schedule "
                f"is now {flag} (a plan's schedule is its pipeline schedule); give "
                f"{flag} {shown(values[old], 40)}"
            )
    for name, opt in table.items():
        if name not in values:
            continue
        if opt.range is not None:
            check_number(opt.flag, values[name], opt.range, opt.default)
        if opt.choices and values[name] not in opt.choices:
            named = ", ".join(c for c in opt.choices if c)
            raise ConfigError(f"{opt.flag} {shown(values[name], 40)}: use one of {named}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of :data:`OPTIONS` to ``parser`` (``dest`` = the parameter name)."""
    for name, opt in OPTIONS.items():
        if isinstance(opt.default, bool):
            parser.add_argument(opt.flag, dest=name, default=opt.default, help=opt.help,
                                action=argparse.BooleanOptionalAction)  # fmt: skip
        else:
            kind = int if opt.default is None else type(opt.default)
            parser.add_argument(opt.flag, dest=name, type=kind, default=opt.default, help=opt.help)
    for old in RENAMED:  # refused by check_values, naming the new flag
        parser.add_argument(f"--{old.replace('_', '-')}", dest=old, help=argparse.SUPPRESS)


def run_spec(
    values: Mapping[str, Any],
    out: Path | None = None,
    progress: bool = False,
    resume: tuple[Path, Path, int | None] | None = None,
    resume_hint: str = "hetpipe run ...",
) -> RunSpec:
    """The :class:`runtime.spec.RunSpec` of a run from the options' values (every entry calls
    this: ``hetpipe run``, torchrun's ``python -m runtime`` and ``hetpipe.train``).

    Args:
        values: every option of :data:`OPTIONS` by name.
        out: the run directory (its snapshots go to ``out/checkpoints``).
        progress: show a progress bar.
        resume: ``(run dir, checkpoint dir, clock or None)`` to resume from
            (:func:`runtime.persist.run_dir.resume_target`).
        resume_hint: the command line a failure message suggests resuming with.

    Raises:
        ConfigError: a value out of its option's range or not among its choices (names the
            option).
    """
    from runtime.config import OptimizerConfig, RunConfig
    from runtime.spec import CheckpointConfig, DataConfig, FailurePolicy, RunSpec, SyncConfig

    v = values
    check_values(v)  # ranges, and --on-failure among stop, restart, continue
    opt = OptimizerConfig(name=v["optimizer"], lr=v["lr"], momentum=v["momentum"],
                          weight_decay=v["weight_decay"], lr_schedule=v["lr_schedule"],
                          remedy=v["remedy"], remedy_warmup=v["remedy_warmup"])  # fmt: skip
    run = RunConfig(steps=v["steps"], epochs=v["epochs"], time_limit_s=v["time_limit"],
                    seed=v["seed"], nm=v["nm"], out_dir=out, timeout_s=v["timeout"],
                    emulate=v["emulate"], progress=progress, precision=v["precision"],
                    on_nonfinite=v["on_nonfinite"],
                    profile_runtime=v["profile_runtime"])  # fmt: skip
    checkpoints = CheckpointConfig(
        dir=resume[1] if resume is not None else (out / "checkpoints" if out else None),
        every=v["checkpoint_every"],
        resume=resume is not None,
        resume_clock=resume[2] if resume is not None else None,
        overwrite=v["overwrite"],
        resume_hint=resume_hint,
        keep=v["keep"],
    )
    return RunSpec(run, opt, DataConfig(ref=v["data"]), SyncConfig(D=v["staleness"]), checkpoints,
                   FailurePolicy(v["on_failure"], v["max_restarts"]), vw=v["vw"])  # fmt: skip
