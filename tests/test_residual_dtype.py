"""--residual-dtype bfloat16: the residual stream between the blocks held in bf16 under bf16 autocast
(forced with --dtype bfloat16, so every CPU runs the branch, native bf16 or emulated): the stream
really is bf16, training (eager and compiled) stays within bf16's tolerance of the fp32 stream,
KV-cache sampling draws the cache-free tokens, it is refused in one line where the resolved dtype
is not bf16, and a resume may change it. The GPU test is marked ``cuda``."""

import dataclasses

import pytest
import torch
from conftest import assert_user_error, run_main, train_losses

from gptspeed.config import preset, run_defining_diff
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import generate, generate_cached, left_pad
from gptspeed.step import TrainStep, check_step

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(block_size=32, n_layer=2, n_head=2, n_embd=64)
BF16 = resolve_runtime("cpu", "bfloat16", False)  # forced: on a CPU without native bf16, emulated


def _model(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SHAPE, **kw}))


def _stream_dtypes(model: GPT, idx: torch.Tensor, autocast) -> set:
    """The dtypes of every block's input and of the final norm's: the residual stream."""
    seen = set()
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].dtype))
        for m in (*model.transformer.h, model.transformer.ln_f)
    ]
    with autocast:
        model(idx)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize(
    "kw",
    [{}, dict(pos_emb="rope", norm="rmsnorm", qk_norm=True, mlp="relu2"), dict(attention="manual", doc_mask=True)],
    ids=["gpt2", "modern", "manual-docmask"],
)
def test_the_stream_is_bf16_only_with_the_setting_under_bf16_autocast(kw):
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert _stream_dtypes(_model(residual_dtype="bfloat16", **kw), idx, bf16()) == {torch.bfloat16}
    assert _stream_dtypes(_model(**kw), idx, bf16()) == {torch.float32}  # the default: fp32 under autocast too
    # outside bf16 autocast (sampling or evaluating such a run in float32) the stream stays fp32: no crash
    for autocast in (torch.autocast("cpu", enabled=False), torch.autocast("cpu", dtype=torch.float16)):
        assert _stream_dtypes(_model(residual_dtype="bfloat16", **kw), idx, autocast) == {torch.float32}


def _losses(residual: str, compile_backend: str | None, steps: int = 5) -> list[float]:
    """``steps`` AdamW steps of TrainStep (what train builds) in bf16 autocast from the same weights
    on the same batches, with the residual stream in ``residual``."""
    cfg = preset("pico").override(
        dict(
            **SHAPE,
            residual_dtype=residual,
            batch_size=4,
            total_batch_tokens=None,
            device="cpu",
            dtype="bfloat16",
            compile=compile_backend is not None,
        )
    )
    cfg.validate()
    rt = dataclasses.replace(BF16, compile=compile_backend is not None)
    step = TrainStep(cfg, rt, model=_model(residual_dtype=residual), backend=compile_backend or "inductor")
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 50257, (4, 33), generator=g)
    return [step(lambda: (data[:, :-1], data[:, 1:]))[0].item() for _ in range(steps)]


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_training_stays_within_bf16_tolerance_of_the_fp32_stream(compile_backend):
    """bf16 keeps 7 mantissa bits (unit roundoff 2^-8 = 3.9e-3) in each residual add: the losses stay
    within 1e-2 relative of the fp32 stream's, bench --verify's bf16 tolerance (measured here: 5e-5
    over the 5 steps, eager and compiled alike); and they are not the same numbers (the branch ran)."""
    ref, got = _losses("float32", compile_backend), _losses("bfloat16", compile_backend)
    assert ref[-1] < ref[0] and got[-1] < got[0]  # the one batch is being learnt
    assert max(abs(a - b) / a for a, b in zip(ref, got)) < 1e-2
    assert ref != got


@pytest.mark.parametrize("kw", [{}, dict(pos_emb="rope")], ids=["learned", "rope"])
def test_kv_cache_sampling_draws_the_cache_free_tokens(kw):
    model = _model(residual_dtype="bfloat16", **kw).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20)  # peaked logits: greedy choices far apart, bf16 rounding or not
    idx = torch.randint(0, 50257, (2, 5), generator=torch.Generator().manual_seed(3))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    ref = torch.stack(list(generate(model, idx, 12, temperature=0, autocast=bf16())), dim=1)
    got = torch.stack(list(generate_cached(model, idx, 12, temperature=0, autocast=bf16())), dim=1)
    assert torch.equal(ref, got)
    batch, pad = left_pad([[11, 12, 13, 14], [21, 22]])  # left padding too
    cached = torch.stack(list(generate_cached(model, batch, 6, temperature=0, pad=pad, autocast=bf16())), dim=1)
    alone = torch.stack(list(generate(model, torch.tensor([[21, 22]]), 6, temperature=0, autocast=bf16())), dim=1)
    assert torch.equal(cached[1], alone[0])


def test_the_kv_cache_holds_the_autocast_dtype():
    from gptspeed.model import KVCache

    model = _model(residual_dtype="bfloat16").eval()
    cache = KVCache(2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([[1, 2, 3]]), kv=cache)
    assert {t.dtype for t in (*cache.k, *cache.v)} == {torch.bfloat16}


# ------------------------------------------------------------------------------------ the rules
@pytest.mark.parametrize("dtype", ["float32", "tf32", "float16"])
def test_refused_with_any_other_dtype_in_one_line(dtype):
    cfg = preset("pico").override(dict(residual_dtype="bfloat16", dtype=dtype))
    with pytest.raises(GptspeedError) as e:
        cfg.validate()
    assert str(e.value) == (
        f"--residual-dtype bfloat16 needs bf16 autocast; this run has --dtype {dtype}: use "
        "--dtype bfloat16, or --residual-dtype float32"
    )
    cfg.override(dict(residual_dtype="float32")).validate()
    preset("pico").override(dict(residual_dtype="bfloat16", dtype="auto")).validate()  # known on the device


def test_refused_where_auto_resolves_to_float32():
    """--dtype auto is float32 on a CPU without native bf16 (and on MPS): the step, which knows the
    resolved dtype, refuses it with the reason auto gave."""
    cfg = preset("pico").override(dict(residual_dtype="bfloat16"))
    rt = dataclasses.replace(
        BF16, dtype="float32", autocast_dtype=None, dtype_reason="float32: no native bf16 matmuls on this CPU"
    )
    with pytest.raises(GptspeedError) as e:
        check_step(cfg, rt, 1)
    assert str(e.value) == (
        "--residual-dtype bfloat16 needs bf16 autocast; this run computes in float32 (float32: no "
        "native bf16 matmuls on this CPU): use --dtype bfloat16, or --residual-dtype float32"
    )
    check_step(cfg, BF16, 1)
    check_step(cfg.override(dict(residual_dtype="float32")), rt, 1)


def test_cli_refuses_float32_in_one_line(tmp_path):
    proc = run_main(
        "train",
        "--preset",
        "pico",
        "--data",
        str(tmp_path),
        "--out",
        str(tmp_path / "r"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--residual-dtype",
        "bfloat16",
    )
    assert_user_error(proc, "--residual-dtype bfloat16 needs bf16 autocast", "--dtype float32")
    assert not (tmp_path / "r").exists()


def test_a_resume_may_change_it(shakespeare_data, tmp_path, capsys):
    """A precision choice, like --dtype: not run-defining. A run trained with the fp32 stream resumes
    with the bf16 stream (evaluation and the checkpoint under it too), and the banner says so."""
    assert run_defining_diff(preset("pico"), preset("pico").override(dict(residual_dtype="bfloat16"))) == []
    run = tmp_path / "run"
    common = [
        "--preset",
        "pico",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--eval-every",
        "2",
        "--eval-tokens",
        "256",
        "--log-every",
        "1",
        "--save-every",
        "2",
    ]
    assert run_main("train", *common, "--max-steps", "2").returncode == 0
    proc = run_main("train", *common, "--max-steps", "4", "--resume", "--residual-dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "residual bf16" in proc.stdout
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_bf16_stream_trains_like_the_fp32_stream_compiled():
    """On a bf16 GPU, under torch.compile (inductor, the default there): 10 AdamW steps at GPT-2 124M's
    width (2 blocks) with the bf16 stream vs the fp32 stream from the same weights on the same
    batches; the losses stay within bf16's 1e-2 relative, and the blocks' inputs are bf16."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("needs a GPU with bf16 (Ampere or newer)")
    from gptspeed.parallelize import parallelize

    rt = resolve_runtime("cuda", "bfloat16", True)
    shape = dict(block_size=256, vocab_size=50304, n_layer=2, n_head=12, n_embd=768, loss="plain")
    torch.manual_seed(0)
    base = GPT(GPTConfig(**shape)).state_dict()
    losses = {}
    for residual in ("float32", "bfloat16"):
        model = GPT(GPTConfig(**shape, residual_dtype=residual))
        model.load_state_dict(base)
        seen = set()
        hook = model.transformer.h[1].register_forward_pre_hook(lambda mod, args: seen.add(args[0].dtype))
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.cuda()(torch.zeros(1, 8, dtype=torch.long, device="cuda"))
        hook.remove()
        train_model = parallelize(model, rt)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        curve = []
        for step in range(10):
            g = torch.Generator().manual_seed(step)
            data = torch.randint(0, 50257, (8, 257), generator=g).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = train_model(data[:, :-1], data[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses[residual] = curve
        assert seen == {torch.bfloat16 if residual == "bfloat16" else torch.float32}
    assert max(abs(a - b) / a for a, b in zip(losses["float32"], losses["bfloat16"])) < 1e-2, losses
