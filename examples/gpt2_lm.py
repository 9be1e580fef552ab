"""A GPT-2 language model from Hugging Face ``transformers`` for ``hetpipe --model``.

``hetpipe run --model examples.gpt2_lm:small --data synthetic`` (from the repository root)
trains a random-init GPT-2 (6 layers, 256 wide) on synthetic token data; ``tiny`` is a 2-layer, 64-wide one for
quick checks. Each factory returns ``(module, {name: tensor})``: the model is called as
``module(**batch)`` and its own ``loss`` output (given ``labels``) is trained.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["gpt2", "small", "small_tied", "tiny"]

VOCAB = 512  # synthetic token ids are drawn below this
SEQ = 64  # tokens per sample


def gpt2(
    batch_size: int, n_layer: int, n_embd: int, n_head: int, seq: int = SEQ, tied: bool = False
) -> tuple[nn.Module, dict[str, Tensor]]:
    """A random-init ``GPT2LMHeadModel`` (no dropout, no cache) and one sample minibatch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer,  # transformer blocks
        n_embd=n_embd,  # model width
        n_head=n_head,  # attention heads
        vocab_size=VOCAB,
        n_positions=seq,  # longest sequence
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,  # training: no key/value cache (and torch.export needs none)
        # tied input/output embeddings: held by the first and the last stage, pushed and
        # pulled once per VW by the first (docs/runtime.md); untied by default here
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 10, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}  # (B, T) each


def small(batch_size: int = 8) -> tuple[nn.Module, dict[str, Tensor]]:
    """GPT-2 with 6 layers, 256 wide, 4 heads (about 5 M parameters)."""
    return gpt2(batch_size, n_layer=6, n_embd=256, n_head=4)


def small_tied(batch_size: int = 8) -> tuple[nn.Module, dict[str, Tensor]]:
    """``small`` with its input and output embeddings tied (as GPT-2 ships)."""
    return gpt2(batch_size, n_layer=6, n_embd=256, n_head=4, tied=True)


def tiny(batch_size: int = 8) -> tuple[nn.Module, dict[str, Tensor]]:
    """GPT-2 with 2 layers, 64 wide, 2 heads, 32 tokens."""
    return gpt2(batch_size, n_layer=2, n_embd=64, n_head=2, seq=32)
