"""Capturing the forwards people write: default and keyword arguments, dict samples mapped onto
the forward's arguments by name, one-line errors naming the argument and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from profiler.errors import ModelError
from profiler.graph import ModelGraph
from profiler.models import keyword_spec


class Masked(nn.Module):
    """A forward with a default mask and a default scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
        h = torch.relu(self.a(x)) * scale  # (B, 16)
        if mask is not None:
            h = h * mask
        return self.b(h)  # (B, 4)


class NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.a(x) * mask  # (B, 4)


def _x() -> Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_positional_sample_with_default_arguments_captures() -> None:
    model = Masked()
    graph = ModelGraph.from_module(model, (_x(),))
    inputs = [lay for lay in graph.layers if lay.op == "placeholder"]
    assert [lay.name for lay in inputs] == ["x"]  # mask and scale keep their defaults
    first, last = graph.build_stages((len(graph.layers) // 2,))
    x = _x()
    torch.testing.assert_close(last(*first(x)), model(x))


def test_dict_sample_is_mapped_onto_the_forward_by_name() -> None:
    model = Masked()
    mask = torch.ones(4, 16)
    batch = {"labels": torch.zeros(4, dtype=torch.int64), "mask": mask, "x": _x()}
    spec = keyword_spec("m", model, batch, F.cross_entropy)
    assert spec.input_names == ("x", "mask")  # labels go to the loss, not to the forward
    assert torch.equal(spec.targets, batch["labels"])
    graph = ModelGraph.from_spec(spec)
    assert graph.input_names == ("x", "mask")


def test_dict_sample_without_the_optional_key() -> None:
    spec = keyword_spec("m", Masked(), {"x": _x(), "labels": torch.zeros(4)}, F.cross_entropy)
    assert spec.input_names == ("x",)


@pytest.mark.parametrize(
    ("model", "batch", "needle"),
    [
        (Masked(), {"x": 1, "maks": 1}, r"sample key 'maks' is not an argument of Masked\.forward"),
        (NeedsMask(), {"x": 1}, r"needs 'mask', which the samples lack: add a 'mask' key"),
        (Masked(), {"x": 1, "labels": 1}, r"takes no 'labels'.*loss_fn="),
    ],
)
def test_dict_sample_errors_name_the_argument(
    model: nn.Module, batch: dict[str, int], needle: str
) -> None:
    names = tuple(batch)
    with pytest.raises(ModelError, match=needle) as err:
        keyword_spec("m", model, {n: torch.zeros(4) for n in names})
    assert "\n" not in str(err.value)


def test_positional_sample_missing_an_argument_names_it() -> None:
    with pytest.raises(
        ModelError, match=r"takes 'mask' \(no default\).*\(\(x, mask, \.\.\.\), y\)"
    ):
        ModelGraph.from_module(NeedsMask(), (_x(),))


def test_bert_attention_mask_goes_through_the_dict_mapping() -> None:
    pytest.importorskip("transformers")
    from tests.runtime.test_hf_models import SEQ, VOCAB, bert

    model = bert().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (4, SEQ), generator=gen)
    mask = torch.ones(4, SEQ, dtype=torch.int64)
    mask[:, SEQ // 2 :] = 0  # padding: the mask changes the loss
    batch = {"labels": ids, "attention_mask": mask, "input_ids": ids}
    spec = keyword_spec("bert", model, batch)
    assert spec.input_names == ("input_ids", "attention_mask", "labels")
    graph = ModelGraph.from_spec(spec)
    first, last = graph.build_stages((len(graph.layers) // 2,))
    out = last(*first(*spec.inputs))  # the last stage gives the model's own output structure
    torch.testing.assert_close(out.logits, model(**batch).logits)
    torch.testing.assert_close(out.loss, model(**batch).loss)
    unmasked = model(input_ids=ids, labels=ids).logits
    assert (out.logits - unmasked).abs().max() > 1e-4  # the mask reached the attention


def test_sample_of_the_wrong_shape_is_one_line_naming_the_node() -> None:
    x7 = torch.randn(4, 7)  # the model takes 8 features
    with pytest.raises(ModelError, match=r"failed at node 'a'.*check the sample's shapes") as err:
        ModelGraph.from_module(Masked(), (x7,), fake=False)
    assert "\n" not in str(err.value)
