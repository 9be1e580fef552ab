"""The built-in models' modules: an MLP, ResNets (CIFAR and ImageNet shapes), VGG-19 and a
small causal transformer. :mod:`profiler.models` names them (``mlp``, ``resnet``, ...) and
builds each with a sample batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "TinyTransformer", "mlp", "vgg19"]


def mlp(
    in_features: int = 64, hidden: int = 256, depth: int = 4, classes: int = 10
) -> nn.Sequential:
    """A plain multi-layer perceptron; the default for the digits data set (8x8 = 64 inputs)."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convolutions) with an identity or 1x1 projection skip."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3, 1x1) with expansion 4."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.short(x))


class ResNet(nn.Module):
    """ResNet of basic or bottleneck blocks.

    ``imagenet=True`` uses the 7x7/stride-2 stem and max-pool of the ImageNet models;
    otherwise a 3x3 stem for 32x32 inputs.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks: tuple[int, ...],
        widths: tuple[int, ...],
        classes: int,
        imagenet: bool,
    ) -> None:
        super().__init__()
        stem_out = widths[0]
        if imagenet:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_out, 7, 2, 3, bias=False),
                nn.BatchNorm2d(stem_out),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_out, 3, 1, 1, bias=False), nn.BatchNorm2d(stem_out), nn.ReLU()
            )
        expansion = 4 if block is Bottleneck else 1
        cin = stem_out
        stages: list[nn.Module] = []
        for i, (n, w) in enumerate(zip(blocks, widths, strict=True)):
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(block(cin, w, stride))
                cin = w * expansion
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, 3, H, W)
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))  # (B, classes)


def vgg19(classes: int = 1000) -> nn.Sequential:
    """VGG-19 (configuration E, no batch norm), 224x224 inputs: 143.7 M parameters (548 MiB fp32)."""
    cfg: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M"]
    cfg += [512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    layers: list[nn.Module] = []
    cin = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU()]
            cin = int(v)
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout()]
    layers += [nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, classes)]
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with traceable ops (no shape-dependent code)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, T, C)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, T, C)
        q = q.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = k.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).flatten(-2))  # (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A small GPT-style language model; its positional embedding is a bare parameter."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, heads: int = 4, depth: int = 2, seq: int = 32
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.Sequential(*[TransformerBlock(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        # idx: (B, T) token ids
        x = self.tok(idx) + self.pos  # (B, T, C)
        x = self.ln(self.blocks(x))
        return self.head(x).flatten(0, 1)  # (B*T, vocab)
