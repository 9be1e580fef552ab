"""The whole trained state, every time: parameters AND buffers (batch-norm statistics) under
every name of the user's ``state_dict``, equal to a plain loop at Nm = 1, loadable with
``strict=True`` from ``weights.pt``; several VWs export the mean of their float buffers and
evaluate with them in eval mode."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from hetpipe.api import _module_source, train
from planner.manual import multi_vw_plan
from profiler.capture import quiet_treespec
from profiler.graph import ModelGraph
from runtime.config import OptimizerConfig, RunConfig
from runtime.data import MinibatchSource
from runtime.launch.launcher import launch
from runtime.results.evaluation import split_dataset
from runtime.results.run_result import RunResult
from runtime.results.whole_state import merge_buffers, state_keys, user_state
from runtime.stage.model import resolve_source, stage_rng_seed
from tests.runtime._spec import spec

pytestmark = pytest.mark.timeout(120)

BATCH, STEPS, SEED = 16, 20, 1


def bn_mlp() -> nn.Module:
    """Batch norm on both stages, dropout on the second (its RNG is that stage's alone)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4),
    )  # fmt: skip


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN with a skip connection."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))  # (B, C, H, W)
        return F.relu(x + self.bn2(self.conv2(h)))


class TinyResNet(nn.Module):
    """A stem with batch norm, two residual blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))  # (B, 4, 6, 6)
        return self.head(h.mean(dim=(2, 3)))  # (B, 4)


def tiny_resnet() -> nn.Module:
    torch.manual_seed(0)
    return TinyResNet()


def _data(shape: tuple[int, ...], n: int = 320) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, *shape, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    )


def _plain_loop(
    model: nn.Module, data: TensorDataset, cfg: OptimizerConfig, rng_seed: int
) -> tuple[list[float], dict[str, Tensor]]:
    """One process: forward, backward, step; dropout drawn from ``rng_seed``. Returns the
    losses and the whole ``state_dict`` (buffers included)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, foreach=True)
    source = MinibatchSource(data, BATCH, SEED)
    torch.manual_seed(rng_seed)
    losses = []
    for p in range(1, STEPS + 1):
        (x,), y = source.batch(p)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("make", "shape", "cuts"),
    [(bn_mlp, (8,), (4,)), (tiny_resnet, (3, 6, 6), (6,))],
    ids=["mlp-bn-dropout", "resnet-bn2d"],
)
def test_bn_model_at_nm_1_equals_the_plain_loop_buffers_included(
    tmp_path: Path, make: type[nn.Module], shape: tuple[int, ...], cuts: tuple[int, ...]
) -> None:
    model, data = make(), _data(shape)
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.1, momentum=0.5)
    result = train(model, data, cuts=cuts, nm=1, batch_size=BATCH, steps=STEPS, seed=SEED,
                   optimizer=cfg, out=tmp_path, emulate=False)  # fmt: skip
    # the dropout of the last stage draws from that stage's RNG, as the loop does here
    losses, expected = _plain_loop(reference, data, cfg, stage_rng_seed(SEED, 0, len(cuts)))
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    assert list(state) == list(model.state_dict())  # every key, the module's order
    assert any("running_var" in k for k in state)
    for name, t in expected.items():
        assert_close(state[name], t, rtol=1e-5, atol=1e-5, msg=name)
    saved = torch.load(tmp_path / "weights.pt", weights_only=True)
    fresh = make()
    fresh.load_state_dict(saved, strict=True)  # raises on a missing or unexpected key
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, state[name]), name


def _eval_loss(model: nn.Module, test: object) -> float:
    """Mean cross-entropy of ``model`` in eval mode over full minibatches of ``test``."""
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=BATCH, drop_last=True):  # type: ignore[arg-type]
            total += float(F.cross_entropy(model(x), y))
            n += 1
    return total / n


@pytest.mark.parametrize("rule", ["wsp", "allreduce"])
def test_two_vws_export_the_mean_of_their_buffers_and_evaluate_with_them(
    tmp_path: Path, rule: str
) -> None:
    model, data = bn_mlp(), _data((8,))
    source = _module_source(model, data, None, BATCH)
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=False))
    plan = multi_vw_plan(graph, [(4,), (4,)], "bn_mlp", BATCH, nm=1, D=0, n_shards=1)
    if rule == "allreduce":  # every VW holds the model: no shards
        plan = dataclasses.replace(plan, sync="allreduce", shards=())
    run = RunConfig(steps=6, seed=SEED, timeout_s=15.0, emulate=False)  # no return_state:
    # the shards hold the parameters, the stages still return their buffers
    result = launch(plan, source, spec(OptimizerConfig(lr=0.1), run), data)
    assert isinstance(result, RunResult)
    state = result.state_dict()
    assert list(state) == list(model.state_dict())
    per_vw = [vw.buffers() for vw in result.vws]
    for name in ("1.running_mean", "4.running_var"):
        assert not torch.equal(per_vw[0][name], per_vw[1][name])  # each VW saw its own data
        assert_close(state[name], (per_vw[0][name] + per_vw[1][name]) / 2, rtol=1e-6, atol=1e-7)
    assert int(state["1.num_batches_tracked"]) == 6
    # the run's test loss is the trained model's, with its buffers, in eval mode
    trained = bn_mlp()
    trained.load_state_dict(state, strict=True)
    _, test = split_dataset(data, 0.2, SEED)
    assert_close(result.test_loss, _eval_loss(trained, test), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["allreduce", "easgd"])
def test_resume_carries_every_vws_buffers(tmp_path: Path, rule: str) -> None:
    """Each VW's batch norm sees its own data (an AllReduce copy its slice, an EASGD replica
    its shard): its part of a snapshot holds its own buffers, so a run resumed at step 2 ends
    bit-identical to the one that went on; the outputs written from the last snapshot hold
    them too."""
    model, data = bn_mlp(), _data((8,))
    source = _module_source(model, data, None, BATCH)
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=False))
    plan = multi_vw_plan(graph, [(4,), (4,)], "bn_mlp", BATCH, nm=1, D=0, n_shards=1)
    if rule == "allreduce":
        plan = dataclasses.replace(plan, sync="allreduce", shards=())
    else:  # an exchange every wave: a snapshot at every clock
        plan = dataclasses.replace(plan, sync="easgd", sync_params=(("alpha", 0.25), ("tau", 1.0)))
    run = RunConfig(steps=4, seed=SEED, timeout_s=15.0, emulate=False, out_dir=tmp_path)
    whole = launch(plan, source, spec(None, run, checkpoint_every=2), data)
    resume = dict(checkpoint_every=2, resume=True, resume_clock=2)
    resumed = launch(plan, source, spec(None, run, **resume), data)
    assert [vw.steps for vw in resumed.vws] == [2, 2]
    for k in range(2):  # every copy's own statistics went on from its part
        ref = whole.vws[k].buffers()
        for name, t in resumed.vws[k].buffers().items():
            assert torch.equal(t, ref[name]), (k, name)
    again = launch(plan, source, spec(None, run, checkpoint_every=2, resume=True), data)
    assert again.exported_from and list(again.state_dict()) == list(model.state_dict())
    for name, t in whole.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_state_keys_name_every_alias_of_a_tied_weight() -> None:
    """A tied output layer is one tensor under two keys; a non-persistent buffer no key."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(3), persistent=False)

    keys = state_keys(Tied())
    assert keys == (("embed.weight", "embed.weight"), ("head.weight", "embed.weight"))
    trained = {"embed.weight": torch.zeros(5, 3), "scale": torch.ones(3)}
    assert list(user_state(trained, keys)) == ["embed.weight", "head.weight"]


def test_merge_buffers_means_floats_and_takes_the_largest_count() -> None:
    a = {"bn.running_var": torch.tensor([1.0, 3.0]), "bn.num_batches_tracked": torch.tensor(4)}
    b = {"bn.running_var": torch.tensor([2.0, 5.0]), "bn.num_batches_tracked": torch.tensor(6)}
    out = merge_buffers([a, b, {"other": torch.tensor([7.0])}])
    assert_close(out["bn.running_var"], torch.tensor([1.5, 4.0]))
    assert out["bn.num_batches_tracked"].dtype == torch.int64
    assert int(out["bn.num_batches_tracked"]) == 6 and float(out["other"]) == 7.0
    half = merge_buffers([{"x": torch.tensor([1.0], dtype=torch.float16)}] * 2)
    assert half["x"].dtype == torch.float16


class KeywordBN(nn.Module):
    """Keyword inputs and its own loss: captured with ``torch.export`` (not fx), whose program
    lists the running statistics among the buffers it mutates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = bn_mlp()

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


class KeywordData(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = _data((8,)).tensors

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def test_exported_bn_model_updates_the_buffers_torch_export_mutates() -> None:
    model, data = KeywordBN(), KeywordData()
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(model, data, stages=2, nm=1, batch_size=BATCH, steps=10,
                   seed=SEED, optimizer=OptimizerConfig(lr=0.1), emulate=False)  # fmt: skip
    state = result.state_dict()
    assert list(state) == list(before)
    sample = data[0]
    batch = {k: torch.stack([sample[k]] * BATCH) for k in sample}
    with quiet_treespec():  # torch's own deprecation warning while it copies specs
        ep = torch.export.export(copy.deepcopy(model), (), batch, strict=False)
        # the training IR keeps aten.batch_norm in place; functionalised, it lists what it mutates
        mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert mutated == {k for k in state if not torch.equal(state[k], before[k])} - {
        k for k, _ in model.named_parameters()
    }
    assert len(mutated) == 6  # running_mean, running_var, num_batches_tracked of two norms
    source = MinibatchSource(data, BATCH, SEED, (), input_names=("x", "labels"))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, foreach=True)
    reference.train()
    torch.manual_seed(stage_rng_seed(SEED, 0, 1))  # the dropout of the last stage
    for p in range(1, 11):
        (x, y), _ = source.batch(p)
        opt.zero_grad(set_to_none=True)
        reference(x, y)["loss"].backward()
        opt.step()
    for name, t in reference.state_dict().items():
        assert_close(state[name], t, rtol=1e-5, atol=1e-5, msg=name)
