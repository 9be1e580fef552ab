"""The model graph: cut sets, bytes, and stage modules that compose back into the model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from profiler.crossing import crossing_sets
from profiler.errors import ModelError
from profiler.graph import ModelGraph
from profiler.models import BUILTIN_MODELS, ModelSpec, resolve_model


def _run_stages(graph: ModelGraph, cuts: list[int], inputs: tuple[Tensor, ...]) -> Tensor:
    stages = graph.build_stages(cuts)
    values: tuple[Tensor, ...] = inputs
    out: Tensor | None = None
    for i, stage in enumerate(stages):
        result = stage(*values)
        if i == len(stages) - 1:
            out = result
        else:
            values = result
    assert out is not None
    return out


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _check_composition(spec: ModelSpec, n_cuts: int, seed: int) -> None:
    """Stages of random cuts reproduce the model's outputs and parameter gradients."""
    model = spec.module
    graph = ModelGraph.from_spec(spec)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(graph)), n_cuts))

    torch.manual_seed(seed)
    ref_out = model(*spec.inputs)
    spec.loss(ref_out, spec.targets).backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    torch.manual_seed(seed)  # same dropout masks
    out = _run_stages(graph, cuts, spec.inputs)
    spec.loss(out, spec.targets).backward()
    grads = _grads(model)

    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["mlp", "resnet", "transformer"])
@pytest.mark.parametrize("seed", range(4))
def test_small_models_compose_for_random_cuts(name: str, seed: int) -> None:
    spec = resolve_model(name, 4)
    _check_composition(spec, n_cuts=1 + seed % 3, seed=seed)


def test_resnet152_composes_with_skips_cut() -> None:
    # ImageNet architecture on a small image keeps the test fast; the graph is the same.
    spec = resolve_model("resnet152", 1)
    spec = ModelSpec(
        spec.name, spec.module, (torch.randn(1, 3, 64, 64),), spec.targets, batch_size=1
    )
    graph = ModelGraph.from_spec(spec)
    # Pick a cut inside a residual block so a skip tensor must cross it.
    inside = next(k for k in range(1, len(graph)) if len(graph.crossing[k]) >= 2)
    assert len(graph.cut_names(inside)) >= 2
    _check_composition(spec, n_cuts=3, seed=7)


@pytest.mark.slow
def test_vgg19_composes() -> None:
    spec = resolve_model("vgg19", 1)
    spec.module.eval()
    _check_composition(spec, n_cuts=3, seed=3)


def test_builtin_graph_sizes() -> None:
    sizes = {}
    for name in BUILTIN_MODELS:
        graph = ModelGraph.from_spec(resolve_model(name, 2))
        sizes[name] = len(graph)
        params = sum(lay.param_bytes for lay in graph.layers)
        assert params == sum(p.numel() * 4 for p in resolve_model(name, 2).module.parameters())
        assert graph.layers[0].op == "placeholder"
        assert graph.layers[-1].op == "output"
    # vgg19: 16 conv + 16 relu + 5 pool + flatten + 3 linear + 2 relu + 2 dropout + in + out
    assert sizes["vgg19"] == 47
    assert sizes["resnet152"] > 500


def test_vgg19_parameter_bytes_match_paper() -> None:
    graph = ModelGraph.from_spec(resolve_model("vgg19", 32))
    total_mib = sum(lay.param_bytes for lay in graph.layers) / 2**20
    assert 540 < total_mib < 560  # the paper quotes 548 MB


def test_crossing_sets_include_skips() -> None:
    # 0 -> 1 -> 2 -> 3, with a skip 0 -> 3 and 1 -> 3
    inputs = [(), (0,), (1,), (0, 2), (3,)]
    cross = crossing_sets(inputs)
    assert cross[0] == ()
    assert cross[1] == (0,)
    assert cross[2] == (0, 1)
    assert cross[3] == (0, 2)
    assert cross[4] == (3,)
    assert cross[5] == ()


def test_crossing_rejects_non_topological_order() -> None:
    with pytest.raises(ModelError, match="not topological"):
        crossing_sets([(1,), ()])


def test_cut_bytes_count_every_crossing_tensor() -> None:
    spec = resolve_model("resnet", 2)
    graph = ModelGraph.from_spec(spec)
    for k in range(len(graph) + 1):
        expected = sum(graph.layers[i].act_bytes for i in graph.crossing[k])
        assert graph.cut_bytes(k) == expected
    assert max(len(graph.crossing[k]) for k in range(len(graph))) >= 2  # residual skips exist


class TwoOutputs(nn.Module):
    """A model with a bare parameter and two outputs (one of them early)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.a(x)
        return self.b(torch.relu(h)) + self.bias, h


def test_multiple_outputs_and_bare_parameters() -> None:
    model = TwoOutputs()
    x = torch.randn(3, 4)
    graph = ModelGraph.from_module(model, (x,))
    owners = [lay for lay in graph.layers if "bias" in lay.params]
    assert len(owners) == 1
    for cut in range(1, len(graph)):
        out = _run_stages(graph, [cut], (x,))
        ref = model(x)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])
    stage_params = [
        n for s in graph.build_stages([len(graph) - 2]) for n, _ in s.named_parameters()
    ]
    assert sorted(graph.original_param_name(n) for n in stage_params) == sorted(
        n for n, _ in model.named_parameters()
    )


def test_only_builds_the_requested_stage() -> None:
    spec = resolve_model("mlp", 2)
    graph = ModelGraph.from_spec(spec)
    (stage,) = graph.build_stages([4, 8], only=1)
    names = {graph.original_param_name(n) for n, _ in stage.named_parameters()}
    assert names and all(n.split(".")[0] in {"2", "3", "4", "5", "6"} for n in names)


@pytest.mark.parametrize("cuts", [[0], [5, 5], [3, 2], [100]])
def test_bad_cuts_are_rejected(cuts: list[int]) -> None:
    graph = ModelGraph.from_spec(resolve_model("mlp", 2))
    with pytest.raises(ModelError, match="strictly increasing"):
        graph.build_stages(cuts)


class Untraceable(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


def test_untraceable_model_is_a_clear_error() -> None:
    # the message names the user's line and a fix that works for tensor-dependent control flow
    with pytest.raises(ModelError, match=r"cannot capture .*test_graph\.py:\d+.*torch\.where"):
        ModelGraph.from_module(Untraceable(), (torch.randn(2),))


def test_profile_cut_at_a_row_boundary_is_detected(tmp_path: Path) -> None:
    from profiler.errors import ProfileError
    from profiler.pipedream import import_pipedream
    from profiler.table import load_profile
    from tests.conftest import PIPEDREAM

    path = import_pipedream(PIPEDREAM / "vgg16" / "graph.txt").save(tmp_path / "p.csv")
    assert len(load_profile(path).table) > 3
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-3]))  # drop whole rows: still valid CSV
    with pytest.raises(ProfileError, match="truncated"):
        load_profile(path)


def test_profile_key_follows_the_model_not_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory that now returns another model gets another profile cache key."""
    from profiler.measure import profile_key

    pkg = tmp_path / "keymodels.py"
    pkg.write_text(
        "import torch\nfrom torch import nn\nWIDTH = 8\n"
        "def factory(batch_size=4):\n"
        "    m = nn.Sequential(nn.Linear(4, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 2))\n"
        "    return m, (torch.randn(batch_size, 4), torch.zeros(batch_size, dtype=torch.int64))\n"
    )
    monkeypatch.chdir(tmp_path)  # found like `python -m` finds it: in the current directory
    first = profile_key("keymodels:factory", 4)
    assert profile_key("keymodels:factory", 4) == first
    assert profile_key("keymodels:factory", 8) != first  # the batch is part of the key
    import keymodels  # type: ignore[import-not-found]

    monkeypatch.setattr(keymodels, "WIDTH", 16)
    assert profile_key("keymodels:factory", 4) != first
