"""The stage memory manager (runtime.stage.offload): offload and recompute change where bytes
live, never what is computed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from planner.manual import balanced_cuts, manual_plan
from planner.offload import MemoryPlacement, Place
from profiler.errors import HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.launch.launcher import launch
from runtime.stage.model import resolve_source
from runtime.stage.offload import OffloadManager, ResidencyMeter, memory_manager
from tests.runtime._spec import spec

EXACT = {"rtol": 0.0, "atol": 0.0}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)
    )


def _step(net: nn.Module, mgr: OffloadManager | None, mb: int) -> tuple[list[torch.Tensor], ...]:
    torch.manual_seed(100 + mb)
    x = torch.randn(5, 6)
    params = list(net.parameters())
    if mgr is None:
        out = net(x)
    else:
        out = mgr.forward(mb, net, (x,), params)
        mgr.prefetch_ahead()
    grads = torch.autograd.grad(out.square().sum(), params)
    if mgr is not None:
        mgr.release(mb)
    return list(grads), [b.clone() for b in net.buffers()]


@pytest.mark.parametrize("where", ["offload", "recompute"])
def test_forward_backward_bit_equal(where: str) -> None:
    ref_net, net = _net(), _net()
    mgr = OffloadManager(MemoryPlacement(activations=Place(where)), list(net.buffers()))
    for mb in (1, 2, 3):  # minibatch 1 measures the recompute working set, 2-3 checkpoint
        ref = _step(ref_net, None, mb)
        got = _step(net, mgr, mb)
        for a, b in zip(ref[0] + ref[1], got[0] + got[1], strict=True):
            assert_close(b, a, **EXACT)
    assert mgr.working_bytes > 0 if where == "recompute" else mgr.saved_bytes > 0


def test_offloaded_tensors_are_copies_brought_back() -> None:
    net = _net()
    mgr = OffloadManager(MemoryPlacement(activations=Place.OFFLOAD))
    x = torch.randn(5, 6)
    mgr.forward(1, net, (x,), list(net.parameters()))
    packed = mgr._packed[1]
    assert packed and all(p.ready is None for p in packed)
    mgr.prefetch_ahead()
    assert all(p.ready is not None for p in packed)
    mgr.release(1)
    assert not mgr._packed


def test_residency_meter_splits_device_and_host() -> None:
    pl = MemoryPlacement(Place.OFFLOAD, Place.OFFLOAD, Place.OFFLOAD, Place.OFFLOAD)
    m = ResidencyMeter("s", 10_000, 1000, 0, 1.0, pl, host_cap_bytes=0)
    assert m.static_bytes == 1000 and m.static_host_bytes == 2000  # optimizer and gradients
    for mb, held in ((1, 100), (2, 300), (3, 200)):
        m.check(mb, held, stashed_bytes=4000)
    dev, host = m.split(4000)
    assert dev == 300 + 200 + 2 * 1000  # two minibatches and two versions on the device
    assert host == 100 + 2 * 1000
    tight = ResidencyMeter("s", 10_000, 1000, 0, 1.0, pl, host_cap_bytes=2500)
    with pytest.raises(HetPipeRuntimeError, match="host memory"):
        tight.check(1, 100, stashed_bytes=4000)
    keep = ResidencyMeter("s", 2500, 1000, 0, 1.0, MemoryPlacement())
    with pytest.raises(HetPipeRuntimeError, match="out of memory"):
        keep.check(1, 600, stashed_bytes=0)


def test_memory_manager_factory() -> None:
    mgr, meter = memory_manager("keep", "s", 0, 0, 10, 0, 1.0)
    assert mgr is None and not isinstance(meter, ResidencyMeter)
    mgr, meter = memory_manager("activations:recompute", "s", 0, 0, 10, 0, 1.0)
    assert mgr is not None and mgr.recompute and isinstance(meter, ResidencyMeter)
    with pytest.raises(HetPipeRuntimeError, match="placement"):
        memory_manager("weights:recompute", "s", 0, 0, 10, 0, 1.0)


def test_pipeline_runs_equal_the_all_keep_run() -> None:
    """Three stages, Nm = 4 (3 in flight on stage 0): every placement trains bit-equal."""
    ref, batch = "mlp", 8
    source = ModelSource(ref=ref)
    graph = ModelGraph.from_spec(resolve_source(source, batch, meta=True))
    plan = manual_plan(graph, balanced_cuts(graph, 3), ref, batch, 4)
    cfg = OptimizerConfig(name="adam", lr=1e-3)
    run = RunConfig(steps=8, seed=3, return_state=True, timeout_s=30)

    def with_memory(memory: str) -> object:
        vw = plan.virtual_workers[0]
        stages = tuple(replace(s, memory=memory) for s in vw.stages)
        return replace(plan, virtual_workers=(replace(vw, stages=stages),))

    base = launch(plan, source, spec(cfg, run))
    for memory in ("activations:recompute", "ORKO", "OOOO"):  # O: moved to host memory
        got = launch(with_memory(memory), source, spec(cfg, run))  # type: ignore[arg-type]
        assert got.losses == base.losses
        for name, p in base.state_dict().items():
            assert_close(got.state_dict()[name], p, **EXACT)
    off = launch(with_memory("activations:offload"), source, spec(cfg, run))  # type: ignore[arg-type]
    assert off.losses == base.losses
    for name, p in base.state_dict().items():
        assert_close(off.state_dict()[name], p, **EXACT)
