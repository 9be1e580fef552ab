"""Run settings each stage process receives: its model source, optimizer and run settings.

Everything here is a frozen dataclass that pickles cleanly into spawned processes; the whole
run's description, these among its sections, is :class:`runtime.spec.RunSpec`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from planner.nonfinite import POLICIES
from planner.staleness import check_remedy
from profiler.capture import quiet_treespec
from profiler.errors import ConfigError, shown
from profiler.precision import check_precision
from runtime.by_value import pickler
from runtime.defaults import TIMEOUT_S
from runtime.options import LR_SCHEDULES, OPTIMIZERS

__all__ = ["LossFn", "ModelSource", "OptimizerConfig", "RunConfig"]

LossFn = Callable[[Any, Tensor], Tensor]

_OPTIMIZERS = OPTIMIZERS  # the option table's, so that the CLI checks them without torch
_SCHEDULES = LR_SCHEDULES


@dataclass(frozen=True)
class OptimizerConfig:
    """Per-stage optimizer and learning-rate schedule (one update per minibatch).

    Attributes:
        name: ``sgd`` or ``adam``.
        lr: base learning rate.
        momentum: SGD momentum (0 = plain SGD).
        weight_decay: L2 weight decay (both optimizers).
        betas: Adam betas.
        eps: Adam epsilon.
        lr_schedule: ``constant``; ``step`` (multiply by ``gamma`` every ``step_size`` updates);
            ``cosine`` (to 0 over ``total_updates``); ``warmup`` (linear from 0 over
            ``warmup`` updates, then constant).
        gamma: decay factor of the ``step`` schedule.
        step_size: updates between decays of the ``step`` schedule.
        warmup: updates of linear warm-up.
        total_updates: horizon of the ``cosine`` schedule (0 = the run's step count).
        remedy: staleness remedy of every stage's update (:mod:`planner.staleness`):
            ``none``, ``predict`` (weight prediction, SGD only) or ``pipemare``.
        remedy_warmup: updates of PipeMare's step-size warm-up (``K``).
    """

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: str = "constant"
    gamma: float = 0.1
    step_size: int = 100
    warmup: int = 0
    total_updates: int = 0
    remedy: str = "none"
    remedy_warmup: int = 100

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ConfigError(f"optimizer {self.name!r} is not supported: use one of {_OPTIMIZERS}")
        if self.lr_schedule not in _SCHEDULES:
            raise ConfigError(
                f"lr schedule {self.lr_schedule!r} is not supported: use one of {_SCHEDULES}"
            )
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")
        try:
            check_remedy(self.remedy)
        except ValueError as e:
            raise ConfigError(f"--remedy: {e}") from None
        if self.remedy == "predict" and self.name != "sgd":
            raise ConfigError(
                f"--remedy predict follows SGD's update rule, not {self.name}'s: "
                "use --optimizer sgd, or --remedy pipemare"
            )
        if self.remedy_warmup < 0:
            raise ConfigError(f"--remedy-warmup must be >= 0, got {self.remedy_warmup}")

    @property
    def memory_class(self) -> str:
        """The planner's optimizer-state class (``sgd``, ``momentum`` or ``adam``): how many
        parameter-sized buffers the optimizer keeps (0, 1 or 2)."""
        if self.name == "adam":
            return "adam"
        # weight prediction with plain SGD keeps the last gradient as its velocity
        return "momentum" if self.momentum or self.remedy == "predict" else "sgd"


@dataclass(frozen=True)
class ModelSource:
    """Where a process gets its model from.

    Exactly one of ``ref`` (a built-in name or ``package.module:factory``, rebuilt in each
    process, on the meta device when possible), ``module`` (the user's module), ``stage``
    and ``weights`` is set. The last two are what a process receives for a user's module
    (:func:`runtime.stage.model.ship_stage`, :func:`~runtime.stage.model.ship_shard`): a stage
    process only its stage, a parameter-server shard only its initial weights.

    Attributes:
        ref: model reference for :func:`profiler.models.resolve_model`.
        module: the user's model.
        sample_inputs: one minibatch of inputs for tracing ``module``.
        sample_targets: one minibatch of targets for ``module``.
        loss: loss function; ``None`` = the model spec's (cross-entropy by default).
        input_names: keyword names of ``sample_inputs`` (``module(**batch)``); ``()`` = positional.
        stage: one built stage (a :class:`runtime.stage.model.BuiltStage`).
        weights: initial weights by original parameter name (a shard's).
        cache: the launcher's memo of built stages per ``(batch, cuts)`` (never pickled).
    """

    ref: str | None = None
    module: nn.Module | None = None
    sample_inputs: tuple[Tensor, ...] = ()
    sample_targets: Tensor | None = None
    loss: LossFn | None = None
    input_names: tuple[str, ...] = ()
    stage: Any = None
    weights: dict[str, Tensor] | None = None
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.ref, self.module, self.stage, self.weights)]
        if sum(given) != 1:
            raise ConfigError(
                "give a model reference (e.g. 'mlp') or an nn.Module, not both or neither"
            )
        if self.module is not None and not self.sample_inputs:
            raise ConfigError(
                "a user nn.Module needs sample inputs (one minibatch) to be traced and split"
            )

    @property
    def name(self) -> str:
        """Display name of the model."""
        if self.ref is not None:
            return self.ref
        if self.stage is not None:
            return str(self.stage.model_name)
        return type(self.module).__name__ if self.module is not None else "weights"

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the module, stage or weights as one ``torch.save`` blob each.

        ``multiprocessing`` would otherwise share every tensor through its own file
        descriptor (``too many fds`` for a ResNet-50) and every stage process would see the
        *same* storage, so one stage's update of a tied weight would reach the other.
        """
        state = dict(self.__dict__)
        state["cache"] = {}
        for key in _BLOBS:
            if state[key] is not None:
                buf = io.BytesIO()
                with quiet_treespec():  # by value where __main__ has no file (runtime.by_value)
                    torch.save(state[key], buf, pickle_module=pickler())
                state[key] = buf.getvalue()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in _BLOBS:
            if isinstance(state.get(key), bytes):
                # our own blob from __getstate__ (the module's classes must be importable)
                with quiet_treespec():
                    state[key] = torch.load(io.BytesIO(state[key]), weights_only=False)
        for key, value in state.items():
            object.__setattr__(self, key, value)


_BLOBS = ("module", "stage", "weights")


@dataclass(frozen=True)
class RunConfig:
    """How long and how to run.

    Attributes:
        steps: minibatches per virtual worker (0 = derived from ``epochs``).
        epochs: passes over the data set (used when ``steps`` is 0).
        time_limit_s: stop admitting minibatches after this many seconds (0 = none).
        seed: seeds the initial weights and the data order.
        nm: minibatches in flight (0 = the plan's Nm).
        out_dir: run directory (metrics CSV, calibration cache, final weights); ``None`` = none.
        timeout_s: timeout of every process-group operation; a rank stuck this long fails.
        emulate: pace emulated devices and enforce their memory caps.
        return_state: send every stage's final parameters and buffers back to the caller.
        progress: show a progress bar.
        log_every: minibatches between metric log lines.
        precision: ``fp32`` or ``bf16`` (autocast, fp32 master weights, bfloat16 activations
            across cuts: :mod:`profiler.precision`); ``""`` = the plan's.
        on_nonfinite: a NaN or infinite loss or gradient: ``stop`` the run, or ``skip`` that
            minibatch's update at every stage of the VW (:mod:`planner.nonfinite`).
        profile_runtime: time where each stage's wall time goes, by category and task kind
            (:mod:`runtime.results.breakdown`), into the summary.
    """

    steps: int = 0
    epochs: float = 0.0
    time_limit_s: float = 0.0
    seed: int = 0
    nm: int = 0
    out_dir: Path | None = None
    timeout_s: float = TIMEOUT_S
    emulate: bool = True
    return_state: bool = False
    progress: bool = False
    log_every: int = 10
    precision: str = ""
    on_nonfinite: str = "stop"
    profile_runtime: bool = False

    def __post_init__(self) -> None:
        if self.precision:
            check_precision(self.precision)
        if self.on_nonfinite not in POLICIES:
            raise ConfigError(
                f"--on-nonfinite {shown(self.on_nonfinite)}: use {' or '.join(POLICIES)}"
            )
        if self.steps < 0 or self.epochs < 0 or self.time_limit_s < 0:
            raise ConfigError(
                f"--steps/--epochs/--time-limit must be >= 0, got {self.steps}/{self.epochs}/{self.time_limit_s}"
            )
        if self.nm < 0:
            raise ConfigError(f"--nm must be >= 1 (or 0 for the plan's), got {self.nm}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout_s}")
