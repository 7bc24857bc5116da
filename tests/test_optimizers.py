"""Optimizers are a registry (issue 29): adding one is one register_optimizer call. A toy optimizer,
registered here and nowhere else, is a --optimizer choice, trains, checkpoints and resumes, and its
declared rules (no GradScaler) hold."""

import pytest
import torch
from conftest import TINY_MODEL, make_step, train_losses

from gptspeed import optim
from gptspeed.config import OPTIMIZERS as CHOICES
from gptspeed.errors import GptspeedError
from gptspeed.runtime import Runtime
from gptspeed.trainer import build_train_config, fit


def build_sgd(model, cfg, device_type):
    """Plain SGD at --lr (momentum 0.9): the toy."""
    opt = torch.optim.SGD([p for p in model.parameters()], lr=cfg.lr, momentum=0.9)
    for g in opt.param_groups:
        g["lr_mult"] = 1.0
    return opt, False


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(optim, "OPTIMIZERS", dict(optim.OPTIMIZERS))
    monkeypatch.setattr(optim, "CONFIG_OPTIMIZERS", CHOICES)
    before = list(CHOICES)
    spec = optim.register_optimizer(optim.OptimizerSpec("toy-sgd", build_sgd, grad_scaler=False, doc="SGD"))
    yield spec
    CHOICES[:] = before


def test_a_registered_optimizer_trains_checkpoints_and_resumes(toy, shakespeare_data, tmp_path):
    base = dict(
        TINY_MODEL,
        data=str(shakespeare_data),
        optimizer="toy-sgd",
        lr=0.05,
        batch_size=4,
        max_steps=4,
        save_every=2,
        eval_every=0,
        log_every=1,
        device="cpu",
        dtype="float32",
    )
    full = tmp_path / "full"
    fit(build_train_config("pico", dict(base, out=str(full))), echo=False)
    losses = train_losses(full)
    assert losses[4] < losses[1]  # it trains
    part = tmp_path / "part"
    part.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json", "config.json"):
        (part / name).write_bytes((full / name).read_bytes())
    fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    assert train_losses(part)[4] == losses[4]  # SGD's momentum buffers came back with the checkpoint


def test_a_registered_optimizers_rules_are_the_steps(toy):
    step = make_step(TINY_MODEL, dict(optimizer="toy-sgd"))
    assert isinstance(step.optimizer, torch.optim.SGD) and step.skips_on_device is False
    fp16 = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    with pytest.raises(GptspeedError, match="--optimizer toy-sgd does not support float16"):
        make_step(TINY_MODEL, dict(optimizer="toy-sgd"), rt=fp16)


def test_an_unregistered_name_is_one_line():
    assert "toy-sgd" not in CHOICES and set(optim.OPTIMIZERS) == set(CHOICES) == {"adamw", "muon"}
    with pytest.raises(GptspeedError, match="--optimizer must be one of adamw, muon, got 'sgd'"):
        make_step(TINY_MODEL, dict(optimizer="sgd"))
