"""Text generation and checkpoint evaluation for a trained run."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch
from torch.nn import functional as F

from gptspeed.checkpoint import load_latest
from gptspeed.config import RunConfig
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT
from gptspeed.runtime import Runtime, resolve_runtime


def load_model(run_dir: str | Path, rt: Runtime) -> tuple[GPT, dict]:
    """The model of the newest checkpoint in ``run_dir``, on ``rt.device``, in eval mode.
    Returns ``(model, checkpoint)``; GptspeedError if there is none."""
    ckpt = load_latest(Path(run_dir))
    cfg = RunConfig.from_dict(ckpt["config"])
    model = GPT(cfg.model)
    model.load_state_dict(ckpt["model"])
    model.to(rt.device).eval()
    return model, ckpt


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             autocast=None) -> Iterator[torch.Tensor]:
    """Autoregressive sampling without a KV cache (each step re-reads the last ``block_size``
    tokens). ``idx`` is ``(B, T0)`` int64; yields each new column ``(B,)`` int64 as it is drawn.

    ``temperature`` 0 is greedy decoding; ``top_k`` keeps the k most likely tokens (Fan et al.
    2018). Vocabulary padding has -inf logits (see :class:`GPT`), so it is never drawn.
    """
    for _ in range(max_new_tokens):
        ctx = idx[:, -model.config.block_size :]
        with autocast if autocast is not None else contextlib.nullcontext():
            h = model.hidden_states(ctx)
            logits = model.logits(h[:, -1, :]).float()  # (B, V): the last position only
        if temperature == 0:
            nxt = logits.argmax(dim=-1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        yield nxt


def evaluate_run(run_dir: str | Path, data_dir: str | Path, *, batch_size: int = 8, max_tokens: int = 0,
                 device: str = "auto", dtype: str = "auto") -> dict:
    """Val loss of the newest checkpoint of ``run_dir`` on the val split of ``data_dir``.
    Returns ``{"step", "val_loss", "perplexity", "tokens", "run", "data"}``."""
    from gptspeed.data import find_shards
    from gptspeed.train import evaluate

    if batch_size < 1:
        raise GptspeedError(f"--batch-size must be at least 1, got {batch_size}")
    rt = resolve_runtime(device, dtype, compile=False)
    shards = find_shards(data_dir, "val")
    model, ckpt = load_model(run_dir, rt)
    loss, n = evaluate(model, rt, shards, batch_size, model.config.block_size, max_tokens)
    return {"step": ckpt["step"], "val_loss": loss, "perplexity": math.exp(loss), "tokens": n,
            "run": str(run_dir), "data": str(data_dir)}
