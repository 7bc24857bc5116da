"""``gptspeed.bench.worker``: one ladder row, measured in this process: ``python -m gptspeed.bench SPEC.json RESULT.json``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gptspeed.bench.stages import (
    BASELINE,
    baseline_with,
)
from gptspeed.bench.worker import init_gpt

from support.shapes import SMALLEST_ROW
from support.verify_rows import TINY_RUNG


def test_init_is_the_same_function_for_both_vocab_sizes():
    import torch

    from gptspeed.model import GPTConfig

    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, loss="plain")
    small = init_gpt(GPTConfig(**{**cfg.__dict__, "vocab_size": 50257}), seed=3)
    padded = init_gpt(cfg, seed=3)
    x = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(small(x, x)[1], padded(x, x)[1], rtol=1e-5)
    assert torch.equal(small.transformer.h[0].mlp.c_fc.weight, padded.transformer.h[0].mlp.c_fc.weight)


def test_a_softmax_data_row_covers_the_ids_of_its_data_as_train_does(shakespeare_data):
    """``--softmax data`` (the nano preset's) in a bench row: the head covers the data's ids, as
    ``train`` sets them, not all 50,257 (which would time a 4x larger head than the run has)."""

    import numpy as np
    import torch

    from gptspeed.bench.verify_worker import verify_stage
    from gptspeed.bench.worker import StageSpec, SyntheticLoader
    from gptspeed.data.train_data import find_train_data

    base = StageSpec(name="r", settings={"dtype": "float32", "compile": False, "softmax": "data"}, **TINY_RUNG)
    full = verify_stage(dataclasses.replace(base, settings={"dtype": "float32", "compile": False}))
    phrases = verify_stage(base)
    synthetic = SyntheticLoader(2, 16, 3, base.seed, torch.device("cpu"), "phrases")  # the row's own batches
    on_data = verify_stage(dataclasses.replace(base, data=str(shakespeare_data)))
    per_id = 6 * 32  # the head's FLOPs per token per vocabulary row (6 x n_embd)
    used = len(np.unique(synthetic.tokens))
    assert 0 < used < 512  # the phrases' ids that occur in the row's tokens
    assert full["flops_per_token"] - phrases["flops_per_token"] == per_id * (50304 - used)
    ids = len(find_train_data(str(shakespeare_data)).token_ids())
    assert full["flops_per_token"] - on_data["flops_per_token"] == per_id * (50304 - ids)


def test_a_bench_row_reading_a_data_folder_holds_its_read_lock(shakespeare_data, tmp_path):
    """A bench worker reads its data folder under the shared lock ``train`` holds: a ``prepare --force``
    of that folder meanwhile is refused in one line instead of rewriting the shards under the row."""
    import torch

    from gptspeed.bench import worker
    from gptspeed.bench.worker import StageSpec, make_loader
    from gptspeed.data.folder import data_folder_lock
    from gptspeed.errors import GptspeedError as Error

    spec = StageSpec(
        name="r",
        settings={},
        n_layer=1,
        n_head=2,
        n_embd=32,
        seq_len=16,
        batch_size=2,
        steps=1,
        warmup=1,
        device="cpu",
        data=str(shakespeare_data),
    )
    make_loader(spec, torch.device("cpu"))
    try:
        with pytest.raises(Error, match="is in use"):
            data_folder_lock(shakespeare_data, exclusive=True).acquire()
    finally:
        for lock in worker._HELD:
            lock and lock.release()
        worker._HELD.clear()
    data_folder_lock(shakespeare_data, exclusive=True).acquire().release()


def test_a_batch_auto_rung_trains_the_same_sequences_per_step_as_its_reference(monkeypatch):
    """--batch-size auto in verify keeps the global batch (B x grad_accum sequences) and regroups
    the same sequences into its micro-batch, so its losses match the fixed-batch rung's; a micro-batch
    larger or smaller than the reference's alike."""
    from gptspeed.bench import verify_worker, worker
    from gptspeed.bench.worker import StageSpec

    base = dict(TINY_RUNG, grad_accum=2)
    ref = verify_worker.verify_stage(StageSpec(name="ref", settings=dict(BASELINE), **base))
    for auto in (4, 1):
        seen = []
        monkeypatch.setattr(
            worker, "auto_batch_size", lambda cfg, rt, say, auto=auto: seen.append(cfg.train.total_batch_tokens) or auto
        )
        got = verify_worker.verify_stage(
            StageSpec(name="batch-auto", settings=baseline_with(batch_size="auto"), **base)
        )
        assert seen == [2 * 2 * 16]  # the probe divides the global batch, as train's --total-batch-tokens
        assert (got["batch_size"], got["grad_accum"]) == (auto, 4 // auto)
        assert got["tokens_per_step"] == ref["tokens_per_step"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), auto
    assert len(set(ref["losses"])) == 3  # three different steps: the weights moved


def test_bench_step_reports_a_step_it_did_not_apply():
    from gptspeed.bench.worker import StageSpec, bench_step, build_row
    from gptspeed.runtime import resolve_runtime

    spec = StageSpec(name="t", settings=dict(BASELINE), **SMALLEST_ROW, grad_accum=2)
    rt = resolve_runtime("cpu", "float32", False)
    step, _ = build_row(spec, rt)
    assert step.accum == 2
    before = step.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    x = torch.randint(0, 50257, (1, 8))
    poisoned = x.clone()
    step.model.transformer.wpe.weight.data[0, 0] = math.nan  # a non-finite loss
    loss, skipped = bench_step(step, lambda: (poisoned, x))
    assert skipped.item() is True and math.isnan(loss.item())
    assert torch.equal(step.model.transformer.h[0].mlp.c_fc.weight, before)  # not applied
    step.model.transformer.wpe.weight.data[0, 0] = 0.0
    loss, skipped = bench_step(step, lambda: (x, x))
    assert skipped.item() is False and math.isfinite(loss.item())


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.cuda)])
def test_one_process_ddp_step(tmp_path, backend, device):
    # torchrun-free: a process group of one. On CUDA this is the one-GPU NCCL DDP step; the gloo
    # twin runs the same code on the CPU in CI. In a fresh process that ends without freeing the
    # group (tests/support/ddp_row.py): freed here after destroy_process_group, gloo's destructor
    # once joined a thread that never ended and hung the session.
    import json
    import subprocess
    import sys

    from support.cli import child_env
    from support.paths import ROOT

    script = ROOT / "tests" / "support" / "ddp_row.py"
    cmd = [sys.executable, str(script), backend, device, str(tmp_path / "rendezvous")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["ddp"]  # the row's train_model is DistributedDataParallel
    assert seen["sync"] and seen["accum"] == 2  # no_sync() on the first micro-batch
    assert seen["finite"] and seen["skipped"] == [False, False], seen
    assert seen["moved"]  # the step was applied
