"""The Python API with the user's own nn.Module, data set and loss (the docs example)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from hetpipe.api import train
from profiler.graph import ModelGraph
from runtime.config import OptimizerConfig
from runtime.data import MinibatchSource
from runtime.stage.tied import tied_params
from tests.runtime.reference import delayed_loop, plain_loop


class SkipNet(nn.Module):
    """A custom model with a skip connection that crosses the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.mid = nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.out = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, 32)
        return self.out(F.relu(h + self.mid(h)))  # (B, 4)


def mse_on_logits(out: Tensor, y: Tensor) -> Tensor:
    """A user loss: squared error against one-hot targets."""
    return F.mse_loss(out, F.one_hot(y, 4).float())


def test_custom_model_dataset_and_loss_match_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(256, 8, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    )
    model = SkipNet()
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.1, momentum=0.5)
    result = train(
        model, data, mse_on_logits, stages=3, nm=2, batch_size=16, steps=10, seed=1, optimizer=cfg
    )
    losses, params = delayed_loop(
        reference, MinibatchSource(data, 16, 1), mse_on_logits, cfg, 10, 2
    )
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for name, p in params.items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-5)
    assert len(result.stages) == 3
    assert result.throughput > 0


class Reuse(nn.Module):
    """One linear layer applied ``uses`` times (ALBERT's sharing): cut between the uses, every
    stage holds a copy of it."""

    def __init__(self, uses: int) -> None:
        super().__init__()
        self.uses = uses
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, 16)
        for _ in range(self.uses):
            h = torch.tanh(self.shared(h))  # (B, 16)
        return self.out(h)  # (B, 4)


@pytest.mark.parametrize(("stages", "nm"), [(3, 1), (4, 2)])
def test_parameter_on_every_stage_matches_reference(stages: int, nm: int) -> None:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 8, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    )
    torch.manual_seed(0)
    model = Reuse(stages)
    graph = ModelGraph.from_module(model, (data.tensors[0][:8],))
    uses = [lay.index for lay in graph.layers if lay.op == "Linear"][1:-1]
    cuts = tuple(uses[1:])  # each stage runs one use of the shared layer
    assert set(tied_params(graph, cuts)["shared.weight"].holders) == set(range(stages))
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.1)
    result = train(
        model, data, F.cross_entropy, cuts=cuts, nm=nm, batch_size=8, steps=5, optimizer=cfg,
        timeout=30.0,
    )  # fmt: skip
    losses, params = delayed_loop(
        reference, MinibatchSource(data, 8, 0), F.cross_entropy, cfg, 5, nm
    )
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for name, p in params.items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-5)
    copies = [st.state["shared.weight"] for st in result.stages]
    assert all(torch.equal(copies[0], c) for c in copies[1:])  # bit-equal on every stage


class MaskedNet(nn.Module):
    """A forward with an optional mask, as people write it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = torch.relu(self.inp(x))  # (B, 16)
        if mask is not None:
            h = h * mask
        return self.out(h)  # (B, 4)


class MaskedData(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Dict samples ``{"labels", "mask", "x"}``: keys in no particular order, labels included."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=gen)
        self.mask = (torch.rand(64, 16, generator=gen) > 0.3).float()
        self.y = torch.randint(0, 4, (64,), generator=gen)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"labels": self.y[i], "mask": self.mask[i], "x": self.x[i]}


def test_dict_samples_map_onto_forward_arguments_labels_to_the_loss() -> None:
    data = MaskedData()
    torch.manual_seed(0)
    model = MaskedNet()
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.1)
    result = train(
        model, data, F.cross_entropy, stages=2, nm=1, batch_size=8, steps=4, optimizer=cfg,
        timeout=30.0,
    )  # fmt: skip
    source = MinibatchSource(data, 8, 0, (), input_names=("x", "mask"))
    losses, params = plain_loop(reference, source, F.cross_entropy, cfg, 4)
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for name, p in params.items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-5)
