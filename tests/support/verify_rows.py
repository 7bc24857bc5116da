"""The tiny shape ``bench --verify``'s tests train (flags of ``gptspeed bench``)."""

from __future__ import annotations

from support.training import TINY_MODEL, flags

TINY = [
    *flags(dict(TINY_MODEL, batch_size=2)),
    "--steps",
    "2",
    "--warmup",
    "1",
    "--synthetic",
    "--device",
    "cpu",
    "--compile-backend",
    "eager",
]
