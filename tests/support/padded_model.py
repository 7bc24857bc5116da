"""A tiny model with the padded vocabulary (50304) and its batches, on the CPU runtime."""

from __future__ import annotations

import torch

from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime

SHAPE = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


CPU = resolve_runtime("cpu", "float32", False)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SHAPE, **kw}))


def _batch(B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (B, T), generator=g), torch.randint(0, 50257, (B, T), generator=g)
