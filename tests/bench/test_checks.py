"""``gptspeed.bench.checks``: what ``bench verify`` watches while a rung trains: host-device syncs, compilation, the SDPA kernel."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from gptspeed.bench.checks import SYNC_MESSAGE, CompileWatch, SyncCounter, sdpa_backend

pytestmark = pytest.mark.usefixtures("one_thread")


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
