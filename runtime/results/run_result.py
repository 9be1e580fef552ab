"""The result of a run, whatever its rule: per-VW figures, the shards' state, the summary.

Every rule returns a :class:`RunResult` (``hetpipe.train``, ``hetpipe run`` and
``python -m runtime`` alike): ``wsp``, ``backup`` and ``easgd`` with their shards' states,
``allreduce`` without shards (every VW holds the model), ``local`` (one VW alone) with one VW.

Per VW: throughput (the simulator's definition, stage-0 completions after the warm-up wave),
**waiting** (seconds its stages spent blocked on the parameter servers: WSP pulls and the
final flush), **idle** (seconds its stages had no task to run and were not waiting: pipeline
bubbles), both summed over the VW's stages, as in the paper's Fig. 9 breakdown.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table
from torch import Tensor
from torch.utils.data import Dataset

from planner.plan import Plan
from planner.rules import DEFAULT_RULE, get_rule, layout
from planner.sync import SyncParams
from profiler.capture import quiet_treespec
from profiler.errors import HetPipeRuntimeError
from profiler.files import atomic_write_text
from runtime.config import ModelSource
from runtime.persist.checkpoint import ShardState, atomic_torch_save
from runtime.ps.layout import ShardSpec, export_state_dict
from runtime.ps.outcome import ClockEvent
from runtime.results.breakdown import breakdown_json, breakdown_table
from runtime.results.evaluation import evaluate_module
from runtime.results.metrics import (
    StageResult,
    VWResult,
    skipped_caption,
    stage_table,
    write_metrics,
)
from runtime.results.metrics_log import history, metrics_paths
from runtime.results.restarts import restart_caption
from runtime.results.sync import arrival_table, describe_rule, dropped_vw_waves, kth_push_s
from runtime.results.timeline import write_timeline
from runtime.results.whole_state import merge_buffers, state_keys, user_state
from runtime.stage.model import build_stage, resolve_source

__all__ = ["LostVW", "RunResult", "evaluate", "model_keys"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LostVW:
    """A VW evicted during the run (``--on-failure continue``).

    Attributes:
        vw: the VW.
        cause: the failure that evicted it (the rank blamed and why).
        wave: its first wave left out: waves ``< wave`` are applied at every shard, none after.
        discarded: its pushes the shards had buffered and dropped (all shards together).
        waves_lost: its waves never applied (``wave`` to the run's last wave).
    """

    vw: int
    cause: str
    wave: int
    discarded: int
    waves_lost: int

    @staticmethod
    def from_shards(
        lost: dict[int, str], states: Sequence[ShardState], waves: int
    ) -> tuple[LostVW, ...]:
        """The lost VWs from the launcher's causes and the shards' evictions (``waves``: the
        global clock the run was to reach)."""
        out = []
        for vw, cause in sorted(lost.items()):  # the last eviction (earlier ones restarted)
            evs = [[e for e in s.evictions if e[0] == vw][-1:] for s in states]
            last = [e[0] for e in evs if e]
            wave = min((e[1] for e in last), default=0)
            out.append(LostVW(vw, cause, wave, sum(e[2] for e in last), max(0, waves - wave)))
        return tuple(out)


@dataclass(frozen=True)
class RunResult:
    """A finished run (any rule; one VW alone is the ``local`` rule with one entry in ``vws``).

    Attributes:
        vws: one :class:`VWResult` per VW (its stages, its predicted throughput).
        nm, D: minibatches per wave and the clock-distance threshold.
        states: every shard's final state, in shard order.
        traces: every shard's clock trace (one event per accepted push).
        specs: every shard's spec (for :meth:`state_dict`; none without shards).
        wall_s: launcher wall time including start-up, seconds.
        predicted_throughput: the plan's prediction for all VWs together (samples/s).
        test_accuracy, test_loss: the exported model on the held-out split (NaN if not a classifier).
        stopped_by: why the run ended early (the time limit and the wave it stopped after;
            empty: it trained every minibatch asked for).
        exported_from: the snapshot folder these outputs were written from, without training
            (:func:`runtime.results.export.export_snapshot`; empty for a run that trained).
        exported_state: the model those outputs hold when there are no shards (AllReduce:
            VW 0's copy of every stage, from the snapshot); ``None`` otherwise.
        restarts: the failures survived by restarting from the last snapshot (``--on-failure
            restart``), oldest first; this result is the last attempt's.
        sync, sync_params: the synchronisation rule (``wsp``, ``backup``, ``easgd``,
            ``allreduce``, ``local``) and its parameters (:mod:`runtime.results.sync` summarises what it did).
        lost: the VWs evicted during the run (``--on-failure continue``).
        keys: every key of the user's ``module.state_dict()`` with the canonical name of its
            tensor (:func:`runtime.results.whole_state.state_keys`; ``()``: canonical names).
        exported_buffers: the buffers those outputs hold, from the snapshot's stage parts
            (``None``: the stages' own at the end of the run).
        remedy: the stages' staleness remedy (``--remedy``, :mod:`planner.staleness`).
        data: what the run trained and tested on (``digits (...)``, ``synthetic (...)``,
            ``mydata:make (train 400, test 100)``; empty: not known).
        links: the plan's links and whether the run paced them, with the factor
            (:func:`runtime.link_pacing.links_statement`; empty: not known).
        predicted_without_overhead: the plan's prediction without the runtime overhead its
            planner assumed (compute and links only, samples/s; 0: it assumed none).
    """

    vws: tuple[VWResult, ...]
    nm: int
    D: int
    states: tuple[ShardState, ...]
    traces: tuple[tuple[ClockEvent, ...], ...]
    specs: tuple[ShardSpec, ...]
    wall_s: float
    predicted_throughput: float = 0.0
    test_accuracy: float = float("nan")
    test_loss: float = float("nan")
    stopped_by: str = ""
    exported_from: str = ""
    restarts: tuple[str, ...] = ()
    sync: str = DEFAULT_RULE
    sync_params: SyncParams = ()
    lost: tuple[LostVW, ...] = ()
    exported_state: dict[str, Tensor] | None = None
    keys: tuple[tuple[str, str], ...] = ()
    exported_buffers: dict[str, Tensor] | None = None
    data: str = ""
    remedy: str = "none"
    links: str = ""
    predicted_without_overhead: float = 0.0

    @staticmethod
    def build(
        plan: Plan,
        nm: int,
        D: int,
        stages: Sequence[StageResult],
        states: Sequence[tuple[ShardState, Sequence[ClockEvent]]],
        specs: Sequence[ShardSpec],
        wall_s: float,
        sync: str = "",
    ) -> RunResult:
        """Group stage results by VW and shard results by shard id."""
        vws = []
        for k, vw in enumerate(plan.virtual_workers):
            mine = tuple(sorted((s for s in stages if s.vw == k), key=lambda s: s.stage))
            devices = tuple(f"{vw.gpus[st.gpu].node}:{vw.gpus[st.gpu].index}" for st in vw.stages)
            vws.append(VWResult(mine, plan.batch_size, nm, vw.throughput, wall_s, devices=devices))
        ordered = sorted(states, key=lambda st: st[0].shard_id)
        return RunResult(
            tuple(vws),
            nm,
            D,
            tuple(s for s, _ in ordered),
            tuple(tuple(t) for _, t in ordered),
            tuple(specs),
            wall_s,
            plan.predicted.throughput,
            sync=sync or plan.sync,
            sync_params=plan.sync_params,
            predicted_without_overhead=_without_overhead(plan),
        )

    @property
    def throughput(self) -> float:
        """Samples/s of all VWs together."""
        return sum(v.throughput for v in self.vws)

    @property
    def stages(self) -> tuple[StageResult, ...]:
        """Every stage's result, VW by VW in pipeline order."""
        return tuple(s for v in self.vws for s in v.stages)

    @property
    def steps(self) -> int:
        """Minibatches each VW trained in this run (the most any VW trained)."""
        return max((v.steps for v in self.vws), default=0)

    @property
    def losses(self) -> list[float]:
        """The run's loss at every step: the mean over the VWs that reported of their losses at
        that step. One VW alone: its own; ``allreduce``: the global minibatch's (the VWs' slices
        are equal in size), the one loss the old DDP baseline reported."""
        per_vw = [v.losses for v in self.vws if v.stages]
        n = min((len(x) for x in per_vw), default=0)
        return [sum(x[i] for x in per_vw) / len(per_vw) for i in range(n)]

    @property
    def skipped_updates(self) -> int:
        """Minibatch updates skipped over every VW (``--on-nonfinite skip``)."""
        return sum(len(v.skipped) for v in self.vws)

    @property
    def alone(self) -> bool:
        """One VW trained alone (the ``local`` rule): its figures are the run's."""
        return layout(self.sync) == "alone" and len(self.vws) == 1

    @property
    def max_clock_distance(self) -> int:
        """Largest clock distance (fastest VW clock - global clock) any shard recorded."""
        return max((e.distance for t in self.traces for e in t), default=0)

    def waiting_s(self, vw: int) -> float:
        """Seconds VW ``vw``'s stages spent blocked on the parameter servers (summed)."""
        return sum(s.wait_s for s in self.vws[vw].stages)

    def idle_s(self, vw: int) -> float:
        """Seconds VW ``vw``'s stages had no task and were not waiting (summed)."""
        return sum(max(0.0, s.wall_s - s.busy_s - s.wait_s) for s in self.vws[vw].stages)

    def state_dict(self) -> dict[str, Tensor]:
        """The trained model's whole state under every name of the user's ``state_dict``
        (:attr:`keys`), for ``module.load_state_dict(..., strict=True)``.

        Parameters: the shards' global weights; without shards (AllReduce: every VW holds the
        same model) VW 0's, or the snapshot's. Buffers (batch-norm statistics): the stages',
        merged over the VWs (:func:`runtime.results.whole_state.merge_buffers`: the mean of
        floating-point ones, the largest integer), or the snapshot's."""
        if self.exported_state is not None:
            params = dict(self.exported_state)
        elif not self.specs and self.vws:
            params = self.vws[0].state_dict()
        else:
            params = export_state_dict(self.specs, [s.weights for s in self.states])
        buffers = self.exported_buffers
        if buffers is None:
            buffers = merge_buffers([v.buffers() for v in self.vws if v.stages])
        return user_state({**buffers, **params}, self.keys)

    def save(self, out_dir: Path, about: str = "") -> None:
        """``vw<k>/metrics.csv``, ``summary.json``, ``weights.pt`` (one ordinary state_dict) and
        the measured ``timeline.png`` / ``trace.json`` of every VW (``about``: model and plan,
        :func:`runtime.results.timeline.describe_run`).

        Raises:
            HetPipeRuntimeError: a file cannot be written (one line naming it).
        """
        try:
            self._save(out_dir, about)
        except OSError as exc:
            where = exc.filename or out_dir
            raise HetPipeRuntimeError(
                f"{where}: cannot write the run's outputs ({exc.strerror or exc}); free disk "
                f"space, then write them from the last snapshot with --resume {out_dir}"
            ) from None

    def _save(self, out_dir: Path, about: str) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = metrics_paths(out_dir, range(len(self.vws)), self.alone)
        for k, vw in enumerate(self.vws):
            if vw.stages:  # a lost VW reported nothing
                write_metrics(vw, paths[k].parent)
        kept = [history(paths[k]) for k in range(len(self.vws))]  # every attempt's rows
        if self.vws:
            write_timeline(list(self.stages), out_dir, about=about)
        atomic_torch_save(self.state_dict(), out_dir / "weights.pt")
        summary = {
            "throughput": self.throughput,
            "predicted_throughput": self.predicted_throughput,
            "predicted_without_overhead": self.predicted_without_overhead,
            "nm": self.nm,
            "D": self.D,
            "remedy": self.remedy,
            "max_clock_distance": self.max_clock_distance,
            "data": self.data,
            "links": self.links,
            "test_accuracy": self.test_accuracy,
            "test_loss": self.test_loss,
            "final_loss": self.losses[-1] if self.losses else None,
            "wall_s": self.wall_s,
            "stopped_by": self.stopped_by,
            "global_clock": min((s.clock for s in self.states), default=0),
            "exported_from": self.exported_from,
            "restarts": list(self.restarts),
            "sync": self.sync,
            "sync_params": dict(self.sync_params),
            "dropped_vw_waves": dropped_vw_waves(self.vws),
            "kth_push_s": kth_push_s(self.vws),
            "wave_arrivals_s": arrival_table(self.vws),
            "lost": [dataclasses.asdict(v) for v in self.lost],
            "skipped_updates": self.skipped_updates,
            "runtime_breakdown": breakdown_json(self.stages),
            "vws": [
                {
                    "throughput": v.throughput,
                    "predicted": v.predicted_throughput,
                    "steps": v.steps,
                    "waiting_s": self.waiting_s(k),
                    "idle_s": self.idle_s(k),
                    "metrics_rows": kept[k].rows,  # metrics.csv: every attempt, incarnation
                    "metrics_minibatches": kept[k].minibatches,  # distinct minibatches there
                    "metrics_attempts": kept[k].attempts,
                    "skipped": v.skipped,
                }
                for k, v in enumerate(self.vws)
            ],
        }
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))

    def table(self) -> Table:
        """The summary as a rich table: one row per VW, totals in the title and caption (one VW
        alone: its stages, :func:`runtime.results.metrics.stage_table`)."""
        if self.alone:
            alone = stage_table(self.vws[0])
            if self.data or self.links:
                data = f"data: {escape(self.data)}" if self.data else ""
                alone.caption = "; ".join(
                    filter(None, [data, str(alone.caption or ""), escape(self.links)])
                )
            return alone
        rule = describe_rule(self.sync, self.sync_params, self.D)
        title = f"{len(self.vws)} VWs, Nm={self.nm}, {rule}: {self.throughput:.1f} samples/s"
        if self.predicted_throughput > 0:
            title += f" (predicted {self.predicted_throughput:.1f}, ratio {self.throughput / self.predicted_throughput:.2f})"
        if self.predicted_without_overhead > 0:
            without = self.predicted_without_overhead
            title += (
                f"; without the runtime overhead {without:.1f} ({self.throughput / without:.2f})"
            )
        one_loss = layout(self.sync) == "ddp"  # the VWs train slices of one global minibatch
        table = Table(title=title)
        columns = ["VW", "devices", "minibatches", "samples/s", "predicted", "waiting s", "idle s"]
        for col in columns if one_loss else [*columns, "last loss"]:
            table.add_column(col, justify="right")
        for k, v in enumerate(self.vws):
            row = [
                str(k),
                " ".join(v.devices or tuple(s.device for s in v.stages)),  # a lost VW: the plan's
                str(v.steps),
                f"{v.throughput:.1f}",
                f"{v.predicted_throughput:.1f}",
                f"{self.waiting_s(k):.2f}",
                f"{self.idle_s(k):.2f}",
            ]
            losses = v.losses
            table.add_row(*row, *([] if one_loss else [f"{losses[-1]:.4f}" if losses else "-"]))
        table.caption = self._caption()
        return table

    def breakdown_table(self) -> Table | None:
        """Where each stage's time went (``--profile-runtime``; ``None``: not profiled)."""
        return breakdown_table(self.stages)

    def _caption(self) -> str:
        """The table's caption: the test figures, what the rule did, how the run ended."""
        acc = self.test_accuracy
        tested = (  # a model whose output is not class scores (a language model) has no accuracy
            f"test loss {self.test_loss:.4f}"
            if math.isnan(acc)
            else f"test accuracy {acc:.2%} (loss {self.test_loss:.4f})"
        )
        applied = sum(len(s.ledger) for s in self.states)
        if self.states:
            clocks = (
                f"global clock {min(s.clock for s in self.states)}, {applied} updates applied "
                f"once, max clock distance {self.max_clock_distance} (bound D+1 = {self.D + 1})"
            )
        else:
            losses = self.losses
            clocks = "gradients averaged over every VW each minibatch" + (
                f"; loss of the global minibatch: first {losses[0]:.4f}, last {losses[-1]:.4f}"
                if losses
                else ""
            )
        caption = f"{tested}; {clocks}; wall {self.wall_s:.1f} s"
        if self.data:
            caption = f"data: {escape(self.data)}; {caption}"
        if self.links:
            caption += f"; {escape(self.links)}"
        if get_rule(self.sync).drops:
            kth = " ".join(f"{t:.2f}" for t in kth_push_s(self.vws))
            caption += (
                f"; {dropped_vw_waves(self.vws)} VW-waves dropped; k-th push after the first "
                f"(s, mean over waves): {kth}"
            )
        if self.stopped_by:
            caption += f"; {self.stopped_by}"
        if self.skipped_updates:
            caption += f"; {skipped_caption(self.skipped_updates)}"
        if self.restarts:
            caption += f"; {escape(restart_caption(self.restarts))}"
        for gone in self.lost:
            caption += (
                f"; vw {gone.vw} lost ({escape(gone.cause)}): evicted at wave {gone.wave}, "
                f"{gone.discarded} buffered pushes discarded, {gone.waves_lost} waves not trained"
            )
        if self.exported_from:
            caption += f"; written from the snapshot {self.exported_from} (nothing left to train)"
        return caption


def model_keys(source: ModelSource, batch_size: int) -> tuple[tuple[str, str], ...]:
    """The keys of the model's ``state_dict`` with their tensors' canonical names
    (:func:`runtime.results.whole_state.state_keys`; a model reference is built on ``meta``)."""
    if source.module is None and source.ref is None:
        return ()
    return state_keys(resolve_source(source, batch_size, meta=source.module is None).module)


def evaluate(
    source: ModelSource,
    batch_size: int,
    seed: int,
    state: dict[str, Tensor],
    test: Dataset[Any],
) -> tuple[float, float]:
    """Test accuracy and mean loss, in eval mode, of the whole ``state`` (parameters and
    buffers, :meth:`RunResult.state_dict`) loaded into the model (NaN accuracy if not a
    classifier). A user's module is left as it was: the state goes into a copy of it, by its
    own names, as a user would load it (its own ``forward``, so dropout and batch norm follow
    ``eval()`` even where the captured graph fixed their mode); a model reference is rebuilt
    whole and the state loaded by the stage's names."""
    if len(test) == 0:  # type: ignore[arg-type]
        return float("nan"), float("nan")
    if source.module is not None:
        with quiet_treespec():
            module = copy.deepcopy(source.module)
        missing = module.load_state_dict(state, strict=False).missing_keys
        if missing:  # tensors the forward never reads: their initial values
            log.warning("evaluated with the initial values of %s (never trained)", missing[:5])
        loss_fn = source.loss if source.loss is not None else resolve_source(
            source, batch_size, meta=False
        ).loss  # fmt: skip
        return evaluate_module(module, test, batch_size, loss_fn)
    built = build_stage(source, batch_size, (), 0, seed)
    names = {**built.names, **built.buffer_names}
    by_orig = {orig: n for n, orig in names.items()}
    built.module.load_state_dict(
        {by_orig[k]: v for k, v in state.items() if k in by_orig}, strict=False
    )
    return evaluate_module(built.module, test, batch_size, built.loss)


def _without_overhead(plan: Plan) -> float:
    """The plan's prediction without the runtime overhead (0: its planner assumed none)."""
    p = plan.predicted
    return p.throughput_without_overhead if p.charges_overhead else 0.0
