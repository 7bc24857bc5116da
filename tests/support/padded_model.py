"""A tiny model with the padded vocabulary (50304) and its batches, on the CPU runtime."""

from __future__ import annotations

import torch

from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime

from support.shapes import PADDED_VOCAB_MODEL

CPU = resolve_runtime("cpu", "float32", False)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**PADDED_VOCAB_MODEL, **kw}))


def _batch(B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (B, T), generator=g), torch.randint(0, 50257, (B, T), generator=g)
