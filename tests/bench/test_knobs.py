"""``gptspeed.bench.knobs``: the knobs ``gptspeed bench tune`` turns: each a setting of the run configuration and the values to try from the best configuration found so far, on this device."""

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
    assert values["loss"] == [{"loss": "plain"}, {"loss": "liger"}, {"loss": "fused"}]
    assert "--loss auto is plain here" in state.duplicate({"loss": "plain"})  # auto is plain on CUDA: not run
    assert state.duplicate({"loss": "fused"}) is None
    assert values["sdpa-backend"] == [
        {"sdpa_backend": "cudnn"},
        {"sdpa_backend": "flash"},
        {"sdpa_backend": "efficient"},
    ]
    assert values["fp8-lm-head"] == [{"fp8_lm_head": True}] and values["residual-dtype"] == [
        {"residual_dtype": "bfloat16"}
    ]
    assert rule_refusal(state.user, {}, values["fp8-lm-head"][0]) is None  # the plain loss, vocabulary 50304
    assert values["cast-weights-once"] == knobs_mod.WHOLE_MODEL_COMPILE  # decided before any row runs
    assert values["coordinate-descent"] == [{"coordinate_descent_tuning": True}]
    assert values["fp8"] == [{"fp8": True}] and values["cuda-graphs"] == [{"compile_tuning": "reduce-overhead"}]
    assert values["compile-tuning"] == [{"compile_tuning": "max-autotune-no-cudagraphs"}]
    # CUDA graphs cannot accumulate: refused for the gpt2 run's 32 micro-steps, with the rule's own line
    assert "cannot accumulate gradients over 32 micro-steps" in rule_refusal(state.user, {}, values["cuda-graphs"][0])
    # a kept micro-batch is where the next knob starts
    state.best = {"batch_size": 64, "loss": "fused"}
    assert knobs_mod._micro_batch(state) == [{"batch_size": 128}]
    assert "--loss is already fused" in state.duplicate({"loss": "fused"})
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


def test_cast_weights_once_is_tried_where_it_compiles_and_not_under_whole_model_compile():
    """Under whole-model compile dynamo breaks the graph at FSDP2's hooks (the row would fail verification):
    "not applicable" before the row runs. Per-block compile or no compile: the candidate, which gptspeed's
    rules accept for the gpt2 run."""
    for flags in (["--compile-mode", "blocks"], ["--no-compile"]):
        state = cuda_state(flags)
        if flags == ["--no-compile"]:
            state.auto = {"dtype": "bfloat16", "compile": False}
        got = knobs_mod._cast_once(state)
        assert got == [{"parallel": "fsdp", "cast_weights_once": True}], flags
        assert rule_refusal(state.user, {}, got[0]) is None
    state = cuda_state(["--compile"])
    assert "whole-model compile" in knobs_mod._cast_once(state)
    state.best = {"cast_weights_once": True}
    state.user = state.user.override({"compile_mode": "blocks"})
    assert knobs_mod._cast_once(state) == "already on"


def test_sdpa_auto_resolves_to_the_kernel_that_ran_and_that_candidate_is_a_duplicate():
    state = cuda_state()
    sdpa = {k.name: k for k in CUDA_KNOBS}["sdpa-backend"].values(state)
    assert all(state.duplicate(d) is None for d in sdpa)  # nothing seen running yet: every kernel is a candidate
    state.ran = {"sdpa_backend": "cudnn"}  # the kernel your row's profile saw
    assert state.resolved("sdpa_backend") == "cudnn"
    assert "--sdpa-backend auto already ran cudnn's kernel" in state.duplicate({"sdpa_backend": "cudnn"})
    assert [d for d in sdpa if state.duplicate(d) is None] == [{"sdpa_backend": "flash"}, {"sdpa_backend": "efficient"}]
    state.best = {"sdpa_backend": "flash"}  # a kept backend is named: no longer auto
    assert state.resolved("sdpa_backend") == "flash" and state.duplicate({"sdpa_backend": "cudnn"}) is None


def test_coordinate_descent_tuning_is_a_knob_where_inductor_generates_triton_kernels():
    import torch

    state = cuda_state()
    assert knobs_mod._coordinate_descent(state) == [{"coordinate_descent_tuning": True}]
    state.best = {"compile_tuning": "max-autotune-no-cudagraphs"}  # that mode includes it
    assert "--compile-tuning max-autotune-no-cudagraphs already includes it" in state.duplicate(
        {"coordinate_descent_tuning": True}
    )
    state.best = {"compile": False}
    assert "needs --compile" in knobs_mod._coordinate_descent(state)
    state.device = torch.device("cpu")
    assert "this device is cpu" in knobs_mod._coordinate_descent(state)
    assert "coordinate-descent" in [k.name for k in knobs_mod.knobs_for(torch.device("cpu"))]  # listed, with why


def test_the_cuda_knobs_are_tried_by_expected_gain_per_second_of_row_each_with_its_source():
    order = [k.name for k in CUDA_KNOBS]
    assert order == [
        "micro-batch",
        "fp8-lm-head",
        "residual-dtype",
        "cuda-graphs",
        "cast-weights-once",
        "sdpa-backend",
        "coordinate-descent",
        "compile-tuning",
        "fp8",
        "loss",
    ]
    rates = [k.gain_per_cost for k in CUDA_KNOBS]
    assert rates == sorted(rates, reverse=True)
    assert set(CUDA_KNOBS) == set(knobs_mod.CUDA_TABLE)
    for k in CUDA_KNOBS:
        assert k.source and k.cost > 0 and k.gain[0] <= k.gain[1], k.name
    by_name = {k.name: k for k in CUDA_KNOBS}
    assert "records/120424_ValueEmbed" in by_name["coordinate-descent"].source
    assert by_name["micro-batch"].sizes and not any(k.sizes for k in CUDA_KNOBS if k.name != "micro-batch")
