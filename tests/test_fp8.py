"""``gptspeed.fp8``: FP8 matmuls for the transformer blocks' Linear layers (``--fp8``) and for the LM head (``--fp8-lm-head``), through torchao."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptspeed import fp8 as fp8_mod
from gptspeed.config import AUTO_BATCH_SIZE, config_to_yaml, preset
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError
from gptspeed.fp8 import (
    block_linears,
    check_fp8_lm_head,
    check_fp8_lm_head_loss,
    check_fp8_shapes,
    convert_to_float8,
    fp8_eligible,
    large_enough,
)
from gptspeed.loss import resolve_loss
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime

from support.cli import assert_user_error, run_main
from support.cuda_rules import CudaRuleError, check_scaled_mm, cuda_scaled_mm_rules
from support.padded_model import _batch
from support.runs import train_args
from support.shapes import FP8_HEAD_MODEL, FP8_MODEL

pytestmark = pytest.mark.usefixtures("one_thread", "emulated_fp8_matmul")


NEEDS_TORCHAO = (
    "test_layers_converted_follow_torchaos_tensorwise_rule",
    "test_conversion_keeps_parameters_and_state_dict",
    "test_fp8_training_step",
    "test_fp8_step_with",
    "test_cuda_fp8",
    # the LM head's conversion: every test of it
    "test_the_converted_head_stays_tied_and_checkpoints_load_either_way",
    "test_an_untied_head_converts_alone",
    "test_a_lost_tie_is_restored",
    "test_fp8_head_obeys_cuda_rules_and_stays_close_to_the_bf16_head",
    "test_both_uses_of_the_tied_weight_reach_its_gradient",
    "test_the_fp8_head_compiles_in_one_graph_like_eager",
    "test_soft_capped_logits_through_the_fp8_head",
    "test_each_rule_refuses_for_its_reason_only",
    "test_what_the_rules_let_through",
    "test_the_step_checks_the_device_then_the_resolved_loss",
    "test_a_training_step_converts_the_head_and_obeys_cuda_rules",
    "test_parallelize_refuses_it_off_hopper",
    "test_the_flag_round_trips_through_print_config_and_the_banner",
    "test_cli_refuses_the_unpadded_vocabulary_in_one_line",
    "test_cuda_fp8_lm_head_training_matches_bf16",
)


@pytest.fixture(autouse=True)
def _torchao(request):
    """torchao is an optional package (the test extra installs it): the tests that convert layers
    skip with the reason without it -- when run, not at import, so the module still collects
    (``pytest -m cuda`` with the runtime dependencies only: tests/system/test_gpu_collection.py)."""
    if request.node.name.startswith(NEEDS_TORCHAO):
        pytest.importorskip("torchao", reason="torchao is not installed (pip install 'gptspeed[fp8]')")


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**FP8_MODEL))


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


def _pair(**kw):
    """The same weights twice: a plain model and one with its head converted (only the head)."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**{**FP8_HEAD_MODEL, **kw}))
    model = GPT(GPTConfig(**{**FP8_HEAD_MODEL, **kw}))
    model.load_state_dict(ref.state_dict())
    assert convert_to_float8(model, blocks=False, lm_head=True) == 1
    return ref, model


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------ the rules
def _cfg(**kw):
    base = dict(
        fp8_lm_head=True,
        loss="plain",
        batch_size=4,
        block_size=64,
        n_layer=2,
        n_head=2,
        n_embd=64,
        total_batch_tokens=None,
    )
    return preset("pico").override({**base, **kw})


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


# ------------------------------------------------------------------------------ the conversion
def test_the_converted_head_stays_tied_and_checkpoints_load_either_way():
    from torchao.float8.float8_linear import Float8Linear

    ref, model = _pair()
    wte = model.transformer.wte
    assert isinstance(model.lm_head, Float8Linear) and model.lm_head.returns_view
    assert model.lm_head.weight is wte.weight  # torchao keeps the Parameter object: still one tensor
    assert type(wte) is torch.nn.Embedding and wte.weight.dtype == torch.float32  # the lookup reads fp32
    assert not any(isinstance(m, Float8Linear) for n, m in model.named_modules() if n != "lm_head")  # the blocks
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict())  # a plain run's checkpoint loads into the converted model ...
    ref.load_state_dict(model.state_dict())  # ... and the converted model's into a plain one (strict)
    x, _ = _batch()
    assert torch.equal(wte(x), ref.transformer.wte(x))  # the embedding lookup is untouched, fp32
    # --fp8 and --fp8-lm-head: one pass converts the blocks' layers and the head
    torch.manual_seed(0)
    both = GPT(GPTConfig(**FP8_HEAD_MODEL))
    assert convert_to_float8(both, lm_head=True, skip_small=False) == 4 * 2 + 1
    assert both.lm_head.weight is both.transformer.wte.weight


def test_an_untied_head_converts_alone():
    _, model = _pair(tie_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    x, y = _batch()
    with cuda_scaled_mm_rules() as calls:
        model(x, y)[1].backward()
    assert len(calls) == 3 and model.transformer.wte.weight.grad.abs().sum() > 0


def test_a_lost_tie_is_restored(monkeypatch):
    """Were a torchao release to copy the weight into a new Parameter, the head would silently train a
    second matrix: convert_to_float8 re-ties it."""
    from torchao.float8.float8_linear import Float8Linear

    real = Float8Linear.from_float.__func__

    def copying(cls, mod, config=None):
        new = real(cls, mod, config)
        new.weight = torch.nn.Parameter(mod.weight.detach().clone())
        return new

    monkeypatch.setattr(Float8Linear, "from_float", classmethod(copying))
    _, model = _pair()
    assert model.lm_head.weight is model.transformer.wte.weight


# ---------------------------------------------------------------- numerics under CUDA's rules
def test_fp8_head_obeys_cuda_rules_and_stays_close_to_the_bf16_head():
    """Tolerances: e4m3 keeps 3 mantissa bits (unit roundoff 2^-4), e5m2 gradients 2 (2^-3); a
    rounding error uniform in +-u has an RMS of u / sqrt(3): 3.6% for e4m3, 7.2% for e5m2. So the
    logits (two e4m3 operands) are held to 10% relative (norm), every gradient (an e5m2 operand) to
    10%, and the loss, an average over the vocabulary, to 2e-2 as bench verify holds FP8 rungs
    (measured here: 1e-6 on the loss, 2.6-3.6% on the gradients)."""
    ref, model = _pair()
    x, y = _batch()
    out = {}
    for name, m in (("ref", ref), ("fp8", model)):
        with cuda_scaled_mm_rules() as calls:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, loss = m(x, y, return_logits=True)
            loss.backward()
        out[name] = logits.detach(), loss.detach(), {n: p.grad for n, p in m.named_parameters()}, calls
    (l_ref, loss_ref, g_ref, none), (l_fp8, loss_fp8, g_fp8, calls) = out["ref"], out["fp8"]
    assert none == []
    # forward (M, C) @ (C, V) in e4m3 with fast accumulation; grad input (M, V) @ (V, C) and grad weight
    # (V, M) @ (M, C) with e5m2 output gradients; M = B*T = 64, C = 64, V = 50304
    assert [(c.shape_a, c.shape_b, c.dtype_a, c.dtype_b, c.use_fast_accum) for c in calls] == [
        ((64, 64), (64, 50304), E4M3, E4M3, True),
        ((64, 50304), (50304, 64), E5M2, E4M3, False),
        ((50304, 64), (64, 64), E5M2, E4M3, False),
    ]
    assert torch.isinf(l_fp8[..., 50257:]).all() and torch.isfinite(l_fp8[..., :50257]).all()
    assert _rel(l_fp8[..., :50257], l_ref[..., :50257]) < 0.1
    assert abs(loss_fp8.item() - loss_ref.item()) < 2e-2 * loss_ref.item()
    for k, g in g_ref.items():
        assert _rel(g_fp8[k], g) < 0.1, k


def test_both_uses_of_the_tied_weight_reach_its_gradient():
    """The tied weight's gradient is the embedding lookup's (rows of the batch's tokens) plus the FP8
    head's (every row): each part close to the plain model's, their sum in the one ``.grad``."""
    parts = {}
    for name, m in zip(("ref", "fp8"), _pair()):
        grads = {}

        def keep_grad(module, args, out):
            out.register_hook(lambda g: grads.__setitem__("out", g))

        m.transformer.wte.register_forward_hook(keep_grad)
        x, y = _batch()
        with cuda_scaled_mm_rules():
            m(x, y)[1].backward()
        w = m.transformer.wte.weight
        lookup = torch.zeros_like(w).index_add_(0, x.reshape(-1), grads["out"].reshape(-1, w.size(1)))
        parts[name] = lookup, w.grad - lookup
    (lookup_ref, head_ref), (lookup_fp8, head_fp8) = parts["ref"], parts["fp8"]
    assert lookup_fp8.abs().sum() > 0 and head_fp8.abs().sum() > 0
    assert _rel(lookup_fp8, lookup_ref) < 0.1 and _rel(head_fp8, head_ref) < 0.1
    unseen = torch.ones(50304, dtype=torch.bool)
    unseen[_batch()[0].reshape(-1)] = False
    assert (lookup_fp8[unseen] == 0).all() and head_fp8[unseen][:50257].abs().sum() > 0  # the head's alone


def test_the_fp8_head_compiles_in_one_graph_like_eager():
    """torch.compile (AOTAutograd, ``fullgraph``: no graph break) traces the converted head and the
    out-of-place padding mask; writing into the matmul's output in place, as the plain head does,
    fails there as in eager (autograd forbids it on a view made inside torchao's Function)."""
    _, model = _pair()
    x, y = _batch()
    eager = model(x, y)[1]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x, y)[1]
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert model.transformer.wte.weight.grad.abs().sum() > 0
    model.lm_head.returns_view = False
    with pytest.raises(RuntimeError, match="view"):
        model(x, y)


def test_soft_capped_logits_through_the_fp8_head():
    """--logit-softcap is applied after the head's matmul: it works with --fp8-lm-head."""
    cap = 2.0
    ref, model = _pair(logit_softcap=cap)
    with torch.no_grad():
        for m in (ref, model):
            m.transformer.wte.weight.mul_(50)  # logits far beyond the cap
    x, y = _batch()
    with cuda_scaled_mm_rules() as calls:
        logits, loss = model(x, y, return_logits=True)
        loss.backward()
    assert len(calls) == 3 and torch.isinf(logits[..., 50257:]).all()
    assert logits[..., :50257].abs().max() <= cap
    assert abs(loss.item() - ref(x, y)[1].item()) < 2e-2 * loss.item()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(loss="fused"), "--fp8-lm-head converts the LM head module, which only --loss plain calls (--loss fused "),
        (
            dict(loss="liger"),
            "which only --loss plain calls (--loss liger multiplies by the head's weight in chunks): use --loss plain",
        ),
        (dict(softmax="data"), "--fp8-lm-head converts the LM head module, which --softmax data bypasses"),
        (
            dict(vocab_size=50257),
            "--fp8-lm-head needs --vocab-size to be a multiple of 16 (CUDA's FP8 matmul); got 50257: "
            "use --vocab-size 50304",
        ),
        (
            dict(n_embd=40, n_head=2),
            "--fp8-lm-head needs --n-embd to be a multiple of 16 (CUDA's FP8 matmul); got 40: "
            "change --n-embd (e.g. 48)",
        ),
        (
            dict(batch_size=3, block_size=37),
            "--fp8-lm-head needs batch_size * seq_len to be a multiple of 16 (CUDA's FP8 matmul); got 3 * 37 = 111",
        ),
    ],
)
def test_each_rule_refuses_for_its_reason_only(change, message):
    with pytest.raises(GptspeedError) as e:
        _cfg(**change).validate()
    assert message in str(e.value) and "\n" not in str(e.value)
    _cfg(**change).override({"fp8_lm_head": False}).validate()  # without the flag the same run is fine


def test_what_the_rules_let_through():
    _cfg().validate()
    _cfg(logit_softcap=15.0, tie_embeddings=False, fp8=False).validate()
    _cfg(loss="auto").validate()  # auto: checked where the device is known
    _cfg(batch_size=AUTO_BATCH_SIZE, total_batch_tokens=4 * 64).validate()  # B not known yet: the rest is checked
    check_fp8_lm_head(0, 37, GPTConfig(**FP8_HEAD_MODEL))
    check_fp8_lm_head_loss("plain", resolve_loss("plain", "cpu"), "cpu")
    check_fp8_lm_head_loss("auto", resolve_loss("auto", "cuda"), "cuda")  # plain there
    with pytest.raises(GptspeedError) as e:
        check_fp8_lm_head_loss("auto", resolve_loss("auto", "cpu"), "cpu")
    assert str(e.value) == (
        "--fp8-lm-head runs only on the plain loss path (the one that calls the LM head module); "
        "--loss auto resolves to fused on cpu: use --loss plain"
    )


def test_the_step_checks_the_device_then_the_resolved_loss(monkeypatch):
    from gptspeed.step import check_step

    cpu = resolve_runtime("cpu", "float32", False)
    with pytest.raises(GptspeedError) as e:
        check_step(_cfg(), cpu, 1)
    assert str(e.value) == "--fp8-lm-head needs an NVIDIA GPU with FP8 tensor cores (H100, L4, ...); not cpu"
    monkeypatch.setattr(fp8_mod, "check_fp8_device", lambda device, flag="--fp8": None)  # as on an H100
    check_step(_cfg(), cpu, 1)
    with pytest.raises(GptspeedError, match="--loss auto resolves to fused on cpu: use --loss plain"):
        check_step(_cfg(loss="auto"), cpu, 1)


def test_a_training_step_converts_the_head_and_obeys_cuda_rules(monkeypatch):
    """TrainStep (what train, the bench and verify build) converts the head where the device check
    passes (faked here: a CPU has no FP8 tensor cores) and trains through it."""
    from gptspeed.step import TrainStep

    monkeypatch.setattr(fp8_mod, "check_fp8_device", lambda device, flag="--fp8": None)
    # a 512-row head (500 tokens and 12 rows of padding): the rules hold at any multiple of 16, and
    # three steps through GPT-2's 50304 rows cost ~100x the matmul work on a CPU
    cfg = _cfg(dtype="bfloat16", device="cpu", vocab_size=512, valid_vocab_size=500)
    cfg.validate()
    step = TrainStep(cfg, resolve_runtime("cpu", "bfloat16", False))
    assert step.model.lm_head.returns_view and step.model.lm_head.weight is step.model.transformer.wte.weight
    x, y = torch.randint(0, 500, (2, 4, 64), generator=torch.Generator().manual_seed(1))
    with cuda_scaled_mm_rules() as calls:
        losses = [step(lambda: (x, y))[0].item() for _ in range(3)]
    assert len(calls) == 3 * 3 and losses[-1] < losses[0]  # the one batch is being learnt


def test_parallelize_refuses_it_off_hopper():
    from gptspeed.parallelize import parallelize

    with pytest.raises(GptspeedError, match="^--fp8-lm-head needs an NVIDIA GPU"):
        parallelize(GPT(GPTConfig(**FP8_HEAD_MODEL)), resolve_runtime("cpu", "float32", False), fp8_lm_head=True)


# ---------------------------------------------------------------- the flag, files and banner
def test_the_flag_round_trips_through_print_config_and_the_banner(tmp_path, capsys):
    from gptspeed.cli import main
    from gptspeed.runinfo import banner

    flags = ["--preset", "pico", "--fp8-lm-head", "--loss", "plain", "--out", str(tmp_path / "r")]
    assert main(["train", *flags, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "\n  fp8_lm_head: true\n" in text and not (tmp_path / "r").exists()
    (tmp_path / "run.yaml").write_text(text)
    cfg = build_train_config(None, {}, str(tmp_path / "run.yaml"))
    assert cfg.runtime.fp8_lm_head is True and build_train_config(None, {}, str(tmp_path / "run.yaml")) == cfg
    assert "fp8_lm_head: true" in config_to_yaml(cfg)
    rt = resolve_runtime("cpu", "float32", False)
    derived = dict(params=1.0, fused_adamw=False, grad_accum_steps=1, tokens_per_step=512, peak_flops=1.0)
    line = banner(cfg, rt, derived, malloc_reason="", step=0)[0]
    assert " | fp8 lm_head | " in line and " | fp8 | " not in line
    both = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, fp8=True))
    assert " | fp8 | fp8 lm_head | " in banner(both, rt, derived, malloc_reason="", step=0)[0]


def test_cli_refuses_the_unpadded_vocabulary_in_one_line(tmp_path):
    proc = run_main(
        *train_args(
            tmp_path, tmp_path / "r", "--fp8-lm-head", "--loss", "plain", "--vocab-size", "50257", max_steps=None
        )
    )
    assert_user_error(proc, "--fp8-lm-head needs --vocab-size to be a multiple of 16", "use --vocab-size 50304")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_fp8_lm_head_training_matches_bf16(compile):
    """On an FP8 GPU (capability >= 8.9): 15 AdamW steps at GPT-2 124M's width and vocabulary (2
    blocks), the FP8 head vs the bf16 head from the same weights on the same batches, eager and
    under torch.compile (inductor: the out-of-place padding mask); the loss curves stay within 0.05
    nats, and the head stays tied."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need an Ada / Hopper GPU (compute capability 8.9+)")
    from gptspeed.parallelize import parallelize

    rt = resolve_runtime("cuda", "bfloat16", compile)
    shape = dict(block_size=256, vocab_size=50304, n_layer=2, n_head=12, n_embd=768, loss="plain")
    torch.manual_seed(0)
    base = GPT(GPTConfig(**shape))
    losses = {}
    for head in (False, True):
        model = GPT(GPTConfig(**shape))
        model.load_state_dict(base.state_dict())
        train_model = parallelize(model, rt, fp8_lm_head=head)
        assert model.lm_head.weight is model.transformer.wte.weight
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        curve = []
        for step in range(15):
            x, y = (t.cuda() for t in _batch(B=8, T=256, seed=step))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = train_model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses[head] = curve
    assert max(abs(a - b) for a, b in zip(losses[False], losses[True])) < 0.05, losses
