"""A plan for real GPUs is refused at once on a host without them (it used to start, sit at
0 minibatches and blame a parameter-server shard)."""

from __future__ import annotations

import pytest

from planner.cluster import Cluster, Emulation, Link, Node
from planner.manual import balanced_cuts, cpu_cluster, manual_plan
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.launch.roles import require_devices, stage_contexts
from runtime.stage.model import resolve_source


def _graph() -> ModelGraph:
    return ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))


def _cluster(emulate: bool) -> Cluster:
    emu = Emulation(0.2, 8 << 20) if emulate else None
    node = Node("V", "localhost", "TITAN V", "V", 2, 12 << 30, emu)
    return Cluster("gpus", (node,), Link(1e10, 1e-5), Link(1e10, 1e-5))


def test_real_gpus_without_cuda_are_refused_naming_them() -> None:
    g = _graph()
    plan = manual_plan(g, balanced_cuts(g, 2), "mlp", 8, 2, _cluster(emulate=False))
    with pytest.raises(
        ConfigError, match=r"real GPUs \(V:0 \(TITAN V\), V:1 \(TITAN V\)\).*no CUDA"
    ):
        require_devices(plan, 0, cuda_devices=0)
    require_devices(plan, 0, cuda_devices=2)  # a GPU host: accepted


@pytest.mark.parametrize("cluster", [_cluster(emulate=True), cpu_cluster(2)])
def test_emulated_and_cpu_devices_need_no_cuda(cluster: Cluster) -> None:
    g = _graph()
    plan = manual_plan(g, balanced_cuts(g, 2), "mlp", 8, 2, cluster)
    require_devices(plan, 0, cuda_devices=0)
    assert len(stage_contexts(plan, 0, 2, 4)) == 2
