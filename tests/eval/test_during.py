"""``gptspeed.eval.during``: the evaluations a run makes while it trains."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from gptspeed.configure import build_train_config
from gptspeed.eval.bpb import evaluate_bpb
from gptspeed.eval.during import RunEvaluator
from gptspeed.model import GPT
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_model
from gptspeed.trainer import fit

from support.hf_models import write_data_pico

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eval_bpb_puts_the_val_bits_per_byte_in_the_training_log(tmp_path):
    """--eval-bpb: each evaluation's record (step 0's too) holds val_bpb, the figure `gptspeed eval` gives for the
    checkpoint of that step; without it the log has none (off by default)."""
    data = write_data_pico(tmp_path / "data", manifest=False)
    common = dict(
        data=str(data),
        max_steps=2,
        eval_every=2,
        batch_size=2,
        eval_tokens=128,
        block_size=32,
        n_layer=1,
        n_embd=32,
        n_head=2,
        device="cpu",
        dtype="float32",
        compile=False,
    )
    fit(build_train_config("pico", {**common, "eval_bpb": True, "out": str(tmp_path / "run")}), echo=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("val_loss") is not None and r["step"] == 2]
    assert evals and all("val_bpb" in r for r in evals)
    first = [r for r in records if r["step"] == 0]  # the step-0 evaluation too (the untrained model: ~ ln(V) nats)
    assert len(first) == 1 and first[0]["val_bpb"] > evals[-1]["val_bpb"] > 0
    model, _ = load_model(tmp_path / "run", resolve_runtime("cpu", "float32"))
    want = evaluate_bpb(model, resolve_runtime("cpu", "float32"), [data / "val_000000.bin"], 2, 32, 128)
    assert evals[-1]["val_bpb"] == pytest.approx(want, rel=1e-5)
    assert build_train_config("pico", {**common, "out": str(tmp_path / "plain")}).train.eval_bpb is False


@pytest.mark.parametrize("parallel", ["none", "fsdp"])
def test_eval_bpb_comes_from_the_val_loss_pass_without_a_forward_of_its_own(tmp_path, parallel):
    """An evaluation with --eval-bpb runs the forwards of the val loss alone (the same batches, the
    run's micro-batch) and gives both figures, each the one `gptspeed eval`'s pass gives; under FSDP2
    too, which it was refused before (it ran a second pass on the unsharded model)."""
    data = write_data_pico(tmp_path / "data", manifest=False)
    common = dict(data=str(data), batch_size=2, eval_tokens=160, block_size=32, n_layer=1, n_embd=32, n_head=2)
    rt = dataclasses.replace(resolve_runtime("cpu", "float32"), parallel=parallel)
    torch.manual_seed(0)
    model = GPT(build_train_config("pico", common).model)
    forwards = []
    model.register_forward_pre_hook(lambda m, args: forwards.append(tuple(args[0].shape)))
    stepper = SimpleNamespace(model=model, train_model=model, attention=contextlib.nullcontext)
    split = SimpleNamespace(has_val=True, val_shards=[data / "val_000000.bin"])
    figures = {}
    for bpb in (False, True):
        evals = RunEvaluator(build_train_config("pico", {**common, "eval_bpb": bpb}), rt, split, stepper)
        forwards.clear()
        figures[bpb] = (evals.val_loss(), evals.bpb(), list(forwards))
    assert figures[True][2] == figures[False][2] == [(2, 32), (2, 32), (1, 32)]  # 5 windows: no second pass
    assert figures[True][0] == figures[False][0] and figures[False][1] == {}
    want = evaluate_bpb(model, rt, split.val_shards, 2, 32, 160)
    assert figures[True][1] == {"val_bpb": pytest.approx(want, rel=1e-12)}
