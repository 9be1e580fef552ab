"""Test helper: build a :class:`Plan` directly from per-stage time lists (no planner needed)."""

from __future__ import annotations

from collections.abc import Sequence

from planner.cluster import Cluster, load_cluster
from planner.plan import GpuSlot, Plan, Prediction, ShardPlan, StagePlan, VirtualWorker
from tests.conftest import EXAMPLES


def paper_cluster() -> Cluster:
    return load_cluster(EXAMPLES / "paper_cluster.yaml")


def make_plan(
    vws: Sequence[Sequence[tuple[str, float, float]]],
    nm: int,
    D: int = 0,
    batch_size: int = 32,
    recv_bytes: int = 1_000_000,
    param_bytes: int = 4_000_000,
    placement: str = "default",
    shards: bool = True,
    cluster: Cluster | None = None,
) -> Plan:
    """A plan whose VW ``v`` has stages ``(node, fwd_ms, bwd_ms)`` in order, on GPUs of those nodes.

    Receive times follow the cluster's links for ``recv_bytes`` per cut; every stage holds
    ``param_bytes`` of parameters split over one layer; one shard per node used (default
    placement: each shard holds one layer of every stage's).
    """
    cl = cluster or paper_cluster()
    used: dict[str, int] = {}
    out = []
    n_stage_max = max(len(v) for v in vws)
    for v, stages in enumerate(vws):
        gpus = []
        for node, _, _ in stages:
            idx = used.get(node, 0)
            used[node] = idx + 1
            gpus.append(GpuSlot(node, idx, cl.node(node).gpu_type, cl.node(node).memory_bytes))
        sts = []
        for j, (node, f, b) in enumerate(stages):
            prev = stages[j - 1][0] if j > 0 else node
            nxt = stages[j + 1][0] if j + 1 < len(stages) else node
            rf = cl.links.between(prev, node)  # as charged (an emulated cluster's scale)
            rb = cl.links.between(node, nxt)
            sts.append(
                StagePlan(
                    gpu=j,
                    first_layer=f"layer{j}",
                    last_layer=f"layer{j}",
                    first_index=j,
                    last_index=j,
                    fwd_ms=f,
                    bwd_ms=b,
                    recv_fwd_ms=rf.time_s(recv_bytes) * 1e3 if j > 0 else 0.0,
                    recv_bwd_ms=rb.time_s(recv_bytes) * 1e3 if j + 1 < len(stages) else 0.0,
                    recv_bytes=recv_bytes if j > 0 else 0,
                    send_bytes=recv_bytes if j + 1 < len(stages) else 0,
                    param_bytes=param_bytes,
                    in_flight=nm if j + 1 < len(stages) else 1,
                    memory_bytes=0,
                    capacity_bytes=gpus[j].memory_bytes,
                )
            )
        out.append(VirtualWorker(v, tuple(gpus), tuple(sts), nm, 0.0))
    nodes = sorted(used)
    shard_list = (
        tuple(
            ShardPlan(
                i,
                node,
                tuple(f"layer{j}" for j in range(n_stage_max) if j % len(nodes) == i),
                param_bytes,
            )
            for i, node in enumerate(nodes)
        )
        if shards
        else ()
    )
    return Plan(
        model="synthetic",
        batch_size=batch_size,
        policy="test",
        nm=nm,
        D=D,
        placement=placement,
        cluster=cl,
        virtual_workers=tuple(out),
        shards=shard_list,
        predicted=Prediction(0.0, tuple(0.0 for _ in out)),
        num_layers=n_stage_max,
    )
