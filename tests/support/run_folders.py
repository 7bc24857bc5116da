"""A tiny run's flags and a run trained into a given folder, for the run-folder tests."""

from __future__ import annotations

from gptspeed.trainer import build_train_config, fit

from support.training import TINY_MODEL

BASE = dict(
    TINY_MODEL,
    n_layer=1,
    batch_size=4,
    device="cpu",
    dtype="float32",
    eval_every=0,
    log_every=1,
    save_every=1,
    keep_checkpoints=3,
)


def train(data, out, **kw):
    return fit(build_train_config("pico", dict(BASE, data=str(data), out=str(out), **kw)), echo=False)
