"""`gptspeed bench --verify`: every rung checked against fp32, failures recorded, the run goes on.

One end-to-end run on a tiny shape (CPU, ``eager`` compile backend, one thread per worker): two
of its rungs are made to fail inside their worker processes (an out-of-memory error and a crash,
injected by a ``sitecustomize`` module on the workers' PYTHONPATH), and the others must still run
and verify. Everything else -- the loss comparison, the verdicts, the plan on a GPU, the sync and
compile counters -- is tested on results and objects built here, with no timing involved.
Tests marked ``cuda`` run only on a GPU (``pytest -m cuda``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import warnings

import pytest
import torch
from conftest import TINY_MODEL, fake_packages, flags

from gptspeed import cli
from gptspeed.bench import verify as verify_mod
from gptspeed.bench.checks import SYNC_MESSAGE, CompileWatch, SyncCounter, sdpa_backend
from gptspeed.bench.stages import BASELINE, STAGE_NAMES, VERIFY_EXTRA_NAMES, baseline_with
from gptspeed.bench.verify import compare_losses, plan_verify, rung_problems
from gptspeed.config import AUTO_BATCH_SIZE

TINY = [
    *flags(dict(TINY_MODEL, batch_size=2)),
    "--steps",
    "2",
    "--warmup",
    "1",
    "--synthetic",
    "--device",
    "cpu",
    "--compile-backend",
    "eager",
]

FAULTS = """
import os
if os.environ.get("GPTSPEED_TEST_FAULTS"):  # written by tests/test_verify.py: make named rungs fail
    import json
    import torch
    import gptspeed.bench.verify_worker as verify_worker
    faults = json.loads(os.environ["GPTSPEED_TEST_FAULTS"])
    real_build_row = verify_worker.build_row
    def build_row(spec, rt, *rest):
        fault = faults.get(spec.name)
        if fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by a test)")
        if fault == "crash":
            raise RuntimeError("injected crash")
        return real_build_row(spec, rt, *rest)
    verify_worker.build_row = build_row
"""


@pytest.fixture(autouse=True)
def _one_thread_workers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------------------------ end to end
def test_verify_end_to_end_records_failures_and_goes_on(tmp_path, monkeypatch, capsys):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(faults), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("GPTSPEED_TEST_FAULTS", json.dumps({"compile": "oom", "flash": "crash"}))
    out = tmp_path / "verify"
    argv = ["bench", "--verify", "--out", str(out), "--stages", "compile,flash,fused-ce", *TINY]
    monkeypatch.setattr(sys, "argv", ["gptspeed", *argv])

    code = cli.main(argv)
    stdout, stderr = capsys.readouterr()
    assert code == 1
    assert stderr.strip().splitlines()[-1].startswith("gptspeed bench: verify failed for 2 rung(s): compile, flash")
    assert "Traceback" not in stderr

    result = json.loads((out / "verify.json").read_text())
    rungs = {r["name"]: r for r in result["rungs"]}
    assert list(rungs) == ["baseline", *STAGE_NAMES[1:], *VERIFY_EXTRA_NAMES]  # no Muon rung ran: no baseline-muon
    assert result["ok"] is False and result["failing"] == ["compile", "flash"]
    # the failures, with their reasons; the rungs after them still ran
    assert rungs["compile"]["status"] == "failed" and rungs["compile"]["oom"] is True
    assert rungs["compile"]["reason"].startswith("out of memory at B=2 (T=32, 2 micro-batch(es) per step)")
    assert rungs["flash"]["status"] == "failed" and "RuntimeError: injected crash" in rungs["flash"]["reason"]
    assert (out / "logs" / "flash.log").exists()
    # the reference runs although not selected; the selected survivor is verified against it
    base, last = rungs["baseline"], rungs["fused-ce"]
    assert base["status"] == "ok" and base["problems"] == [] and base["compile"] is None
    assert last["status"] == "ok" and last["problems"] == [] and last["reference"] == "baseline"
    assert len(last["losses"]) == len(base["losses"]) == 3 and last["grad_accum"] == 2
    assert math.isclose(last["losses"][0], base["losses"][0], rel_tol=1e-5)
    assert last["losses"][-1] < last["losses"][0]  # the synthetic phrases are learnable
    assert last["loss_check"]["ok"] and last["loss_check"]["steps_compared"] == 3
    assert last["loss_check"]["rtol"] == 1e-4 or last["settings"]["dtype"] != "float32"
    assert last["compile"]["graph_breaks"] == 0 and last["compile"]["recompiles"] == 0
    assert last["compile"]["frames_compiled"] >= 1
    assert last["sdpa"]["backend"] == "flash"  # the CPU's flash kernel (_scaled_dot_product_flash_attention_for_cpu)
    assert last["syncs"]["counted"] is False and "needs CUDA" in last["syncs"]["note"]
    assert last["syncs"]["budget"] == 0 and base["syncs"]["budget"] == 1  # fused AdamW vs the non-fused step
    # every rung that did not run says why
    assert "NVIDIA" in rungs["tf32"]["reason"]
    assert rungs["vocab-pad"]["reason"] == "not selected (--stages)"
    for name in ("fp16", "reduce-overhead", "max-autotune", "fp8", "batch-auto"):
        assert rungs[name]["status"] == "skipped" and "cpu" in rungs[name]["reason"], name

    md = (out / "verify.md").read_text()
    assert md in stdout
    assert "| fused-ce | " + last["switches"] + " | verified | " in md
    # the switches depend on the host's --dtype auto (fp32 on AVX2 CPUs, bf16 where the CPU has native bf16)
    assert rungs["compile"]["switches"].endswith("+compile")
    assert f"| compile | {rungs['compile']['switches']} | **FAILED** |" in md and "out of memory at B=2" in md
    assert "not counted (GPU only; budget 0)" in md
    assert "2 failing" in md
    env = result["environment"]
    for key in ("device", "torch", "git_commit", "command", "date"):
        assert key in env
    assert env["command"].startswith("gptspeed bench --verify")


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


@pytest.mark.parametrize("off, code", [(1.0, 0), (1.03, 1)])
def test_a_rung_with_a_wrong_loss_is_flagged_and_the_exit_is_nonzero(tmp_path, monkeypatch, capsys, off, code):
    def fake_worker(spec, log_path, timeout=None, **kw):
        if spec.name == "fused-ce":  # 3% off from step 2 on: a wrong result, far outside any tolerance
            return _fake(spec, [REF[0], REF[1], REF[2] * off, REF[3] * off])
        return _fake(spec, [x * (1 + 1e-7) for x in REF] if spec.name != "baseline" else REF)

    monkeypatch.setattr(verify_mod, "run_worker", fake_worker)
    out = tmp_path / "v"
    assert cli.main(["bench", "--verify", "--out", str(out), "--stages", "compile,fused-ce", *TINY]) == code
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


def _on_a_simulated_h100(monkeypatch):
    """``bench --verify --device cpu`` planned and reported as on an H100 (nothing runs on a GPU:
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


def test_on_an_h100_the_default_rungs_run_and_the_verdict_is_verified(tmp_path, monkeypatch, capsys, h100):
    """Issue 30: without --stages, verify runs the seeds' rungs (fp32 .. fused AdamW: train's default
    switches one at a time); the others are skipped as outside the default set, the CUDA-graph modes
    are refused by their rule -- none of it makes the verdict "not verified": exit 0."""
    _on_a_simulated_h100(monkeypatch)
    ran = []
    monkeypatch.setattr(verify_mod, "run_worker", _fake_h100_worker(ran))
    out = tmp_path / "v"
    assert cli.main(["bench", "--verify", "--out", str(out), *TINY]) == 0
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
        cli.main(["bench", "--verify", "--out", str(out), "--stages", "all", *TINY, "--compile-backend", "inductor"])
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


def test_a_batch_auto_rung_trains_the_same_sequences_per_step_as_its_reference(monkeypatch):
    """--batch-size auto in verify keeps the global batch (B x grad_accum sequences) and regroups
    the same sequences into its micro-batch, so its losses match the fixed-batch rung's; a micro-batch
    larger or smaller than the reference's alike."""
    from gptspeed.bench import verify_worker, worker
    from gptspeed.bench.worker import StageSpec

    base = dict(
        n_layer=1,
        n_head=2,
        n_embd=32,
        seq_len=16,
        batch_size=2,
        steps=2,
        warmup=1,
        device="cpu",
        grad_accum=2,
        mode="verify",
        synthetic="phrases",
    )
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


def test_loss_tolerance_is_that_of_the_least_precise_format(monkeypatch):
    from gptspeed import optim
    from gptspeed.bench.stages import loss_rtol

    assert loss_rtol(baseline_with(compile=True, attention="sdpa", loss="fused")) == 1e-4  # fp32: summation order only
    assert loss_rtol(baseline_with(dtype="tf32")) == 2e-3
    assert loss_rtol(baseline_with(dtype="bfloat16")) == loss_rtol(baseline_with(dtype="float16")) == 1e-2
    assert loss_rtol(baseline_with(dtype="bfloat16", fp8=True)) == 2e-2
    assert loss_rtol(baseline_with(optimizer="muon")) == 1e-2  # Newton-Schulz in bf16, even in an fp32 rung
    assert loss_rtol(baseline_with(optimizer="muon"), updates=False) == 1e-4  # step 0: before any update
    # the optimizer's own tolerance is its registry entry's: a new optimizer declares it there
    monkeypatch.setitem(optim.OPTIMIZERS, "muon", dataclasses.replace(optim.OPTIMIZERS["muon"], verify_rtol=5e-2))
    assert loss_rtol(baseline_with(optimizer="muon")) == 5e-2 and loss_rtol(baseline_with(dtype="bfloat16")) == 1e-2


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


@pytest.fixture
def h100(monkeypatch):
    """An H100 as the plan sees it (no GPU is used: only the capability queries are answered)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    fake_packages(monkeypatch, triton=True, torchao=True)


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


def test_plan_on_a_gpu_compares_like_with_like(h100):
    plan = {r.name: r for r in plan_verify(torch.device("cuda"), None, "inductor", grad_accum=1)}
    assert list(plan)[:2] == ["baseline", "baseline-muon"]
    assert all(r.skip_reason is None for r in plan.values()), {
        n: r.skip_reason for n, r in plan.items() if r.skip_reason
    }
    assert plan["baseline-muon"].settings == baseline_with(optimizer="muon")
    for name in (
        "tf32",
        "bf16",
        "compile",
        "fused-ce",
        "fp8",
        "fp16",
        "fp16-fused-ce",
        "reduce-overhead",
        "sdpa-cudnn",
    ):
        assert plan[name].reference == "baseline", name
    for name in ("muon", "compile-blocks", "max-autotune"):
        assert plan[name].reference == "baseline-muon", name
    # only the batch-auto rung picks its own micro-batch -- over the same sequences per step, so it is
    # compared like the others; later rungs keep B fixed
    auto = [n for n, r in plan.items() if r.settings.get("batch_size") == AUTO_BATCH_SIZE]  # --batch-size auto
    assert auto == ["batch-auto"] and plan["batch-auto"].reference == "baseline"
    assert plan["batch-auto"].not_compared is None
    fused_ce = plan["fused-ce"].settings
    assert plan["fp16-fused-ce"].settings == {**fused_ce, "dtype": "float16"}
    assert plan["fp16"].settings == baseline_with(dtype="float16")
    assert plan["reduce-overhead"].settings == {**fused_ce, "compile": True, "compile_tuning": "reduce-overhead"}
    # cuDNN attention against CUDA's default configuration (the seeds' last rung), one switch apart
    assert plan["sdpa-cudnn"].settings == {**plan["fused-adamw"].settings, "sdpa_backend": "cudnn"}
    assert plan["sdpa-cudnn"].reference == "baseline"


def test_plan_on_a_cpu_skips_with_reasons():
    plan = {r.name: r for r in plan_verify(torch.device("cpu"), ["fused-ce"], "eager")}
    assert plan["baseline"].skip_reason is None and "reference" in plan["baseline"].not_compared
    assert plan["fused-ce"].skip_reason is None
    for name in ("tf32", "batch-auto", "fp8", "max-autotune", *VERIFY_EXTRA_NAMES):
        assert plan[name].settings is None and "cpu" in plan[name].skip_reason, name
        assert not plan[name].applies_here, name  # skipped here, not "not verified"
    for name in ("reduce-overhead", "max-autotune"):  # refused with accumulation whatever the device
        assert plan[name].skip_reason.startswith("refused: --compile-tuning "), name


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


# ------------------------------------------------------------------------------------ the worker's watchers
def test_sync_counter_counts_warnings_raised_in_python_and_printed_by_cpp():
    modes = []
    with pytest.warns(UserWarning, match="something else"), SyncCounter(set_mode=modes.append) as counter:
        for _ in range(3):
            warnings.warn(SYNC_MESSAGE)
        warnings.warn("something else")
        sys.stderr.flush()
        os.write(2, f"[W Context.cpp] Warning: {SYNC_MESSAGE} (function warn_or_error_on_sync)\n".encode())
        os.write(2, b"an unrelated line\n")
    assert modes == ["warn", "default"]
    assert counter.count == 4
    assert list(counter.sites.values()) == [3] and next(iter(counter.sites)).startswith(__file__)
    assert counter.other_stderr == "an unrelated line"  # kept, and other warnings given back (pytest.warns)


def test_compile_watch_counts_graph_breaks_and_recompiles():
    def f(x):
        y = x.sin()
        if y.sum() > 0:  # data-dependent branch: a graph break
            return y.cos()
        return y

    watch = CompileWatch()
    compiled = torch.compile(f, backend="eager", dynamic=False)
    compiled(torch.ones(4))
    watch.step_done()
    compiled(torch.ones(5))  # another shape: a recompile
    watch.step_done()
    r = watch.result()
    assert r["graph_breaks"] >= 1 and r["graph_break_reasons"]
    assert r["recompiles"] >= 1 and any("size mismatch" in s for s in r["recompile_reasons"])
    assert r["frames_compiled_per_step"][0] >= 1 and r["frames_compiled_per_step"][1] >= 1


@pytest.mark.parametrize(
    "names, backend",
    [
        (["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<...>"], "flash"),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], "flash"),
        (["aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"], "cudnn"),
        (
            ["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"],
            "mem-efficient",
        ),
        (["aten::_scaled_dot_product_attention_math", "aten::softmax"], "math"),
        (["aten::mm", "aten::softmax"], None),
    ],
)
def test_sdpa_backend_from_profiler_names(names, backend):
    assert sdpa_backend(names)["backend"] == backend


def test_bench_step_reports_a_step_it_did_not_apply():
    from gptspeed.bench.worker import StageSpec, bench_step, build_row
    from gptspeed.runtime import resolve_runtime

    spec = StageSpec(
        name="t",
        settings=dict(BASELINE),
        n_layer=1,
        n_head=2,
        n_embd=16,
        seq_len=8,
        batch_size=1,
        steps=1,
        warmup=1,
        device="cpu",
        grad_accum=2,
    )
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


def test_a_combination_gptspeed_refuses_is_a_skipped_rung_with_the_refusal(tmp_path):
    from gptspeed.bench import entry
    from gptspeed.bench.worker import StageSpec

    spec = StageSpec(
        name="fp16",
        settings=baseline_with(dtype="float16"),
        n_layer=1,
        n_head=2,
        n_embd=16,
        seq_len=8,
        batch_size=1,
        steps=1,
        warmup=1,
        device="cpu",
        mode="verify",
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    assert entry.main([str(tmp_path / "spec.json"), str(tmp_path / "result.json")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {
        "status": "skipped",
        "reason": "refused: --dtype float16 is not supported on a CPU: use bfloat16 or float32",
    }


def test_an_fp8_rung_that_would_convert_no_layer_is_refused_not_passed(tmp_path):
    """At a width where torchao's rule converts no Linear, the FP8 rung used to train in bf16 and pass
    as "verified"; it is refused by the configuration's own rule: "refused", not "verified"."""
    from gptspeed.bench import entry
    from gptspeed.bench.worker import StageSpec

    spec = StageSpec(
        name="fp8",
        settings=baseline_with(fp8=True),
        n_layer=1,
        n_head=2,
        n_embd=16,
        seq_len=8,
        batch_size=2,
        steps=1,
        warmup=1,
        device="cpu",
        mode="verify",
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    assert entry.main([str(tmp_path / "spec.json"), str(tmp_path / "result.json")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
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
    code = cli.main(["bench", "--verify", "--out", str(tmp_path / "o"), *TINY, *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and err.startswith("gptspeed bench: error:")


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
def test_verify_on_cuda_at_a_small_shape_passes(tmp_path, monkeypatch, capsys):
    """``bench --verify`` on CUDA exits 0 (it could not: refused rungs made it "not verified", exit 3).
    The default rung set at 2 layers x 128: ~7 processes and 3 small cold compiles, ~3 minutes by the
    estimate (gpu_session.py's cudatests phase runs it as its own part, last)."""
    out = tmp_path / "verify"
    argv = [
        "bench",
        "--verify",
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


@pytest.mark.cuda
def test_a_fused_sdpa_kernel_is_chosen_for_bf16_at_t1024():
    """With the SDPA backend left to PyTorch, bf16 attention at T=1024 runs a fused kernel, never the
    math fallback or the memory-efficient one. Which fused kernel is PyTorch's priority order: on an
    H100 with torch 2.11.0+cu130 (2026-11-27) it was cuDNN's, not flash (this test expected flash
    until then, and failed there)."""
    from gptspeed.bench.checks import profiled_names
    from gptspeed.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, n_layer=1, n_head=12, n_embd=768, attention="sdpa", loss="plain")).cuda()
    x = torch.randint(0, 50257, (2, 1024), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()

    step()  # warm-up outside the profile
    found = sdpa_backend(profiled_names(step, "cuda"))
    assert found["backend"] in ("flash", "cudnn"), found


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.cuda)])
def test_one_process_ddp_step(tmp_path, backend, device):
    # torchrun-free: a process group of one. On CUDA this is the one-GPU NCCL DDP step; the gloo
    # twin runs the same code on the CPU in CI.
    import dataclasses

    import torch.distributed as dist

    from gptspeed.bench.worker import StageSpec, bench_step, build_row
    from gptspeed.runtime import resolve_runtime

    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        dtype = "bfloat16" if device == "cuda" else "float32"
        rt = dataclasses.replace(resolve_runtime(device, dtype, False), parallel="ddp")
        spec = StageSpec(
            name="ddp",
            settings=baseline_with(dtype=dtype, attention="sdpa"),
            n_layer=1,
            n_head=2,
            n_embd=16,
            seq_len=16,
            batch_size=2,
            steps=1,
            warmup=1,
            device=device,
            grad_accum=2,
        )
        step, _ = build_row(spec, rt)
        assert isinstance(step.train_model, torch.nn.parallel.DistributedDataParallel)
        assert step.sync is not None and step.accum == 2  # no_sync() on the first micro-batch
        before = step.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
        x = torch.randint(0, 50257, (2, 16), device=device)
        losses = [bench_step(step, lambda: (x, x)) for _ in range(2)]
        assert all(math.isfinite(loss.item()) and not skipped.item() for loss, skipped in losses)
        assert not torch.equal(step.model.transformer.h[0].mlp.c_fc.weight, before)
    finally:
        dist.destroy_process_group()
