"""``gptspeed.averaging``: the tail average of the weights (``--ema-tail-ratio``), in a run, its checkpoints, a
resume, and what eval, sample and export-hf read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gptspeed import api
from gptspeed.averaging import PART, TailAverage, readout_state
from gptspeed.checkpoint import checkpoint_path, load_checkpoint
from gptspeed.config import preset
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_model
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_main
from support.training import records

pytestmark = pytest.mark.usefixtures("one_thread")

#: 6 float32 eager steps of a 2-layer model, a checkpoint each; the tail the last 3 (from the weights after
#: step 3), a horizon of 2.5 steps (a lerp weight of 0.4); evaluated at the start and the end.
RUN = dict(
    n_layer=2,
    n_embd=32,
    batch_size=8,
    device="cpu",
    dtype="float32",
    compile=False,
    eval_every=0,
    eval_tokens=1024,
    max_steps=6,
    save_every=1,
    keep_checkpoints=10,
)
TAIL = dict(ema_tail_ratio=0.5, ema_horizon=2.5)


def train(data, out, **kw):
    return fit(build_train_config("pico", dict(RUN, data=str(data), out=str(out), **kw)), echo=False)


def ckpt(run, step):
    return load_checkpoint(checkpoint_path(run, step))


@pytest.fixture(scope="module")
def runs(shakespeare_data, tmp_path_factory):
    """The same run with the tail average (``tail``) and without (``off``)."""
    root = tmp_path_factory.mktemp("averaging")
    train(shakespeare_data, root / "tail", **TAIL)
    train(shakespeare_data, root / "off")
    return root


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2, 2))


def test_the_average_is_a_copy_then_lerps_toward_each_steps_weights_and_reads_out_as_the_blend():
    model, cfg = Toy(), preset("pico")
    cfg.train.max_steps, cfg.train.ema_tail_ratio, cfg.train.ema_horizon, cfg.train.ema_blend = 10, 0.3, 4.0, 0.6
    avg = TailAverage(model, cfg)
    assert avg.start == 7  # the last 3 of 10 steps
    history = {}
    for step in range(1, 11):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step * step))  # the weights after each step: 1, 4, 9, ...
        avg.update(step)
        history[step] = avg.state_dict()
    assert all(history[s] == {} for s in range(1, 7))  # nothing before the tail
    hand = 49.0  # step 7: a copy; then avg += (w - avg) / 4
    for w in (64.0, 81.0, 100.0):
        hand += (w - hand) / 4
    assert avg.state_dict()["a"].dtype == torch.float32
    assert torch.allclose(avg.state_dict()["a"], torch.full((3,), hand), rtol=0, atol=1e-5)
    with avg.applied():
        assert torch.allclose(model.a, torch.full((3,), 0.4 * 100 + 0.6 * hand), rtol=0, atol=1e-5)
    assert torch.equal(model.a, torch.full((3,), 100.0)) and torch.equal(model.b, torch.full((2, 2), 100.0))


def test_a_run_averages_its_tail_as_a_hand_lerp_of_its_checkpointed_weights(runs):
    run = runs / "tail"
    assert all(ckpt(run, s)[PART] == {} for s in (1, 2))
    hand = {n: t.float().clone() for n, t in ckpt(run, 3)["model"].items() if n != "lm_head.weight"}
    assert set(ckpt(run, 3)[PART]) == set(hand)
    for s in (4, 5, 6):
        weights = ckpt(run, s)["model"]
        hand = {n: torch.lerp(a, weights[n], 0.4) for n, a in hand.items()}
        saved = ckpt(run, s)[PART]
        assert all(torch.equal(saved[n], hand[n]) for n in hand), s


def test_off_by_default_nothing_changes_and_on_the_weights_still_train_the_same(runs):
    assert preset("pico").train.ema_tail_ratio == 0
    on, off = ckpt(runs / "tail", 6), ckpt(runs / "off", 6)
    assert PART not in off
    assert all(torch.equal(on["model"][n], off["model"][n]) for n in off["model"])  # the raw weights
    val = {
        name: [r["val_loss"] for r in records(runs / name) if r.get("val_loss") is not None] for name in ("tail", "off")
    }
    assert val["tail"][0] == val["off"][0]  # before the tail: the same evaluation
    assert val["tail"][-1] != val["off"][-1]  # the last: of the blend


@pytest.mark.parametrize("stopped_at", [2, 4], ids=["before-the-tail", "in-the-tail"])
def test_a_run_resumed_in_or_before_its_tail_ends_with_the_same_average_to_the_bit(runs, tmp_path, stopped_at):
    run = tmp_path / "run"
    shutil.copytree(runs / "tail", run)
    for p in run.glob("ckpt_*"):
        if int(p.name[5:13]) > stopped_at:
            p.unlink()
    summary = fit(build_train_config(None, dict(out=str(run), resume=True)), echo=False)
    assert summary["step"] == 6
    ref, got = ckpt(runs / "tail", 6), ckpt(run, 6)
    assert set(got[PART]) == set(ref[PART])
    assert all(torch.equal(got[PART][n], ref[PART][n]) for n in ref[PART])
    assert all(torch.equal(got["model"][n], ref["model"][n]) for n in ref["model"])
    assert records(run)[-1]["val_loss"] == records(runs / "tail")[-1]["val_loss"]


def test_eval_sample_and_the_last_logged_val_loss_read_the_blend(runs, shakespeare_data):
    run = runs / "tail"
    last = ckpt(run, 6)
    blend = {n: torch.lerp(last["model"][n], a, 0.6) for n, a in last[PART].items()}
    model, loaded = load_model(run, resolve_runtime("cpu", "float32", compile=False))
    assert loaded["readout"] == "tail average"
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n].detach(), blend[n]) for n in blend)
    out = run_main(
        "eval", "--run", str(run), "--data", str(shakespeare_data), "--max-tokens", "1024", "--dtype", "float32"
    )
    out = json.loads(out.stdout)
    assert out["weights"] == "tail average"
    assert out["val_loss"] == pytest.approx(records(run)[-1]["val_loss"], abs=1e-5)
    off = json.loads(
        run_main(
            "eval",
            "--run",
            str(runs / "off"),
            "--data",
            str(shakespeare_data),
            "--max-tokens",
            "1024",
            "--dtype",
            "float32",
        ).stdout
    )
    assert "weights" not in off and abs(off["val_loss"] - out["val_loss"]) > 1e-5


def test_export_hf_writes_the_blend(runs, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch", reason="pip install -e '.[hf]'")
    pytest.importorskip("tokenizers", reason="pip install -e '.[hf]'")
    from gptspeed.hf.export import export_hf

    last = ckpt(runs / "tail", 6)
    out = export_hf(runs / "tail", tmp_path / "hf")
    tensors = safetensors.load_file(out / "model.safetensors")
    for name in ("transformer.ln_f.weight", "transformer.wpe.weight"):
        assert torch.equal(tensors[name], torch.lerp(last["model"][name], last[PART][name], 0.6)), name


def test_readout_state_leaves_a_checkpoint_without_an_average_as_it_is():
    w = torch.ones(2)
    state = {"model": {"x": w}, "config": {}}
    assert readout_state(state)["x"] is w and torch.equal(w, torch.ones(2)) and state["readout"] == "weights"


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--ema-tail-ratio", "1.5"], "--ema-tail-ratio"),
        (["--ema-tail-ratio", "-0.1"], "--ema-tail-ratio"),
        (["--ema-tail-ratio", "0.1", "--max-steps", "10"], "would change nothing"),
        (["--ema-tail-ratio", "0.3", "--ema-horizon", "1"], "--ema-horizon"),
        (["--ema-tail-ratio", "0.3", "--ema-blend", "0"], "--ema-blend"),
        (["--ema-tail-ratio", "0.3", "--ema-blend", "1.5"], "--ema-blend"),
        (["--ema-horizon", "20"], "does nothing without --ema-tail-ratio"),
        (["--ema-blend", "0.5"], "does nothing without --ema-tail-ratio"),
    ],
)
def test_bad_values_are_refused_in_one_line(flags, fragment, tmp_path):
    assert_user_error(run_main("train", "--preset", "pico", "--out", str(tmp_path / "r"), *flags), fragment)
    assert not (tmp_path / "r").exists()


def test_the_api_takes_the_settings_and_refuses_a_tail_of_one_step():
    assert api.make_config("pico", ema_tail_ratio=0.25, max_steps=100).train.ema_tail_ratio == 0.25
    with pytest.raises(Exception, match="would change nothing"):
        api.make_config("pico", ema_tail_ratio=0.01, max_steps=100)


def test_a_sharded_checkpoint_restores_the_average_in_place_and_consolidate_keeps_it(tmp_path):
    from gptspeed.checkpoint import Checkpointer, ModelState, OptimizerState
    from gptspeed.checkpoint.consolidate import consolidate

    model, cfg = Toy(), preset("pico")
    cfg.train.max_steps, cfg.train.ema_tail_ratio, cfg.train.ema_horizon = 4, 0.5, 2.0
    avg = TailAverage(model, cfg)
    meta = {"config": {"model": {}, "train": {"ema_blend": 0.6}, "runtime": {"parallel": "fsdp"}}, "run_id": "r"}
    saver = Checkpointer(tmp_path / "run", sharded=True, meta=meta, keep=5)
    saver.register("model", ModelState(model, sharded=True), sharded=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.a.grad, model.b.grad = torch.ones(3), torch.ones(2, 2)
    sgd.step()  # a state to save (consolidate splits it)
    saver.register("optimizer", OptimizerState(model, sgd, sharded=True), sharded=True)
    saver.register(PART, avg, sharded=True)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.a.add_(torch.arange(3.0) * step)
            model.b.sub_(step)
        avg.update(step)
        saver.save(step)
    expected = {n: t.clone() for n, t in avg.state_dict().items()}
    for step, held in ((1, {}), (3, expected)):
        fresh = TailAverage(Toy(), cfg)
        loader = Checkpointer(tmp_path / "run", sharded=True, meta=meta)
        loader.register("model", ModelState(Toy(), sharded=True), sharded=True)
        loader.register(PART, fresh, sharded=True)
        fresh.expect(step)  # as the trainer does before loading
        loader.load(checkpoint_path(tmp_path / "run", step, sharded=True))
        assert set(fresh.state_dict()) == set(held)
        assert all(torch.equal(fresh.state_dict()[n], held[n]) for n in held)
    one = load_checkpoint(consolidate(checkpoint_path(tmp_path / "run", 3, sharded=True), tmp_path / "one.pt"))
    assert all(torch.equal(one[PART][n], expected[n]) for n in expected)
