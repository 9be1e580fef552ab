"""The run options, one table for every way to start a run: ``hetpipe run`` (typer) and
``python -m runtime`` under torchrun (argparse) take the same names, types, defaults and help
from here, and turn the values into the same configs (:func:`configs`).

Plain data and no heavy imports: the CLI reads it at start-up without loading torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from runtime.defaults import CHECKPOINT_EVERY, TIMEOUT_S

if TYPE_CHECKING:
    from pathlib import Path

    from runtime.config import OptimizerConfig, RunConfig, WSPConfig

__all__ = ["OPTIONS", "Option", "add_arguments", "configs"]


@dataclass(frozen=True)
class Option:
    """One run option.

    Attributes:
        flag: the command-line flag (``--time-limit``).
        default: its default (its type is the default's, ``None``: an int).
        help: one line for ``--help``.
    """

    flag: str
    default: Any
    help: str


OPTIONS: Mapping[str, Option] = MappingProxyType(
    {
        "steps": Option("--steps", 0, "minibatches each VW trains (per VW, not in total; 0 = from --epochs)"),
        "epochs": Option("--epochs", 0.0, "passes over each VW's share of the data (default: 40 when several VWs train together, else 1; unused with --steps)"),
        "time_limit": Option("--time-limit", 0.0, "stop admitting minibatches after SECONDS (several VWs: all stop at one agreed wave)"),
        "seed": Option("--seed", 0, "seed of the initial weights and the data order"),
        "nm": Option("--nm", 0, "minibatches in flight (0 = the plan's Nm)"),
        "vw": Option("--vw", -1, "run only this virtual worker of the plan (-1 = all, through its synchronisation rule)"),
        "staleness": Option("--D", None, "WSP clock-distance threshold D (default: the plan's)"),
        "checkpoint_every": Option("--checkpoint-every", CHECKPOINT_EVERY, "checkpoint every K global clocks into --out/checkpoints (0 = never)"),
        "on_failure": Option("--on-failure", "stop", "stop: a failed process ends the run; restart: restart a failed stage's VW alone where the shards cut it (the others wait there) and a failed shard's whole job from its last snapshot, up to --max-restarts times, then evict a failed VW (under torchrun: torchrun's own --max-restarts, whole group); continue: evict a failed VW and go on with the others (a failed shard still stops the run)"),
        "max_restarts": Option("--max-restarts", 3, "restarts allowed with --on-failure restart"),
        "overwrite": Option("--overwrite", False, "replace another run's outputs in --out"),
        "optimizer": Option("--optimizer", "sgd", "sgd or adam"),
        "lr": Option("--lr", 0.05, "learning rate"),
        "momentum": Option("--momentum", 0.0, "SGD momentum"),
        "weight_decay": Option("--weight-decay", 0.0, "weight decay"),
        "schedule": Option("--schedule", "constant", "lr schedule: constant, step, cosine, warmup"),
        "remedy": Option("--remedy", "none", "staleness remedy of each stage's update: none, predict (weight prediction, SGD) or pipemare (per-stage lr warm-up by the delay)"),
        "remedy_warmup": Option("--remedy-warmup", 100, "updates of PipeMare's lr warm-up (--remedy pipemare)"),
        "timeout": Option("--timeout", TIMEOUT_S, "seconds before a stuck process-group operation fails"),
        "emulate": Option("--emulate", True, "pace emulated devices and enforce their memory caps"),
        "on_nonfinite": Option("--on-nonfinite", "stop", "a NaN or infinite loss or gradient (a diverging run): stop (the run ends naming the VW, stage, minibatch and the last snapshot) or skip (that minibatch's update is skipped at every stage of its VW, counted in the summary)"),
        "precision": Option("--precision", "", "fp32 or bf16 (autocast, fp32 master weights; default: the plan's)"),
    }
)  # fmt: skip
"""Every option both entries take, by parameter name (``hetpipe run`` adds the planning ones,
``--resume``, ``--out`` and ``--progress``; torchrun adds ``--calibration``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of :data:`OPTIONS` to ``parser`` (``dest`` = the parameter name)."""
    for name, opt in OPTIONS.items():
        if isinstance(opt.default, bool):
            parser.add_argument(opt.flag, dest=name, default=opt.default, help=opt.help,
                                action=argparse.BooleanOptionalAction)  # fmt: skip
        else:
            kind = int if opt.default is None else type(opt.default)
            parser.add_argument(opt.flag, dest=name, type=kind, default=opt.default, help=opt.help)


def configs(
    values: Mapping[str, Any],
    out: Path | None = None,
    progress: bool = False,
    resume: tuple[Path, Path, int | None] | None = None,
    resume_hint: str = "hetpipe run ...",
) -> tuple[OptimizerConfig, RunConfig, WSPConfig]:
    """The configs of a run from the options' values (both entries call this).

    Args:
        values: every option of :data:`OPTIONS` by name.
        out: the run directory.
        progress: show a progress bar.
        resume: ``(run dir, checkpoint dir, clock or None)`` to resume from
            (:func:`runtime.persist.run_dir.resume_target`).
        resume_hint: the command line a failure message suggests resuming with.

    Raises:
        ConfigError: an unknown ``--on-failure`` or a bad value (names the option).
    """
    from profiler.errors import ConfigError
    from runtime.config import OptimizerConfig, RunConfig, WSPConfig

    v = values
    if v["on_failure"] not in ("stop", "restart", "continue"):
        raise ConfigError(f"--on-failure {v['on_failure']!r}: use stop, restart or continue")
    opt = OptimizerConfig(name=v["optimizer"], lr=v["lr"], momentum=v["momentum"],
                          weight_decay=v["weight_decay"], schedule=v["schedule"],
                          remedy=v["remedy"], remedy_warmup=v["remedy_warmup"])  # fmt: skip
    run = RunConfig(steps=v["steps"], epochs=v["epochs"], time_limit_s=v["time_limit"],
                    seed=v["seed"], nm=v["nm"], out_dir=out, timeout_s=v["timeout"],
                    emulate=v["emulate"], progress=progress, precision=v["precision"],
                    on_nonfinite=v["on_nonfinite"])  # fmt: skip
    wsp = WSPConfig(
        D=v["staleness"],
        checkpoint_dir=resume[1] if resume is not None else None,
        checkpoint_every=v["checkpoint_every"],
        resume=resume is not None,
        resume_clock=resume[2] if resume is not None else None,
        resume_hint=resume_hint,
        overwrite=v["overwrite"],
        max_restarts=v["max_restarts"] if v["on_failure"] == "restart" else 0,
        evict=v["on_failure"] == "continue",
        restart_vw=v["on_failure"] == "restart",
    )
    return opt, run, wsp
