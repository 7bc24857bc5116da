"""The flags of a tiny ``gptspeed train`` run on real text, a run started in the background, and the arguments of a
``train --preset pico`` on the CPU."""

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


def train_args(data, out, *extra: str, max_steps: int | None = 2) -> tuple[str, ...]:
    """The arguments of ``gptspeed train --preset pico`` on the CPU reading ``data`` into ``out``, for
    :func:`support.cli.run_main` or :func:`support.cli.run_cli`: ``--max-steps`` (None: the preset's),
    then ``extra``."""
    steps = () if max_steps is None else ("--max-steps", str(max_steps))
    return ("train", "--preset", "pico", "--data", str(data), "--out", str(out), "--device", "cpu", *steps, *extra)
