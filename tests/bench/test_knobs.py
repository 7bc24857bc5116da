"""``gptspeed.bench.knobs``: the knobs ``gptspeed bench --tune`` turns: each a setting of the run configuration and the values to try from the best configuration found so far, on this device."""

from __future__ import annotations

import pytest

from gptspeed.bench import knobs as knobs_mod
from gptspeed.bench.knobs import CUDA_KNOBS, TuneState
from gptspeed.bench.tune import measured_sequences, rule_refusal


def cuda_state(flags: list[str] = ()) -> TuneState:
    import torch

    from gptspeed.configure import config_from_flags

    run = config_from_flags(["--preset", "gpt2", *flags], "test")
    return TuneState(
        torch.device("cuda"), run, {}, measured_sequences(run, "cuda"), {"dtype": "bfloat16", "compile": True}
    )


def test_cuda_knobs_values_for_gpt2():
    state = cuda_state()
    assert state.sequences == 128  # B=16 x 8 of the 32 micro-batches of a 524,288-token step
    values = {k.name: k.values(state) for k in CUDA_KNOBS}
    assert values["micro-batch"] == [{"batch_size": 32}, {"batch_size": 64}, {"batch_size": 128}]
    assert values["loss"] == [{"loss": "liger"}, {"loss": "fused"}]  # auto is plain on CUDA
    assert values["sdpa-backend"] == [
        {"sdpa_backend": "cudnn"},
        {"sdpa_backend": "flash"},
        {"sdpa_backend": "efficient"},
    ]
    assert values["fp8-lm-head"] == [{"fp8_lm_head": True}] and values["residual-dtype"] == [
        {"residual_dtype": "bfloat16"}
    ]
    assert rule_refusal(state.user, {}, values["fp8-lm-head"][0]) is None  # the plain loss, vocabulary 50304
    assert values["cast-weights-once"] == [{"parallel": "fsdp", "cast_weights_once": True}]
    assert rule_refusal(state.user, {}, values["cast-weights-once"][0]) is None
    assert values["fp8"] == [{"fp8": True}] and values["cuda-graphs"] == [{"compile_tuning": "reduce-overhead"}]
    assert values["compile-tuning"] == [{"compile_tuning": "max-autotune-no-cudagraphs"}]
    # CUDA graphs cannot accumulate: refused for the gpt2 run's 32 micro-steps, with the rule's own line
    assert "cannot accumulate gradients over 32 micro-steps" in rule_refusal(state.user, {}, values["cuda-graphs"][0])
    # a kept micro-batch is where the next knob starts
    state.best = {"batch_size": 64, "loss": "fused"}
    assert knobs_mod._micro_batch(state) == [{"batch_size": 128}]
    assert knobs_mod._choices("loss", ("plain", "liger", "fused"))(state) == [{"loss": "plain"}, {"loss": "liger"}]
    assert "cannot accumulate gradients over 8 micro-steps" in rule_refusal(
        state.user, state.best, {"compile_tuning": "reduce-overhead"}
    )
    state.best = {"batch_size": 128}  # a global batch of 128 sequences in one micro-step: nothing to cast less often
    state.user = state.user.override({"total_batch_tokens": 128 * 1024})
    assert "already cast once a step" in knobs_mod._cast_once(state)
    # a kept fp32 run has no bf16 stream or bf16 weight copy to try
    state.auto = {"dtype": "float32", "compile": True}
    assert "needs --dtype bfloat16" in knobs_mod._residual(state)
    assert "needs --dtype bfloat16" in knobs_mod._cast_once(state)


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_dtype_knob_on_both_kinds_of_cpu(monkeypatch, native):
    """An AVX2-only CPU emulates bf16 (slower than fp32): the knob says so instead of trying it; a CPU
    with native bf16 tries the other dtype, whichever this host is."""
    import torch

    from gptspeed.configure import config_from_flags

    monkeypatch.setattr(knobs_mod, "cpu_has_native_bf16", lambda: native)
    run = config_from_flags(["--preset", "pico"], "test")
    state = TuneState(torch.device("cpu"), run, {}, 8, {"dtype": "float32", "compile": False})
    got = knobs_mod._cpu_dtype(state)
    assert got == [{"dtype": "bfloat16"}] if native else "emulated bf16 runs slower than fp32" in got
    state.auto = {"dtype": "bfloat16", "compile": False}  # a bf16 run may always try fp32
    assert knobs_mod._cpu_dtype(state) == [{"dtype": "float32"}]
    assert knobs_mod._compile(state) == [{"compile": True}]
