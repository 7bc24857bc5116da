"""``gptspeed.bench.verify``: ``gptspeed bench verify``: does every rung train correctly here, and how fast? One command."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from gptspeed import cli
from gptspeed.bench import verify as verify_mod
from gptspeed.bench.stages import baseline_with
from gptspeed.bench.verify import compare_losses, plan_verify, rung_problems

from support.ladder_rows import in_process_worker
from support.shapes import LADDER_FLAGS, SMALLEST_ROW

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ the parent's verdicts
def _fake(spec, losses, **kw):
    """What a verify worker returns, built here."""
    fused = spec.settings["fused_adamw"]
    return {
        "status": "ok",
        "losses": losses,
        "skipped": [False] * len(losses),
        "batch_size": spec.batch_size,
        "grad_accum": spec.grad_accum,
        "ms_median": 10.0,
        "ms_q25": 9.0,
        "ms_q75": 11.0,
        "tokens_per_s": 100.0,
        "mfu": None,
        "peak_flops_source": "none",
        "peak_mem_bytes": 2**20,
        "grad_scaler": False,
        "syncs": {
            "counted": False,
            "total": None,
            "per_step": None,
            "budget": 0 if fused else 1,
            "sites": {},
            "note": "not counted",
        },
        "compile": {
            "graph_breaks": 0,
            "graph_break_reasons": [],
            "recompiles": 0,
            "recompile_reasons": [],
            "frames_compiled": 1,
            "frames_compiled_per_step": [1, 0],
        }
        if spec.settings["compile"]
        else None,
        "sdpa": {"backend": "flash", "evidence": []} if spec.settings["attention"] == "sdpa" else None,
        **kw,
    }


REF = [10.8, 10.4, 10.0, 9.7]


def _on_a_simulated_h100(monkeypatch):
    """``bench verify --device cpu`` planned and reported as on an H100 (nothing runs on a GPU:
    the workers are faked, the plan sees capability 9.0, the environment is the CPU's)."""
    real_base_spec, real_env = verify_mod.base_spec, verify_mod.report.environment
    monkeypatch.setattr(verify_mod, "base_spec", lambda cfg: dataclasses.replace(real_base_spec(cfg), device="cuda"))
    monkeypatch.setattr(
        verify_mod.report, "environment", lambda device, command: real_env(torch.device("cpu"), command)
    )


def _fake_h100_worker(ran):
    def fake_worker(spec, log_path, timeout=None, cache_dir=None):
        ran.append((spec.name, cache_dir, cache_dir is not None and cache_dir.is_dir()))
        if spec.name == "fp8":  # n_embd 128: torchao's rule converts no layer, and the worker says so
            return {"status": "skipped", "reason": "refused: --fp8 would convert no layer at n_embd 128"}
        losses = REF if spec.name.startswith("baseline") else [x * (1 + 1e-6) for x in REF]
        return _fake(spec, losses)

    return fake_worker


@pytest.mark.parametrize("off, code", [(1.0, 0), (1.03, 1)])
def test_a_rung_with_a_wrong_loss_is_flagged_and_the_exit_is_nonzero(tmp_path, monkeypatch, capsys, off, code):
    def fake_worker(spec, log_path, timeout=None, **kw):
        if spec.name == "fused-ce":  # 3% off from step 2 on: a wrong result, far outside any tolerance
            return _fake(spec, [REF[0], REF[1], REF[2] * off, REF[3] * off])
        return _fake(spec, [x * (1 + 1e-7) for x in REF] if spec.name != "baseline" else REF)

    monkeypatch.setattr(verify_mod, "run_worker", fake_worker)
    out = tmp_path / "v"
    assert cli.main(["bench", "verify", "--out", str(out), "--stages", "compile,fused-ce", *LADDER_FLAGS]) == code
    stdout, stderr = capsys.readouterr()
    rungs = {r["name"]: r for r in json.loads((out / "verify.json").read_text())["rungs"]}
    assert rungs["compile"]["problems"] == []
    if code == 0:
        assert stderr.strip() == "" or "verify failed" not in stderr
        assert rungs["fused-ce"]["problems"] == []
        return
    assert stderr.strip().splitlines()[-1].startswith("gptspeed bench: verify failed for 1 rung(s): fused-ce")
    check = rungs["fused-ce"]["loss_check"]
    assert not check["ok"] and check["at_step"] in (2, 3) and math.isclose(check["max_rel_diff"], 0.03, rel_tol=1e-6)
    assert rungs["fused-ce"]["problems"][0].startswith(
        "loss 10.30000 vs baseline's 10.00000 at step 2: 3.0e-02 relative"
    )
    assert "| fused-ce | " in stdout and "**FAILED**" in stdout


def test_on_an_h100_the_default_rungs_run_and_the_verdict_is_verified(tmp_path, monkeypatch, capsys, h100):
    """Without --stages, verify runs the seeds' rungs (fp32 .. fused AdamW: train's default
    switches one at a time); the others are skipped as outside the default set, the CUDA-graph modes
    are refused by their rule -- none of it makes the verdict "not verified": exit 0."""
    _on_a_simulated_h100(monkeypatch)
    ran = []
    monkeypatch.setattr(verify_mod, "run_worker", _fake_h100_worker(ran))
    out = tmp_path / "v"
    assert cli.main(["bench", "verify", "--out", str(out), *LADDER_FLAGS]) == 0
    assert [name for name, _, _ in ran] == list(verify_mod.DEFAULT_RUNGS)
    result = json.loads((out / "verify.json").read_text())
    assert result["verdict"] == "verified" and result["ok"] and result["complete"]
    assert result["not_verified"] == [] and result["failing"] == []
    assert result["refused"] == ["max-autotune", "reduce-overhead"]
    rungs = {r["name"]: r for r in result["rungs"]}
    for name in verify_mod.DEFAULT_RUNGS[1:]:
        assert rungs[name]["verdict"] == "verified", (name, rungs[name]["verdict_reason"])
    for name in ("fused-ce", "batch-auto", "fp8", "muon", "sdpa-cudnn", "fp16"):
        assert rungs[name]["verdict"] == "skipped" and "--stages all" in rungs[name]["reason"], name
    md = (out / "verify.md").read_text()
    assert "**VERIFIED: 6 verified, 0 not verified, 0 failing, 2 refused by a rule before they started" in md
    assert "| reduce-overhead | — | refused |" in md


def test_on_an_h100_every_rung_runs_refusals_are_not_failures_and_batch_auto_is_compared(
    tmp_path, monkeypatch, capsys, h100
):
    """--stages all on an H100 with 2 micro-steps: reduce-overhead / max-autotune refused up front,
    fp8 refused by its worker at n_embd 128, batch-auto compared with its reference: every rung that
    ran is within tolerance, so the verdict is VERIFIED and the exit 0 (it was "not verified", exit 3).
    All rungs share one compile cache, fresh for this run and removed after it."""
    _on_a_simulated_h100(monkeypatch)
    ran = []
    monkeypatch.setattr(verify_mod, "run_worker", _fake_h100_worker(ran))
    out = tmp_path / "v"
    assert (
        cli.main(
            ["bench", "verify", "--out", str(out), "--stages", "all", *LADDER_FLAGS, "--compile-backend", "inductor"]
        )
        == 0
    )
    result = json.loads((out / "verify.json").read_text())
    assert result["verdict"] == "verified" and result["not_verified"] == []
    assert result["refused"] == ["fp8", "max-autotune", "reduce-overhead"]
    assert result["refusals"][0] == "fp8: --fp8 would convert no layer at n_embd 128"
    rungs = {r["name"]: r for r in result["rungs"]}
    assert rungs["batch-auto"]["verdict"] == "verified" and rungs["batch-auto"]["reference"] == "baseline"
    names = [name for name, _, _ in ran]
    assert names[:2] == ["baseline", "baseline-muon"] and "max-autotune-no-cudagraphs" in names and len(names) == 19
    assert {"fp8-lm-head", "bf16-residual"} <= set(names)  # the extras of --fp8-lm-head and --residual-dtype
    caches = {cache for _, cache, _ in ran}
    assert len(caches) == 1 and all(existed for _, _, existed in ran)  # one cache, there while the rungs ran
    assert not next(iter(caches)).exists()  # and removed afterwards
    assert "Refused** (a rule of gptspeed's" in (out / "verify.md").read_text()


def test_compare_losses_stops_at_the_first_step_a_run_did_not_apply():
    # a GradScaler skipped step 2 (fp16 overflow): from step 3 on the weights differ by design
    row = {"losses": [10.8, 10.41, 10.05, 10.3], "skipped": [False, False, True, False]}
    ref = {"losses": REF, "skipped": [False] * 4}
    check = compare_losses(row, ref, 1e-2)
    assert check["steps_compared"] == 3 and check["ok"] and "first step not applied" in check["note"]
    assert check["at_step"] == 2 and math.isclose(check["max_rel_diff"], 0.005, rel_tol=1e-9)
    bad = compare_losses({"losses": [10.8, math.nan, 10.0, 9.7]}, ref, 1e-2)
    assert bad["max_rel_diff"] == math.inf and not bad["ok"] and bad["at_step"] == 1
    flat = compare_losses({"losses": [10.8] * 4}, {"losses": [10.8] * 4}, 1e-4)
    assert flat["ok"] and "agreement says little" in flat["note"]


def test_verdicts_name_each_broken_contract():
    ok = {
        "status": "ok",
        "reference": "baseline",
        "skipped": [False, True],
        "grad_scaler": True,
        "loss_check": {"ok": True},
        "compile": {"graph_breaks": 0, "graph_break_reasons": [], "recompiles": 0, "recompile_reasons": []},
        "syncs": {"counted": True, "per_step": 1.0, "budget": 1, "sites": {}},
    }
    assert rung_problems(ok) == []  # a GradScaler skip is by design; 1 sync is within a budget of 1
    broken = {
        **ok,
        "grad_scaler": False,
        "compile": {
            "graph_breaks": 2,
            "graph_break_reasons": ["Data-dependent branching"],
            "recompiles": 1,
            "recompile_reasons": ["0/1 forward: tensor 'x' size mismatch"],
        },
        "syncs": {"counted": True, "per_step": 3.0, "budget": 0, "sites": {"gptspeed/trainer.py:144": 3}},
    }
    problems = rung_problems(broken)
    assert problems == [
        "step(s) 1 not applied: non-finite loss or gradient",
        "2 graph break(s): Data-dependent branching",
        "1 recompile(s): 0/1 forward: tensor 'x' size mismatch",
        "3 host-device syncs per step, designed for 0 (e.g. at gptspeed/trainer.py:144)",
    ]
    assert rung_problems({"status": "failed", "reason": "out of memory at B=64"}) == ["failed: out of memory at B=64"]
    assert rung_problems({"status": "skipped", "reason": "needs CUDA"}) == []


def test_plan_on_a_gpu_refuses_cuda_graph_rungs_with_accumulation_before_they_run(h100):
    """With verify's default 2 micro-batches per step, the CUDA-graph compile modes are planned as
    refused (they would crash mid-rung: the second micro-step reads buffers the graph overwrote),
    with train's own reason; a refused rung is "refused (reason)": not a failure, not unverified."""
    plan = {r.name: r for r in plan_verify(torch.device("cuda"), None, "inductor")}
    for name in ("reduce-overhead", "max-autotune"):
        assert plan[name].settings is None and plan[name].applies_here
        assert (
            plan[name].skip_reason.startswith("refused: --compile-tuning ")
            and "2 micro-steps" in plan[name].skip_reason
        )
        row = {
            "name": name,
            "status": "skipped",
            "reason": plan[name].skip_reason,
            "applies_here": True,
            "problems": [],
        }
        verdict, why = verify_mod.rung_verdict(row)
        assert verdict == "refused" and why.startswith("--compile-tuning ") and "2 micro-steps" in why
    assert plan["max-autotune-no-cudagraphs"].skip_reason is None


@pytest.mark.parametrize(
    "row, verdict, why",
    [
        (
            dict(status="skipped", reason="refused: --fp8 would convert no layer", applies_here=True),
            "refused",
            "no layer",
        ),
        (dict(status="skipped", reason="FP8 tensor cores need an NVIDIA GPU", applies_here=False), "skipped", "NVIDIA"),
        (dict(status="skipped", reason="not selected (--stages)", applies_here=True), "skipped", "not selected"),
        (
            dict(
                status="ok", loss_check=None, not_compared="not compared: the reference baseline did not run (failed)"
            ),
            "not verified",
            "did not run",
        ),
        (dict(status="pending", reason="pending: not run yet"), "pending", "not run yet"),
        (
            dict(
                status="ok", loss_check=dict(steps_compared=1, note="compared up to step 0, the first step not applied")
            ),
            "not verified",
            "only 1 step(s) compared",
        ),
        (dict(status="ok", loss_check=dict(steps_compared=5, note="")), "verified", ""),
        (dict(status="ok", loss_check=None, kind="reference", not_compared="the reference"), "reference", "reference"),
    ],
)
def test_a_rung_is_verified_only_when_its_losses_were_compared_over_updates(row, verdict, why):
    got = verify_mod.rung_verdict({"name": "r", "problems": [], **row})
    assert got[0] == verdict and why in got[1]
    failed = verify_mod.rung_verdict({"name": "r", "problems": ["1 graph break(s)"], **row})
    assert failed[0] == "failed"


def test_an_fp8_rung_that_would_convert_no_layer_is_refused_not_passed(tmp_path):
    """At a width where torchao's rule converts no Linear, the FP8 rung used to train in bf16 and pass
    as "verified"; it is refused by the configuration's own rule: "refused", not "verified"."""
    from gptspeed.bench.worker import StageSpec

    spec = StageSpec(name="fp8", settings=baseline_with(fp8=True), **dict(SMALLEST_ROW, batch_size=2), mode="verify")
    result = in_process_worker(spec, tmp_path / "fp8.log")
    assert result["status"] == "skipped" and result["reason"].startswith("refused: --fp8 would convert no layer")
    row = {"name": "fp8", "problems": [], "applies_here": True, **result}
    assert verify_mod.rung_verdict(row) == ("refused", result["reason"].removeprefix("refused: "))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["--stages", "fp16,warp-drive"], "unknown stage(s) 'warp-drive'"),
        (["--stages", "fp16,tf32"], "none of the selected rungs runs on cpu (tf32: TF32 is an NVIDIA"),
    ],
)
def test_verify_bad_flags_one_line(tmp_path, capsys, args, message):
    code = cli.main(["bench", "verify", "--out", str(tmp_path / "o"), *LADDER_FLAGS, *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and err.startswith("gptspeed bench: error:")


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
def test_verify_on_cuda_at_a_small_shape_passes(tmp_path, monkeypatch, capsys):
    """``bench verify`` on CUDA exits 0 (it could not: refused rungs made it "not verified", exit 3).
    The default rung set at 2 layers x 128: ~7 processes and 3 small cold compiles, ~3 minutes by the
    estimate (gpu_session.py's cudatests phase runs it as its own part, last)."""
    out = tmp_path / "verify"
    argv = [
        "bench",
        "verify",
        "--out",
        str(out),
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "128",
        "--seq-len",
        "256",
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--warmup",
        "3",
        "--synthetic",
        "--device",
        "cuda",
    ]
    code = cli.main(argv)
    result = json.loads((out / "verify.json").read_text())
    assert code == 0, result["problems"] + result["unverified"]
    rungs = {r["name"]: r for r in result["rungs"]}
    # the default rungs (the seeds': train's default switches one at a time) all ran and agree with fp32
    assert result["verdict"] == "verified" and result["complete"]
    assert all(rungs[name]["verdict"] == "verified" for name in verify_mod.DEFAULT_RUNGS[1:])
    assert rungs["fused-adamw"]["syncs"]["counted"] and rungs["fused-adamw"]["syncs"]["per_step"] == 0
    assert rungs["flash"]["sdpa"]["backend"] is not None
