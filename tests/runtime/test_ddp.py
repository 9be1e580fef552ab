"""The AllReduce (DDP) baseline: equality with single-process SGD, device filtering, failures."""

from __future__ import annotations

import pytest
import torch

from planner.cluster import Cluster, parse_cluster
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import ModelSource, OptimizerConfig
from runtime.data import DigitsDataset, MinibatchSource
from runtime.ddp import (
    accuracy,
    device_capacity_bytes,
    eligible_devices,
    run_allreduce,
    split_dataset,
)
from runtime.model import reference_module

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


def test_eligible_devices_filters_by_emulated_cap() -> None:
    cluster = _cluster([1, 8, 2, 16])
    devices = eligible_devices(cluster, 3 * MiB)
    assert [d.label for d in devices] == ["N1:0", "N3:0"]
    assert device_capacity_bytes(devices[0]) == 8 * MiB
    assert eligible_devices(cluster, 100 * MiB) == ()


def test_no_device_holds_the_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no device can hold mlp"):
        run_allreduce(_cluster([1, 1]), "mlp", 8, 2, memory_bytes=2 * MiB)


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


def test_two_ranks_equal_single_process_sgd_on_the_combined_batch() -> None:
    cfg = OptimizerConfig(lr=0.2, momentum=0.5)
    result = run_allreduce(
        _cluster([8, 8]), "mlp", 8, 5, optimizer=cfg, memory_bytes=MiB, emulate=False, timeout_s=20
    )
    assert result.devices == ("N0:0", "N1:0")
    assert len(result.losses) == 5 and result.throughput > 0
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    expected = _single_process_sgd(train, 16, 5, cfg)
    assert set(result.state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result.state[name], tensor, rtol=1e-5, atol=1e-6)
    # the accuracy reported is the final model's on the held-out split
    module, names, _ = reference_module(ModelSource(ref="mlp"), 8, seed=0)
    inverse = {v: k for k, v in names.items()}
    module.load_state_dict({inverse[k]: v for k, v in result.state.items()})
    assert result.test_accuracy == pytest.approx(accuracy(module, test, 8))


def test_a_killed_rank_ends_the_run_naming_it() -> None:
    with pytest.raises(HetPipeRuntimeError, match=r"rank 1 \(device N1:0\).*SIGKILL"):
        run_allreduce(
            _cluster([8, 8]),
            "mlp",
            8,
            50,
            memory_bytes=MiB,
            emulate=False,
            timeout_s=10,
            fault="kill:1:3",
        )
