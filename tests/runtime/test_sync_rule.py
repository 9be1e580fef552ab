"""The synchronisation rule plug-in: the registry, the plan's rule parameters, each rule's
pure part, and the AllReduce rule's gradient mean across processes."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from planner.rules import BUILTIN as PLAN_RULES
from planner.sync import check_sync_params, effective_rule, global_slice, param
from profiler.errors import ConfigError, PlanError
from runtime.data import MinibatchSource
from runtime.link_pacing import NO_LINKS
from runtime.ps.core import ShardCore
from runtime.ps.layout import shard_specs_for_layout
from runtime.sync.allreduce import AllReduceSync
from runtime.sync.registry import BUILTIN as RULES
from runtime.sync.registry import shard_fold
from runtime.sync.rule import LocalSync, SyncSpec


def test_every_planned_rule_has_a_runtime_side_and_back() -> None:
    assert set(PLAN_RULES) == set(RULES)
    assert shard_fold(SyncSpec("wsp")) is None  # WSP's shards add the wave


def test_rule_parameters_are_checked_and_frozen() -> None:
    assert check_sync_params("allreduce", {}, "p.yaml") == ()
    with pytest.raises(PlanError, match=r"p\.yaml: sync: 'gossip' is not a synchronisation rule"):
        check_sync_params("gossip", {}, "p.yaml")
    with pytest.raises(PlanError, match="'alpha' is not a parameter of rule 'wsp'"):
        check_sync_params("wsp", {"alpha": 0.5}, "p.yaml")
    assert param((("alpha", 0.5),), "alpha") == 0.5
    assert param((), "alpha", 1.0) == 1.0


def test_the_effective_rule_of_one_vw_without_shards_is_local() -> None:
    assert effective_rule("wsp", n_shards=2, n_vws=3) == "wsp"
    assert effective_rule("wsp", n_shards=2, n_vws=3, vw=1) == "local"
    assert effective_rule("allreduce", n_shards=0, n_vws=3) == "allreduce"
    with pytest.raises(ConfigError, match="3 VWs but no parameter-server shards"):
        effective_rule("wsp", n_shards=0, n_vws=3)


def test_rank_slices_tile_the_global_minibatch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40))
    whole = MinibatchSource(data, 12, seed=3)
    ranks = [MinibatchSource(data, 4, seed=3, slice_of=(r, 3)) for r in range(3)]
    for mb in (1, 2, 3, 4):  # 3 global minibatches per epoch: 4 is the next epoch's first
        assert [i for s in ranks for i in s.indices(mb)] == whole.indices(mb)
    assert global_slice(1, 4) == (4, 8)
    shifted = MinibatchSource(data, 12, seed=3, offset=2)
    assert shifted.indices(1) == whole.indices(3)


def test_local_rule_leaves_gradients_alone() -> None:
    g = {"w": torch.ones(2), "b": None}
    assert LocalSync().reduce_grads(1, g) is g


class _Halve:
    def fold(
        self, weights: torch.Tensor, update: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        weights.add_(update, alpha=0.5)
        state["seen"] = state.get("seen", torch.zeros(())) + 1


def test_a_rule_can_fold_the_waves_of_a_shard() -> None:
    specs = shard_specs_for_layout(
        [("l0", ("w",))], {"w": (2,)}, [("l0",)], [[(0, 0)], [(0, 0)]], [0], [[1], [2]], D=0
    )
    core = ShardCore(specs[0], torch.zeros(2), fold=_Halve())
    core.push(0, 0, 0, torch.ones(2))
    core.push(1, 0, 0, torch.full((2,), 3.0))
    torch.testing.assert_close(core.weights(), torch.full((2,), 2.0))
    assert core.state().optimizer["seen"].item() == 1


def _rank(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))  # fmt: skip
    try:
        spec = SyncSpec("allreduce", groups=(tuple(range(world)),))
        view = SimpleNamespace(links=NO_LINKS, result=None)  # one group, not paced: no more read
        rule = AllReduceSync.create(spec, view)  # type: ignore[arg-type]
        grads = {
            "w": torch.full((2, 2), float(rank + 1)),
            "skip": None,
            "b": torch.tensor([rank * 2.0]),
        }
        mean = rule.reduce_grads(1, grads)
        torch.save(mean, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_allreduce_rule_averages_every_copy() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rdzv'}"
        tmp_mp.spawn(_rank, args=(2, init, tmp), nprocs=2, join=True)
        for r in range(2):
            mean = torch.load(os.path.join(tmp, f"{r}.pt"))
            torch.testing.assert_close(mean["w"], torch.full((2, 2), 1.5))
            torch.testing.assert_close(mean["b"], torch.tensor([1.0]))
            assert mean["skip"] is None
