"""A newcomer's walk through the models hetpipe trains: each one pipelined with
``hetpipe.train``, its ``weights.pt`` loaded with ``strict=True`` into a fresh instance of the
model's own class, and checked against a plain PyTorch loop (same seed, same data, Nm = 1).

Run it from the repository root (CPU minutes; needs ``transformers``, downloads nothing)::

    python examples/model_matrix.py            # every row
    python examples/model_matrix.py vit bart   # some rows

It prints one row per model: its stages, the call that trained it, the first minibatch's loss
next to the plain loop's, the last loss, whether the strict load worked and whether the loaded
module's eval logits on unseen samples equal the plain loop's. ``tests/runtime/
test_model_matrix.py`` asserts the same at smaller sizes.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

VOCAB, SEQ, BATCH, STEPS, SEED, LR, N = 128, 16, 8, 6, 0, 0.1, 64


class DictData(Dataset[dict[str, Tensor]]):
    """Dict samples: each column's tensors, indexed alike."""

    def __init__(self, **columns: Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return int(next(iter(self.columns.values())).shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tokens() -> Dataset[Any]:
    """``{"input_ids", "attention_mask", "labels"}``, the last 3 tokens masked."""
    g = _gen()
    ids = torch.randint(3, VOCAB, (N, SEQ), generator=g)
    mask = torch.ones(N, SEQ, dtype=torch.int64)
    mask[:, -3:] = 0
    return DictData(input_ids=ids, attention_mask=mask, labels=ids.clone())


def images() -> Dataset[Any]:
    """``{"pixel_values": (3, 16, 16), "labels" < 5}``."""
    g = _gen()
    return DictData(pixel_values=torch.randn(N, 3, 16, 16, generator=g),
                    labels=torch.randint(0, 5, (N,), generator=g))  # fmt: skip


def pictures() -> Dataset[Any]:
    """``(image (3, 16, 16), class < 5)`` pairs."""
    g = _gen()
    return TensorDataset(torch.randn(N, 3, 16, 16, generator=g),
                         torch.randint(0, 5, (N,), generator=g))  # fmt: skip


def masked() -> Dataset[Any]:
    """``{"labels", "mask", "x"}`` for :class:`MaskedNet`."""
    g = _gen()
    return DictData(labels=torch.randint(0, 5, (N,), generator=g),
                    mask=(torch.rand(N, 64, generator=g) > 0.3).float(),
                    x=torch.randn(N, 16, generator=g))  # fmt: skip


def hf(kind: str, config: str, **cfg: Any) -> Callable[[], nn.Module]:
    """A seeded random-init ``transformers.<kind>(<config>(**cfg))`` factory."""

    def make() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, kind)(getattr(transformers, config)(**cfg))  # type: ignore[no-any-return]

    return make


NO_DROP = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
BERT = hf("BertForMaskedLM", "BertConfig", num_hidden_layers=4, hidden_size=64,
          num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
          max_position_embeddings=SEQ, pad_token_id=0, **NO_DROP)  # fmt: skip
BART = hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=64,
          encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
          max_position_embeddings=SEQ, use_cache=False, dropout=0.0, attention_dropout=0.0,
          activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
          decoder_start_token_id=2)  # fmt: skip
T5 = hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16,
        d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0)  # fmt: skip
QWEN2 = hf("Qwen2ForCausalLM", "Qwen2Config", vocab_size=VOCAB, hidden_size=64,
           intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True,
           use_cache=False)  # fmt: skip
ALBERT = hf("AlbertForMaskedLM", "AlbertConfig", vocab_size=VOCAB, embedding_size=32,
            hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=SEQ, classifier_dropout_prob=0.0, pad_token_id=0,
            **NO_DROP)  # fmt: skip
VIT = hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4,
         num_channels=3, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
         intermediate_size=128, num_labels=5, **NO_DROP)  # fmt: skip


def bn_dropout_cnn() -> nn.Module:
    """Conv-BN-ReLU twice, then dropout and a linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),  # (B, 16, 16, 16)
        nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),  # (B, 16, 8, 8)
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(1024, 5),  # (B, 5)
    )  # fmt: skip


class Residual(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the input, then ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + x)  # (B, C, H, W)


def resnet() -> nn.Module:
    """A stem with batch norm, three residual blocks, pooling and a linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Residual(16), Residual(16), Residual(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),  # (B, 5)
    )  # fmt: skip


class MaskedNet(nn.Module):
    """A forward with an optional mask, as people write it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 5)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = torch.relu(self.inp(x))  # (B, 64)
        if mask is not None:
            h = h * mask
        return self.out(torch.relu(self.mid(h)))  # (B, 5)


def masked_net() -> nn.Module:
    torch.manual_seed(0)
    return MaskedNet()


@dataclass(frozen=True)
class Row:
    """One model of the matrix: how to build it, its data, its stages, its inputs and loss."""

    name: str
    make: Callable[[], nn.Module]
    data: Callable[[], Dataset[Any]]
    stages: int = 2
    names: tuple[str, ...] = ()  # keyword inputs of a dict sample; () = (input, target)
    loss: Callable[[Any, Tensor], Tensor] | None = None  # None: the model's own output.loss
    cuts: tuple[int, ...] | None = None  # hand cuts (layer indices) instead of planned stages


LM = ("input_ids", "attention_mask", "labels")
ROWS = (
    Row("BERT + attention mask", BERT, tokens, 2, LM),
    Row("BART", BART, tokens, 2, LM),
    Row("T5 (default config)", T5, tokens, 2, LM),
    Row("Qwen2 (tied embeddings)", QWEN2, tokens, 2, LM),
    Row("ALBERT (one shared layer)", ALBERT, tokens, 3, LM),
    Row("ViT", VIT, images, 2, ("pixel_values", "labels")),
    Row("CNN + BN + dropout", bn_dropout_cnn, pictures, 2, (), F.cross_entropy, (4,)),
    Row("ResNet-style (BatchNorm2d)", resnet, pictures, 2, (), F.cross_entropy),
    Row("forward(x, mask=None)", masked_net, masked, 2, ("x", "mask"), F.cross_entropy),
)


def _forward(model: nn.Module, row: Row, inputs: tuple[Tensor, ...]) -> Any:
    if row.names:
        return model(**dict(zip(row.names, inputs, strict=True)))
    return model(*inputs)


def plain_loop(model: nn.Module, row: Row, data: Dataset[Any], rng_seed: int) -> list[float]:
    """The plain PyTorch loop: the run's minibatch order, SGD, dropout from ``rng_seed``."""
    from runtime.data import MinibatchSource

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    source = MinibatchSource(data, BATCH, SEED, (), input_names=row.names)
    torch.manual_seed(rng_seed)
    losses = []
    for p in range(1, STEPS + 1):
        inputs, y = source.batch(p)
        opt.zero_grad(set_to_none=True)
        out = _forward(model, row, inputs)
        loss = out.loss if row.loss is None else row.loss(out, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


@torch.no_grad()
def eval_logits(model: nn.Module, row: Row, data: Dataset[Any]) -> Tensor:
    """Eval-mode logits on the data set's last minibatch (samples the run never reached)."""
    from runtime.data import MinibatchSource

    model.eval()
    source = MinibatchSource(data, BATCH, SEED, (), input_names=row.names)
    out = _forward(model, row, source.batch(len(data) // BATCH)[0])  # type: ignore[arg-type]
    return out if isinstance(out, Tensor) else out.logits


def run_row(row: Row, out_dir: Path) -> dict[str, str]:
    """Train ``row`` with hetpipe, load its weights strictly, compare with the plain loop."""
    import hetpipe
    from runtime.config import OptimizerConfig
    from runtime.stage.model import stage_rng_seed

    data, model = row.data(), row.make()
    reference = copy.deepcopy(model)
    t0 = time.perf_counter()
    stages = 0 if row.cuts else row.stages  # cuts: the dropout on the last stage, as the loop
    result = hetpipe.train(model, data, row.loss, stages=stages, cuts=row.cuts, nm=1, batch_size=BATCH,
                           steps=STEPS, seed=SEED, optimizer=OptimizerConfig(lr=LR),
                           out=out_dir, emulate=False)  # fmt: skip
    seconds = time.perf_counter() - t0
    stages = len(result.vws[0].stages)
    # a dropout draws from its stage's RNG: the loop uses the last stage's (where the CNN's is)
    plain = plain_loop(reference, row, data, stage_rng_seed(SEED, 0, stages - 1))
    fresh, ok = row.make(), "yes"
    try:
        fresh.load_state_dict(torch.load(out_dir / "weights.pt", weights_only=True), strict=True)
    except RuntimeError as exc:
        ok = f"NO: {str(exc).splitlines()[1].strip()[:60]}"
    same = torch.allclose(eval_logits(fresh, row, data), eval_logits(reference, row, data),
                          rtol=1e-5, atol=1e-5)  # fmt: skip
    how = f"cuts={row.cuts}" if row.cuts else f"stages={row.stages}"
    call = f"hetpipe.train(model, data, {how}, nm=1)"
    return {"model": row.name, "stages": str(stages), "call": call,
            "first loss (hetpipe / plain)": f"{result.losses[0]:.4f} / {plain[0]:.4f}",
            "last loss": f"{result.losses[-1]:.4f}", "strict load": ok,
            "eval equal": "yes" if same else "NO", "s": f"{seconds:.0f}"}  # fmt: skip


def table(rows: list[dict[str, str]]) -> str:
    """A Markdown table of ``rows`` (one dict per row, the same keys)."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(names: list[str]) -> int:
    """Run the rows whose names contain one of ``names`` (all without); print the table."""
    torch.set_num_threads(1)
    chosen = [r for r in ROWS if not names or any(n.lower() in r.name.lower() for n in names)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {row.name} ...", flush=True)
            results.append(run_row(row, Path(tmp) / str(i)))
    print(table(results))
    bad = [r for r in results if r["strict load"] != "yes" or r["eval equal"] != "yes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
