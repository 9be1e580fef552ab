"""Run settings shared by the launcher, the stage workers and the Python API.

Everything here is a frozen dataclass that pickles cleanly into spawned processes.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from planner.nonfinite import POLICIES
from planner.staleness import check_remedy
from profiler.capture import quiet_treespec
from profiler.errors import ConfigError, shown
from profiler.precision import check_precision
from runtime.by_value import pickler
from runtime.defaults import TIMEOUT_S
from runtime.options import OPTIMIZERS, SCHEDULES

if TYPE_CHECKING:
    from runtime.launch.faults import ShardFault, StageFault
    from runtime.persist.snapshot import WriteFault

__all__ = ["LossFn", "ModelSource", "OptimizerConfig", "RunConfig", "WSPConfig"]

LossFn = Callable[[Any, Tensor], Tensor]

_OPTIMIZERS = OPTIMIZERS  # the option table's, so that the CLI checks them without torch
_SCHEDULES = SCHEDULES


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
        schedule: ``constant``; ``step`` (multiply by ``gamma`` every ``step_size`` updates);
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
    schedule: str = "constant"
    gamma: float = 0.1
    step_size: int = 100
    warmup: int = 0
    total_updates: int = 0
    remedy: str = "none"
    remedy_warmup: int = 100

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ConfigError(f"optimizer {self.name!r} is not supported: use one of {_OPTIMIZERS}")
        if self.schedule not in _SCHEDULES:
            raise ConfigError(
                f"lr schedule {self.schedule!r} is not supported: use one of {_SCHEDULES}"
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
        flush_every_wave: baseline mode for benchmarks: admit the next ``Nm`` minibatches only
            when the whole previous wave finished (a pipeline flush, as GPipe/1F1B schedules do).
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
    flush_every_wave: bool = False
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


@dataclass(frozen=True)
class WSPConfig:
    """Settings of a multi-VW run.

    Attributes:
        D: clock-distance threshold (``None`` = the plan's).
        test_fraction: share of the data held out for the final test accuracy.
        checkpoint_dir: where shards write checkpoints (``None`` = the run's ``out_dir/checkpoints``
            when ``out_dir`` is set, else none).
        checkpoint_every: snapshot each time the global clock reaches a multiple of this, and at
            the end (0 = never).
        resume: continue from the newest snapshot of ``checkpoint_dir`` that verifies.
        resume_clock: with ``resume``: this clock's snapshot instead (``--resume DIR@CLOCK``).
        overwrite: a fresh run may replace another run's outputs in its directory.
        keep: committed snapshots kept.
        write_fault: test hook: a snapshot write that fails as on a full disk.
        stage_fault: test hook: a stage that kills or freezes itself.
        shard_fault: test hook: a shard that kills itself.
        max_restarts: ``--on-failure restart``: after a process failure, restart the whole job
            from its last committed snapshot, at most this many times (0: stop at the first).
        evict: ``--on-failure continue``: a VW whose process fails is evicted from the global
            clock (its unfinished wave discarded at every shard) and the others go on; a
            shard failure still ends the run (see ``docs/fault_tolerance.md``).
        restart_vw: with ``max_restarts`` (``--on-failure restart``, one host, the ``wsp``
            rule): a VW whose process fails is restarted alone at its cut while the others
            wait there (:mod:`runtime.launch.restart_vw`); a shard failure restarts the job.
        resume_hint: the command line to print when the run fails (``--resume DIR`` is appended).
        overlap_pulls: stages keep running tasks while a pull is in flight (``False``: the
            stage blocks in the pull at the wave end; a benchmark baseline).
    """

    D: int | None = None
    test_fraction: float = 0.2
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_hint: str = "hetpipe run ..."
    overlap_pulls: bool = True
    resume_clock: int | None = None
    overwrite: bool = False
    keep: int = 2
    write_fault: WriteFault | None = None
    stage_fault: StageFault | None = None
    shard_fault: ShardFault | None = None
    max_restarts: int = 0
    evict: bool = False
    restart_vw: bool = False
