"""``gptspeed.runtime``: where and in what precision a run computes: :func:`resolve_runtime` turns the user's ``--device/--dtype/--compile/--parallel`` into a :class:`Runtime` (the device, the autocast dtype, rank and world size from torchrun's environment, and why each default was chosen)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gptspeed import step as step_mod
from gptspeed.bench.checks import profiled_names, sdpa_backend
from gptspeed.config import preset
from gptspeed.configure import build_train_config
from gptspeed.cpu import cpu_has_native_bf16
from gptspeed.errors import GptspeedError
from gptspeed.runtime import resolve_runtime, sdpa_backend_problem
from gptspeed.step import TrainStep

from support.cli import child_env, run_main
from support.training import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")


FAULTS_SCRIPT = """
import resource, sys, torch
from gptspeed.cpu import keep_freed_memory

def faults_of_steps(n=5):
    # a CPU training step's pattern at GPT-2 124M: two 154 MB fp32 buffers (50304 x 768, the tied
    # embedding's gradients) allocated, written and freed every step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = torch.empty(50304, 768).fill_(1.0)
        b = torch.empty(50304, 768).fill_(2.0)
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_steps(1)
plain = faults_of_steps()
applied, reason = keep_freed_memory()
for _ in range(4):  # the heap grows to the steps' peak once (measured: within 10 steps here)
    faults_of_steps()
kept = faults_of_steps()
print(plain, kept, applied, reason, sep="|")
"""


CPU = resolve_runtime("cpu", "float32", False)


SWITCHES = ("flash_sdp_enabled", "cudnn_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")


def switches() -> dict[str, bool]:
    return {name: getattr(torch.backends.cuda, name)() for name in SWITCHES}


@pytest.fixture(autouse=True)
def the_sdpa_choice_never_outlives_its_step():
    """--sdpa-backend used to switch kernels off process-wide and never back on, so a later test (or a
    library caller's next model) kept the restriction. Every test here must leave PyTorch's switches as
    it found them."""
    before = switches()
    yield
    assert switches() == before


def tiny(**overrides):
    cfg = preset("pico").override({**TINY_MODEL, "batch_size": 2, "lr": 1e-3, **overrides})
    cfg.validate()
    return cfg


def train_steps(step: TrainStep, n: int = 3) -> list[float]:
    """``n`` steps on one batch (so the loss must fall)."""
    x = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(0))
    return [step(lambda: (x[:, :-1], x[:, 1:]))[0].item() for _ in range(n)]


def kernel_ran(step: TrainStep) -> str | None:
    x = torch.randint(0, 50257, (2, 33))
    return sdpa_backend(profiled_names(lambda: step(lambda: (x[:, :-1], x[:, 1:])), "cpu"))["backend"]


def test_the_batch_size_probe_takes_the_size_check_as_does_not_fit(monkeypatch):
    """--batch-size auto probes micro-batches until one runs out of memory: the size check's verdict on
    a micro-batch is the probe's "does not fit" (torch.cuda.OutOfMemoryError), not the end of the run;
    a model that cannot train even at micro-batch 1 is said in one line before any probe. (The probe
    needs CUDA; its fits() is replaced here to run the adapter on the CPU.)"""
    import torch

    import gptspeed.batchsize as batchsize
    import gptspeed.step as step
    from gptspeed.runtime import resolve_runtime

    rt = resolve_runtime("cpu", "float32", False)
    cfg = build_train_config("pico", {"batch_size": 8})
    monkeypatch.setattr(step, "host_memory_available", lambda: 64 << 20)  # the pico model's state fits in 64 MiB
    seen = {}

    def probe(device, settings, sequences, make_step, **kw):
        make_step(1)()  # micro-batch 1 fits and steps
        with pytest.raises(torch.cuda.OutOfMemoryError, match="for activations at --batch-size 65536"):
            make_step(65536)  # 2 x 65536 x 64 x 64 x 2 bytes of activations: 1 GiB
        seen["probed"] = True
        return 1

    monkeypatch.setattr(batchsize, "resolve_auto_batch", probe)
    assert step.auto_batch_size(cfg, rt) == 1 and seen["probed"]
    cfg.model.n_layer = 100  # its fp32 weights fit in the 64 MiB, not with gradients and AdamW state
    with pytest.raises(step.ModelTooLarge, match="needs at least"):
        step.auto_batch_size(cfg, rt)


def test_resolve_runtime_cpu_auto_dtype_matches_this_machine():
    rt = resolve_runtime("cpu", "auto", compile=False)
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert rt.dtype == expected
    assert rt.autocast_dtype == (torch.bfloat16 if expected == "bfloat16" else None)
    assert rt.dtype_reason
    # an explicit dtype is kept, whatever the CPU
    assert resolve_runtime("cpu", "float32", compile=False).dtype == "float32"
    assert resolve_runtime("cpu", "bfloat16", compile=False).dtype == "bfloat16"


def test_explicit_compile_is_kept_on_cpu():
    assert resolve_runtime("cpu", "float32", compile=True).compile is True
    assert resolve_runtime("cpu", "float32", compile=False).compile is False


def test_compile_uses_a_persistent_cache_folder(tmp_path, monkeypatch):
    from gptspeed.model import GPT, GPTConfig
    from gptspeed.parallelize import parallelize

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
    parallelize(model, resolve_runtime("cpu", "float32", compile=False))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ""  # no compile: nothing set
    parallelize(model, resolve_runtime("cpu", "float32", compile=True), backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    # a folder the user chose is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    parallelize(model, resolve_runtime("cpu", "float32", compile=True), backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_resolve_runtime_auto_compile_on_this_cpu():
    long_run = resolve_runtime("cpu", "auto", compile=None, planned_steps=10**6)
    assert long_run.compile == (long_run.dtype == "bfloat16" and cpu_has_native_bf16())
    assert long_run.compile_reason.startswith("on" if long_run.compile else "off")
    assert resolve_runtime("cpu", "auto", compile=None, planned_steps=1).compile is False
    assert resolve_runtime("cpu", "auto", compile=None).compile is False  # length unknown


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_stops_page_faulting_a_steps_large_buffers_in_again():
    res = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert res.returncode == 0, res.stderr
    plain, kept, applied, reason = res.stdout.strip().split("|")
    assert applied == "True", reason
    pages = 50304 * 768 * 4 // 4096  # of one buffer
    # glibc mmaps a buffer this large and unmaps it on free: every page of both faults in again every step
    assert int(plain) >= 5 * 2 * pages, plain
    # kept: once the heap has grown to the steps' peak, the freed memory is reused, already mapped
    assert int(kept) < 1000, kept


def test_threads_setting_sets_torchs_intra_op_threads_on_a_cpu_and_zero_leaves_them():
    from support.training import TINY_MODEL, make_step

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        make_step(TINY_MODEL, threads=0)
        assert torch.get_num_threads() == 2  # 0: PyTorch's own choice, untouched
        make_step(TINY_MODEL, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend, expected", [("auto", "flash"), ("flash", "flash"), ("math", "math")])
def test_the_named_kernel_is_the_one_that_runs(backend, expected):
    torch.manual_seed(0)
    assert kernel_ran(TrainStep(tiny(sdpa_backend=backend), CPU)) == expected


def test_the_choice_holds_inside_a_compiled_model():
    """torch.compile picks the attention kernel when it traces (AOTAutograd's graph holds the op):
    the switch is set before the model is compiled, so the traced graph runs the named kernel."""
    torch.manual_seed(0)
    compiled = resolve_runtime("cpu", "float32", True)
    names = {}
    for backend in ("flash", "math"):
        torch._dynamo.reset()
        step = TrainStep(tiny(sdpa_backend=backend), compiled, backend="aot_eager")
        x = torch.randint(0, 50257, (2, 33))
        names[backend] = profiled_names(lambda: step(lambda: (x[:, :-1], x[:, 1:])), "cpu")
    flash_ops = [n for n in names["flash"] if "flash_attention" in n]
    assert flash_ops, names["flash"]
    assert not [n for n in names["math"] if "flash_attention" in n]


def test_every_kernel_trains_to_the_same_losses():
    runs = {}
    for backend in ("auto", "flash", "math"):
        torch.manual_seed(0)
        runs[backend] = train_steps(TrainStep(tiny(sdpa_backend=backend, warmup_steps=0), CPU))
    assert runs["auto"] == runs["flash"]  # auto picks flash on a CPU: the very same computation
    assert runs["math"] == pytest.approx(runs["flash"], rel=1e-5)
    assert runs["flash"][-1] < runs["flash"][0]  # and it learns


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_a_kernel_this_device_lacks_stops_the_step_before_the_model_is_built(backend, monkeypatch):
    monkeypatch.setattr(step_mod, "build_model", lambda cfg: pytest.fail("built a model"))
    with pytest.raises(
        GptspeedError,
        match=rf"--sdpa-backend {backend} cannot run this attention \(2 heads x 16 "
        r"channels, T=32, float32, cpu\): .*use --sdpa-backend auto",
    ):
        TrainStep(tiny(sdpa_backend=backend), CPU)
    assert all(switches().values())  # a refused choice changes nothing


def test_the_probe_uses_the_runs_shape_and_dtype():
    assert sdpa_backend_problem("auto", torch.device("cpu"), torch.float32, 2, 16, 32) is None
    assert sdpa_backend_problem("math", torch.device("cpu"), torch.bfloat16, 12, 64, 128) is None
    said = sdpa_backend_problem("cudnn", torch.device("cpu"), torch.bfloat16, 12, 64, 1024)
    assert (
        said.startswith(
            "--sdpa-backend cudnn cannot run this attention (12 heads x 64 channels, T=1024, bfloat16, cpu)"
        )
        and "\n" not in said
    )


def test_manual_attention_with_a_kernel_choice_is_refused():
    cfg = preset("pico").override({"attention": "manual", "sdpa_backend": "flash"})
    with pytest.raises(GptspeedError, match="--sdpa-backend flash chooses the kernel of --attention sdpa"):
        cfg.validate()


def test_the_cli_refuses_a_missing_kernel_in_one_line(tmp_path):
    proc = run_main(
        "train",
        "--preset",
        "pico",
        "--device",
        "cpu",
        "--sdpa-backend",
        "cudnn",
        "--max-steps",
        "1",
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--sdpa-backend cudnn cannot run this attention" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_library_run_leaves_every_kernel_allowed(shakespeare_data, tmp_path):
    """gptspeed.train with --sdpa-backend math: the run's steps use math, and afterwards the caller's
    own attention picks PyTorch's default again (flash on a CPU)."""
    import gptspeed

    cfg = gptspeed.make_config(
        "pico",
        **TINY_MODEL,
        batch_size=2,
        max_steps=2,
        eval_every=1,
        eval_tokens=128,
        sdpa_backend="math",
        device="cpu",
        dtype="float32",
        data=str(shakespeare_data),
        out=str(tmp_path / "run"),
    )
    gptspeed.train(cfg, echo=False)
    assert all(switches().values())
    q = torch.randn(1, 2, 32, 16)
    names = profiled_names(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), "cpu")
    assert sdpa_backend(names)["backend"] == "flash"


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_on_a_gpu_each_kernel_runs_itself_and_trains_like_flash(backend):
    """bf16, GPT-2 124M's attention shape (12 heads x 64, T=1024), one block, eager: the profiled step
    runs the named kernel, and its losses over 3 steps on one batch stay within bf16's 1e-2 of flash's."""
    rt = resolve_runtime("cuda", "bfloat16", False)
    shape = dict(
        n_layer=1,
        n_head=12,
        n_embd=768,
        block_size=1024,
        batch_size=2,
        total_batch_tokens=2048,
        warmup_steps=0,
        lr=1e-3,
    )
    losses, ran = {}, {}
    for name in ("flash", backend):
        torch.manual_seed(0)
        cfg = preset("gpt2").override({**shape, "sdpa_backend": name})
        cfg.validate()
        step = TrainStep(cfg, rt)
        x = torch.randint(0, 50257, (2, 1025), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        losses[name] = [step(lambda: (x[:, :-1], x[:, 1:]))[0].item() for _ in range(3)]
        ran[name] = sdpa_backend(profiled_names(lambda: step(lambda: (x[:, :-1], x[:, 1:])), "cuda"))["backend"]
    assert ran[backend] == {"efficient": "mem-efficient"}.get(backend, backend), ran
    assert losses[backend] == pytest.approx(losses["flash"], rel=1e-2)
