"""The one training step (gptspeed.step.TrainStep) that train, the ladder, verify and the auto-batch
probe build alike: every rule is checked where it is built, before anything touches the device, so
a GPU user's refusal is one line on any machine. Checked here on the CPU with a CUDA runtime that is
never used (the rules run first)."""

from __future__ import annotations

import dataclasses
import sysconfig

import pytest
import torch
from conftest import fake_packages, run_main

from gptspeed import step as step_mod
from gptspeed.compat import check_torch
from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.runtime import Runtime
from gptspeed.step import TrainStep

CUDA = Runtime(device=torch.device("cuda", 0), dtype="bfloat16", autocast_dtype=torch.bfloat16, compile=True)


def pico(**overrides):
    cfg = preset("pico").override(overrides)
    cfg.validate()
    return cfg


@pytest.fixture
def never_builds(monkeypatch):
    """Fails the test if the step gets as far as building a model (the rules come first)."""

    def build(cfg):
        raise AssertionError("the model was built before the step's rules were checked")

    monkeypatch.setattr(step_mod, "build_model", build)


def test_cuda_graphs_with_accumulation_are_refused_where_the_step_is_built(never_builds):
    cfg = pico(compile_tuning="reduce-overhead", batch_size=4, total_batch_tokens=8 * 64)
    with pytest.raises(
        GptspeedError, match="reduce-overhead uses CUDA graphs.*2 micro-steps.*max-autotune-no-cudagraphs"
    ) as e:
        TrainStep(cfg, CUDA)
    # the advice that works: one micro-step per step by lowering the global batch to B x T x processes
    # (raising B until it covers GPT-2's 0.5M tokens, as it used to say, cannot fit in memory)
    assert "lower --total-batch-tokens to 256 (B x T x processes)" in str(e.value)
    assert "raise --batch-size" not in str(e.value)


def test_fp8_without_torchao_names_the_package(monkeypatch, never_builds):
    fake_packages(monkeypatch, torchao=False)
    cfg = preset("gpt2").override(dict(fp8=True, batch_size=4))
    with pytest.raises(GptspeedError, match=r"--fp8 needs torchao.*gptspeed\[fp8\]"):
        TrainStep(cfg, dataclasses.replace(CUDA, compile=False))


def test_muon_with_a_grad_scaler_is_refused_for_the_resolved_dtype(never_builds):
    fp16 = dataclasses.replace(CUDA, dtype="float16", autocast_dtype=torch.float16, compile=False)
    with pytest.raises(GptspeedError, match="muon does not support float16"):  # --dtype auto on a V100 resolves so
        TrainStep(pico(optimizer="muon"), fp16)


@pytest.mark.parametrize(
    "missing, says", [("cc", "C compiler"), ("Python.h", "Python's headers"), ("triton", "needs triton")]
)
def test_compile_on_a_gpu_needs_triton_a_c_compiler_and_pythons_headers(
    monkeypatch, tmp_path, never_builds, missing, says
):
    fake_packages(monkeypatch, triton=missing != "triton")
    if missing == "cc":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(step_mod.shutil, "which", lambda name: None)
    if missing == "Python.h":
        monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    with pytest.raises(GptspeedError, match=f"{says}.*--no-compile") as e:
        TrainStep(pico(), CUDA)
    assert "\n" not in str(e.value)
    assert step_mod.compile_toolchain_problem("cpu") is None  # a CPU's inductor checks its own C++ compiler


def test_the_toolchain_check_passes_on_a_machine_that_has_it(monkeypatch):
    fake_packages(monkeypatch, triton=True)
    assert step_mod.compile_toolchain_problem("cuda") is None  # this machine has gcc and Python.h (CI's image too)


def test_auto_batch_resets_the_peak_memory_after_probing(monkeypatch):
    from gptspeed import batchsize

    events = []
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda *a, **k: events.append("probe") or 8)
    monkeypatch.setattr(step_mod, "reset_peak_memory", lambda device: events.append(("reset", device.type)))
    cfg = pico(batch_size=0, total_batch_tokens=64 * 64)
    assert step_mod.auto_batch_size(cfg, dataclasses.replace(CUDA, compile=False), say=lambda m: None) == 8
    assert events == ["probe", ("reset", "cuda")]


def test_the_steps_micro_batches_come_from_the_configuration():
    from gptspeed.runtime import resolve_runtime

    step = TrainStep(
        pico(n_layer=1, n_embd=16, n_head=2, batch_size=2, total_batch_tokens=3 * 2 * 64),
        resolve_runtime("cpu", "float32", False),
    )
    seen = []

    def next_batch():
        seen.append(1)
        x = torch.randint(0, 50257, (2, 64))
        return x, x

    loss, grad_norm, bad = step(next_batch)
    assert step.accum == 3 and len(seen) == 3 and not bad.item() and torch.isfinite(grad_norm)


@pytest.mark.parametrize(
    "version, ok", [("2.13.0+cpu", True), ("2.9.1", True), ("2.8.0", False), ("2.4.1+cu121", False), ("3.0.0", True)]
)
def test_torch_older_than_the_minimum_is_one_line(version, ok):
    if ok:
        check_torch(version)
    else:
        with pytest.raises(GptspeedError, match=r"needs torch >= 2\.9.*this is torch " + version.replace("+", r"\+")):
            check_torch(version)


def test_an_old_torch_stops_the_cli_with_one_line(monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.5.0" if name == "torch" else real(name))
    proc = run_main("sample", "--run", "nowhere", "--prompt", "x")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "needs torch >= 2.9" in proc.stderr
