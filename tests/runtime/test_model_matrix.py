"""The model matrix (issue #23): each kind of model people bring, trained with
``hetpipe.train`` over 2-3 stages, then ``weights.pt`` loaded with ``strict=True`` into a fresh
instance of the user's own class, whose eval output on a held-out batch equals that of the same
module trained by a plain PyTorch loop (same seed, same data, Nm = 1).

What other modules already assert is not run again here:

- ResNet-style CNN with ``BatchNorm2d``: ``test_whole_state.py::
  test_bn_model_at_nm_1_equals_the_plain_loop_buffers_included[resnet-bn2d]`` (losses, every
  parameter and buffer against a plain loop, strict load from ``weights.pt``).
- Losses and parameters against one process for BERT (2, 3 stages), ALBERT (3, 4 stages), T5,
  GPT-2: ``test_hf_models.py``; every tied name of Qwen2 and BART in ``weights.pt``:
  ``test_hf_models.py::test_trained_state_loads_strictly_under_every_tied_name``; dict samples
  onto ``forward(x, mask=None)``: ``test_api.py``; several VWs' buffers and ``test_loss``:
  ``test_whole_state.py::test_two_vws_export_the_mean_of_their_buffers_and_evaluate_with_them``.

``examples/model_matrix.py`` walks a newcomer through the same matrix with a printed table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import Dataset, TensorDataset

import hetpipe
from runtime.config import OptimizerConfig
from runtime.data import MinibatchSource
from runtime.stage.model import stage_rng_seed
from tests.runtime import test_hf_models as hf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)

VOCAB, SEQ, BATCH, STEPS, SEED, LR = 64, 8, 4, 3, 0, 0.1


class DictData(Dataset[dict[str, Tensor]]):
    """Seeded dict samples: each key's tensors, indexed alike."""

    def __init__(self, **columns: Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return int(next(iter(self.columns.values())).shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def tokens(n: int = 32) -> DictData:
    """``{"input_ids", "attention_mask", "labels"}``; the mask hides each sample's last two."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=gen)
    mask = torch.ones(n, SEQ, dtype=torch.int64)
    mask[:, -2:] = 0
    return DictData(input_ids=ids, attention_mask=mask, labels=ids.clone())


def images(n: int = 32) -> DictData:
    """``{"pixel_values": (3, 8, 8), "labels"}`` for a 3-class ViT."""
    gen = torch.Generator().manual_seed(0)
    return DictData(pixel_values=torch.randn(n, 3, 8, 8, generator=gen),
                    labels=torch.randint(0, 3, (n,), generator=gen))  # fmt: skip


def masked(n: int = 32) -> DictData:
    """``{"labels", "mask", "x"}`` for :class:`MaskedNet` (keys in no particular order)."""
    gen = torch.Generator().manual_seed(0)
    return DictData(labels=torch.randint(0, 4, (n,), generator=gen),
                    mask=(torch.rand(n, 16, generator=gen) > 0.3).float(),
                    x=torch.randn(n, 8, generator=gen))  # fmt: skip


def pictures(n: int = 32) -> TensorDataset:
    """``(image (3, 8, 8), class < 4)`` pairs for :func:`bn_dropout_cnn`."""
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=gen),
                         torch.randint(0, 4, (n,), generator=gen))  # fmt: skip


def t5() -> nn.Module:
    """T5's default config (``use_cache=True``) at tiny dims, dropout off."""
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def albert() -> nn.Module:
    """One encoder layer shared by 3 blocks: its weights on every stage of 3."""
    cfg = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AlbertForMaskedLM(cfg)


def vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg)


def bn_dropout_cnn() -> nn.Module:
    """Conv-BN-ReLU twice, then dropout and a linear head (dropout on the last stage)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),  # (B, 8, 8, 8)
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),  # (B, 8, 4, 4)
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(128, 4),  # (B, 4)
    )  # fmt: skip


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


def masked_net() -> nn.Module:
    torch.manual_seed(0)
    return MaskedNet()


@dataclass(frozen=True)
class Case:
    """One row of the matrix.

    Attributes:
        make: a fresh, seeded instance of the model (the same weights every call).
        data: its data set.
        stages: pipeline stages.
        names: the forward's keyword inputs in a dict sample (``()``: ``(input, target)`` pairs).
        loss: the user's loss (``None``: the model's own, ``output.loss``).
        cuts: hand cuts (``None``: ``stages`` planned).
    """

    make: Callable[[], nn.Module]
    data: Callable[[], Dataset[Any]]
    stages: int = 2
    names: tuple[str, ...] = ()
    loss: Callable[[Any, Tensor], Tensor] | None = None
    cuts: tuple[int, ...] | None = None


LM = ("input_ids", "attention_mask", "labels")
CASES = {
    "bert-mask": Case(partial(hf.bert, VOCAB), tokens, names=LM),
    "bart": Case(partial(hf.bart, VOCAB), tokens, names=LM),
    "t5-default": Case(t5, tokens, names=LM),
    "qwen2-tied": Case(partial(hf.qwen2_tied, VOCAB), tokens, names=LM),
    "albert-3-stages": Case(albert, tokens, stages=3, names=LM),
    "vit": Case(vit, images, names=("pixel_values", "labels")),
    "cnn-bn-dropout": Case(bn_dropout_cnn, pictures, loss=F.cross_entropy, cuts=(4,)),
    "forward-x-mask-none": Case(masked_net, masked, names=("x", "mask"), loss=F.cross_entropy),
}
SLOW = {"bart", "t5-default", "albert-3-stages"}


def _forward(model: nn.Module, case: Case, inputs: tuple[Tensor, ...]) -> Any:
    """The model on one minibatch: keyword inputs by name, else positional."""
    if case.names:
        return model(**dict(zip(case.names, inputs, strict=True)))
    return model(*inputs)


def _loss(case: Case, out: Any, y: Tensor) -> Tensor:
    return out.loss if case.loss is None else case.loss(out, y)


def plain_loop(model: nn.Module, case: Case, data: Dataset[Any]) -> list[float]:
    """One process, plain SGD, the run's minibatch order; dropout drawn from the last stage's
    RNG (the CNN's only dropout sits there)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    source = MinibatchSource(data, BATCH, SEED, (), input_names=case.names)
    n_stages = len(case.cuts) if case.cuts is not None else case.stages - 1
    torch.manual_seed(stage_rng_seed(SEED, 0, n_stages))
    losses = []
    for p in range(1, STEPS + 1):
        inputs, y = source.batch(p)
        opt.zero_grad(set_to_none=True)
        loss = _loss(case, _forward(model, case, inputs), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


@torch.no_grad()
def eval_output(model: nn.Module, case: Case, data: Dataset[Any]) -> Tensor:
    """The eval-mode scores (logits) on the last minibatch of ``data`` (one the run never
    trained on: 3 steps of 4 use the first 12 samples of 32 at most, shuffled)."""
    model.eval()
    inputs, _ = MinibatchSource(data, BATCH, SEED, (), input_names=case.names).batch(
        len(data) // BATCH  # type: ignore[arg-type]
    )
    out = _forward(model, case, inputs)
    return out if isinstance(out, Tensor) else out.logits


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]
)
def test_trained_model_loads_strictly_and_evaluates_like_a_plain_loop(
    tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    data, model = case.data(), case.make()
    reference = copy.deepcopy(model)
    result = hetpipe.train(
        model, data, case.loss, stages=0 if case.cuts else case.stages, cuts=case.cuts,
        nm=1, batch_size=BATCH, steps=STEPS, seed=SEED, optimizer=OptimizerConfig(lr=LR),
        out=tmp_path, emulate=False, timeout=60.0,
    )  # fmt: skip
    assert len(result.vws[0].stages) == (len(case.cuts) + 1 if case.cuts else case.stages)
    losses = plain_loop(reference, case, data)
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    fresh = case.make()
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True), strict=True)
    trained = eval_output(fresh, case, data)
    assert not torch.equal(trained, eval_output(case.make(), case, data))  # it trained
    assert_close(trained, eval_output(reference, case, data), rtol=1e-5, atol=1e-5)
