"""``gptspeed.bench.stages``: the optimization ladder: one rung per technique, each a change to the run configuration."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import pytest
import torch

from gptspeed import cli
from gptspeed.bench import ladder as ladder_mod
from gptspeed.bench.ladder import PEER_NAME
from gptspeed.bench.stages import (
    BASELINE,
    STAGE_NAMES,
    STAGES,
    VERIFY_EXTRA_NAMES,
    baseline_with,
    plan_ladder,
    record,
    switches,
)
from gptspeed.bench.verify import plan_verify
from gptspeed.config import AUTO_BATCH_SIZE
from gptspeed.errors import GptspeedError

from support.ladder_rows import in_process_worker
from support.packages import fake_packages
from support.shapes import LADDER_FLAGS

pytestmark = pytest.mark.usefixtures("one_thread")

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


def test_ladder_tiny_cpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(ladder_mod, "run_worker", in_process_worker)
    out = tmp_path / "ladder"
    argv = ["bench", "ladder", "--out", str(out), "--stages", "baseline,fused-ce,muon", *LADDER_FLAGS]
    monkeypatch.setattr(sys, "argv", ["gptspeed", *argv])
    assert cli.main(argv) == 0, capsys.readouterr().err
    stdout, stderr = capsys.readouterr()
    assert "Traceback" not in stderr

    result = json.loads((out / "ladder.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert [r["name"] for r in result["rows"] if r["kind"] == "stage"] == list(STAGE_NAMES)
    for r in result["rows"]:  # every stage is there: run, or skipped with its reason
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "skipped":
            assert r["reason"]
    assert rows["tf32"]["status"] == "skipped" and "NVIDIA" in rows["tf32"]["reason"]
    assert rows["flash"]["reason"] == "not selected (--stages)"
    assert [n for n, r in rows.items() if r["status"] == "ok" and r["kind"] == "stage"] == [
        "baseline",
        "fused-ce",
        "muon",
    ]
    # cumulative: the last row has every applicable technique on (bf16 only where this CPU has it natively)
    bf16 = next(p for p in plan_ladder(torch.device("cpu"), None, "eager") if p.stage.name == "bf16").settings
    dtype = "bfloat16" if bf16 is not None else "float32"
    assert rows["fused-ce"]["settings"] == {
        "dtype": dtype,
        "compile": True,
        "attention": "sdpa",
        "vocab_size": 50304,
        "fused_adamw": True,
        "loss": "fused",
        "batch_auto": False,
        "fp8": False,
        "optimizer": "adamw",
        "compile_mode": "model",
        "compile_tuning": "default",
        "sdpa_backend": "auto",
        "fp8_lm_head": False,
        "residual_dtype": "float32",
    }
    assert rows["compile"]["settings"] == {
        **rows["fused-ce"]["settings"],
        "attention": "manual",
        "vocab_size": 50257,
        "fused_adamw": False,
        "loss": "plain",
    }  # planned though not run
    assert rows["fused-ce"]["compile"] is True and rows["baseline"]["compile"] is False
    assert rows["fused-ce"]["fused_adamw"] is True and rows["fused-ce"]["dtype"] == dtype
    # rows say what was on, and no single technique is credited with the jump from baseline
    assert (
        rows["fused-ce"]["switches"] == ("bf16+" if bf16 else "fp32+") + "compile+sdpa+vocab50304+fused-adamw+fused-ce"
    )
    assert rows["fused-ce"]["speedup_prev"] is None
    assert rows["fused-ce"]["speedup_prev_na"].startswith("n/a (differs from the previous row by: ")
    assert "compile, attention, vocab-size, fused-adamw, loss" in rows["fused-ce"]["speedup_prev_na"]

    ran = [r for r in result["rows"] if r["status"] == "ok"]
    for r in ran:
        for key in ("ms_median", "ms_min", "ms_max", "tokens_per_s", "warmup_s", "loss_step0", "loss_last"):
            assert math.isfinite(r[key]), (r["name"], key)
        assert r["ms_min"] <= r["ms_median"] <= r["ms_max"]
        assert r["loss_check"]["ok"], r["loss_check"]
        assert abs(r["loss_step0"] - math.log(50257)) < 0.5  # ~uniform prediction at initialisation
    assert rows["baseline"]["speedup_baseline"] == 1.0 and rows["baseline"]["speedup_prev"] is None
    assert result["ok"] and result["problems"] == []
    env = result["environment"]
    for key in ("device", "torch", "cpu", "command", "git_commit", "date"):
        assert key in env
    assert env["command"].startswith("gptspeed bench ladder")

    peer = rows[PEER_NAME]  # transformers is in the test extras
    assert peer["kind"] == "peer" and peer["status"] == "ok", peer  # after Muon's row (its groups need our names)
    assert peer["settings"]["dtype"] == rows["muon"]["settings"]["dtype"] and peer["compile"] == rows["muon"]["compile"]
    assert peer["settings"]["optimizer"] == "adamw" and peer["settings"]["fused_adamw"] is True
    assert peer["loss_check"]["ok"]
    assert peer["speedup_prev"] is None and "implementation (peer)" in peer["speedup_prev_na"]

    md = (out / "ladder.md").read_text()
    assert md in stdout
    assert "| stage | switches | ms/step | IQR |" in md
    assert "| fused-ce | " + rows["fused-ce"]["switches"] + " |" in md
    for name in STAGE_NAMES:
        assert f"| {name} |" in md
    assert "skipped: TF32" in md

    png = out / "ladder.png"
    assert result["plot"] == str(png)
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert (out / "logs" / "baseline.log").exists()


# ------------------------------------------------------------------------------------ pieces
def test_every_stage_defined_once_and_cumulative():
    import torch

    assert len(set(STAGE_NAMES)) == len(STAGES) and STAGE_NAMES[0] == "baseline"
    plan = plan_ladder(torch.device("cpu"), ["baseline", "fused-ce"])
    assert plan[0].settings == BASELINE
    assert plan[1].settings is None  # tf32 on a CPU
    assert [p.skip_reason for p in plan if p.stage.name in ("baseline", "fused-ce")] == [None, None]
    assert all(p.skip_reason for p in plan if p.stage.name not in ("baseline", "fused-ce"))
    last = [p.settings for p in plan if p.settings is not None][-1]  # later rungs skip on a CPU
    assert (last["attention"], last["vocab_size"], last["loss"]) == ("sdpa", 50304, "fused")


def test_switches_name_every_setting_that_is_on():
    assert switches(record(BASELINE)) == "fp32"
    everything = baseline_with(
        dtype="bfloat16",
        compile=True,
        attention="sdpa",
        vocab_size=50304,
        fused_adamw=True,
        loss="fused",
        batch_size="auto",
        fp8=True,
        optimizer="muon",
        compile_mode="blocks",
        compile_tuning="max-autotune",
        sdpa_backend="cudnn",
    )
    # in the order the ladder's rungs turn them on; each by its rung's name for it
    assert switches(record(everything)) == (
        "bf16+compile+sdpa+vocab50304+fused-adamw+fused-ce+batch-auto+fp8+muon+compile-blocks+max-autotune+sdpa-cudnn"
    )
    # a setting no rung changes is named by its flag
    assert (
        switches(record(baseline_with(loss="liger", compile_tuning="reduce-overhead")))
        == "fp32+loss-liger+reduce-overhead"
    )


def test_a_rung_is_a_change_of_settings_checked_as_a_config_files_are():
    """Every rung is a name and settings of the run configuration: a wrong name or value is one line
    where the rung is declared, and every row records the same settings, ``--batch-size auto`` as
    ``batch_auto``."""
    from gptspeed.bench.stages import Stage

    with pytest.raises(GptspeedError, match="bench stage 'warp': unknown setting 'warp_drive'"):
        Stage("warp", "", {"warp_drive": True})
    with pytest.raises(GptspeedError, match="loss must be one of"):
        Stage("warp", "", {"loss": "warp"})
    assert next(st for st in STAGES if st.name == "batch-auto").delta == {"batch_size": 0}  # --batch-size auto
    assert record(baseline_with(batch_size="auto"))["batch_auto"] is True and record(BASELINE)["batch_auto"] is False
    assert list(record(BASELINE)) == [
        "dtype",
        "compile",
        "attention",
        "vocab_size",
        "fused_adamw",
        "loss",
        "batch_auto",
        "fp8",
        "optimizer",
        "compile_mode",
        "compile_tuning",
        "sdpa_backend",
        "fp8_lm_head",
        "residual_dtype",
    ]


def test_rows_that_need_torchao_are_refused_before_they_start_naming_the_package(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    fake_packages(monkeypatch, torchao=False, triton=True)
    rows = {p.stage.name: p for p in plan_ladder(torch.device("cuda"), None, "inductor")}
    assert rows["fp8"].settings is None and "pip install 'gptspeed[fp8]'" in rows["fp8"].skip_reason
    assert not any(
        p.settings.get("fp8") for p in rows.values() if p.settings is not None
    )  # the rows after it run without


# ------------------------------------------------------------------------------------------ ladder
def test_issue7_stages_follow_fused_ce_and_skip_with_reasons_on_cpu():
    from gptspeed.bench.stages import STAGE_NAMES, plan_ladder, record

    new = ["batch-auto", "fp8", "muon", "compile-blocks", "max-autotune"]
    assert list(STAGE_NAMES[STAGE_NAMES.index("fused-ce") + 1 :]) == new
    rows = {r.stage.name: r for r in plan_ladder(torch.device("cpu"), None, "eager")}
    for name in ("batch-auto", "fp8", "max-autotune"):
        assert rows[name].settings is None and "cpu" in rows[name].skip_reason, name
    assert rows["muon"].skip_reason is None and rows["muon"].settings["optimizer"] == "muon"
    last = record(rows["compile-blocks"].settings)
    assert (last["compile_mode"], last["optimizer"], last["loss"], last["fp8"], last["batch_auto"]) == (
        "blocks",
        "muon",
        "fused",
        False,
        False,
    )


# ------------------------------------------------------------------------------------ end to end
def test_verify_end_to_end_records_failures_and_goes_on(tmp_path, monkeypatch, capsys):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(faults), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("GPTSPEED_TEST_FAULTS", json.dumps({"compile": "oom", "flash": "crash"}))
    out = tmp_path / "verify"
    argv = ["bench", "verify", "--out", str(out), "--stages", "compile,flash,fused-ce", *LADDER_FLAGS]
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
    assert env["command"].startswith("gptspeed bench verify")


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
