"""--fp8 through torchao: which layers convert (torchao's rule), shapes refused before the first
step, and a training step that obeys CUDA's ``_scaled_mm`` rules (checked on the CPU by
tests/cuda_rules.py) and stays close to bf16. The GPU parity test is marked ``cuda``."""

import pytest
import torch
from cuda_rules import CudaRuleError, check_scaled_mm, cuda_scaled_mm_rules

from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.fp8 import block_linears, check_fp8_shapes, convert_to_float8, fp8_eligible, large_enough
from gptspeed.model import GPT, GPTConfig

NEEDS_TORCHAO = (
    "test_layers_converted_follow_torchaos_tensorwise_rule",
    "test_conversion_keeps_parameters_and_state_dict",
    "test_fp8_training_step",
    "test_fp8_step_with",
    "test_cuda_fp8",
)


@pytest.fixture(autouse=True)
def _torchao(request):
    """torchao is an optional package (the test extra installs it): the tests that convert layers
    skip with the reason without it, and the module still collects (``pytest -m cuda`` with the
    runtime dependencies only)."""
    if request.node.name.startswith(NEEDS_TORCHAO):
        pytest.importorskip("torchao", reason="torchao is not installed (pip install 'gptspeed[fp8]')")


SHAPE = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SHAPE))


def _batch(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (B, T), generator=g), torch.randint(0, 50257, (B, T), generator=g)


def _loss_and_grads(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# ------------------------------------------------------------------------- the CUDA rules helper
def _fp8(shape, dtype=E4M3):
    return torch.randn(shape).to(dtype)


def test_cuda_rules_refuse_what_a_gpu_refuses_and_the_cpu_kernel_accepts():
    one = torch.tensor(1.0)
    a, b = _fp8((32, 48)), _fp8((64, 48)).t()  # row-major (32, 48) @ column-major (48, 64)
    check_scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    bad = {
        "row-major mat2": (a, b.contiguous(), one, one),
        "inner dimension 40": (_fp8((32, 40)), _fp8((64, 40)).t(), one, one),
        "mat2 with 24 columns": (a, _fp8((24, 48)).t(), one, one),
        "column-major mat1": (_fp8((48, 32)).t(), b, one, one),
        "bf16 operands": (a.to(torch.bfloat16), b, one, one),
        "bf16 scale": (a, b, one.bfloat16(), one),
        "a scale of 2 values": (a, b, torch.ones(2), one),
    }
    for what, args in bad.items():
        with pytest.raises(CudaRuleError):
            check_scaled_mm(*args)
        if what in ("row-major mat2", "inner dimension 40", "mat2 with 24 columns", "column-major mat1"):
            torch._scaled_mm(*args[:2], scale_a=one, scale_b=one, out_dtype=torch.float32)  # the CPU runs it anyway
    with pytest.raises(CudaRuleError, match="fp32 output"):
        check_scaled_mm(a, b, one, one, bias=torch.zeros(64), out_dtype=torch.float32)
    check_scaled_mm(_fp8((7, 48)), b, one, one)  # M is free in one call (CUDA checks K and mat2 only)


# ----------------------------------------------------------------------------- which layers
def test_layers_converted_follow_torchaos_tensorwise_rule():
    from torchao.float8 import _auto_filter_for_recipe

    torchao_filter = _auto_filter_for_recipe("tensorwise", filter_fqns=[])
    for n_embd in (64, 128, 768, 1024, 1280, 1600):
        for name, (fan_in, fan_out) in block_linears(n_embd).items():
            with torch.device("meta"):
                lin = torch.nn.Linear(fan_in, fan_out)
            assert fp8_eligible("transformer.h.3." + name, fan_in, fan_out) == torchao_filter(lin, name), (n_embd, name)
    gpt2 = {n for n, d in block_linears(768).items() if large_enough(*d)}
    assert gpt2 == {"attn.c_attn", "mlp.c_fc"}  # 124M: both c_proj layers are too small to gain
    assert all(large_enough(*d) for d in block_linears(1600).values())  # gpt2-xl: all four
    assert not fp8_eligible("lm_head", 768, 50304) and not fp8_eligible("transformer.h.0.attn.c_attn", 40, 120, False)


def test_conversion_keeps_parameters_and_state_dict():
    ref, model = _model(), _model()
    params = {n: p for n, p in model.named_parameters()}
    assert convert_to_float8(model) == 0  # n_embd 64: nothing is large enough by torchao's rule
    assert convert_to_float8(model, skip_small=False) == 4 * 2
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.transformer.h[1].mlp.c_proj, Float8Linear)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert list(model.state_dict()) == list(ref.state_dict())


# ------------------------------------------------------------------ shapes refused before a step
def test_fp8_shapes_refused_by_validate_before_the_first_step():
    cfg = preset("gpt2").override({"fp8": True, "batch_size": 3, "block_size": 37, "total_batch_tokens": None})
    with pytest.raises(GptspeedError, match=r"multiple of 16.*3 \* 37 = 111"):
        cfg.validate()
    cfg.override({"batch_size": 16}).validate()  # 16 * 37 is fine
    cfg.override({"fp8": False}).validate()  # and without --fp8 nothing is checked
    with pytest.raises(GptspeedError, match="--fp8 would convert no layer"):
        preset("nano").override({"fp8": True}).validate()  # n_embd 128: every layer below torchao's threshold
    check_fp8_shapes(0, 37, preset("gpt2").model)  # --batch-size auto: B not known yet, layers checked


def test_cli_refuses_fp8_with_one_line(tmp_path, capsys):
    from gptspeed.cli import main

    code = main(
        [
            "train",
            "--preset",
            "gpt2",
            "--data",
            str(tmp_path),
            "--out",
            str(tmp_path / "r"),
            "--device",
            "cpu",
            "--fp8",
            "--batch-size",
            "3",
            "--seq-len",
            "37",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--fp8" in err and "multiple of 16" in err and not (tmp_path / "r").exists()


# ------------------------------------------------------------------ a step under CUDA's rules
def test_fp8_training_step_obeys_cuda_rules_and_stays_close_to_bf16():
    x, y = _batch(B=2, T=32)  # 64 tokens: a multiple of 16
    ref = _model()
    ref_loss, ref_grads = _loss_and_grads(ref, x, y)
    model = _model()
    n = convert_to_float8(model, skip_small=False)
    with cuda_scaled_mm_rules() as calls:
        loss, grads = _loss_and_grads(model, x, y)
    assert len(calls) == 3 * n  # forward, grad input, grad weight of every converted layer
    forward = [c for c in calls if c.dtype_a == E4M3 and c.dtype_b == E4M3]
    backward = [c for c in calls if E5M2 in (c.dtype_a, c.dtype_b)]  # e5m2 output gradients
    assert len(forward) == n and len(backward) == 2 * n
    assert all(c.use_fast_accum for c in forward)  # fast accumulation in the forward matmul only
    assert not any(c.use_fast_accum for c in backward)
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item()
    for k, g in ref_grads.items():  # e5m2 gradients: 2 mantissa bits
        assert (grads[k] - g).norm() <= 0.25 * g.norm() + 1e-6, k


def test_fp8_step_with_a_token_count_not_a_multiple_of_16_breaks_cuda_rules():
    """What check_fp8_shapes prevents: 3 x 5 = 15 tokens pass the CPU kernel but not CUDA's."""
    x, y = _batch(B=3, T=5)
    model = _model()
    convert_to_float8(model, skip_small=False)
    _loss_and_grads(model, x, y)  # the CPU kernel takes it
    with cuda_scaled_mm_rules(), pytest.raises(CudaRuleError, match="multiple"):
        _loss_and_grads(model, x, y)


def test_fp8_refused_off_hopper(tmp_path):
    from gptspeed.parallelize import parallelize
    from gptspeed.runtime import resolve_runtime

    with pytest.raises(GptspeedError, match="--fp8"):
        parallelize(_model(), resolve_runtime("cpu", "float32", False), fp8=True)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_training_matches_bf16():
    """On an FP8 GPU (capability >= 8.9): 20 AdamW steps at GPT-2 124M's width (2 blocks), FP8
    vs bf16 from the same weights on the same batches; the loss curves stay within 0.05 nats."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need an Ada / Hopper GPU (compute capability 8.9+)")
    from gptspeed.parallelize import parallelize
    from gptspeed.runtime import resolve_runtime

    rt = resolve_runtime("cuda", "bfloat16", False)
    shape = dict(block_size=256, vocab_size=50304, n_layer=2, n_head=12, n_embd=768)
    torch.manual_seed(0)
    base = GPT(GPTConfig(**shape))
    losses = {}
    for fp8 in (False, True):
        model = GPT(GPTConfig(**shape))
        model.load_state_dict(base.state_dict())
        model = parallelize(model, rt, fp8=fp8)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        curve = []
        for step in range(20):
            x, y = (t.cuda() for t in _batch(B=8, T=256, seed=step))
            with cuda_scaled_mm_rules(), torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses[fp8] = curve
    assert max(abs(a - b) for a, b in zip(losses[False], losses[True])) < 0.05
