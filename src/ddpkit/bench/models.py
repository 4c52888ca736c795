"""Models for `ddpkit bench ddp`, built in-process with no download: a GPT-2-small-like
decoder, a ResNet-50-like CNN, a tiny MLP for CPUs and CI, or the user's own
`MODULE:FACTORY`. A factory returns (model, make_batch), where make_batch(batch_size, device)
gives (inputs, targets) and the loss is cross-entropy."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
Factory = Callable[[], tuple[nn.Module, Callable[[int, torch.device], Batch]]]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A GPT-2-like decoder (pre-norm blocks, causal attention, learned positions)."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tokens(idx) + self.positions(pos))
        return self.head(self.norm(x)).flatten(0, 1)


def gpt(
    layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50304, seq: int = 1024
) -> tuple[nn.Module, Callable[[int, torch.device], Batch]]:
    def batch(size: int, device: torch.device) -> Batch:
        idx = torch.randint(0, vocab, (size, seq + 1), device=device)
        return idx[:, :-1], idx[:, 1:].reshape(-1)

    return Decoder(layers, width, heads, vocab, seq), batch


def resnet() -> tuple[nn.Module, Callable[[int, torch.device], Batch]]:
    """ResNet-50's shape: bottleneck stages of 3, 4, 6, 3 blocks, 224x224 inputs."""

    def stage(cin: int, mid: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for i in range(blocks):
            layers.append(Bottleneck(cin if i == 0 else mid * 4, mid, stride if i == 0 else 1))
        return nn.Sequential(*layers)

    model = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        stage(64, 64, 3, 1),
        stage(256, 128, 4, 2),
        stage(512, 256, 6, 2),
        stage(1024, 512, 3, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2048, 1000),
    )

    def batch(size: int, device: torch.device) -> Batch:
        return (
            torch.randn(size, 3, 224, 224, device=device),
            torch.randint(0, 1000, (size,), device=device),
        )

    return model, batch


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, mid * 4, 1, bias=False),
            nn.BatchNorm2d(mid * 4),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == mid * 4
            else nn.Sequential(
                nn.Conv2d(cin, mid * 4, 1, stride, bias=False), nn.BatchNorm2d(mid * 4)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def tiny() -> tuple[nn.Module, Callable[[int, torch.device], Batch]]:
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )

    def batch(size: int, device: torch.device) -> Batch:
        return (torch.randn(size, 256, device=device), torch.randint(0, 10, (size,), device=device))

    return model, batch


BUILT_IN: dict[str, Factory] = {"gpt": gpt, "resnet": resnet, "tiny": tiny}


def resolve(name: str) -> Factory:
    """A built-in name, or MODULE:FACTORY for the user's own model."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(
            f"--model {name!r} is neither {', '.join(BUILT_IN)} nor MODULE:FACTORY",
            fix="e.g. --model gpt, or --model mypkg.models:build",
        )
    try:
        factory: Any = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"--model {name}: {err}",
            fix="the module must be importable here and define the factory",
        ) from None
    return factory
