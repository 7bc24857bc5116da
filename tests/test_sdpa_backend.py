"""--sdpa-backend: which F.scaled_dot_product_attention kernel a run uses (issue 20 compares cuDNN's
with flash attention on an H100). On the CPU PyTorch has two of the four kernels, flash and math:
the CPU checks that the choice reaches every attention call (eager, and traced by torch.compile),
that it does not change the losses, and that a kernel the device lacks stops the run in one line
before the model is built."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL, run_main

from gptspeed import step as step_mod
from gptspeed.bench.checks import profiled_names, sdpa_backend
from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.runtime import resolve_runtime, sdpa_backend_problem
from gptspeed.step import TrainStep

CPU = resolve_runtime("cpu", "float32", False)


SWITCHES = ("flash_sdp_enabled", "cudnn_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")


def switches() -> dict[str, bool]:
    return {name: getattr(torch.backends.cuda, name)() for name in SWITCHES}


@pytest.fixture(autouse=True)
def the_choice_never_outlives_its_step():
    """Issue 30 item 5: --sdpa-backend used to switch kernels off process-wide and never back on, so
    a later test (or a library caller's next model) kept the restriction. Every test here must leave
    PyTorch's switches as it found them."""
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
