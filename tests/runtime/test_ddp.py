"""The AllReduce baseline (the ``allreduce`` rule under the one launcher): its plan, equality
with single-process SGD, the run options it shares with the pipelines (time limit), failures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe.planning import profiles_for
from planner.baseline import allreduce_plan, device_capacity_bytes, eligible_devices
from planner.cluster import Cluster, parse_cluster
from planner.plan import Plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import DigitsDataset, MinibatchSource
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.persist.snapshot import committed_clocks, load_part, read_manifest, snapshot_dir
from runtime.results.evaluation import accuracy, split_dataset
from runtime.results.run_result import RunResult
from runtime.stage.model import reference_module
from tests.runtime._spec import spec

MiB = 2**20


def _cluster(caps_mib: list[float], speed: float = 0.5) -> Cluster:
    nodes = [
        {
            "name": f"N{i}",
            "gpu": "TITAN V",
            "count": 1,
            "emulate": {"speed": speed, "memory": f"{cap}MiB"},
        }
        for i, cap in enumerate(caps_mib)
    ]
    return parse_cluster({"name": "t", "nodes": nodes})


def _ar_plan(cluster: Cluster, memory_bytes: int) -> Plan:
    """The AllReduce plan of ``mlp`` at batch 8 on the CPU profile a front end measures."""
    cpu = profiles_for(cluster, [], "mlp", 8)
    return allreduce_plan(cluster, "mlp", 8, profiles=cpu, memory_bytes=memory_bytes)


def test_eligible_devices_filters_by_emulated_cap() -> None:
    cluster = _cluster([1, 8, 2, 16])
    devices = eligible_devices(cluster, 3 * MiB)
    assert [d.label for d in devices] == ["N1:0", "N3:0"]
    assert device_capacity_bytes(devices[0]) == 8 * MiB
    assert eligible_devices(cluster, 100 * MiB) == ()


def test_no_device_holds_the_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no device can hold mlp"):
        _ar_plan(_cluster([1, 1]), memory_bytes=2 * MiB)


def test_the_plan_has_one_whole_model_vw_per_device_that_holds_it() -> None:
    plan = _ar_plan(_cluster([1, 8, 2, 16]), memory_bytes=3 * MiB)
    assert plan.sync == "allreduce" and plan.shards == () and plan.nm == 1
    assert [(g.node, g.index) for v in plan.virtual_workers for g in v.gpus] == [
        ("N1", 0),
        ("N3", 0),
    ]
    for vw in plan.virtual_workers:
        (st,) = vw.stages
        assert (st.first_index, st.last_index) == (0, plan.num_layers - 1)
        assert st.fwd_ms > 0 and st.bwd_ms > 0  # the planner's profile paces emulated devices
    assert plan.predicted.allreduce_gpus == 2
    again = Plan.from_dict(plan.to_dict())
    assert again.sync == "allreduce" and again.to_dict() == plan.to_dict()


def _plan(caps: list[float]) -> Plan:
    return _ar_plan(_cluster(caps), memory_bytes=MiB)


def test_split_is_disjoint_and_seeded() -> None:
    data = DigitsDataset()
    train, test = split_dataset(data, 0.2, seed=3)
    assert len(train) + len(test) == len(data)
    assert not set(train.indices) & set(test.indices)
    assert split_dataset(data, 0.2, seed=3)[1].indices == test.indices
    assert split_dataset(data, 0.2, seed=4)[1].indices != test.indices


def _single_process_sgd(
    train: torch.utils.data.Dataset[object], batch: int, steps: int, cfg: OptimizerConfig
) -> dict[str, torch.Tensor]:
    module, names, loss_fn = reference_module(ModelSource(ref="mlp"), batch, seed=0)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    src = MinibatchSource(train, batch, seed=0)
    for p in range(1, steps + 1):
        xs, y = src.batch(p)
        opt.zero_grad()
        loss_fn(module(*xs), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {names[n]: t.detach() for n, t in module.named_parameters()}


def _allreduce(
    plan: Plan, run: RunConfig, optimizer: OptimizerConfig | None = None, **cfg: Any
) -> RunResult:
    result = launch(plan, ModelSource(ref=plan.model), spec(optimizer, run, **cfg))
    assert isinstance(result, RunResult)
    return result


def test_two_ranks_equal_single_process_sgd_on_the_combined_batch() -> None:
    cfg = OptimizerConfig(lr=0.2, momentum=0.5)
    run = RunConfig(steps=5, emulate=False, timeout_s=20)
    result = _allreduce(_plan([8, 8]), run, optimizer=cfg)
    assert [vw.stages[0].device for vw in result.vws] == ["N0:0", "N1:0"]
    assert [len(vw.losses) for vw in result.vws] == [5, 5] and result.throughput > 0
    assert result.sync == "allreduce" and "BSP" in str(result.table().title)
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    expected = _single_process_sgd(train, 16, 5, cfg)
    for vw in result.vws:  # every copy took the same steps
        state = vw.state_dict()
        assert set(state) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    # the accuracy reported is the final model's on the held-out split
    module, names, _ = reference_module(ModelSource(ref="mlp"), 8, seed=0)
    inverse = {v: k for k, v in names.items()}
    module.load_state_dict({inverse[k]: v for k, v in result.state_dict().items()})
    assert result.test_accuracy == pytest.approx(accuracy(module, test, 8))


def test_a_killed_rank_ends_the_run_naming_it() -> None:
    cfg: dict[str, Any] = dict(stage_fault=StageFault(0, 3, vw=1))
    with pytest.raises(HetPipeRuntimeError, match=r"rank 1 \(vw 1 \| stage 0 .*N1:0\).*SIGKILL"):
        _allreduce(_plan([8, 8]), RunConfig(steps=50, emulate=False, timeout_s=10), **cfg)


def test_a_time_limit_stops_every_rank_after_the_same_step() -> None:
    result = _allreduce(_plan([8, 8]), RunConfig(time_limit_s=1.0, timeout_s=20))
    assert result.stopped_by.startswith("time limit")
    steps = {vw.steps for vw in result.vws}
    assert len(steps) == 1 and steps.pop() >= 2
    assert all(len(vw.losses) == vw.steps for vw in result.vws)


def test_a_pipeline_plan_without_shards_is_refused() -> None:
    from planner.manual import cpu_cluster, multi_vw_plan
    from profiler.graph import ModelGraph
    from runtime.stage.model import resolve_source

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan = multi_vw_plan(graph, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    plan = type(plan)(**{**plan.__dict__, "shards": ()})
    with pytest.raises(ConfigError, match="no parameter-server shards"):
        _allreduce(plan, RunConfig(steps=2))


def test_the_backend_is_nccl_for_cuda_tensors_only_under_allreduce_on_real_gpus() -> None:
    from planner.rules import layout
    from runtime.launch.backend import GLOO, GLOO_NCCL, stage_backend

    ddp = layout("allreduce")
    assert stage_backend(ddp, emulated=False, cuda_available=True) == GLOO_NCCL
    assert GLOO_NCCL == "cpu:gloo,cuda:nccl"  # CPU tensors (flags, p2p, barriers) stay on gloo
    assert stage_backend(ddp, emulated=True, cuda_available=True) == GLOO
    assert stage_backend(ddp, emulated=False, cuda_available=False) == GLOO
    for rule in ("wsp", "local", "backup", "easgd"):
        assert stage_backend(layout(rule), emulated=False, cuda_available=True) == GLOO


def test_an_nccl_rank_takes_its_plan_gpu_as_cuda_device() -> None:
    from runtime.stage.device import cuda_index

    assert [cuda_index(d, 2) for d in ("N0:0", "N0:1", "N1:0", "my:node:3")] == [0, 1, 0, 1]


def _assert_equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_restart_and_resume_go_on_from_the_last_allreduce_snapshot(tmp_path: Path) -> None:
    """A rank killed at step 5 of 6: the run restarts from its last committed snapshot (step 2
    or 4) and ends with single-process SGD's weights; a resume to 8 steps trains the 2 left."""
    opt = OptimizerConfig(lr=0.2, momentum=0.5)
    out = tmp_path / "run"
    run = RunConfig(steps=6, emulate=False, timeout_s=20, out_dir=out)
    kill = StageFault(0, at_mb=5, vw=1)  # fires in the first attempt only
    cfg = dict(checkpoint_every=2, stage_fault=kill, on_failure="restart", max_restarts=1)
    result = _allreduce(_plan([8, 8]), run, optimizer=opt, **cfg)
    assert len(result.restarts) == 1 and "SIGKILL" in result.restarts[0]
    clock = int(result.restarts[0].rsplit("restarted from clock ", 1)[1].rstrip(")"))
    assert clock in (2, 4) and [vw.steps for vw in result.vws] == [6 - clock] * 2
    assert committed_clocks(out / "checkpoints")[-1] == 6
    train, _ = split_dataset(DigitsDataset(), 0.2, seed=0)
    _assert_equal(result.state_dict(), _single_process_sgd(train, 16, 6, opt))
    more = dataclasses.replace(run, steps=8)
    resumed = _allreduce(_plan([8, 8]), more, optimizer=opt, checkpoint_every=2, resume=True)
    assert [vw.steps for vw in resumed.vws] == [2, 2]
    _assert_equal(resumed.state_dict(), _single_process_sgd(train, 16, 8, opt))
    (out / "weights.pt").unlink()  # e.g. lost to a failure during evaluation
    again = _allreduce(  # nothing left to train: the outputs come from the snapshot
        _plan([8, 8]), more, optimizer=opt, checkpoint_every=2, resume=True
    )
    assert again.exported_from and not again.vws
    _assert_equal(torch.load(out / "weights.pt"), resumed.state_dict())
    assert json.loads((out / "summary.json").read_text())["exported_from"] == again.exported_from
    newest = read_manifest(snapshot_dir(out / "checkpoints", 8))
    assert "weights" not in load_part(newest, "vw1-stage0")  # the model once, in VW 0's part
