"""Each process's role, read from the plan: stage contexts, device checks, run length, pacing.

Pure reading of a :class:`planner.plan.Plan` (no processes): what :mod:`runtime.launch.launcher`
puts into every process's job, on one host or under torchrun (``python -m runtime``).
"""

from __future__ import annotations

import logging
import math

import torch

from planner.cluster import OWN_LINK, sender_queue
from planner.plan import Plan
from planner.predict import ring_link
from planner.rules import layout
from planner.straggle import NO_STRAGGLE, Straggle
from profiler.errors import ConfigError
from runtime.config import ModelSource, RunConfig
from runtime.link_pacing import NO_LINKS, StageLinks
from runtime.stage.emulation import Calibration, calibrate
from runtime.stage.job import StageContext
from runtime.stage.model import model_graph, resolve_source, sample_batch

__all__ = [
    "emulation",
    "pacing_table",
    "require_devices",
    "stage_contexts",
    "stage_links",
    "total_steps",
]

log = logging.getLogger(__name__)


def stage_contexts(
    plan: Plan, vw: int, nm: int, steps: int, first_rank: int = 0
) -> list[StageContext]:
    """The role of every process of virtual worker ``vw`` (global ranks from ``first_rank``).

    Raises:
        ConfigError: no such virtual worker.
    """
    if not 0 <= vw < len(plan.virtual_workers):
        raise ConfigError(
            f"the plan has {len(plan.virtual_workers)} virtual workers; --vw {vw} does not exist"
        )
    worker = plan.virtual_workers[vw]
    require_devices(plan, vw)
    cuts = tuple(st.first_index for st in worker.stages[1:])
    n = len(worker.stages)
    out = []
    for s, st in enumerate(worker.stages):
        gpu = worker.gpus[st.gpu]
        speed, cap = emulation(plan, gpu.node, gpu.speed, gpu.memory_bytes)
        out.append(
            StageContext(
                rank=first_rank + s,
                vw=vw,
                stage=s,
                n_stages=n,
                nm=nm,
                cuts=cuts,
                batch_size=plan.batch_size,
                device=f"{gpu.node}:{gpu.index}",
                speed=speed,
                cap_bytes=cap,
                optimizer_state_factor=plan.optimizer_state_factor,
                prev_rank=first_rank + s - 1 if s > 0 else None,
                next_rank=first_rank + s + 1 if s < n - 1 else None,
                total_steps=steps,
                memory=st.memory,
                host_cap_bytes=plan.cluster.host_memory_bytes(gpu.node),
                straggle=_straggle(plan, gpu.node) if speed > 0 else NO_STRAGGLE,
                gpu_type=gpu.type,
                schedule=plan.schedule,
                links=stage_links(plan, vw, s),
            )
        )
    return out


def stage_links(plan: Plan, vw: int, stage: int) -> StageLinks:
    """The charged links of stage ``stage`` of VW ``vw``: to its neighbours, to every shard
    and (the AllReduce baseline) its ring; none on a real cluster (:mod:`runtime.link_pacing`)."""
    cluster = plan.cluster
    if not cluster.emulated:
        return NO_LINKS
    links, worker = cluster.links, plan.virtual_workers[vw]
    nodes = [worker.gpus[st.gpu].node for st in worker.stages]
    me = nodes[stage]
    ring, size = None, 1
    if layout(plan.sync) == "ddp" and len(plan.virtual_workers) > 1:
        copies = [w.gpus[w.stages[stage].gpu].node for w in plan.virtual_workers]
        ring, size = ring_link(cluster, copies), len(copies)
    return StageLinks(
        prev=links.between(nodes[stage - 1], me) if stage > 0 else None,
        next=links.between(me, nodes[stage + 1]) if stage + 1 < len(nodes) else None,
        shards=tuple((sh.id, links.between(me, sh.node)) for sh in plan.shards),
        ring=ring,
        ring_size=size,
        prev_queue=sender_queue(me, nodes[stage - 1]) if stage > 0 else OWN_LINK,
        next_queue=sender_queue(me, nodes[stage + 1]) if stage + 1 < len(nodes) else OWN_LINK,
        shard_queues=tuple((sh.id, sender_queue(me, sh.node)) for sh in plan.shards),
    )


def require_devices(plan: Plan, vw: int, cuda_devices: int | None = None) -> None:
    """Refuse at once a VW that needs real GPUs on a host that has none.

    A device needs CUDA unless it is emulated (``emulate:`` in the cluster) or of type ``CPU``.

    Raises:
        ConfigError: the VW has real GPUs and this host has no CUDA device (names them).
    """
    have = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    worker = plan.virtual_workers[vw]
    real = [
        g
        for g in worker.gpus
        if emulation(plan, g.node, g.speed, g.memory_bytes)[0] == 0 and g.type.upper() != "CPU"
    ]
    if real and have == 0:
        names = ", ".join(f"{g.node}:{g.index} ({g.type})" for g in real[:4])
        more = f" and {len(real) - 4} more" if len(real) > 4 else ""
        raise ConfigError(
            f"VW {vw} of the {plan.model} plan runs on real GPUs ({names}{more}) but this host "
            "has no CUDA device; run it on the GPU hosts (torchrun, see docs/wsp_runtime.md), or "
            "plan for an emulated cluster (add 'emulate: {speed: 0.2, memory: 8MiB}' to its nodes)"
        )


def _straggle(plan: Plan, node: str) -> Straggle:
    """The straggler model of an emulated node (``emulate: {straggle: ...}``), else none."""
    try:
        emu = plan.cluster.node(node).emulation
    except ConfigError:
        emu = None
    return emu.straggle if emu is not None else NO_STRAGGLE


def emulation(plan: Plan, node: str, speed: float, memory_bytes: int) -> tuple[float, int]:
    """Speed and memory cap of an emulated device: the cluster's ``emulate:`` entry (the
    source of truth), else the plan's GPU slot; ``(0, 0)`` for a real GPU."""
    try:
        emu = plan.cluster.node(node).emulation
    except ConfigError:
        emu = None
    if emu is not None:
        return emu.speed, emu.memory_bytes
    return (speed, memory_bytes) if speed > 0 else (0.0, 0)


def total_steps(run: RunConfig, steps_per_epoch: int) -> int:
    """Minibatches to train: ``--steps``, else ``--epochs`` worth, else unbounded under a time limit, else one epoch."""
    if run.steps > 0:
        return run.steps
    if run.epochs > 0:
        return max(1, math.ceil(run.epochs * steps_per_epoch))
    if run.time_limit_s > 0:
        return 2**62
    return steps_per_epoch


def pacing_table(
    plan: Plan, source: ModelSource, contexts: list[StageContext], run: RunConfig
) -> Calibration | None:
    """The pacing table of one VW's emulated devices: the plan's stage times (the planner's CPU
    profile over each stage's layers / speed), written to ``calibration.json`` in the run
    directory (``python -m runtime --calibration`` reads it on other hosts)."""
    if not run.emulate or not any(c.speed > 0 for c in contexts):
        return None
    worker = plan.virtual_workers[contexts[0].vw]
    cuts = contexts[0].cuts
    if any(st.fwd_ms + st.bwd_ms > 0 for st in worker.stages):  # a stage may be ~0 ms
        key = f"{source.name}|batch={plan.batch_size}|cuts={list(cuts)}|plan"
        cal = Calibration.from_plan(
            key, [(st.fwd_ms, st.bwd_ms) for st in worker.stages], [c.speed for c in contexts]
        )
    else:  # a hand-made plan without any stage times: measure them here
        log.info(
            "the plan has no stage times: calibrating %d stages (single thread)", len(contexts)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.seed)
            spec = resolve_source(source, plan.batch_size, meta=False)
        loss = source.loss if source.loss is not None else spec.loss
        inputs, targets = sample_batch(spec)
        key = f"{source.name}|batch={plan.batch_size}|cuts={list(cuts)}|measured"
        stages = model_graph(source, spec).build_stages(cuts)
        cal = calibrate(stages, inputs, targets, loss, key)
    if run.out_dir is not None:
        cal.save(run.out_dir / "calibration.json")
    return cal
