"""Measurements: per-stage results, one VW's figures, its CSV/TensorBoard output, its table.

A run's result (every rule) is :class:`runtime.results.run_result.RunResult`, which holds one
:class:`VWResult` per VW.

Throughput is samples per second with the simulator's definition
(:func:`planner.throughput.measured_throughput`): stage-0 backward completions after the
warm-up wave, so the pipeline's fill is excluded and measured and predicted agree in meaning.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table
from torch import Tensor

from runtime.results.breakdown import Breakdown
from runtime.results.metrics_log import HEADER, has_history

__all__ = [
    "ProgressBar",
    "StageResult",
    "VWResult",
    "skipped_caption",
    "stage_table",
    "write_metrics",
]

log = logging.getLogger(__name__)

MAX_TASK_LOG = 4000  # tasks (and waits) a stage logs for the timeline: a long run's log stays small


@dataclass
class StageResult:
    """What one stage process measured (an accumulator, filled while it runs).

    Attributes:
        rank, vw, stage, device: who.
        start_time: wall-clock start (after the start barrier), seconds since the epoch.
        wall_s: time from start to this stage's end.
        busy_s: time spent executing tasks (compute, pacing, posting sends).
        tasks: tasks executed.
        steps: minibatches whose backward finished here.
        max_in_flight: most minibatches held at once (forward started, backward not done).
        peak_bytes: peak of the byte accounting.
        cuda_peak_bytes: ``torch.cuda.max_memory_allocated`` of the stage's process on its
            GPU (0 on CPU).
        losses: ``(minibatch, loss)`` (last stage only).
        done_times: wall-clock time each backward finished.
        state: final parameters by original name (when requested).
        buffers: final buffers (batch-norm statistics) by original name (always returned).
        wait_s: time blocked waiting for the parameter servers (WSP pulls and pushes).
        clocks: ``(required global clock, pulled global clock)`` of every WSP pull.
        overrun_s: time paced tasks ran past their target (an emulated device whose real
            computation is slower than its planned time: the plan overrates it).
        task_log: ``(kind, minibatch or wave, start, end)`` wall-clock seconds of the first
            tasks (``F``, ``B``, ``FB``) and WSP pull waits (``wait``), for the timeline.
        pushes: ``(wave, wall-clock time)`` of every push to the shards (the rule's arrivals).
        dropped: ``(shard, wave)`` of every push a shard dropped (backup workers).
        skipped: minibatches whose update this stage skipped (``--on-nonfinite skip``: a NaN
            or infinite loss or gradient; every stage of a VW skips the same ones).
        breakdown: where the stage's wall time went (``--profile-runtime``; ``None``: off).
    """

    rank: int
    vw: int
    stage: int
    device: str
    start_time: float = 0.0
    wall_s: float = 0.0
    busy_s: float = 0.0
    tasks: int = 0
    steps: int = 0
    max_in_flight: int = 0
    peak_bytes: int = 0
    cuda_peak_bytes: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    done_times: list[float] = field(default_factory=list)
    state: dict[str, Tensor] | None = None
    buffers: dict[str, Tensor] | None = None
    wait_s: float = 0.0
    clocks: list[tuple[int, int]] = field(default_factory=list)
    overrun_s: float = 0.0
    task_log: list[tuple[str, int, float, float]] = field(default_factory=list)
    pushes: list[tuple[int, float]] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    breakdown: Breakdown | None = None

    def log_interval(self, kind: str, mb: int, start: float, end: float) -> None:
        """Record a task or wait for the timeline (the first :data:`MAX_TASK_LOG` of a run)."""
        if len(self.task_log) < MAX_TASK_LOG:
            self.task_log.append((kind, mb, start, end))

    @property
    def busy_fraction(self) -> float:
        """Busy share of the stage's wall time."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class VWResult:
    """What one VW of a finished run measured.

    Attributes:
        stages: per-stage results in pipeline order (none for a VW lost in the run).
        batch_size: samples per minibatch.
        nm: minibatches in flight.
        predicted_throughput: the plan's prediction for this VW (samples/s, 0 = none).
        wall_s: launcher wall time including start-up.
        bound_throughput: emulated runs: batch / slowest stage's paced forward+backward time
            (the pipeline's upper bound, samples/s; 0 = not emulated).
        devices: the plan's device of each stage (``N0:0``), known even when the VW was lost.
        earlier: minibatches its earlier incarnations trained that the shards kept (a VW
            restarted alone at a cut, ``--on-failure restart``; ``stages`` are its last one's).
        run_start: with ``earlier``: the attempt's start (its earliest stage start), seconds
            since the epoch: the whole VW's throughput counts from there.
    """

    stages: tuple[StageResult, ...]
    batch_size: int
    nm: int
    predicted_throughput: float = 0.0
    wall_s: float = 0.0
    bound_throughput: float = 0.0
    devices: tuple[str, ...] = ()
    earlier: int = 0
    run_start: float = 0.0

    @property
    def steps(self) -> int:
        """Minibatches trained (a restarted VW: every incarnation's that the shards kept)."""
        return self.earlier + (self.stages[0].steps if self.stages else 0)

    @property
    def losses(self) -> list[float]:
        """Loss of every minibatch, in order (none for a VW lost in the run)."""
        return [loss for _, loss in sorted(self.stages[-1].losses)] if self.stages else []

    @property
    def skipped(self) -> list[int]:
        """Minibatches whose update was skipped (``--on-nonfinite skip``), in order: any
        stage's (every stage of the VW skips the same ones)."""
        return sorted({mb for s in self.stages for mb in s.skipped})

    @property
    def throughput(self) -> float:
        """Samples/s with the simulator's definition (``planner.throughput.measured_throughput``:
        stage-0 backward completions after warm-up wave 0); whole-run average for runs shorter
        than two waves; 0 for a VW lost in the run. A VW restarted alone: every minibatch
        it trained in all over the time from the attempt's start (the restart's gap included)."""
        times = sorted(self.stages[0].done_times) if self.stages else []
        if self.earlier and times:
            span = times[-1] - self.run_start
            return self.steps * self.batch_size / span if span > 0 else 0.0
        if len(times) >= 2 * self.nm:
            from planner.throughput import measured_throughput

            start = self.stages[0].start_time
            return measured_throughput(
                [[(t - start) * 1e3 for t in times]], self.nm, self.batch_size
            )
        if not times:
            return 0.0
        span = times[-1] - self.stages[0].start_time
        return len(times) * self.batch_size / span if span > 0 else 0.0

    def state_dict(self) -> dict[str, Tensor]:
        """Final parameters of the whole model by original name (when the run returned them),
        without its buffers (:meth:`buffers`)."""
        out: dict[str, Tensor] = {}
        for s in self.stages:
            out.update(s.state or {})
        return out

    def buffers(self) -> dict[str, Tensor]:
        """Final buffers of the whole model (batch-norm statistics) by original name (when the
        run returned them); a buffer read on several stages: the first stage's."""
        out: dict[str, Tensor] = {}
        for s in reversed(self.stages):
            out.update(s.buffers or {})
        return out


def write_metrics(result: VWResult, out_dir: Path) -> Path:
    """Write ``metrics.csv`` (one row per minibatch, unless the launcher already wrote the
    run's history there while it ran, :mod:`runtime.results.metrics_log`) and ``stages.csv``;
    TensorBoard when installed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.csv"
    done = sorted(result.stages[0].done_times)
    start = result.stages[0].start_time
    if not has_history(path):  # a result saved by hand: its own rows, one attempt
        skipped = set(result.skipped)
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(HEADER)
            for i, (mb, loss) in enumerate(sorted(result.stages[-1].losses)):
                t = done[i] - start if i < len(done) else float("nan")
                w.writerow(
                    [
                        0,
                        0,
                        mb,
                        f"{loss:.6f}",
                        f"{t:.6f}",
                        mb * result.batch_size,
                        int(mb in skipped),
                    ]
                )
    with (out_dir / "stages.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "vw",
                "stage",
                "rank",
                "device",
                "busy_s",
                "wall_s",
                "busy_fraction",
                "max_in_flight",
                "peak_bytes",
            ]
        )
        for s in result.stages:
            w.writerow(
                [
                    s.vw,
                    s.stage,
                    s.rank,
                    s.device,
                    f"{s.busy_s:.4f}",
                    f"{s.wall_s:.4f}",
                    f"{s.busy_fraction:.4f}",
                    s.max_in_flight,
                    s.peak_bytes,
                ]
            )
    _tensorboard(result, out_dir)
    return path


def _tensorboard(result: VWResult, out_dir: Path) -> None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return
    writer = SummaryWriter(str(out_dir / "tb"))
    try:
        for mb, loss in sorted(result.stages[-1].losses):
            writer.add_scalar("loss", loss, mb)
        writer.add_scalar("throughput", result.throughput, result.steps)
    finally:
        writer.close()


def stage_table(result: VWResult) -> Table:
    """One VW's summary as a rich table: per-stage busy/idle, in-flight, memory; throughput."""
    measured = result.throughput
    title = f"{result.steps} minibatches x {result.batch_size} samples, Nm={result.nm}: {measured:.1f} samples/s"
    if result.predicted_throughput > 0:
        title += f" (predicted {result.predicted_throughput:.1f}, measured/predicted {measured / result.predicted_throughput:.2f})"
    if result.bound_throughput > 0:
        title += f"; bound 1/slowest stage {result.bound_throughput:.1f} ({measured / result.bound_throughput:.0%})"
    table = Table(title=title)
    for col in ("stage", "device", "busy", "idle", "max in flight", "peak MiB"):
        table.add_column(col, justify="right")
    for s in result.stages:
        table.add_row(
            str(s.stage),
            s.device,
            f"{s.busy_fraction:.0%}",
            f"{1 - s.busy_fraction:.0%}",
            str(s.max_in_flight),
            f"{s.peak_bytes / 2**20:.2f}",
        )
    if result.losses:
        table.caption = f"loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}"
    if result.skipped:
        skipped = f"{skipped_caption(len(result.skipped))}"
        table.caption = f"{table.caption}; {skipped}" if table.caption else skipped
    return table


def skipped_caption(n: int) -> str:
    """What a summary says of ``n`` skipped updates (``--on-nonfinite skip``)."""
    return f"{n} update{'s' if n != 1 else ''} skipped (non-finite loss or gradients)"


class ProgressBar:
    """Rich progress bar fed by the stages' events (no-op when disabled).

    It is shown from the moment the processes start ("starting processes", with a spinner and
    the elapsed time) and turns into the training bar at the first finished minibatch."""

    def __init__(self, enabled: bool, total: int, batch_size: int) -> None:
        self.bar: Any = None
        self.batch_size = batch_size
        self.t0 = time.time()
        self.last_loss: dict[int, float] = {}  # each last stage's latest loss
        self.done = 0  # stage-0 completions seen (recomputed ones included): the rate
        self.per_rank: dict[int, int] = {}  # minibatches each stage 0 has to its credit
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self.task = self.bar.add_task(
                "starting processes",
                total=total if total < 2**40 else None,
                info="(joining the process group, building stages)",
            )
            self.bar.start()

    def event(self, msg: tuple[Any, ...]) -> None:
        """A stage's ``loss``/``done`` event, or a restarted VW's ``rejoined`` one (its
        stage 0's rank, the minibatches kept before its cut): what its previous incarnation
        trained past the cut is recomputed, not counted twice. The loss shown is the run's:
        the mean of every VW's latest (AllReduce: over the slices of one global minibatch,
        as :attr:`runtime.results.run_result.RunResult.losses`)."""
        if msg[0] == "loss":
            self.last_loss[int(msg[1])] = float(msg[3])
        elif msg[0] == "rejoined":
            self.per_rank[int(msg[1])] = int(msg[2])
        elif msg[0] == "done":
            self.done += 1
            self.per_rank[int(msg[1])] = self.per_rank.get(int(msg[1]), 0) + 1
            if self.done == 1:
                self.t0 = float(msg[3])
            if self.bar is not None:
                rate = (self.done - 1) * self.batch_size / max(1e-9, float(msg[3]) - self.t0)
                self.bar.update(
                    self.task,
                    description="training",
                    completed=self.completed,
                    info=f"{rate:.1f} samples/s  loss {self.loss:.4f}",
                )

    @property
    def completed(self) -> int:
        """Minibatches trained and kept, every VW's (a restarted VW's recomputed ones once)."""
        return sum(self.per_rank.values())

    @property
    def loss(self) -> float:
        """The mean of the latest loss of every VW that reported one (NaN: none yet)."""
        losses = self.last_loss.values()
        return sum(losses) / len(losses) if losses else float("nan")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def warn_overruns(
    stages: Sequence[StageResult], share: float = 0.25, min_s: float = 0.05
) -> list[str]:
    """Log (and return) a warning for each emulated stage whose computation ran past its paced
    target for more than ``share`` of its busy time and ``min_s`` seconds in all: its device
    is much slower than the plan says (e.g. a plan made from an analytic GPU profile), so
    measured and predicted times diverge. Smaller overruns are expected when tasks last 1-3 ms:
    the stage's fixed Python cost per task (autograd, weight versions, memory accounting) is
    not in a per-layer profile and two cores are shared by every process; ``min_s`` keeps a
    stage planned at ~0 ms (e.g. only a reshape) quiet."""
    out = []
    for r in stages:
        if r.busy_s > 0 and r.overrun_s > max(share * r.busy_s, min_s):
            msg = (
                f"vw {r.vw} stage {r.stage} ({r.device}): tasks ran {r.overrun_s:.2f} s past their "
                f"planned times ({r.overrun_s / r.busy_s:.0%} of busy time): the device is slower "
                "than its profile; re-profile ('hetpipe profile') or lower its speed"
            )
            log.warning(msg)
            out.append(msg)
    return out
