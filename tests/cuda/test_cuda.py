"""The CUDA branch of every guarded path, compared with its CPU result or a plain loop on the
same GPU. Marked ``cuda``: skipped without a GPU (``scripts/gpu_check.sh`` runs them)."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from hetpipe.api import train
from planner.baseline import allreduce_plan
from planner.cluster import Cluster, parse_cluster
from planner.manual import balanced_cuts, manual_plan
from profiler.graph import ModelGraph
from profiler.memory import cuda_peak_bytes, reset_cuda_peak
from profiler.precision import autocast
from profiler.timing import timed_ms
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import DigitsDataset, MinibatchSource
from runtime.launch.launcher import launch
from runtime.results.evaluation import split_dataset
from runtime.results.run_result import RunResult
from runtime.stage.model import reference_module, resolve_source
from runtime.stage.moves import HostCopies
from tests.runtime._spec import spec

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda:0")


def gpu_cluster(count: int) -> Cluster:
    """``count`` real (not emulated) GPUs on this host: on a one-GPU machine every stage
    takes ``cuda:0`` (:func:`runtime.stage.device.cuda_index` wraps)."""
    return parse_cluster({"name": "gpu", "nodes": [{"name": "G", "gpu": "H100", "count": count}]})


class Net(nn.Module):
    """Three blocks, so two stages have something to cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64))
        self.c = nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(F.relu(self.b(self.a(x))))  # (B, 4)


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(256, 16, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    )


def test_cuda_event_time_agrees_with_synchronised_wall_time() -> None:
    a = torch.randn(2048, 2048, device=CUDA)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ms, _ = timed_ms(CUDA, lambda: [a @ a for _ in range(20)])
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert 0 < ms <= wall_ms + 0.5  # the events sit inside the synchronised wall interval
    assert ms >= 0.3 * wall_ms  # and cover the kernels, not only the launches


def test_cuda_peak_bytes_counts_an_allocation() -> None:
    reset_cuda_peak(CUDA)
    base = cuda_peak_bytes(CUDA)
    x = torch.empty(8 << 20, dtype=torch.uint8, device=CUDA)
    assert cuda_peak_bytes(CUDA) - base >= x.numel()
    assert cuda_peak_bytes(torch.device("cpu")) == 0


def test_side_stream_copies_round_trip_through_pinned_memory() -> None:
    copies = HostCopies(copy=True)
    t = torch.randn(1000, device=CUDA)
    host = copies.down(t)
    assert host.device.type == "cpu"
    back = copies.ready(copies.up(host, CUDA))
    assert back.device == t.device
    assert torch.equal(back, t)


def test_offloaded_placements_train_equal_to_all_keep_on_the_gpu() -> None:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 3, gpu_cluster(2))
    cfg = OptimizerConfig(name="adam", lr=1e-3)
    run = RunConfig(steps=6, seed=3, return_state=True, timeout_s=60, emulate=False)

    def with_memory(memory: str) -> object:
        vw = plan.virtual_workers[0]
        stages = tuple(replace(s, memory=memory) for s in vw.stages)
        return replace(plan, virtual_workers=(replace(vw, stages=stages),))

    base = launch(plan, source, spec(cfg, run))
    assert isinstance(base, RunResult)
    assert all(st.cuda_peak_bytes > 0 for st in base.stages)  # they computed on the GPU
    for memory in ("OOOO", "activations:offload"):
        got = launch(with_memory(memory), source, spec(cfg, run))  # type: ignore[arg-type]
        assert isinstance(got, RunResult)
        assert got.losses == base.losses
        for name, p in base.state_dict().items():
            assert_close(got.state_dict()[name], p, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_stages_on_one_gpu_match_a_plain_loop(precision: str) -> None:
    """Both stages on cuda:0: the first step's loss is the plain loop's on the same GPU."""
    model, data = Net(), _data()
    ref = copy.deepcopy(model).to(CUDA)
    result = train(
        model, data, F.cross_entropy, cluster=gpu_cluster(2), stages=2, nm=1, batch_size=16,
        steps=8, seed=1, emulate=False, precision=precision, timeout=60,
    )  # fmt: skip
    xs, y = MinibatchSource(data, 16, 1).batch(1)
    with torch.no_grad(), autocast("cuda", precision):
        want = float(F.cross_entropy(ref(*(x.to(CUDA) for x in xs)), y.to(CUDA)))
    tol = 1e-5 if precision == "fp32" else 2e-2  # bf16: the stage cut casts to bf16
    assert result.losses[0] == pytest.approx(want, rel=tol, abs=tol)
    assert [st.device for st in result.vws[0].stages] == ["G:0", "G:1"]


def test_allreduce_baseline_on_nccl_world_one_equals_sgd() -> None:
    plan = allreduce_plan(gpu_cluster(1), "mlp", 8)
    cfg = OptimizerConfig(lr=0.2, momentum=0.5)
    result = launch(
        plan, ModelSource(ref="mlp"), spec(cfg, RunConfig(steps=4, emulate=False, timeout_s=60))
    )
    assert isinstance(result, RunResult)
    train_split, _ = split_dataset(DigitsDataset(), 0.2, seed=0)
    module, names, loss_fn = reference_module(ModelSource(ref="mlp"), 8, seed=0)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    src = MinibatchSource(train_split, 8, seed=0)
    for p in range(1, 5):
        xs, y = src.batch(p)
        opt.zero_grad()
        loss_fn(module(*xs), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    state = result.state_dict()
    for n, t in module.named_parameters():
        assert_close(state[names[n]], t.detach(), rtol=1e-4, atol=1e-5)  # GPU vs CPU sums


def test_two_wsp_vws_on_one_gpu_equal_the_cpu_reference() -> None:
    """Pushes and pulls through the host wire, folded into CUDA weights (Nm = 2, D = 0)."""
    from planner.manual import multi_vw_plan
    from tests.runtime.test_wsp_run import BATCH, LR, SOURCE, wsp_reference

    graph = ModelGraph.from_spec(resolve_source(SOURCE, BATCH, meta=True))
    plan = multi_vw_plan(graph, [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2,
                         cluster=gpu_cluster(4))  # fmt: skip
    run = RunConfig(steps=8, timeout_s=60.0, emulate=False)
    result = launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run))
    assert isinstance(result, RunResult)
    assert all(st.cuda_peak_bytes > 0 for vw in result.vws for st in vw.stages)
    ref, losses = wsp_reference(2, 2, 4)
    state = result.state_dict()
    for n, t in ref.items():
        assert_close(state[n], t, rtol=1e-4, atol=1e-5)  # GPU vs CPU arithmetic
    for k in range(2):
        assert_close(result.vws[k].losses, losses[k], rtol=1e-4, atol=1e-5)
