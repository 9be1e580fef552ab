"""Real models end to end: Hugging Face GPT-2, BERT and ALBERT (torch.export path) and a
torchvision-style ResNet (torch.fx path) split into 2 to 4 stages equal one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import Dataset

from hetpipe.api import train
from runtime.config import OptimizerConfig
from runtime.data import MinibatchSource

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 8


class TokenData(Dataset[dict[str, Tensor]]):
    """Seeded token samples ``{"input_ids", "attention_mask", "labels"}``."""

    def __init__(self, n: int = 64, mask: bool = True) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
        self.mask = mask

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        item = {"input_ids": self.ids[i], "labels": self.ids[i]}
        if self.mask:
            item["attention_mask"] = torch.ones(SEQ, dtype=torch.int64)
        return item


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def bert(vocab: int = VOCAB) -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=vocab, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


def albert() -> nn.Module:
    """ALBERT: one encoder layer shared by all 4 blocks, so its weights sit on every stage
    that runs a block (several tied groups per stage)."""
    cfg = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AlbertForMaskedLM(cfg)


def t5() -> nn.Module:
    """T5 with its default config (``use_cache=True``, which its decoder's copy keeps too)."""
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def plain_loop(
    model: nn.Module, data: MinibatchSource, names: tuple[str, ...], lr: float, steps: int
) -> tuple[list[float], dict[str, Tensor]]:
    """One process, keyword inputs, the model's own loss, plain SGD."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=True)
    losses = []
    for p in range(1, steps + 1):
        inputs, _ = data.batch(p)
        opt.zero_grad(set_to_none=True)
        loss = model(**dict(zip(names, inputs, strict=True))).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


def _check_against_reference(model: nn.Module, stages: int, steps: int = 4) -> Any:
    data = TokenData()
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.1)
    result = train(model, data, stages=stages, nm=1, batch_size=4, steps=steps, optimizer=cfg)
    names = tuple(n for n in ("input_ids", "attention_mask", "labels") if n in data[0])
    losses, params = plain_loop(
        reference, MinibatchSource(data, 4, 0, (), input_names=names), names, 0.1, steps
    )
    assert losses[-1] < losses[0]  # it trains
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for name, p in params.items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-5)
    return result


@pytest.mark.parametrize("stages", [2, 3])
def test_gpt2_pipeline_equals_one_process_with_tied_embedding(stages: int) -> None:
    result = _check_against_reference(gpt2(), stages)
    holders = [st.state for st in result.stages if "transformer.wte.weight" in st.state]
    assert len(holders) == 2  # the tied embedding lives on the first and the last stage
    assert torch.equal(holders[0]["transformer.wte.weight"], holders[1]["transformer.wte.weight"])


@pytest.mark.parametrize("stages", [2, 3])
def test_bert_pipeline_equals_one_process(stages: int) -> None:
    _check_against_reference(bert(), stages)


@pytest.mark.parametrize("stages", [3, 4])
def test_albert_shared_layer_over_many_stages_equals_one_process(stages: int) -> None:
    result = _check_against_reference(albert(), stages, steps=3)
    name = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"
    copies = [st.state[name] for st in result.stages if name in st.state]
    assert len(copies) >= 2
    assert all(torch.equal(copies[0], c) for c in copies[1:])  # every copy bit-equal


def test_albert_four_stages_two_in_flight_trains() -> None:
    cfg = OptimizerConfig(lr=0.1)
    result = train(
        albert(), TokenData(), stages=4, nm=2, batch_size=4, steps=4, optimizer=cfg,
        timeout=30.0,
    )  # fmt: skip
    assert len(result.losses) == 4
    assert result.losses[-1] < result.losses[0]
    state = [st.state for st in result.stages]
    for name in {n for s in state for n in s}:
        copies = [s[name] for s in state if name in s]
        assert all(torch.equal(copies[0], c) for c in copies[1:])


def test_t5_default_config_equals_one_process() -> None:
    _check_against_reference(t5(), 2, steps=3)


class Block(nn.Module):
    """A torchvision-style basic block with in-place ReLUs."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)  # type: ignore[no-any-return]


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer1(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("relu_cut", [False, True])
def test_resnet_with_inplace_relu_equals_one_process(relu_cut: bool) -> None:
    from torch.utils.data import TensorDataset

    from profiler.graph import ModelGraph
    from tests.runtime.reference import plain_loop as reference_loop

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 4, (32,)))
    torch.manual_seed(0)
    model = TinyResNet()
    graph = ModelGraph.from_module(model, (data.tensors[0][:4],))
    relus = [lay.index for lay in graph.layers if lay.op == "ReLU"]
    # a cut right before an in-place ReLU: the received activation is cloned before it
    cuts = (relus[2],) if relu_cut else (len(graph.layers) // 2,)
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.05)
    result = train(
        model, data, F.cross_entropy, cuts=cuts, nm=1, batch_size=4, steps=3, optimizer=cfg
    )
    losses, params = reference_loop(reference, MinibatchSource(data, 4, 0), F.cross_entropy, cfg, 3)
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for name, p in params.items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-5)


def qwen2_tied(vocab: int = VOCAB) -> nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def bart(vocab: int = VOCAB) -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=SEQ, use_cache=False, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(cfg)


@pytest.mark.parametrize(
    ("make", "aliases"),
    [
        (qwen2_tied, ("lm_head.weight", "model.embed_tokens.weight")),
        (bart, ("lm_head.weight", "model.shared.weight", "model.decoder.embed_tokens.weight")),
    ],
    ids=["qwen2-tied", "bart"],
)
def test_trained_state_loads_strictly_under_every_tied_name(
    tmp_path: Any, make: Any, aliases: tuple[str, ...]
) -> None:
    """Every key of the module's state_dict (a tied weight under each of its names, BART's
    ``final_logits_bias`` buffer) is in ``weights.pt``: a strict load works."""
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(model, TokenData(), stages=2, batch_size=4, steps=2, out=tmp_path)
    state = result.state_dict()
    assert list(state) == list(before)
    fresh = make()
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True), strict=True)
    trained = fresh.state_dict()
    assert not torch.equal(trained[aliases[0]], before[aliases[0]])  # it trained
    for name in aliases[1:]:  # one tensor under every name
        assert torch.equal(trained[name], trained[aliases[0]]), name
