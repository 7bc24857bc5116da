"""``gptspeed.distributed``: several processes: joining the process group torchrun set up (a store per restart round), telling a lost peer from a bug, leaving the group, and gradient-sync control for accumulation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gptspeed.checkpoint import check_checkpoint, consolidate, list_checkpoints, load_checkpoint
from gptspeed.data import find_shards
from gptspeed.data.loader import TokenLoader
from gptspeed.trainer import build_train_config, fit

from support.cli import child_env
from support.paths import SRC
from support.shapes import DIST_RUN, DIST_RUNS_FIXTURE
from support.torchrun import assert_same, collect, launch, losses

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------- the GPU paths on 2 ranks
def _single_muon(dist_runs, tmp_path, **extra):
    from gptspeed.eval import hellaswag as hs

    saved = hs.hellaswag_file
    hs.hellaswag_file = lambda progress=True: dist_runs["hellaswag"]
    try:
        cfg = build_train_config(
            "pico",
            dict(
                DIST_RUNS_FIXTURE,
                data=str(dist_runs["data"]),
                out=str(tmp_path / "single_muon"),
                optimizer="muon",
                save_every=0,
                max_steps=3,
                **extra,
            ),
        )
        fit(cfg, echo=False)
    finally:
        hs.hellaswag_file = saved
    return tmp_path / "single_muon"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_rank_with_accumulation(dist_runs, mode):
    single, dist = losses(dist_runs["single"]), losses(dist_runs[mode])
    assert sorted(single) == sorted(dist) == [0, 1, 2, 3, 4]
    assert_same(single, dist, range(5))
    rec = [json.loads(l) for l in (dist_runs[mode] / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["tokens"] == 4 * 256 and rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"] / 2)
    conf = json.loads((dist_runs[mode] / "config.json").read_text())["derived"]
    assert conf["world_size"] == 2 and conf["grad_accum_steps"] == 1 and conf["parallel"] == mode


def test_checkpoint_layout(dist_runs, tmp_path):
    ddp = list_checkpoints(dist_runs["ddp"])
    assert [p.name for p in ddp] == ["ckpt_00000002.pt", "ckpt_00000004.pt"]  # written once, by rank 0
    fsdp = list_checkpoints(dist_runs["fsdp"])
    assert [p.name for p in fsdp] == ["ckpt_00000002.dcp", "ckpt_00000004.dcp"]
    assert all(check_checkpoint(p) is None for p in ddp + fsdp)
    torn = tmp_path / "torn"
    shutil.copytree(dist_runs["fsdp"], torn)  # keep the fixture intact for the other tests
    shard = next((torn / fsdp[-1].name).glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])  # a torn shard unseals the checkpoint
    assert "does not match its seal" in check_checkpoint(torn / fsdp[-1].name)
    assert list_checkpoints(torn)[0].name == "ckpt_00000002.dcp"


def test_ddp_checkpoint_resumes_in_one_process(dist_runs, tmp_path):
    """The DDP checkpoint (2 ranks x 1) continues in one process (1 x 2): the loader re-shards."""
    run = tmp_path / "ddp_resume"
    shutil.copytree(dist_runs["ddp"], run)
    for p in run.glob("ckpt_00000004*"):
        p.unlink()
    fit(build_train_config(None, dict(out=str(run), resume=True)), echo=False)
    assert_same(losses(dist_runs["single"]), losses(run), [3, 4])


def test_consolidated_fsdp_checkpoint_loads_in_one_process(dist_runs, tmp_path):
    from gptspeed.eval import evaluate_run

    out = consolidate(dist_runs["fsdp"], tmp_path / "one")
    ck = load_checkpoint(out)  # sealed, weights_only
    assert ck["step"] == 4 and ck["model"]["transformer.wte.weight"].shape == (50304, 32)
    res = evaluate_run(
        str(tmp_path / "one"), str(dist_runs["data"]), batch_size=4, max_tokens=512, device="cpu", dtype="float32"
    )
    assert res["val_loss"] == pytest.approx(losses(dist_runs["fsdp"])[4][1], abs=1e-5)
    single = consolidate(dist_runs["fsdp"] / "ckpt_00000002.dcp", tmp_path / "two.pt")
    assert load_checkpoint(single)["step"] == 2
    # one-process training resumes the consolidated step-2 checkpoint to the same losses
    run = tmp_path / "cont"
    consolidate(dist_runs["fsdp"] / "ckpt_00000002.dcp", run)
    fit(build_train_config(None, dict(out=str(run), resume=True)), echo=False)
    assert_same(losses(dist_runs["single"]), losses(run), [3, 4])


def test_ranks_read_disjoint_data_and_count_documents_once(shakespeare_data):
    shards = find_shards(shakespeare_data, "train")
    one = TokenLoader(shards, 4, 32)
    ranks = [TokenLoader(shards, 4, 32, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        xs = [ld.next_batch()[0].numpy() for ld in ranks]
        a, b = one.next_batch()[0].numpy(), one.next_batch()[0].numpy()
        np.testing.assert_array_equal(xs[0], a)
        np.testing.assert_array_equal(xs[1], b)
    assert ranks[0].documents == ranks[1].documents == one.documents


def test_indivisible_batch_fails_with_one_line_per_rank_and_no_traceback(dist_runs):
    returncode, stderr = dist_runs["bad"]  # launched by the fixture, alongside the others
    assert returncode != 0
    errors = [l for l in stderr.splitlines() if "gptspeed train: error:" in l]
    # Each rank refuses on its own; torchrun SIGTERMs the others once the first exits, so a slow
    # rank may be stopped before it prints: one or two lines, never a traceback.
    assert 1 <= len(errors) <= 2 and all("not a multiple of batch_size * seq_len * world_size" in e for e in errors), (
        stderr
    )
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr
    assert not (dist_runs["root"] / "bad").exists()


def test_fsdp_muon_trains_evaluates_hellaswag_checkpoints_and_consolidates(dist_runs, tmp_path):
    """FSDP2 + Muon used to crash at the first checkpoint (get_state_dict was handed MuonWithAdamW),
    and FSDP2 + --hellaswag-every at the first HellaSwag (mixed Tensor / DTensor)."""
    run = dist_runs["root"] / "scenarios" / "muon_fsdp"
    assert [r["muon_fsdp"]["resumed_step"] for r in dist_runs["scenarios"]] == [3, 3]
    assert [p.name for p in list_checkpoints(run)] == ["ckpt_00000002.dcp", "ckpt_00000003.dcp"]
    single = _single_muon(dist_runs, tmp_path, hellaswag_every=1, hellaswag_examples=4)
    recs = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    ref = {r["step"]: r for r in map(json.loads, (single / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):  # before the resume: HellaSwag ran on the sharded model
        assert recs[step]["hellaswag_examples"] == 4
    for step in (1, 2, 3):  # step 3 after the DCP resume (Muon's momentum restored)
        assert recs[step]["train_loss"] == pytest.approx(ref[step]["train_loss"], abs=2e-3), step
    # consolidate the step-2 checkpoint (Muon + AdamW state split back) and continue in one process
    cont = tmp_path / "cont"
    ck = load_checkpoint(consolidate(run / "ckpt_00000002.dcp", cont))
    assert set(ck["optimizer"]) == {"adamw", "muon"} and ck["optimizer"]["muon"]["state"]
    # HellaSwag on the sharded model scores as one process scores the same weights (the step-2 weights:
    # the one-process run's differ slightly -- Muon's bf16 Newton-Schulz on whole vs sharded matrices --
    # and its 4 identical examples flip together on a near tie, seen on a CPU with native bf16)
    from gptspeed.config import RunConfig
    from gptspeed.eval.hellaswag import evaluate_hellaswag, load_hellaswag
    from gptspeed.model import GPT

    model = GPT(RunConfig.from_dict(ck["config"]).model)
    model.load_state_dict(ck["model"])
    one = evaluate_hellaswag(model, load_hellaswag(dist_runs["hellaswag"]), device="cpu")
    assert one["examples"] == 4 and recs[2]["hellaswag_acc_norm"] == one["acc_norm"]
    fit(build_train_config(None, dict(out=str(cont), resume=True, hellaswag_every=0)), echo=False)
    assert losses(cont)[3][0] == pytest.approx(recs[3]["train_loss"], abs=2e-3)


def test_muon_under_ddp_matches_one_process_and_resumes_in_one(dist_runs, tmp_path):
    run = dist_runs["root"] / "scenarios" / "muon_ddp"
    single = _single_muon(dist_runs, tmp_path)
    train = lambda run: {s: v[0] for s, v in losses(run).items() if s}  # noqa: E731  (train losses only)
    assert train(run) == pytest.approx({s: train(single)[s] for s in (1, 2)}, abs=1e-5)
    cont = tmp_path / "ddp_cont"
    shutil.copytree(run, cont)
    for p in cont.glob("ckpt_00000002*"):
        p.unlink()
    fit(build_train_config(None, dict(out=str(cont), resume=True, max_steps=3)), echo=False)
    assert train(cont) == pytest.approx(train(single), abs=1e-5)


def test_the_modern_switches_under_fsdp_match_one_process(dist_runs, tmp_path):
    """Rotary positions, QK-norm, ReLU², RMSNorm, an untied zero-initialised head, the soft
    cap, the document mask and WSD, sharded over 2 ranks: the same losses as one process."""
    from support.dist_scenarios import MODERN

    single = tmp_path / "modern_single"
    fit(
        build_train_config(
            "pico", dict(DIST_RUN, **MODERN, data=str(dist_runs["data"]), out=str(single), save_every=0, max_steps=2)
        ),
        echo=False,
    )
    sharded = dist_runs["root"] / "scenarios" / "modern_fsdp"
    train = lambda run: {s: v[0] for s, v in losses(run).items() if s}  # noqa: E731  (train losses only)
    assert train(sharded) == pytest.approx(train(single), abs=1e-5) and set(train(single)) == {1, 2}
    assert [r["modern_fsdp"]["step"] for r in dist_runs["scenarios"]] == [2, 2]


def test_fsdp_eval_with_uneven_batches_matches_one_process(dist_runs):
    """3 val batches on 2 ranks: rank 1 joins rank 0's last forward with a dummy batch (this hung:
    it called a collective while rank 0 was still all-gathering for its forward)."""
    from gptspeed.eval.val_loss import evaluate

    from support.training import make_step

    trainer = make_step(dict(n_layer=2, n_head=2, n_embd=32, block_size=32), seed=1337)
    loss, n = evaluate(trainer.train_model, trainer.rt, find_shards(dist_runs["data"], "val"), 4, 32, max_tokens=384)
    assert [r["eval_uneven"]["tokens"] for r in dist_runs["scenarios"]] == [384, 384] == [n, n]
    for r in dist_runs["scenarios"]:
        assert r["eval_uneven"]["val_loss"] == pytest.approx(loss, abs=1e-5)


def test_fp16_fsdp_ranks_skip_an_overflow_together(dist_runs):
    """An inf in rank 1's gradient shard only: with a plain GradScaler rank 0 stepped and kept its
    scale while rank 1 skipped and halved it; the sharded scaler all-reduces found_inf."""
    for r in dist_runs["scenarios"]:
        seen = r["fp16_fsdp"]
        assert seen["step0"] == {"changed": True, "scale": 65536.0}
        assert seen["step1"] == {"changed": False, "scale": 32768.0}


def test_auto_batch_size_ranks_probe_in_lockstep_and_agree(dist_runs):
    """Rank 0 fits 40 sequences, rank 1 fits 24: both probe the same sizes and take 24."""
    a, b = (r["batch_agree"] for r in dist_runs["scenarios"])
    assert a == b and a["fit"] == 24 and a["probed"][:6] == [1, 2, 4, 8, 16, 32]


def test_ranks_end_with_status_0_after_a_gloo_collective():
    """A rank that ends after a gloo collective exits through finish_process: no SIGABRT from a
    worker thread releasing the collective's tensors in the interpreter's teardown (the CI failure
    of 2026-11-27: a finished FSDP resume reported failed). One launch of 4 ranks: with the plain
    exit, 3 launches in 6 failed so on a 2-core CPU (tests/support/gloo_exit.py plain)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        str(SRC.parent / "tests" / "support" / "gloo_exit.py"),
        "finish",
    ]
    proc = launch(cmd, child_env(OMP_NUM_THREADS="1"))
    out, err = collect(proc, 120)
    assert "terminate called" not in err and proc.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"rank (\d) done", out)) == ["0", "1", "2", "3"], out  # lines may interleave


@pytest.mark.parametrize("joined_gloo", [True, False])
def test_finish_process_runs_atexit_flushes_and_skips_the_teardown_only_after_gloo(joined_gloo):
    """finish_process(3): exit status 3, atexit handlers run, buffered output flushed; the
    interpreter's teardown (a module global's __del__) is skipped only after a gloo group."""
    code = f"""
import atexit, sys
import gptspeed.distributed as d
class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)
kept = Teardown()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, no newline|")
d._joined_gloo = {joined_gloo}
d.finish_process(3)
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith("buffered, no newline|atexit ran") and "not reached" not in proc.stdout, proc.stdout
    assert ("teardown ran" in proc.stdout) is not joined_gloo, proc.stdout
