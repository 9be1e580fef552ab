"""One stage process's job: everything it learns from the plan and the launcher, frozen.

The launcher (:mod:`runtime.launch`) builds a :class:`StageJob` whole for every stage process
(a one-host launch and every torchrun rank alike); the :class:`runtime.stage.worker.StageWorker`
is built from it and nothing is patched afterwards. The stage never sees the ``Plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.schedule import DEFAULT_SCHEDULE
from planner.straggle import NO_STRAGGLE, Straggle
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.link_pacing import NO_LINKS, StageLinks
from runtime.sync.rule import SyncSpec

if TYPE_CHECKING:
    from runtime.faults import StageFault
    from runtime.stage.emulation import Calibration
    from runtime.stage.model import BuiltStage

__all__ = ["StageContext", "StageJob"]


@dataclass(frozen=True)
class StageContext:
    """A stage's place in the plan.

    Attributes:
        rank: global rank.
        vw, stage, n_stages: position in the virtual worker.
        nm: minibatches in flight.
        cuts: cut points of the virtual worker's pipeline.
        batch_size: samples per minibatch.
        device: device label (``G:0``).
        speed: emulated relative speed (0 = not paced).
        cap_bytes: memory cap (0 = none).
        optimizer_state_factor: optimizer state bytes per parameter byte.
        prev_rank, next_rank: neighbours' global ranks (``None`` at the ends).
        total_steps: minibatches to train (stage 0 may stop earlier on a time limit).
        memory: the stage's memory placement (``StagePlan.memory``, :mod:`planner.offload`).
        host_cap_bytes: host memory the stage may offload to (0 = unbounded).
        straggle: the emulated device's straggler model: a paced task of wave ``c`` takes
            ``straggle.slowdown(vw, c)`` times longer (:mod:`planner.straggle`).
        gpu_type: the cluster's type of the device (``V100``; ``CPU``: computes on the host;
            ``""``: unknown), for :meth:`torch_device`.
        schedule: the plan's pipeline schedule (:data:`planner.schedule.SCHEDULES`).
        links: the emulated links its transfers are paced to (:mod:`runtime.link_pacing`;
            none on a real cluster).
        syncing: ``(VWs, D)`` whose updates reach the stage through the rule, for
            ``--remedy predict`` (:func:`runtime.stage.weights.predict_syncing`).
    """

    rank: int
    vw: int
    stage: int
    n_stages: int
    nm: int
    cuts: tuple[int, ...]
    batch_size: int
    device: str
    speed: float
    cap_bytes: int
    optimizer_state_factor: float
    prev_rank: int | None
    next_rank: int | None
    total_steps: int
    memory: str = "keep"
    host_cap_bytes: int = 0
    straggle: Straggle = NO_STRAGGLE
    gpu_type: str = ""
    schedule: str = DEFAULT_SCHEDULE
    links: StageLinks = NO_LINKS
    syncing: tuple[int, int] = (1, 0)

    @property
    def emulated(self) -> bool:
        """Whether the stage emulates its device on CPU (paced or memory-capped)."""
        return self.speed > 0 or self.cap_bytes > 0

    def torch_device(self, cuda_devices: int) -> str:
        """The torch device the stage computes on, given this process's CUDA device count
        (:func:`runtime.stage.device.stage_device`)."""
        from runtime.stage.device import stage_device

        return stage_device(self.device, self.gpu_type, self.emulated, cuda_devices)

    @property
    def where(self) -> str:
        """Log prefix ``vw 0 | stage 2 | rank 2 | device G:0``."""
        return f"vw {self.vw} | stage {self.stage} | rank {self.rank} | device {self.device}"


@dataclass(frozen=True)
class StageJob:
    """Everything one stage process needs.

    Attributes:
        ctx: its place in the plan.
        source: the model; of a user's module, this stage alone (the launcher ships it:
            :func:`runtime.stage.model.ship_stage`).
        optimizer: the local optimizer and schedule.
        run: run settings.
        sync: the synchronisation rule's part (:mod:`runtime.sync.rule`).
        dataset: what this stage reads of its VW's training data
            (:func:`runtime.data.stage_view`; ``None``: the model's built-in data set, or
            nothing for a middle stage, which never reads data).
        data_slice: ``(rank, world)``: train on this slice of global minibatches of
            ``world * batch_size`` (the ``allreduce`` rule's data); ``(0, 1)``: whole ones.
        calibration: the pacing table of an emulated device (``None``: not paced).
        fault: test hook: the stage kills or freezes itself (:class:`StageFault`).
        init_method: the process group's rendezvous (``file://...`` on one host, ``env://``
            under torchrun).
        world_size: processes in the group.
    """

    ctx: StageContext
    source: ModelSource
    optimizer: OptimizerConfig
    run: RunConfig
    sync: SyncSpec = field(default_factory=SyncSpec)
    dataset: Any = None
    data_slice: tuple[int, int] = (0, 1)
    calibration: Calibration | None = None
    fault: StageFault | None = None
    init_method: str = "env://"
    world_size: int = 1

    def _classes(self) -> int | None:
        """The model's output width (its classes: the range of synthetic targets), from its
        whole graph on the meta device (``None``: a shipped stage, or not class scores)."""
        from runtime.data_source import output_classes
        from runtime.stage.model import resolve_source

        if self.source.ref is None:
            return None
        return output_classes(resolve_source(self.source, self.ctx.batch_size, meta=True))

    @property
    def first_mb(self) -> int:
        """Minibatches trained before this run (a resumed run's position)."""
        return self.sync.first_wave * self.ctx.nm

    def minibatches(self, built: BuiltStage) -> MinibatchSource:
        """This VW's minibatches (stage 0 reads the inputs, the last stage the targets), going
        on after :attr:`first_mb`, sliced by :attr:`data_slice`."""
        ds = self.dataset
        if ds is None:
            ds = default_dataset(
                self.source.name, built.inputs, built.targets,
                self.ctx.batch_size, built.input_names, self._classes(),
            )  # fmt: skip
        return MinibatchSource(
            ds, self.ctx.batch_size, self.run.seed, tuple(built.targets.shape),
            input_names=built.input_names, offset=self.first_mb, slice_of=self.data_slice,
        )  # fmt: skip
