"""A tiny ``gptspeed train`` run on real text started in the background (its flags: tests/support/shapes.py), and
the arguments of a ``train --preset pico`` on the CPU."""

from __future__ import annotations

from support.cli import start_cli
from support.shapes import TEXT_RUN_FLAGS


def start(data, run, *extra):
    return start_cli("train", *TEXT_RUN_FLAGS, "--data", str(data), "--out", str(run), *extra)


def train_args(data, out, *extra: str, max_steps: int | None = 2) -> tuple[str, ...]:
    """The arguments of ``gptspeed train --preset pico`` on the CPU reading ``data`` into ``out``, for
    :func:`support.cli.run_main` or :func:`support.cli.run_cli`: ``--max-steps`` (None: the preset's),
    then ``extra``."""
    steps = () if max_steps is None else ("--max-steps", str(max_steps))
    return ("train", "--preset", "pico", "--data", str(data), "--out", str(out), "--device", "cpu", *steps, *extra)
