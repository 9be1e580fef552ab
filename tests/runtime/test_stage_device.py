"""Which torch device a stage computes on, for each kind of cluster entry (CPU-checkable:
the CUDA device count is injected), and the host moves the transports rely on."""

from __future__ import annotations

import pytest
import torch

from planner.cluster import Cluster, Emulation, Link, Node
from planner.manual import balanced_cuts, cpu_cluster, manual_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.launch import roles
from runtime.ps.pull import flat_alias
from runtime.stage.device import on_device, stage_device, to_host
from runtime.stage.model import resolve_source


def _graph() -> ModelGraph:
    return ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))


def _gpus(emulate: bool, count: int = 2, gpu: str = "TITAN V") -> Cluster:
    emu = Emulation(0.2, 8 << 20) if emulate else None
    node = Node("V", "localhost", gpu, "V", count, 12 << 30, emu)
    return Cluster("gpus", (node,), Link(1e10, 1e-5), Link(1e10, 1e-5))


def _devices(cluster: Cluster, cuda_devices: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The torch device of each stage of VW 0 of a 2-stage plan on ``cluster``."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    g = _graph()
    plan = manual_plan(g, balanced_cuts(g, 2), "mlp", 8, 2, cluster)
    return [c.torch_device(cuda_devices) for c in roles.stage_contexts(plan, 0, 2, 4)]


def test_real_gpus_compute_on_their_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices(_gpus(emulate=False), 2, monkeypatch) == ["cuda:0", "cuda:1"]


def test_more_plan_gpus_than_cuda_devices_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    # a 2-GPU cluster file on a one-GPU host: both stages share cuda:0
    assert _devices(_gpus(emulate=False), 1, monkeypatch) == ["cuda:0", "cuda:0"]


def test_emulated_gpus_stay_on_cpu_even_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices(_gpus(emulate=True), 2, monkeypatch) == ["cpu", "cpu"]


def test_cpu_type_devices_stay_on_cpu_even_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices(cpu_cluster(2), 2, monkeypatch) == ["cpu", "cpu"]


def test_context_carries_the_gpu_type_and_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    g = _graph()
    plan = manual_plan(g, balanced_cuts(g, 2), "mlp", 8, 2, _gpus(emulate=True))
    ctx = roles.stage_contexts(plan, 0, 2, 4)[1]
    assert (ctx.gpu_type, ctx.emulated, ctx.device) == ("TITAN V", True, "V:1")


@pytest.mark.parametrize(
    ("label", "gpu", "emulated", "count", "want"),
    [
        ("G:3", "V100", False, 4, "cuda:3"),
        ("G:3", "V100", False, 2, "cuda:1"),
        ("G:3", "V100", False, 0, "cpu"),
        ("G:3", "V100", True, 4, "cpu"),
        ("C:0", "cpu", False, 4, "cpu"),
        ("G:0", "", False, 1, "cuda:0"),
    ],
)
def test_stage_device_rule(label: str, gpu: str, emulated: bool, count: int, want: str) -> None:
    assert stage_device(label, gpu, emulated, count) == want


def test_cpu_moves_copy_nothing() -> None:
    x, y = torch.ones(3), torch.zeros(2)
    moved = on_device((x, y), torch.device("cpu"))
    assert moved[0] is x and moved[1] is y
    assert to_host(x) is x


def test_wire_never_aliases_tensors_off_the_host() -> None:
    """A pull lands directly in the caller's tensors only in host memory (gloo's); device
    tensors get a host buffer and a copy."""
    flat = torch.zeros(6)
    assert flat_alias([flat[:2], flat[2:]]) is not None
    meta = torch.zeros(6, device="meta")
    assert flat_alias([meta[:2], meta[2:]]) is None
