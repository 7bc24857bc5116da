"""The settings of the tiny real-text trainings (``gptspeed.make_config`` field names)."""

from __future__ import annotations

from support.training import TINY_MODEL

TINY = dict(
    TINY_MODEL,
    n_layer=2,
    block_size=64,
    batch_size=8,
    warmup_steps=2,
    lr=3e-3,
    eval_tokens=1024,
    log_every=1,
    device="cpu",
)
