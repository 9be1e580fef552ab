"""A plan on two hosts for the multi-host tests: every VW runs stage 0 on host A and stage 1
on host B, one parameter-server shard per host placed by the planner (``local``: beside the
stage that owns its layers)."""

from __future__ import annotations

from dataclasses import replace

from planner.cluster import Cluster, Link, Node
from planner.manual import manual_plan
from planner.placement import PipelineLayout, place_shards
from planner.plan import Plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.stage.model import resolve_source

HOST_A, HOST_B = "198.18.0.1", "198.18.0.2"


def two_host_plan(n_vws: int = 2, nm: int = 2, hosts: tuple[str, str] = (HOST_A, HOST_B)) -> Plan:
    """``n_vws`` two-stage VWs of the mlp across hosts ``A`` and ``B`` (D = 0, batch 16)."""
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 16, meta=True))
    nodes = tuple(
        Node(name, host, "CPU", "C", n_vws, 1 << 30) for name, host in zip("AB", hosts, strict=True)
    )
    cluster = Cluster("two-hosts", nodes, Link(1e9, 1e-5), Link(1e8, 1e-4))
    by_node = {n: [d for d in cluster.devices if d.node == n] for n in "AB"}
    cuts = (4,)
    vws = []
    for k in range(n_vws):
        devs = [by_node["A"][k], by_node["B"][k]]
        one = manual_plan(graph, cuts, "mlp", 16, nm, cluster, devs)
        vws.append(replace(one.virtual_workers[0], id=k))
    layouts = [
        PipelineLayout((by_node["A"][k], by_node["B"][k]), (0, *cuts, len(graph.layers)), (0,))
        for k in range(n_vws)
    ]
    names = [lay.name for lay in graph.layers]
    shards = place_shards(
        cluster, layouts, names, [lay.param_bytes for lay in graph.layers], "local"
    )
    predicted = replace(one.predicted, per_vw=tuple(v.throughput for v in vws))
    return replace(one, placement="local", virtual_workers=tuple(vws), shards=shards,
                   predicted=predicted)  # fmt: skip
