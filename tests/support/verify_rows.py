"""The tiny verify rung of the bench's worker tests, as :class:`gptspeed.bench.worker.StageSpec` fields."""

from __future__ import annotations

#: A ``bench verify`` rung on the CPU (StageSpec fields): two steps of 2 x 16 tokens of a 1-block model,
#: on the synthetic phrases; each test adds its name and settings (and what it changes).
TINY_RUNG = dict(
    n_layer=1,
    n_head=2,
    n_embd=32,
    seq_len=16,
    batch_size=2,
    steps=2,
    warmup=1,
    device="cpu",
    mode="verify",
    synthetic="phrases",
)
