"""The flags of a tiny ``gptspeed train`` run on real text, and a run started in the background."""

from __future__ import annotations

from support.cli import start_cli
from support.training import TINY_MODEL, flags

TINY = [
    "--preset",
    "pico",
    *flags(dict(TINY_MODEL, n_layer=2, block_size=64, batch_size=8)),
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-tokens",
    "1024",
    "--device",
    "cpu",
]


def start(data, run, *extra):
    return start_cli("train", *TINY, "--data", str(data), "--out", str(run), *extra)
