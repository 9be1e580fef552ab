"""The one frozen description of a run (:class:`RunSpec`), built once by every entry.

``hetpipe run``, ``python -m runtime`` under torchrun and ``hetpipe.train`` turn the values of
the one options table (:mod:`runtime.options`) into a :class:`RunSpec`
(:func:`runtime.options.run_spec`); every function on the run path takes it, and each
component reads only its own section: the launcher the failure policy and the checkpoints,
the parameter-server part the sync settings, each stage its optimizer and run settings
(a :class:`runtime.stage.job.StageJob` pickles those sections only). Test faults live in
:class:`TestHooks`, which no user entry sets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiler.errors import ConfigError, shown
from runtime.config import OptimizerConfig, RunConfig

if TYPE_CHECKING:
    from runtime.faults import ShardFault, StageFault
    from runtime.persist.snapshot import WriteFault

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FailurePolicy",
    "OnFailure",
    "RunSpec",
    "SyncConfig",
    "TestHooks",
]


class OnFailure(enum.Enum):
    """What a failed process does to the run (``--on-failure``)."""

    STOP = "stop"
    """The run ends, naming the process (and the snapshot to resume from)."""
    RESTART = "restart"
    """A failed stage's VW restarts alone where the shards cut it (one host, ``wsp``); any
    other failure restarts the whole job from its last snapshot; within a budget."""
    CONTINUE = "continue"
    """A failed VW is evicted from the WSP clock and the others go on."""

    @classmethod
    def parse(cls, value: str | OnFailure) -> OnFailure:
        """``value`` as a policy.

        Raises:
            ConfigError: not one of ``stop``, ``restart``, ``continue`` (names the flag).
        """
        if isinstance(value, OnFailure):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ConfigError(f"--on-failure {shown(value, 40)}: use one of {names}") from None


@dataclass(frozen=True)
class FailurePolicy:
    """The failure policy: one choice and its budget; what it implies is derived.

    Attributes:
        on_failure: the choice (``--on-failure``).
        max_restarts: restarts allowed under :attr:`OnFailure.RESTART` (``--max-restarts``);
            unused otherwise.
    """

    on_failure: OnFailure = OnFailure.STOP
    max_restarts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_failure", OnFailure.parse(self.on_failure))
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be >= 0; give 0 or more")

    @property
    def budget(self) -> int:
        """Restarts left (0 unless ``restart``)."""
        return self.max_restarts if self.on_failure is OnFailure.RESTART else 0

    @property
    def evict(self) -> bool:
        """A failed VW is evicted and the others go on (``continue``)."""
        return self.on_failure is OnFailure.CONTINUE

    @property
    def restart_vw(self) -> bool:
        """A failed stage's VW may restart alone (``restart``; the launcher narrows it to one
        host, the ``wsp`` rule and VWs without tied weights across stages)."""
        return self.on_failure is OnFailure.RESTART

    def spent(self, restarts: int) -> FailurePolicy:
        """This policy with ``restarts`` of its budget used."""
        return replace(self, max_restarts=max(0, self.max_restarts - restarts))


@dataclass(frozen=True)
class DataConfig:
    """What the run trains and tests on.

    Attributes:
        ref: ``--data``: ``pkg.mod:factory`` or ``synthetic`` (``""``: the model's own data,
            or the data set ``hetpipe.train`` was given).
        test_fraction: share of the data held out for the final test accuracy.
    """

    ref: str = ""
    test_fraction: float = 0.2


@dataclass(frozen=True)
class SyncConfig:
    """Settings of the synchronisation rule (its name and parameters are the plan's:
    ``plan.sync``, ``plan.sync_params``).

    Attributes:
        D: clock-distance threshold (``None`` = the plan's).
        overlap_pulls: stages keep running tasks while a pull is in flight (``False``: the
            stage blocks in the pull at the wave end; a benchmark baseline).
    """

    D: int | None = None
    overlap_pulls: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    """Snapshots and resuming.

    Attributes:
        dir: where snapshots go (``None`` = ``out/checkpoints`` when the run has ``--out``).
        every: snapshot each time the global clock reaches a multiple of this, and at the end
            (0 = never).
        resume: continue from the newest snapshot of ``dir`` that verifies.
        resume_clock: with ``resume``: this clock's snapshot instead (``--resume DIR@CLOCK``).
        overwrite: a fresh run may replace another run's outputs in its directory.
        keep: committed snapshots kept (0: every one, ``--keep 0``).
        resume_hint: the command line a failure message suggests (``--resume DIR`` appended).
    """

    dir: Path | None = None
    every: int = 0
    resume: bool = False
    resume_clock: int | None = None
    overwrite: bool = False
    keep: int = 2
    resume_hint: str = "hetpipe run ..."


@dataclass(frozen=True)
class TestHooks:
    """Faults that tests inject; no user entry point sets them (the first attempt only).

    Attributes:
        write_fault: a snapshot write that fails as on a full disk.
        stage_fault: a stage that kills, freezes or delays itself.
        shard_fault: a shard that kills or delays itself.
        whole_job_restarts: under ``restart``, a failed stage restarts the whole job (as under
            torchrun or with tied weights) instead of its VW alone.
    """

    __test__ = False  # not a pytest class

    write_fault: WriteFault | None = None
    stage_fault: StageFault | None = None
    shard_fault: ShardFault | None = None
    whole_job_restarts: bool = False


@dataclass(frozen=True)
class RunSpec:
    """Everything a run is asked to do, besides the plan, the model and the data set.

    Attributes:
        run: length, seed, out dir, timeouts, emulation, precision (each stage's).
        optimizer: each stage's optimizer, schedule and staleness remedy.
        data: the data's reference and test split.
        sync: the synchronisation rule's settings.
        checkpoints: snapshots and resume.
        failure: what a failed process does.
        vw: train only this VW, alone (-1 = every VW of the plan).
        faults: test hooks (:class:`TestHooks`).
    """

    run: RunConfig = field(default_factory=RunConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailurePolicy = field(default_factory=FailurePolicy)
    vw: int = -1
    faults: TestHooks = field(default_factory=TestHooks)

    def with_run(self, **changes: Any) -> RunSpec:
        """This spec with ``changes`` made to its :attr:`run` section."""
        return replace(self, run=replace(self.run, **changes))

    def with_checkpoints(self, **changes: Any) -> RunSpec:
        """This spec with ``changes`` made to its :attr:`checkpoints` section."""
        return replace(self, checkpoints=replace(self.checkpoints, **changes))

    def without_faults(self) -> RunSpec:
        """This spec for a later attempt: test faults fire in the first attempt only."""
        return replace(self, faults=TestHooks(whole_job_restarts=self.faults.whole_job_restarts))
