"""The plan file: the one contract between planner and runtime (and the simulator's input).

A plan is versioned and self-contained: it embeds the cluster, the model reference and
batch size, each virtual worker's GPUs in pipeline order with its stages (layer ranges by
name and index, per-stage times, transfer times and memory), Nm, D, the pipeline schedule by
name (``schedule: hetpipe``; a file without it has HetPipe's), the parameter-server
shard placement and the predictions. It is stored as YAML (``plan.yaml``) or JSON; both
hold the same document, whose shape is what :meth:`Plan.to_dict` returns. Reading plan
files: :mod:`planner.plan_file`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from planner.cluster import Cluster, parse_cluster
from planner.plan_check import check_plan_document, validate_plan
from planner.rules import DEFAULT_RULE
from planner.schedule import DEFAULT_SCHEDULE, schedule_named
from planner.sync import SyncParams, check_sync_params
from planner.wsp import s_global, s_local
from profiler.errors import PlanError, shown
from profiler.files import atomic_write_text
from profiler.precision import check_precision

__all__ = [
    "PLAN_VERSION",
    "GpuSlot",
    "Plan",
    "Prediction",
    "ShardPlan",
    "StagePlan",
    "VirtualWorker",
]

PLAN_VERSION = 1


@dataclass(frozen=True)
class GpuSlot:
    """One GPU of a virtual worker, in pipeline order.

    Attributes:
        node: node name in the cluster.
        index: GPU index on that node.
        type: catalog GPU type.
        memory_bytes: usable memory (the emulated cap for emulated devices).
        speed: emulated relative speed, or 0.0 for a real GPU.
    """

    node: str
    index: int
    type: str
    memory_bytes: int
    speed: float = 0.0


@dataclass(frozen=True)
class StageCost:
    """What one stage costs (the cost model's answer for a layer range on a GPU).

    Attributes:
        fwd_ms, bwd_ms: compute time of one minibatch on this GPU type.
        recv_fwd_ms: time to receive the activations crossing the stage's first cut.
        recv_bwd_ms: time to receive the gradients crossing its last cut.
        recv_bytes: bytes crossing the first cut (activations in, gradients back out).
        send_bytes: bytes crossing the last cut.
        param_bytes: bytes of the stage's parameters.
        in_flight: most minibatches this stage holds at once (Sec. 4 scheduling rules).
        memory_bytes: estimated peak memory with ``in_flight`` minibatches.
    """

    fwd_ms: float
    bwd_ms: float
    recv_fwd_ms: float
    recv_bwd_ms: float
    recv_bytes: int
    send_bytes: int
    param_bytes: int
    in_flight: int
    memory_bytes: int

    @property
    def time_ms(self) -> float:
        """Stage execution time per minibatch: compute plus receiving activations and gradients."""
        return self.fwd_ms + self.bwd_ms + self.recv_fwd_ms + self.recv_bwd_ms


@dataclass(frozen=True)
class StagePlan(StageCost):
    """One pipeline stage of a plan: a contiguous range of layers on one GPU, and its cost
    (the :class:`StageCost` fields).

    Attributes:
        gpu: position of the stage's GPU in ``VirtualWorker.gpus``.
        first_layer, last_layer: names of the first and last layer (inclusive).
        first_index, last_index: their positions in the model graph's linear order.
        capacity_bytes: the GPU's usable memory.
        memory: where the stage's data classes live (:mod:`planner.offload`, ``keep`` or e.g.
            ``weights:offload,activations:recompute``); ``memory_bytes`` counts device bytes.
        host_bytes: host memory its offloaded classes occupy.
        transfer_bytes: host-link bytes per minibatch (both directions).
        recompute_ms: forward time again per minibatch (included in ``bwd_ms``).
        transfer_ms: host-link time per minibatch not hidden behind compute (included in
            ``bwd_ms``).
    """

    gpu: int
    first_layer: str
    last_layer: str
    first_index: int
    last_index: int
    capacity_bytes: int
    memory: str = "keep"
    host_bytes: int = 0
    transfer_bytes: int = 0
    recompute_ms: float = 0.0
    transfer_ms: float = 0.0


def _stage_dict(stage: StagePlan) -> dict[str, Any]:
    """A stage as the plan file shows it: where it runs first, then what it costs."""
    d = asdict(stage)
    first = ("gpu", "first_layer", "last_layer", "first_index", "last_index")
    return {**{k: d.pop(k) for k in first}, **d, "time_ms": stage.time_ms}


@dataclass(frozen=True)
class VirtualWorker:
    """A group of GPUs running one pipeline.

    Attributes:
        id: 0-based virtual-worker number.
        gpus: GPUs in pipeline order (stage ``j`` runs on ``gpus[stages[j].gpu]``).
        stages: the pipeline stages.
        nm_max: the largest Nm whose memory fits this VW.
        throughput: predicted samples/s of this VW alone at the plan's Nm.
        cross_node_bytes_per_wave: bytes this VW moves across nodes per wave
            (activations/gradients between stages on different nodes plus push/pull).
        partitioner: the solver that chose order and split (``dp``, ``milp-highs``, ...).
        bound_ms: proven lower bound on the planner model's best slowest-stage time for these
            GPUs at this Nm (equal to the slowest stage when proven optimal; smaller after a
            time limit or ``--max-cuts``; 0: unknown, plans written before it existed).
    """

    id: int
    gpus: tuple[GpuSlot, ...]
    stages: tuple[StagePlan, ...]
    nm_max: int
    throughput: float
    cross_node_bytes_per_wave: int = 0
    partitioner: str = ""
    bound_ms: float = 0.0

    @property
    def gap(self) -> float:
        """Proven relative gap of the partition: slowest stage / ``bound_ms`` - 1 (0: optimal)."""
        slowest = max((s.time_ms for s in self.stages), default=0.0)
        return max(0.0, slowest / self.bound_ms - 1.0) if self.bound_ms > 0 else 0.0

    @property
    def signature(self) -> str:
        """GPU letters in pipeline order, e.g. ``VRGQ`` (the paper's Table 3 notation)."""
        return "".join(_letter(g.type) for g in self.gpus)


def _letter(gpu_type: str) -> str:
    from profiler.catalog import CATALOG

    spec = CATALOG.get(gpu_type)
    return spec.letter if spec is not None else gpu_type[:1].upper()


@dataclass(frozen=True)
class ShardPlan:
    """One parameter-server shard: where it runs and which layers' parameters it holds."""

    id: int
    node: str
    layers: tuple[str, ...]
    param_bytes: int


@dataclass(frozen=True)
class Prediction:
    """Predicted performance (samples/s, the same definition the runtime measures).

    Attributes:
        throughput: whole-cluster samples/s under WSP (straggler-bound).
        per_vw: samples/s of each VW alone.
        allreduce_throughput: data-parallel AllReduce BSP baseline on the GPUs that can hold
            the whole model (0.0 when none can).
        allreduce_gpus: how many GPUs that baseline uses.
        method: ``analytic`` or ``simulated``.
        overhead_ms_per_task: the runtime's own cost per task the planner assumed
            (:mod:`planner.overhead`) and ``throughput`` includes when simulated; 0: none
            (compute and links only, as plans before the model).
        throughput_without_overhead: ``throughput`` with no runtime overhead (samples/s; 0:
            the same as ``throughput``).
        overhead_ms_per_wave, overhead_ms_per_mb: the runtime's own cost per stage per wave
            through parameter servers the planner assumed, and per MB of the stage's
            parameters (:func:`planner.overhead.wave_overhead_ms`); 0: none (older plans).
    """

    throughput: float
    per_vw: tuple[float, ...]
    allreduce_throughput: float = 0.0
    allreduce_gpus: int = 0
    method: str = "analytic"
    overhead_ms_per_task: float = 0.0
    throughput_without_overhead: float = 0.0
    overhead_ms_per_wave: float = 0.0
    overhead_ms_per_mb: float = 0.0

    @property
    def charges_overhead(self) -> bool:
        """Whether ``throughput`` includes a runtime overhead (any term above 0)."""
        return (
            max(self.overhead_ms_per_task, self.overhead_ms_per_wave, self.overhead_ms_per_mb) > 0
        )


def _sync(value: Any, source: str) -> str:
    check_sync_params(value, {}, source)  # the rule exists (planner.rules)
    return str(value)


@dataclass(frozen=True)
class Plan:
    """A complete HetPipe plan. ``D`` is the WSP staleness threshold (clock distance bound)."""

    model: str
    batch_size: int
    policy: str
    nm: int
    D: int
    placement: str
    cluster: Cluster
    virtual_workers: tuple[VirtualWorker, ...]
    shards: tuple[ShardPlan, ...]
    predicted: Prediction
    num_layers: int
    profiles: dict[str, str] = field(default_factory=dict)  # GPU type -> provenance
    optimizer_state_factor: float = 1.0
    sync: str = DEFAULT_RULE  # the synchronisation rule across VWs (planner.rules.rules)
    sync_params: SyncParams = ()  # the rule's parameters (planner.sync.check_sync_params)
    precision: str = "fp32"  # "fp32" or "bf16" (autocast, fp32 master weights; profiler.precision)
    remedy: str = "none"  # staleness remedy the memory model counted (planner.staleness.REMEDIES)
    objective: dict[str, Any] = field(default_factory=dict)  # how it was chosen: planner.objective
    schedule: str = DEFAULT_SCHEDULE  # the pipeline schedule (planner.schedule.SCHEDULES)
    version: int = PLAN_VERSION

    @property
    def local_staleness(self) -> int:
        """s_local = Nm - 1 (paper Sec. 4; :func:`planner.wsp.s_local`)."""
        return s_local(self.nm)

    @property
    def global_staleness(self) -> int:
        """s_global = (D + 1) * Nm + Nm - 2 (paper Sec. 5; :func:`planner.wsp.s_global`)."""
        return s_global(self.nm, self.D)

    # ------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (the documented plan-file format)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["cluster"] = self.cluster.to_dict()
        d["virtual_workers"] = [
            {
                **asdict(vw),
                "signature": vw.signature,
                "stages": [_stage_dict(s) for s in vw.stages],
            }
            for vw in self.virtual_workers
        ]
        d["shards"] = [asdict(s) for s in self.shards]
        d["sync_params"] = dict(self.sync_params)
        d["predicted"] = asdict(self.predicted)
        d["local_staleness"] = self.local_staleness
        d["global_staleness"] = self.global_staleness
        return _plain(d)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<memory>") -> Plan:
        """Inverse of :meth:`to_dict`; the result is checked by :func:`planner.plan_check.validate_plan`.

        Raises:
            PlanError: wrong version or a missing/invalid field, naming it.
        """
        try:
            if d.get("version") != PLAN_VERSION:
                raise PlanError(
                    f"{source}: plan version {shown(d.get('version'), 20)} is not supported (this hetpipe reads "
                    f"version {PLAN_VERSION}); re-run 'hetpipe plan'"
                )
            check_plan_document(d, source)
            vws = tuple(_virtual_worker(v) for v in d["virtual_workers"])
            plan = cls(
                model=str(d["model"]),
                batch_size=int(d["batch_size"]),
                policy=str(d["policy"]),
                nm=int(d["nm"]),
                D=int(d["D"]),
                placement=str(d["placement"]),
                cluster=parse_cluster(d["cluster"], f"{source}: cluster"),
                virtual_workers=vws,
                shards=tuple(
                    ShardPlan(
                        int(s["id"]), str(s["node"]), tuple(s["layers"]), int(s["param_bytes"])
                    )
                    for s in d["shards"]
                ),
                predicted=_prediction(d["predicted"]),
                num_layers=int(d["num_layers"]),
                profiles={str(k): str(v) for k, v in d.get("profiles", {}).items()},
                optimizer_state_factor=float(d.get("optimizer_state_factor", 1.0)),
                sync=_sync(d.get("sync", DEFAULT_RULE), source),
                sync_params=check_sync_params(
                    d.get("sync", DEFAULT_RULE), d.get("sync_params") or {}, source
                ),
                precision=check_precision(str(d.get("precision", "fp32")), f"{source}: precision"),
                remedy=_remedy(d.get("remedy", "none"), source),
                objective=dict(d.get("objective") or {}),
                schedule=schedule_named(
                    d.get("schedule", DEFAULT_SCHEDULE), f"{source}: schedule"
                ).name,
            )
        except KeyError as exc:
            raise PlanError(
                f"{source}: plan lacks field {shown(exc.args[0], 40)} (truncated or not a hetpipe plan)"
            ) from None
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise PlanError(
                f"{source}: malformed plan ({type(exc).__name__}: {exc!s:.120})"
            ) from None
        validate_plan(plan, source)
        return plan

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan atomically, as JSON if the name ends in ``.json``, else YAML."""
        p = Path(path)
        d = self.to_dict()
        text = (
            json.dumps(d, indent=2) if p.suffix == ".json" else yaml.safe_dump(d, sort_keys=False)
        )
        return atomic_write_text(p, text)

    def to_json(self) -> str:
        """The plan as a JSON string."""
        return json.dumps(self.to_dict(), indent=2)


def _virtual_worker(v: dict[str, Any]) -> VirtualWorker:
    """A plan file's VW entry (:meth:`Plan.from_dict` reports its errors)."""
    return VirtualWorker(
        id=int(v["id"]),
        gpus=tuple(GpuSlot(**g) for g in v["gpus"]),
        stages=tuple(
            StagePlan(**{k: s[k] for k in _names(StagePlan) if k in s}) for s in v["stages"]
        ),
        nm_max=int(v["nm_max"]),
        throughput=float(v["throughput"]),
        cross_node_bytes_per_wave=int(v.get("cross_node_bytes_per_wave", 0)),
        partitioner=str(v.get("partitioner", "")),
        bound_ms=float(v.get("bound_ms", 0.0)),
    )


def _remedy(value: object, source: str) -> str:
    """A plan file's ``remedy`` (:data:`planner.staleness.REMEDIES`).

    Raises:
        PlanError: another value (names it and the remedies).
    """
    from planner.staleness import REMEDIES

    if value not in REMEDIES:
        raise PlanError(
            f"{source}: remedy {shown(value, 40)} is unknown: use one of {', '.join(REMEDIES)}"
        )
    return str(value)


def _prediction(pred: dict[str, Any]) -> Prediction:
    """A plan file's ``predicted`` entry (:meth:`Plan.from_dict` reports its errors)."""
    return Prediction(
        float(pred["throughput"]),
        tuple(float(x) for x in pred["per_vw"]),
        float(pred.get("allreduce_throughput", 0.0)),
        int(pred.get("allreduce_gpus", 0)),
        str(pred.get("method", "analytic")),
        float(pred.get("overhead_ms_per_task", 0.0)),
        float(pred.get("throughput_without_overhead", 0.0)),
        float(pred.get("overhead_ms_per_wave", 0.0)),
        float(pred.get("overhead_ms_per_mb", 0.0)),
    )


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return float(x)
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "to_dict"):
        return _plain(x.to_dict())
    return x
