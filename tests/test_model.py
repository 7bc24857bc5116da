"""``gptspeed.model``: GPT-2, as OpenAI released it, in one file -- and the modern switches, each off by default."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from gptspeed.config import preset, run_defining_diff
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig, document_ids
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import generate, generate_cached, left_pad, load_model
from gptspeed.step import TrainStep, check_step
from gptspeed.tokenizer import EOT_TOKEN
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_main
from support.runs import train_args
from support.shapes import RESIDUAL_DTYPE_MODEL
from support.training import TINY_MODEL, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **kw})


# ------------------------------------------------------------------ --softmax data (the data's token ids only)
IDS = torch.tensor(sorted({3, 17, 198, 464, 1000, 5000, 11, 50256, 25, 262, 13}))


def data_softmax_model(loss="plain", seed=0):
    torch.manual_seed(seed)
    model = GPT(small(softmax="data", loss=loss))
    model.set_softmax_ids(IDS)
    return model


def _vocab_sized_zero_fills(model, idx, **kw) -> list[tuple]:
    """Shapes of the ``(B, T, V)`` tensors filled with zeros in one forward and backward of ``model``
    compiled with ``aot_eager`` (AOTAutograd's joint graph, run eagerly): a gradient made for the
    logits output. (The cross-entropy's own backward fills a ``(B*T, V)`` gradient: not counted.)"""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    compiled(idx, idx, **kw)[1].backward()  # warm-up: trace and compile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = compiled(idx, idx, **kw)
        out[1].backward()
    fills = []
    for e in prof.events():
        if e.name in ("aten::zero_", "aten::zeros", "aten::zeros_like", "aten::fill_", "aten::new_zeros"):
            for shape in e.input_shapes or []:
                if len(shape) == 3 and shape[-1] == model.config.vocab_size:
                    fills.append((e.name, tuple(shape)))
    return fills


def small_one_layer(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=32, block_size=16), **kw})


# ------------------------------------------------------------------------------ document mask
def reference_doc_mask(idx, start=0, seg_before=None, pad_mask=None):
    """allowed[b, 0, t, s]: key s at or before query start+t, in the same document (documents
    start at each <|endoftext|>), and allowed by the cache's padding mask if any."""
    from gptspeed.tokenizer import EOT_TOKEN

    B, T = idx.shape
    S = start + T
    m = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b in range(B):
        docs = list(seg_before[b]) if seg_before is not None else []
        d = docs[-1] if docs else 0
        for t in range(T):
            d += int(idx[b, t]) == EOT_TOKEN
            docs.append(d)
        for t in range(T):
            for s in range(S):
                m[b, 0, t, s] = s <= start + t and docs[s] == docs[start + t]
    return m if pad_mask is None else m & pad_mask


BF16 = resolve_runtime("cpu", "bfloat16", False)  # forced: on a CPU without native bf16, emulated


def _model(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**RESIDUAL_DTYPE_MODEL, **kw}))


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


def _losses(residual: str, compile_backend: str | None, steps: int = 5) -> list[float]:
    """``steps`` AdamW steps of TrainStep (what train builds) in bf16 autocast from the same weights
    on the same batches, with the residual stream in ``residual``."""
    cfg = preset("pico").override(
        dict(
            **RESIDUAL_DTYPE_MODEL,
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


SWITCHES = {
    "rope": dict(pos_emb="rope"),
    "qk-norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"),
    "rmsnorm": dict(norm="rmsnorm"),
    "untied": dict(tie_embeddings=False),
    "zero-init": dict(zero_init_proj=True),
    "softcap": dict(logit_softcap=15.0),
    "doc-mask": dict(doc_mask=True),
    "value-embeds": dict(value_embeds=1),
    "unet-skips": dict(unet_skips=True),
    "attn-window": dict(attn_window=8),  # < the 32 tokens of a window: each token sees its last 8
}


ALL = {k: v for s in SWITCHES.values() for k, v in s.items()}


CASES = {**SWITCHES, "all": ALL, "all-manual": dict(ALL, attention="manual")}


def tiny(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**dict(TINY_MODEL, n_layer=2), **kw}))


def with_documents(B=2, T=32, seed=0) -> torch.Tensor:
    """Token ids with an <|endoftext|> inside every row (documents packed as gptspeed writes them)."""
    idx = torch.randint(0, 50000, (B, T), generator=torch.Generator().manual_seed(seed))
    idx[:, 0] = EOT_TOKEN
    idx[:, T // 3] = EOT_TOKEN
    idx[0, 2 * T // 3] = EOT_TOKEN
    return idx


def test_shapes_and_padding_never_predicted():
    torch.manual_seed(0)
    model = GPT(small())
    idx = torch.randint(0, 50257, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 50304) and loss is None
    assert torch.isneginf(logits[..., 50257:]).all()
    assert torch.isfinite(logits[..., :50257]).all()
    _, loss = model(idx, idx)
    assert loss.shape == () and loss.dtype == torch.float32
    loss.backward()
    # padded rows of the tied embedding / head get no gradient: they are never predicted
    assert model.transformer.wte.weight.grad[50257:].abs().max() == 0
    with pytest.raises(ValueError):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_weight_tying():
    model = GPT(small())
    assert model.lm_head.weight is model.transformer.wte.weight
    n_unique = sum(p.numel() for p in model.parameters())
    assert n_unique == model.num_params(non_embedding=False)
    assert model.num_params() == n_unique - 32 * 64  # minus position embeddings


def test_gpt2_initialisation_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=6, n_head=4, n_embd=256, block_size=512)
    m = GPT(cfg)
    h = m.transformer.h[0]
    assert h.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert h.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.02)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert h.attn.c_proj.weight.std().item() == pytest.approx(resid, rel=0.03)
    assert h.mlp.c_proj.weight.std().item() == pytest.approx(resid, rel=0.03)
    assert m.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert m.transformer.wpe.weight.std().item() == pytest.approx(0.01, rel=0.03)
    assert h.attn.c_attn.bias.abs().max() == 0 and h.ln_1.weight.eq(1).all() and h.ln_1.bias.eq(0).all()


def test_gpt2_124m_size_and_flops():
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=50257))
    assert m.num_params(non_embedding=False) == 124_439_808  # OpenAI's GPT-2 small
    assert m.flops_per_token() == pytest.approx(855e6, rel=0.002)  # 6N + 12*L*H*Q*T
    with torch.device("meta"):
        untied = GPT(GPTConfig(vocab_size=50257, tie_embeddings=False))
    # a head of its own adds V*C weights that multiply, and the embedding lookup multiplies nothing: the same FLOPs
    assert untied.num_params(non_embedding=False) == 124_439_808 + 50257 * 768
    assert untied.flops_per_token() == m.flops_per_token()


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_logits_match_huggingface(attention):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=32,
        vocab_size=50257,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT(small(attention=attention)).eval()
    sd = hf.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            src = sd[name]
            if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
                src = src.t()  # HF Conv1D stores [in, out]
            if name == "transformer.wte.weight":
                p.zero_()
                p[:50257] = src
            else:
                p.copy_(src)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ref = hf(idx).logits
        got, _ = ours(idx)
    assert (got[..., :50257] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(n_embd=65, n_head=4), "divisible"),
        (dict(vocab_size=50000), "smaller than"),
        (dict(n_layer=0), "--n-layer must be at least 1"),
        (dict(attention="flash3"), "attention"),
    ],
)
def test_invalid_shapes_are_user_errors(kw, msg):
    from gptspeed.errors import GptspeedError

    with pytest.raises(GptspeedError, match=msg):
        GPT(small(**kw))


@pytest.mark.parametrize("loss", ["plain", "fused"])
def test_data_softmax_is_the_full_softmax_with_every_other_token_at_probability_zero(loss):
    model = data_softmax_model(loss)
    ref = GPT(small(loss="plain"))
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k != "softmax_ids"})
    x = IDS[torch.randint(0, len(IDS), (2, 32), generator=torch.Generator().manual_seed(1))]
    _, got = model(x, x)
    h = ref.hidden_states(x)
    masked = torch.full((2, 32, 50304), float("-inf"))
    masked[..., IDS] = ref.logits(h)[..., IDS]  # the full head, every column outside IDS at -inf
    want = torch.nn.functional.cross_entropy(masked.view(-1, 50304), x.view(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward()
    want.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    # a target it cannot predict has probability 0: infinite loss, no sync needed to say so
    y = x.clone()
    y[0, 5] = 4
    assert math.isinf(model(x, y)[1].item())
    # sampling sees -inf outside the ids, so it never draws one
    logits, _ = model(x[:, :4])
    outside = torch.ones(50304, dtype=torch.bool)
    outside[IDS] = False
    assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., IDS]).all()
    assert model.flops_per_token(32) < ref.flops_per_token(32)  # the head multiplies by 11 rows, not 50304


@pytest.mark.parametrize(
    ("loss", "softmax"), [("plain", "full"), ("fused", "full"), ("plain", "data"), ("fused", "data")]
)
def test_the_per_position_loss_is_each_targets_cross_entropy_on_every_loss_path(loss, softmax):
    """``reduction="none"`` (the evaluation's forward): ``(B, T)`` fp32, each target's nats from the
    model's logits (-log softmax at the target); their mean is the training forward's loss; under
    ``--softmax data`` a target outside its ids is +inf at that position only."""
    torch.manual_seed(0)
    model = data_softmax_model(loss) if softmax == "data" else GPT(small(loss=loss))
    x = IDS[torch.randint(0, len(IDS), (2, 32), generator=torch.Generator().manual_seed(1))]
    y = x.roll(1, dims=1)
    if softmax == "data":
        y[0, 5] = 4  # not among the ids: probability 0
    with torch.no_grad():
        got = model(x, y, reduction="none")[1]
        want = F.cross_entropy(model(x)[0].view(-1, 50304).float(), y.view(-1), reduction="none").view(2, 32)
        inside, mean = model(x, x, reduction="none")[1], model(x, x)[1]
    assert got.shape == (2, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if softmax == "data":
        assert torch.isinf(got[0, 5]) and torch.isfinite(got.view(-1)[torch.arange(64) != 5]).all()
    torch.testing.assert_close(inside.mean(), mean, rtol=1e-6, atol=1e-6)


def test_data_softmax_ids_travel_with_the_weights_and_are_checked():
    model = data_softmax_model()
    fresh = GPT(small(softmax="data"))  # covers every token until loaded
    assert fresh.softmax_ids.numel() == 50257
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.softmax_ids, IDS)
    for bad in ([5, 3], [3, 3], [-1, 4], [4, 50257], []):
        with pytest.raises(ValueError, match="sorted, unique"):
            fresh.set_softmax_ids(bad)
    assert "softmax_ids" not in GPT(small()).state_dict()  # the default model's checkpoints are unchanged


def test_the_training_forward_returns_no_logits_so_no_vocab_sized_gradient_is_made():
    """The training forward used to return the full (B, T, V) logits, which the step
    throws away; AOTAutograd then built a zero gradient for that output (1.65 GB at GPT-2 124M,
    B=16, bf16) and the backward read it."""
    torch.manual_seed(0)
    model = GPT(small(loss="plain", n_layer=1))
    idx = torch.randint(0, 50257, (2, 16))
    assert model(idx, idx)[0] is None and model(idx, idx, return_logits=True)[0].shape == (2, 16, 50304)
    assert _vocab_sized_zero_fills(model, idx) == []
    # the reference: asking for the logits too brings the zero gradient back (the count can see it)
    assert _vocab_sized_zero_fills(model, idx, return_logits=True) != []


@pytest.mark.parametrize("bad", [[1, 5, 3], [0, 5, 50257], [2, 2, 9]])
def test_softmax_ids_out_of_order_or_range_anywhere_are_refused(bad):
    """Checked over every neighbouring pair and at the last id, not just against the first."""
    model = GPT(small_one_layer(softmax="data"))
    with pytest.raises(ValueError, match=r"^softmax ids must be sorted, unique and in \[0, 50257\)$"):
        model.set_softmax_ids(bad)


def test_softmax_ids_of_any_integer_like_input_are_int64_where_the_model_is():
    model = GPT(small_one_layer(softmax="data"))
    ids = torch.tensor([[0.0, 5.0], [7.0, 9.0]])
    with torch.device("meta"):  # the default device elsewhere: the ids still go where the buffer is
        model.set_softmax_ids(ids)
    assert model.softmax_ids.dtype == torch.int64 and model.softmax_ids.tolist() == [0, 5, 7, 9]
    with torch.device("meta"):
        model.set_softmax_ids([1, 2])
    assert model.softmax_ids.dtype == torch.int64 and model.softmax_ids.device.type == "cpu"
    assert model.softmax_ids.tolist() == [1, 2]


@pytest.mark.parametrize("loss", ["plain", "fused"])
def test_a_target_beyond_the_largest_id_has_infinite_loss(loss):
    """A target above every id (searchsorted's K) is outside like any other: loss +inf, no error."""
    torch.manual_seed(0)
    model = GPT(small_one_layer(softmax="data", loss=loss))
    model.set_softmax_ids([3, 11, 25])
    x = torch.tensor([[3, 11, 25, 3]])
    assert math.isfinite(model(x, x)[1].item())
    y = x.clone()
    y[0, 2] = 4000
    assert math.isinf(model(x, y)[1].item())


# ------------------------------------------------------------------------------ rotary embeddings
def test_rope_tables_are_cos_and_sin_of_position_times_theta_to_the_minus_2i_over_d():
    from gptspeed.model import rope_cos_sin

    pos = torch.tensor([0, 1, 5, 17])
    cos, sin = rope_cos_sin(pos, 8, 500.0)
    want = [[p * 500.0 ** (-2 * i / 8) for i in range(4)] for p in (0, 1, 5, 17)]
    assert cos.shape == sin.shape == (1, 1, 4, 4) and cos.dtype == sin.dtype == torch.float32
    assert torch.allclose(cos[0, 0], torch.tensor(want).cos(), atol=1e-6)
    assert torch.allclose(sin[0, 0], torch.tensor(want).sin(), atol=1e-6)
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])  # per-row positions: (B, 1, T, Q/2)
    cos2, sin2 = rope_cos_sin(rows, 8, 500.0)
    assert cos2.shape == (2, 1, 3, 4) and torch.equal(cos2[1, 0], rope_cos_sin(rows[1], 8, 500.0)[0][0, 0])


def test_rope_tables_are_fp32_on_the_positions_device_whatever_the_defaults():
    from gptspeed.model import rope_cos_sin

    want = rope_cos_sin(torch.arange(6), 8, 10000.0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            cos, sin = rope_cos_sin(torch.arange(6, device="cpu"), 8, 10000.0)
    finally:
        torch.set_default_dtype(old)
    assert cos.device.type == "cpu" and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_rope_rotates_pairs_so_attention_scores_depend_on_distance_only():
    """The rotary property (Su et al. 2021): <R(m) q, R(n) k> depends on n - m only, and the
    rotation keeps norms; in bf16 the result stays bf16."""
    from gptspeed.model import apply_rope, rope_cos_sin

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def rot(x, p):
        return apply_rope(x, *rope_cos_sin(torch.tensor([p]), 8, 100.0))

    score = lambda m, n: float((rot(q, m) * rot(k, n)).sum())  # noqa: E731
    assert score(3, 7) == pytest.approx(score(10, 14), abs=1e-5) == pytest.approx(score(0, 4), abs=1e-5)
    assert score(0, 4) != pytest.approx(score(0, 5), abs=1e-3)
    assert float(rot(q, 9).norm()) == pytest.approx(float(q.norm()), rel=1e-5)
    x1, x2 = q[..., :4], q[..., 4:]  # the "rotate half" layout: pair (i, i + Q/2) turned by angle_i
    c, s = rope_cos_sin(torch.tensor([2]), 8, 100.0)
    assert torch.allclose(rot(q, 2), torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1), atol=1e-6)
    assert rot(q.bfloat16(), 2).dtype == torch.bfloat16


def test_the_document_mask_is_causal_within_each_document():
    from gptspeed.model import document_mask
    from gptspeed.tokenizer import EOT_TOKEN as E

    idx = torch.tensor([[5, 6, E, 7, 8, E, 9], [E, 1, 2, 3, E, 4, 5]])
    assert torch.equal(document_mask(idx), reference_doc_mask(idx))
    with torch.device("meta"):  # explicit devices
        assert document_mask(idx).device.type == "cpu"


def test_the_document_mask_with_a_cache_continues_its_documents_and_keeps_its_padding_mask():
    from gptspeed.model import KVCache, document_mask
    from gptspeed.tokenizer import EOT_TOKEN as E

    first = torch.tensor([[5, E, 6], [1, 2, 3]])
    kv = KVCache(1, 8)
    document_mask(first, kv)  # the prefill: columns 0..2
    kv.start = 3
    nxt = torch.tensor([[7], [E]])
    pad = torch.tensor([[True, True, True, True], [False, True, True, True]])[
        :, None, None, :
    ]  # row 1: column 0 padding
    kv.mask = pad
    got = document_mask(nxt, kv)
    want = reference_doc_mask(nxt, start=3, seg_before=[[0, 1, 1], [0, 0, 0]], pad_mask=pad)
    assert torch.equal(got, want)
    kv.start, kv.mask = 4, None
    got = document_mask(torch.tensor([[E], [9]]), kv)
    assert torch.equal(
        got, reference_doc_mask(torch.tensor([[E], [9]]), start=4, seg_before=[[0, 1, 1, 1], [0, 0, 0, 1]])
    )


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_generation_with_the_document_mask_draws_what_the_uncached_path_draws(attention):
    """A prompt holding a document boundary, continued past it: the KV-cache path (masks built
    against the cached columns' documents) draws the cache-free tokens."""
    from gptspeed.sample import generate, generate_cached
    from gptspeed.tokenizer import EOT_TOKEN as E

    torch.manual_seed(0)
    model = GPT(small_one_layer(doc_mask=True, attention=attention, block_size=32)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
        model.transformer.wte.weight[E] *= 3  # make <|endoftext|> likely, so documents also start while sampling
    idx = torch.tensor([[11, 12, E, 13, 14], [E, 21, 22, 23, 24]])
    for seed in (1, 2):
        a = torch.stack(list(generate(model, idx, 12, generator=torch.Generator().manual_seed(seed))), 1)
        b = torch.stack(list(generate_cached(model, idx, 12, generator=torch.Generator().manual_seed(seed))), 1)
        assert torch.equal(a, b)


def test_cached_generation_with_the_document_mask_keeps_its_ids_where_the_tokens_are():
    """With the default device set elsewhere (meta: no data), left-padded prompts holding document
    boundaries draw the same tokens with the KV cache: the cache's document ids are made on the
    tokens' device, not the default one (on a GPU, ids on the CPU could not be compared there)."""
    from gptspeed.sample import generate_cached, left_pad
    from gptspeed.tokenizer import EOT_TOKEN as E

    torch.manual_seed(0)
    model = GPT(small_one_layer(doc_mask=True, block_size=32)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
    idx, pad = left_pad([[11, 12, E, 13, 14], [E, 21, 22]])

    def run():
        return torch.stack(list(generate_cached(model, idx, 6, pad=pad, generator=torch.Generator().manual_seed(1))), 1)

    want = run()
    with torch.device("meta"):
        got = run()
    assert torch.equal(got, want), "the cached document mask depends on the default device"


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_cached_step_after_a_document_boundary_sees_only_its_own_document(attention, pos_emb):
    """With doc_mask and a KV cache, a token decoded after an <|endoftext|> attends to its own
    document only: its logits are those of the same weights without the mask run on that document
    alone (at the same positions), not influenced by the earlier document in the cache."""
    from gptspeed.model import KVCache
    from gptspeed.tokenizer import EOT_TOKEN as E

    torch.manual_seed(0)
    model = GPT(small_one_layer(doc_mask=True, attention=attention, pos_emb=pos_emb)).eval()
    plain = GPT(small_one_layer(doc_mask=False, attention=attention, pos_emb=pos_emb)).eval()
    plain.load_state_dict(model.state_dict())
    prompt = torch.tensor([[101, 102, 103, E, 201], [301, E, 401, 402, 403]])
    nxt = torch.tensor([[202], [404]])
    with torch.no_grad():
        kv = KVCache(1, 16)
        model(prompt, kv=kv)  # the prefill: columns 0..4
        kv.start = 5
        got = model(nxt, pos=torch.tensor([5]), kv=kv)[0][:, -1]  # (B, V)
        for b, first in ((0, 3), (1, 1)):  # the last document of each row: from its EOT on
            doc = torch.cat([prompt[b, first:], nxt[b]])[None]
            want = plain(doc, pos=torch.arange(first, 6))[0][0, -1]
            torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)
            whole = plain(torch.cat([prompt[b], nxt[b]])[None])[0][0, -1]  # the whole row: differs
            assert (whole - want)[:50257].abs().max() > 1e-3


def test_data_softmax_logits_are_soft_capped_like_gemma2_and_minus_inf_elsewhere():
    """``--softmax data`` with ``logit_softcap``: the ids' logits are ``cap * tanh(z / cap)`` of the
    plain head ``z = h @ W[id]``, every other column -inf."""
    torch.manual_seed(0)
    cap = 3.0
    model = GPT(small_one_layer(softmax="data", logit_softcap=cap))
    ids = [2, 17, 300, 50000]
    model.set_softmax_ids(ids)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # raw logits well past the cap
        h = torch.randn(2, 3, 32)
        got = model.logits(h)
        z = h @ model.lm_head.weight[ids].t()
    assert z.abs().max() > 2 * cap
    torch.testing.assert_close(got[..., ids], cap * torch.tanh(z / cap), rtol=1e-5, atol=1e-5)
    others = torch.ones(got.size(-1), dtype=torch.bool)
    others[ids] = False
    assert bool((got[..., others] == float("-inf")).all())


def test_weights_without_softmax_ids_load_into_a_data_softmax_model_keeping_its_ids():
    """As gptspeed.hf fills a ``--softmax data`` model from GPT-2 weights (strict=False, no
    ``softmax_ids`` in them): every weight is loaded and the model keeps the ids it has."""
    torch.manual_seed(0)
    model = GPT(small_one_layer(softmax="data"))
    model.set_softmax_ids([4, 9, 1000])
    weights = {k: torch.randn_like(v) for k, v in GPT(small_one_layer()).state_dict().items()}
    weights["lm_head.weight"] = weights["transformer.wte.weight"]  # tied
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["softmax_ids"] and unexpected == []
    assert model.softmax_ids.tolist() == [4, 9, 1000]
    assert torch.equal(model.transformer.wte.weight, weights["transformer.wte.weight"])
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, weights["transformer.h.0.attn.c_attn.weight"])


def test_the_data_softmax_takes_the_unused_head_rows_out_of_the_flops_per_token():
    """With K of the V vocabulary rows in the softmax, the LM head multiplies by K rows: the
    training FLOPs per token drop by 6 * (V - K) * C against the full softmax (6N counts each
    weight's multiply-add forward and twice backward), the attention term unchanged."""
    full = GPT(small_one_layer())
    data = GPT(small_one_layer(softmax="data"))
    data.set_softmax_ids([3, 11, 25])
    c = data.config
    want = 6 * (c.vocab_size - 3) * c.n_embd
    assert full.flops_per_token(8) - data.flops_per_token(8) == want, (
        f"the data softmax should save 6*(V-K)*C = {want} FLOPs per token"
    )


def test_value_embeddings_are_lookups_left_out_of_the_flops_per_token():
    """``value_embeds`` = 1 on 2 layers adds a (V, C) lookup table, which multiplies nothing, and two gates in each of
    the 2 layers it mixes into (the first and the last), which do: 4 weights, 6 FLOPs each a token (6N), the
    attention term unchanged."""
    plain = GPT(small_one_layer(n_layer=2))
    ve = GPT(small_one_layer(n_layer=2, value_embeds=1))
    assert ve.num_params() - plain.num_params() == ve.config.vocab_size * ve.config.n_embd + 4
    assert ve.flops_per_token(8) - plain.flops_per_token(8) == 6 * 4


# ------------------------------------------------------------------ what the switches do to the outputs
def test_rope_makes_the_output_depend_on_the_order_of_the_tokens_before():
    """Causal attention with no position information is blind to the order of earlier tokens: the
    output at position 2 of [a, b, c] and [b, a, c] would be the same. With --pos-emb rope (no
    learned positions) the rotations are the only position information, in every block: the two
    must differ."""
    torch.manual_seed(0)
    for n_layer in (1, 2):
        model = GPT(small_one_layer(n_layer=n_layer, pos_emb="rope")).eval()
        assert "wpe" not in model.transformer
        with torch.no_grad():
            a = model(torch.tensor([[5, 9, 3]]))[0][0, 2]
            b = model(torch.tensor([[9, 5, 3]]))[0][0, 2]
        assert not torch.allclose(a, b, atol=1e-5), f"rope, {n_layer} layers: the output ignores the order before it"


def test_qk_norm_makes_attention_blind_to_the_scale_of_the_queries():
    """--qk-norm RMS-normalises q and k per head (Dehghani et al. 2023): scaling the query projection
    by 3 leaves the output as it was; without it the attention sharpens and the output changes."""
    torch.manual_seed(0)
    x = torch.tensor([[5, 9, 3, 7, 1]])
    for qk_norm in (True, False):
        model = GPT(small_one_layer(qk_norm=qk_norm)).eval()
        with torch.no_grad():
            before = model(x)[0]
            attn = model.transformer.h[0].attn
            C = attn.c_attn.in_features
            attn.c_attn.weight[:C].mul_(3.0)
            attn.c_attn.bias[:C].mul_(3.0)
            after = model(x)[0]
        assert torch.allclose(before, after, atol=1e-4) == qk_norm, (
            f"qk_norm={qk_norm}: scaling the queries {'changed' if qk_norm else 'did not change'} the output"
        )


def test_the_relu2_mlp_is_relu_squared_and_the_gelu_one_tanh_gelu():
    from gptspeed.model import MLP

    torch.manual_seed(0)
    x = torch.randn(3, 32)
    for mlp, act in (
        ("relu2", lambda h: torch.relu(h) ** 2),
        ("gelu", lambda h: torch.nn.functional.gelu(h, approximate="tanh")),
    ):
        m = MLP(small_one_layer(mlp=mlp))
        with torch.no_grad():
            torch.testing.assert_close(m(x), m.c_proj(act(m.c_fc(x))), msg=f"--mlp {mlp}")


def test_the_manual_attentions_causal_mask_is_not_saved_with_the_weights():
    """The mask is rebuilt from block_size: a state dict (checkpoint, export) holds weights only."""
    model = GPT(small_one_layer(attention="manual"))
    assert any(name.endswith("causal_mask") for name, _ in model.named_buffers())
    assert not [k for k in model.state_dict() if k.endswith("causal_mask")], "the causal mask was saved"


@pytest.mark.parametrize("T", [1, 2, 3])
def test_a_cached_prefill_of_any_length_is_causal(T):
    """A prompt of T tokens through a fresh cache gives the cache-free logits (T=2 included: the
    first token must not see the second)."""
    from gptspeed.model import KVCache

    torch.manual_seed(0)
    model = GPT(small_one_layer()).eval()
    x = torch.tensor([[5, 9, 3]])[:, :T]
    with torch.no_grad():
        free = model(x)[0]
        cached = model(x, kv=KVCache(1, 8))[0]
    torch.testing.assert_close(cached, free, atol=1e-5, rtol=1e-5)


def test_the_training_forward_returns_the_loss_alone_unless_logits_are_asked_for():
    torch.manual_seed(0)
    model = GPT(small_one_layer(loss="plain"))  # the path that computes logits (the fused one never makes them)
    x, y = torch.tensor([[5, 9, 3]]), torch.tensor([[9, 3, 7]])
    logits, loss = model(x, y)
    assert logits is None and loss.ndim == 0, "with targets the forward returns no logits by default"
    logits, again = model(x, y, return_logits=True)
    assert logits is not None and logits.shape == (1, 3, 50304)
    torch.testing.assert_close(again, torch.nn.functional.cross_entropy(logits.view(-1, 50304)[:, :50257], y.view(-1)))


def test_a_sequence_longer_than_the_block_is_refused_naming_both_lengths():
    model = GPT(small_one_layer())
    with pytest.raises(ValueError, match=r"^sequence length 17 exceeds block_size 16$"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("layer", ["CausalSelfAttention", "Block"])
def test_a_layer_made_alone_caches_into_layer_0(layer):
    """An attention layer or a block built outside a GPT (no layer index given) reads and writes
    layer 0 of a KV cache: the same output with the cache as without, layer 0 filled to its size."""
    import gptspeed.model as m

    torch.manual_seed(0)
    module = getattr(m, layer)(small_one_layer()).eval()
    x = torch.randn(1, 3, 32)
    kv = m.KVCache(n_layer=1, size=8)
    with torch.no_grad():
        torch.testing.assert_close(module(x, kv), module(x))
    assert kv.k[0] is not None and kv.k[0].shape[2] == 8


def test_embeddings_start_as_gpt2s_token_n_0_002_and_positions_n_0_001():
    """GPT-2's initialisation (OpenAI's model.py): token embedding N(0, 0.02), learned positions
    N(0, 0.01). Checked on 50304 x 32 and 16 x 32 draws: mean and standard deviation. Untied: a
    tied token embedding is the LM head's weight, which the Linear init draws again."""
    torch.manual_seed(0)
    model = GPT(small_one_layer(tie_embeddings=False))
    for name, weight, std in (("wte", model.transformer.wte.weight, 0.02), ("wpe", model.transformer.wpe.weight, 0.01)):
        w = weight.detach()
        n = w.numel()
        assert abs(float(w.mean())) < 5 * std / math.sqrt(n), f"{name}: mean {float(w.mean()):.4g}, not 0"
        assert float(w.std()) == pytest.approx(std, rel=0.25 if n < 1000 else 0.02), f"{name}: std {float(w.std()):.4g}"


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


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_training_stays_within_bf16_tolerance_of_the_fp32_stream(compile_backend):
    """bf16 keeps 7 mantissa bits (unit roundoff 2^-8 = 3.9e-3) in each residual add: the losses stay
    within 1e-2 relative of the fp32 stream's, bench verify's bf16 tolerance (measured here: 5e-5
    over the 5 steps, eager and compiled alike); and they are not the same numbers (the branch ran)."""
    ref, got = _losses("float32", compile_backend), _losses("bfloat16", compile_backend)
    assert ref[-1] < ref[0] and got[-1] < got[0]  # the one batch is being learnt
    assert max(abs(a - b) / a for a, b in zip(ref, got)) < 1e-2
    assert ref != got


@pytest.mark.parametrize("kw", [{}, dict(pos_emb="rope")], ids=["learned", "rope"])
def test_kv_cache_sampling_with_a_bf16_residual_stream_draws_the_cache_free_tokens(kw):
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
        *train_args(tmp_path, tmp_path / "r", "--dtype", "float32", "--residual-dtype", "bfloat16", max_steps=None)
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


@pytest.mark.parametrize("name", CASES)
def test_each_switch_trains_every_parameter_and_counts_them(name):
    model = tiny(**CASES[name]).train()
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())  # the size check's count
    idx = with_documents()
    logits, _ = model(idx)
    assert logits.shape == (2, 32, 50304) and torch.isinf(logits[..., 50257:]).all()
    _, loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert silent == []
    if model.config.zero_init_proj:  # zero-initialised output projections learn from the first step
        assert model.transformer.h[0].mlp.c_proj.weight.abs().max() == 0
        # (with an untied head zeroed too, only the head has a gradient at the first step, as in the speedrun)
        first = model.lm_head if not model.config.tie_embeddings else model.transformer.h[0].mlp.c_proj
        assert first.weight.grad.abs().max() > 0
    if not model.config.tie_embeddings:
        assert model.lm_head.weight is not model.transformer.wte.weight
    if model.config.pos_emb == "rope":
        assert "wpe" not in model.transformer


@pytest.mark.parametrize("name", CASES)
def test_kv_cache_sampling_draws_the_cache_free_tokens(name):
    model = tiny(**CASES[name]).eval()
    idx = with_documents(B=2, T=6, seed=3)
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    ref = torch.stack(list(generate(model, idx, 30, temperature=1.0, generator=g())), dim=1)  # past block_size too
    got = torch.stack(list(generate_cached(model, idx, 30, temperature=1.0, generator=g())), dim=1)
    assert torch.equal(ref, got)
    prompts = [[EOT_TOKEN, 11, 12, EOT_TOKEN, 14], [21, 22]]  # left padding too
    batch, pad = left_pad(prompts)
    cached = torch.stack(list(generate_cached(model, batch, 8, temperature=0, pad=pad)), dim=1)
    for row, prompt in enumerate(prompts):
        alone = torch.stack(list(generate(model, torch.tensor([prompt]), 8, temperature=0)), dim=1)
        assert torch.equal(cached[row], alone[0])


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_with_the_document_mask_each_document_computes_as_if_alone(attention):
    """--doc-mask with rotary positions (relative: a document's logits do not depend on where in the
    window it starts): the logits of a packed window equal those of each document run alone."""
    model = tiny(pos_emb="rope", doc_mask=True, attention=attention).eval()
    idx = with_documents(B=1, T=30)
    starts = [0, 10, 20]
    packed = model(idx)[0]
    for a, b in zip(starts, starts[1:] + [30]):
        alone = model(idx[:, a:b])[0]
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-4, atol=1e-4)
    free = tiny(pos_emb="rope", attention=attention).eval()  # the same weights without the mask see across
    free.load_state_dict(model.state_dict())
    assert not torch.allclose(free(idx)[0][:, 10:20], model(idx[:, 10:20])[0], atol=1e-3)
    assert document_ids(idx)[0].tolist() == [1] * 10 + [2] * 10 + [3] * 10


@pytest.mark.parametrize("loss", ["plain", "fused"])
@pytest.mark.parametrize("softmax", ["full", "data"])
def test_soft_capped_logits_and_loss_through_every_loss_path(loss, softmax):
    """cap * tanh(logits / cap) (Gemma 2): the logits stay within +-cap, and each loss path's loss and
    gradients equal the formula's, computed here from the plain logits."""
    cap = 2.0
    model = tiny(logit_softcap=cap, loss=loss, softmax=softmax)
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(5))
    if softmax == "data":
        model.set_softmax_ids(torch.unique(idx))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(50)  # logits far beyond the cap
    _, got = model(idx, idx)
    h = model.hidden_states(idx)
    ids = model.softmax_ids if softmax == "data" else torch.arange(50257)
    raw = h @ model.lm_head.weight[ids].t()
    capped = cap * torch.tanh(raw / cap)
    target = torch.searchsorted(ids, idx.reshape(-1))
    want = F.cross_entropy(capped.reshape(-1, ids.numel()), target)
    assert (
        raw.abs().max() > 5 * cap
        and model(idx)[0][..., :50257].isfinite().logical_and(model(idx)[0][..., :50257].abs() > cap + 1e-5).sum() == 0
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g_got = torch.autograd.grad(got, model.lm_head.weight)[0]
    g_want = torch.autograd.grad(want, model.lm_head.weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("hf_offline")
def test_a_modern_run_exports_to_transformers_and_samples(shakespeare_data, tmp_path):
    flags = dict(
        TINY_MODEL,
        n_layer=2,  # --value-embeds 1 needs 2 layers
        **{k: v for k, v in ALL.items() if k not in ("doc_mask", "attn_window", "attn_window_start")},
        doc_mask=True,
        lr_schedule="wsd",
        data=str(shakespeare_data),
        batch_size=4,
        max_steps=4,
        eval_every=0,
        log_every=1,
        device="cpu",
        dtype="float32",
        warmup_steps=1,
    )
    full = tmp_path / "full"
    fit(build_train_config("pico", dict(flags, out=str(full))), echo=False)
    out = tmp_path / "hf"
    assert run_main("export-hf", "--run", str(full), "--out", str(out)).returncode == 0
    transformers = pytest.importorskip("transformers")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    model, _ = load_model(full, resolve_runtime("cpu", "float32"))
    idx = with_documents()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx)[0][..., :50257], atol=1e-5, rtol=0)
    proc = run_main("sample", "--run", str(full), "--max-new-tokens", "4", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr


# ---- each switch against its paper's formula, at the layer's output
FP32_EPS = torch.finfo(torch.float32).eps  # the eps of nn.RMSNorm / F.rms_norm given none, for fp32 inputs


def paper_model(seed=0, **kw) -> GPT:
    """A 2-layer tiny GPT in eval mode whose every parameter is drawn at random (N(0, 0.2); the
    norms' gains 1 + N(0, 0.2)), so no zero bias or unit gain can hide a term of a formula."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**dict(TINY_MODEL, n_layer=2), **kw}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.2 * torch.randn(p.shape, generator=g)
            p.copy_(noise + 1 if ".ln_" in name and name.endswith("weight") else noise)
    return model.eval()


def layer_io(model: GPT, layers: dict, idx: torch.Tensor, **kw) -> dict:
    """``{name: (input, output)}`` of each module in ``layers`` during one forward of ``model``."""
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (args[0], out)))
        for name, m in layers.items()
    ]
    try:
        with torch.no_grad():
            model(idx, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert set(seen) == set(layers)
    return seen


def heads_by_hand(attn, x: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v ``(B, H, T, Q)`` in fp64 from the layer's fused projection ``x W^T + b`` (split in
    three along the channels, then each into ``H`` heads of ``Q`` channels)."""
    B, T, C = x.shape
    qkv = x.double() @ attn.c_attn.weight.double().t() + attn.c_attn.bias.double()
    return [t.reshape(B, T, attn.n_head, C // attn.n_head).permute(0, 2, 1, 3) for t in qkv.split(C, dim=-1)]


def attend_by_hand(attn, q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1), ``softmax(q k^T / sqrt(Q)) v`` with
    the scores of the pairs ``allowed`` ``(B, T, S)`` forbids at -inf, heads concatenated, then the
    output projection: the attention layer's output ``(B, T, C)``, fp64."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    y = scores.softmax(dim=-1) @ v
    B, H, T, Q = y.shape
    y = y.permute(0, 2, 1, 3).reshape(B, T, H * Q)
    return y @ attn.c_proj.weight.double().t() + attn.c_proj.bias.double()


def causal(B: int, T: int) -> torch.Tensor:
    """``(B, T, T)``: query ``t`` may see key ``s`` iff ``s <= t``."""
    return torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)


def roformer_rotation(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """RoFormer (Su et al. 2021) eq. 34: the pair ``(x_i, x_{i + Q/2})`` of ``x`` ``(B, H, T, Q)``, as the
    complex number ``x_i + j x_{i + Q/2}``, times ``exp(j m theta_i)`` at position ``m``, with
    ``theta_i = base^(-2i/Q)``, ``i = 0 .. Q/2 - 1``. The pairs are gptspeed's half-split layout
    (GPT-NeoX / Llama "rotate half"); the paper pairs neighbours ``(x_2i, x_2i+1)``, the same rotation
    up to a fixed permutation of the channels. ``pos``: ``(T,)`` or ``(B, T)``."""
    Q = x.size(-1)
    theta = torch.tensor([base ** (-2 * i / Q) for i in range(Q // 2)], dtype=torch.float64)
    angle = pos.double()[..., None] * theta  # (T, Q/2) or (B, T, Q/2)
    angle = angle[:, None] if angle.dim() == 3 else angle
    z = torch.complex(x[..., : Q // 2], x[..., Q // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("blocks", [{}, dict(unet_skips=True)], ids=["blocks", "unet-skips"])
def test_rope_rotates_q_and_k_as_roformer_eq_34_at_every_attention_output(blocks):
    """--pos-emb rope: each attention layer's output is softmax attention over queries and keys
    rotated as RoFormer's eq. 34 (Su et al. 2021; theta_i = base^(-2i/d), the base --rope-theta, here
    not the default), values unrotated -- at the default positions and at per-row positions; also
    through the speedrun's blocks (--unet-skips)."""
    model = paper_model(pos_emb="rope", rope_theta=500.0, **blocks)
    idx = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(3))
    for pos in (torch.arange(12), torch.stack([torch.arange(12) + 5, torch.arange(12) + 17])):
        layers = {f"h{i}": block.attn for i, block in enumerate(model.transformer.h)}
        for name, (x, out) in layer_io(model, layers, idx, pos=pos).items():
            attn = layers[name]
            q, k, v = heads_by_hand(attn, x)
            q, k = roformer_rotation(q, pos, 500.0), roformer_rotation(k, pos, 500.0)
            want = attend_by_hand(attn, q, k, v, causal(2, 12))
            torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}, {pos=}: {m}")


def test_qk_norm_rms_normalises_each_heads_q_and_k_before_the_dot_product():
    """--qk-norm (QK-Norm: Henry et al. 2020; Dehghani et al. 2023, who use LayerNorm): q and k of
    each head divided by their root mean square over the head's channels, ``q / sqrt(mean(q^2) +
    eps)``, no gain, as modded-nanogpt's ``F.rms_norm`` (eps: fp32's machine epsilon), then
    attention with the usual ``1 / sqrt(Q)``; v untouched. Checked at each attention layer's output,
    also with queries shrunk 10^4-fold, where the eps decides the result."""
    model = paper_model(qk_norm=True)
    idx = torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(4))

    def rms_normalised(t):
        return t / torch.sqrt(t.square().mean(dim=-1, keepdim=True) + FP32_EPS)

    for q_scale in (1.0, 1e-4):
        with torch.no_grad():
            for block in model.transformer.h:  # the query rows of the fused projection
                C = block.attn.c_attn.in_features
                block.attn.c_attn.weight[:C] *= q_scale
                block.attn.c_attn.bias[:C] *= q_scale
        layers = {f"h{i}": block.attn for i, block in enumerate(model.transformer.h)}
        for name, (x, out) in layer_io(model, layers, idx).items():
            attn = layers[name]
            q, k, v = heads_by_hand(attn, x)
            want = attend_by_hand(attn, rms_normalised(q), rms_normalised(k), v, causal(2, 10))
            torch.testing.assert_close(
                out, want.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}, q x {q_scale}: {m}"
            )


def test_rmsnorm_is_zhang_and_sennrichs_x_over_its_rms_times_the_gain_at_every_norm():
    """--norm rmsnorm (Zhang & Sennrich 2019, eq. 4): every norm of the model (both of each block's
    and the final one) outputs ``x / sqrt(mean(x^2) + eps) * g`` -- no mean subtracted, no bias,
    eps nn.RMSNorm's default (fp32's machine epsilon); also on rows so small that the eps decides."""
    model = paper_model(norm="rmsnorm")
    idx = torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(5))
    layers = {"ln_f": model.transformer.ln_f}
    for i, block in enumerate(model.transformer.h):
        layers.update({f"h{i}.ln_1": block.ln_1, f"h{i}.ln_2": block.ln_2})

    def by_hand(norm, x):
        x = x.double()
        return (x / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + FP32_EPS) * norm.weight.double()).float()

    for name, (x, out) in layer_io(model, layers, idx).items():
        torch.testing.assert_close(out, by_hand(layers[name], x), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    tiny_rows = torch.randn(3, 32, generator=torch.Generator().manual_seed(6)) * torch.tensor([[1.0], [1e-3], [1e-5]])
    with torch.no_grad():
        out = model.transformer.ln_f(tiny_rows)
    torch.testing.assert_close(out, by_hand(model.transformer.ln_f, tiny_rows), rtol=1e-5, atol=1e-6)


def test_soft_capped_logits_are_gemma2s_cap_times_tanh_of_the_heads_logits_over_cap():
    """--logit-softcap (Gemma 2, Gemma Team 2024): the model's logits are ``cap * tanh(z / cap)`` of the
    head's ``z = h W^T`` (``h`` the final norm's output, ``W`` the tied embedding), here with ``z`` far
    beyond the cap, where a clamp or a missing cap would show; the padded columns stay -inf."""
    cap = 2.0
    model = paper_model(logit_softcap=cap)
    with torch.no_grad():
        model.transformer.wte.weight *= 10  # logits far beyond the cap
    idx = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(7))
    _, h = layer_io(model, {"ln_f": model.transformer.ln_f}, idx)["ln_f"]
    z = h.double() @ model.transformer.wte.weight.double().t()
    with torch.no_grad():
        logits = model(idx)[0]
    assert z[..., :50257].abs().max() > 5 * cap, "the test needs logits well past the cap"
    torch.testing.assert_close(
        logits[..., :50257], (cap * torch.tanh(z / cap))[..., :50257].float(), rtol=1e-5, atol=1e-5
    )
    assert bool((logits[..., 50257:] == float("-inf")).all())


class _MatmulReturningAView(torch.autograd.Function):
    """``x W^T`` returned as a view of a tensor made inside the Function, as torchao's FP8 matmul returns
    its output (autograd forbids writing into such a view)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        out = x @ w.t()
        return out.view(out.shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.reshape(-1, g.size(-1)).t() @ x.reshape(-1, x.size(-1))


class _HeadReturningAView(torch.nn.Linear):
    returns_view = True  # what gptspeed.fp8 marks its converted head with

    def forward(self, x):
        return _MatmulReturningAView.apply(x, self.weight)


def test_the_padding_is_masked_in_the_heads_output_or_in_a_new_tensor_for_a_head_returning_a_view():
    """The logits are ``h W^T`` (``W`` the tied embedding), the 47 padded columns -inf. A plain head's
    output is masked in place: the logits returned are the head's own output, no second ``(..., V)``
    tensor. A head marked ``returns_view`` (gptspeed.fp8's) gets a new masked tensor -- writing into its
    output would raise -- with the same logits, and the gradient of ``W`` is the sum of ``h`` over the
    positions in each valid row, 0 in the padded ones."""
    model = tiny()
    h = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))
    W = model.lm_head.weight
    want = (h.double() @ W.detach().double().t())[..., :50257]
    outputs = []
    model.lm_head.register_forward_hook(lambda module, args, out: outputs.append(out))
    with torch.no_grad():
        logits = model.logits(h)
    assert logits is outputs[-1], "the padding was masked into a new tensor, not in the head's output"
    for head in (model.lm_head, _HeadReturningAView(32, 50304, bias=False)):
        head.weight = W
        model.lm_head = head
        W.grad = None
        logits = model.logits(h)
        torch.testing.assert_close(logits[..., :50257], want.float(), rtol=1e-5, atol=1e-6)
        assert logits.shape == (2, 3, 50304) and bool((logits[..., 50257:] == float("-inf")).all())
        logits[..., :50257].sum().backward()
        torch.testing.assert_close(W.grad[:50257], h.sum(dim=(0, 1)).expand(50257, 32), rtol=1e-5, atol=1e-5)
        assert not W.grad[50257:].any()


def test_a_head_returning_a_view_masks_the_padding_on_the_logits_device():
    """The padding mask of a head marked ``returns_view`` (gptspeed.fp8's, on an accelerator) is made on the
    logits' device, not on the default one: a model whose weights live off the CPU (here the meta device)
    gets its ``(..., vocab_size)`` logits back on that device."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**dict(TINY_MODEL, block_size=16)))
    model.lm_head.returns_view = True
    logits = model.logits(torch.empty(2, 3, 32, device="meta"))
    assert logits.device.type == "meta" and logits.shape == (2, 3, 50304)


@pytest.mark.parametrize("kw", [{}, dict(tie_embeddings=False)], ids=["tied", "untied"])
def test_zero_init_makes_every_block_the_identity_so_the_model_is_its_embeddings_norm_and_head(kw):
    """--zero-init-proj (the modded-nanogpt speedrun's): at initialisation the blocks' output
    projections are zero, so each block adds nothing to the residual stream and the model's output
    is that of the model with its blocks removed: ``LayerNorm(wte[idx] + wpe[pos]) W^T`` (LayerNorm:
    Ba et al. 2016, ``(x - mean) / sqrt(var + 1e-5) * g + b``), ``W`` the tied embedding, or an untied
    head, itself zero (every valid logit 0: the uniform prediction)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**dict(TINY_MODEL, n_layer=2), "zero_init_proj": True, **kw})).eval()
    idx = torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(8))
    x = (model.transformer.wte.weight[idx] + model.transformer.wpe.weight[:10]).double()
    ln = model.transformer.ln_f
    mean, var = x.mean(dim=-1, keepdim=True), x.var(dim=-1, unbiased=False, keepdim=True)
    h = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight.double() + ln.bias.double()
    head = model.lm_head.weight.double()
    with torch.no_grad():
        logits = model(idx)[0]
        hidden = model.hidden_states(idx)
    torch.testing.assert_close(hidden, h.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[..., :50257], (h @ head.t())[..., :50257].float(), rtol=1e-5, atol=1e-5)
    if not model.config.tie_embeddings:
        assert bool((logits[..., :50257] == 0).all())


@pytest.mark.parametrize(
    "attention, blocks",
    [("sdpa", {}), ("manual", {}), ("sdpa", dict(unet_skips=True))],
    ids=["sdpa", "manual", "unet-skips"],
)
def test_the_document_mask_attends_each_token_over_the_earlier_tokens_of_its_document_only(attention, blocks):
    """--doc-mask: each attention layer's output is softmax attention in which a token sees only the
    tokens at or before it in its own document (a document begins at its <|endoftext|>; the tokens
    before a row's first one are an earlier document's tail): masked attention computed by hand from
    q, k, v of the layer's weights, the documents found by walking each row; also through the
    speedrun's blocks (--unet-skips)."""
    model = paper_model(doc_mask=True, attention=attention, **blocks)
    idx = torch.randint(0, 50000, (2, 12), generator=torch.Generator().manual_seed(9))
    idx[0, [0, 4, 5, 9]] = EOT_TOKEN  # documents [0..3], [4], [5..8], [9..11]
    idx[1, [3, 8]] = EOT_TOKEN  # a tail [0..2], then [3..7], [8..11]
    docs = []
    for row in idx.tolist():
        d, ids = 0, []
        for token in row:
            d += token == EOT_TOKEN
            ids.append(d)
        docs.append(ids)
    allowed = torch.tensor(
        [[[s <= t and ids[s] == ids[t] for s in range(12)] for t in range(12)] for ids in docs], dtype=torch.bool
    )
    layers = {f"h{i}": block.attn for i, block in enumerate(model.transformer.h)}
    for name, (x, out) in layer_io(model, layers, idx).items():
        want = attend_by_hand(layers[name], *heads_by_hand(layers[name], x), allowed)
        torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---- the speedrun's value embeddings and U-net skips, against their formulas


def test_value_embeddings_are_mixed_into_the_values_by_the_layers_gates():
    """The modded-nanogpt speedrun's value embeddings: ``v' = g0 * v + g1 * E[idx]`` per token, then
    causal softmax attention over ``v'`` (Vaswani et al. 2017, eq. 1) and the output projection,
    computed by hand from the layer's weights."""
    model = tiny(value_embeds=1).double()
    attn = model.transformer.h[1].attn
    with torch.no_grad():
        attn.ve_gates.copy_(torch.tensor([0.7, -1.3]))
    torch.manual_seed(1)
    idx = torch.randint(0, 50257, (2, 12))
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    ve = model.transformer.ve[0](idx)
    got = attn(x, ve=ve)
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(32, dim=2)
    v = 0.7 * v + -1.3 * model.transformer.ve[0].weight[idx]
    heads = lambda t: t.view(2, 12, 2, 16).transpose(1, 2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-2, -1) / 4.0
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    y = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(2, 12, 32)
    torch.testing.assert_close(got, y @ attn.c_proj.weight.T + attn.c_proj.bias)


def test_value_embedding_i_goes_to_block_i_and_to_block_n_minus_n_plus_i_and_no_other():
    model = tiny(value_embeds=2, n_layer=5).eval()
    seen = {}
    for i, block in enumerate(model.transformer.h):
        block.attn.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, args[4]))
    idx = torch.randint(0, 50257, (1, 7))
    model(idx)
    want = {0: 0, 1: 1, 2: None, 3: 0, 4: 1}  # the speedrun's 12 layers with 3: 0 1 2 . . . . . . 0 1 2
    for i, j in want.items():
        if j is None:
            assert seen[i] is None and not hasattr(model.transformer.h[i].attn, "ve_gates")
        else:
            torch.testing.assert_close(seen[i], model.transformer.ve[j](idx))
    with pytest.raises(GptspeedError, match="--value-embeds 3 mixes into the first and the last 3 blocks: at most"):
        GPTConfig(**dict(TINY_MODEL, n_layer=5, value_embeds=3)).validate()


def test_value_embedding_gates_start_at_one_half_each():
    """Every layer mixing a value embedding starts with the gates ``ve_gates`` = (0.5, 0.5) (the speedrun's):
    a fresh layer's values are ``0.5 * v + 0.5 * E[idx]``."""
    model = tiny(value_embeds=1, block_size=16)
    for block in model.transformer.h:
        assert torch.equal(block.attn.ve_gates.detach(), torch.tensor([0.5, 0.5]))


def test_under_bf16_autocast_the_value_embedding_gates_multiply_in_bf16_and_get_the_bf16_products_gradients():
    """Under bf16 autocast the values are bf16, and so is their mix: ``v' = bf16(g0) * v + bf16(g1) * bf16(E[idx])``,
    then causal attention and the output projection; its backward multiplies the values' gradient by the same bf16
    gates. Output and every weight's gradient (the gates' bf16 numbers, cast to the fp32 gates) are those of a
    hand-written mix in bf16, to the bit."""
    model = tiny(value_embeds=1, block_size=16)
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        attn.ve_gates.copy_(torch.tensor([0.7, -1.3]))
    idx = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    ve = model.transformer.ve[0](idx).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn(x, ve=ve)
    names, weights = zip(*attn.named_parameters())
    grads = torch.autograd.grad(got.float().square().sum(), weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn.c_attn(x).split(32, dim=2)
        g = attn.ve_gates.to(torch.bfloat16)
        v = g[0] * v + g[1] * ve.to(torch.bfloat16)
        heads = lambda t: t.view(2, 12, 2, 16).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        want = attn.c_proj(y.transpose(1, 2).reshape(2, 12, 32))
    want_grads = torch.autograd.grad(want.float().square().sum(), weights)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    for name, grad, want_grad in zip(names, grads, want_grads):
        assert torch.equal(grad, want_grad), f"the gradient of {name}"
    gates = grads[names.index("ve_gates")]
    assert torch.equal(gates, gates.to(torch.bfloat16).float())  # bf16 numbers, cast to the fp32 gates


def test_under_bf16_autocast_the_kv_cache_of_value_embedding_layers_holds_bf16():
    """A layer mixing a value embedding (fp32, a lookup) into its bf16 values keeps bf16 values: the cache it
    fills under bf16 autocast holds keys and values in bf16, the dtype attention computes in (the memory
    check of sampling counts 2 bytes an element)."""
    from gptspeed.model import KVCache

    model = tiny(value_embeds=1, block_size=16).eval()
    cache = KVCache(2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([[1, 2, 3]]), kv=cache)
    assert {t.dtype for t in (*cache.k, *cache.v)} == {torch.bfloat16}


@pytest.mark.parametrize("n_layer", [4, 5])
def test_unet_skips_add_each_first_half_output_to_its_mirror_block_by_its_weight(n_layer):
    """U-net skips (Ronneberger et al. 2015, as the speedrun wires its blocks): with ``h = n_layer // 2``
    the outputs of blocks ``0 .. h-1`` are kept, and block ``n_layer - h + m`` first adds
    ``w[m] * output(h - 1 - m)``; computed here block by block, with random skip weights."""
    model = tiny(unet_skips=True, n_layer=n_layer).eval()
    with torch.no_grad():
        model.skip_weights.copy_(torch.randn(n_layer // 2) * 2)
    idx = torch.randint(0, 50257, (2, 9))
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(9))
    outs, h = [], n_layer // 2
    for i, block in enumerate(model.transformer.h):
        if i >= n_layer - h:
            m = i - (n_layer - h)
            x = x + model.skip_weights[m] * outs[h - 1 - m]
        x = block(x)
        outs.append(x)
    torch.testing.assert_close(model.hidden_states(idx), model.transformer.ln_f(x))
    assert model.skip_weights.shape == (n_layer // 2,)


def test_under_a_bf16_stream_the_skip_weight_gets_the_gradient_of_its_bf16_product():
    """With ``residual_dtype="bfloat16"`` under bf16 autocast the skip ``w * output(0)`` is added to the bf16
    stream as a bf16 product, ``bf16(w) * output(0)``, and the backward multiplies the stream's gradient by the
    same bf16 weight: the loss and every weight's gradient (the skip weight's a bf16 number) are those of a
    hand-written forward of the 2 blocks, to the bit."""
    model = tiny(unet_skips=True, residual_dtype="bfloat16", block_size=16)
    with torch.no_grad():
        model.skip_weights.fill_(0.7)
    idx = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(2))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    loss = lambda h: F.cross_entropy(model.logits(h).float().flatten(0, 1), targets.flatten())  # noqa: E731
    with bf16():
        got = loss(model.hidden_states(idx))
    names, weights = zip(*model.named_parameters())
    grads = torch.autograd.grad(got, weights)
    with bf16():
        x = (model.transformer.wte(idx) + model.transformer.wpe(torch.arange(9))).to(torch.bfloat16)
        x = model.transformer.h[0](x)
        x = x + model.skip_weights[0].to(torch.bfloat16) * x
        want = loss(model.transformer.ln_f(model.transformer.h[1](x)))
    want_grads = torch.autograd.grad(want, weights)
    assert torch.equal(got, want)
    for name, grad, want_grad in zip(names, grads, want_grads):
        assert torch.equal(grad, want_grad), f"the gradient of {name}"
    skip = grads[names.index("skip_weights")]
    assert torch.equal(skip, skip.to(torch.bfloat16).float())  # a bf16 number, cast to the fp32 weight


def test_the_speedruns_logit_rescale_30_sigmoid_over_7_5_is_the_soft_cap_of_15():
    """The modded-nanogpt speedrun rescales its logits as ``30 * sigmoid(z / 7.5)``, which is
    ``15 * tanh(z / 15) + 15`` (``2 sigmoid(2x) = tanh(x) + 1``): --logit-softcap 15 up to a constant,
    which softmax ignores. Same loss and same gradients, computed here from the speedrun's formula."""
    model = tiny(logit_softcap=15.0, tie_embeddings=False).double()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 3.0)  # logits far past the cap, where the two would differ if they did
    idx = torch.randint(0, 50257, (2, 10))
    _, loss = model(idx, idx)
    (g_ours,) = torch.autograd.grad(loss, model.lm_head.weight)
    z = model.lm_head(model.hidden_states(idx))[..., :50257]
    theirs = F.cross_entropy((30 * torch.sigmoid(z / 7.5)).view(-1, 50257), idx.view(-1))
    (g_theirs,) = torch.autograd.grad(theirs, model.lm_head.weight)
    torch.testing.assert_close(loss.double(), theirs, rtol=1e-6, atol=0)  # the plain path's loss is fp32
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-9)
    assert z.abs().max() > 45  # 3 caps out: the cap was exercised


# ---- sliding-window attention (--attn-window), against its rule


def window_rule(idx: torch.Tensor, window: int, documents: bool) -> torch.Tensor:
    """``(B, T, T)``: query ``t`` may see key ``s`` iff ``s <= t`` and ``t - s < window`` (at most the last
    ``window`` tokens, itself included: Beltagy et al. 2020, Longformer's sliding window) and, with
    ``documents``, ``s`` and ``t`` are in the same document (walking each row: a document starts at its
    <|endoftext|>)."""
    B, T = idx.shape
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    for b, row in enumerate(idx.tolist()):
        docs = [sum(tok == EOT_TOKEN for tok in row[: i + 1]) for i in range(T)]
        for t in range(T):
            for s in range(T):
                allowed[b, t, s] = s <= t and t - s < window and (not documents or docs[s] == docs[t])
    return allowed


@pytest.mark.parametrize(
    "kw", [{}, dict(window=3), dict(documents=True, window=3)], ids=["causal", "window", "documents-window"]
)
def test_attention_allowed_adds_the_window_and_the_documents_only_when_asked(kw):
    """``attention_allowed``'s rule (:func:`window_rule`): causal alone by default, one ``(1, 1, T, T)`` mask for
    the batch; ``window=W``: the last W tokens only; ``documents=True``: within each row's documents too,
    ``(B, 1, T, T)``."""
    from gptspeed.model import attention_allowed

    idx = torch.randint(0, 50000, (2, 10), generator=torch.Generator().manual_seed(5))
    idx[0, [0, 4]] = EOT_TOKEN
    idx[1, 6] = EOT_TOKEN
    documents = kw.get("documents", False)
    got = attention_allowed(idx, **kw)
    assert got.shape == (2 if documents else 1, 1, 10, 10)
    assert torch.equal(got[:, 0].expand(2, 10, 10), window_rule(idx, kw.get("window", 10), documents))


@pytest.mark.parametrize("start, T", [(0, 8), (0, 9), (5, 3), (5, 4)])
def test_an_eval_window_covering_every_column_leaves_plain_causal_attention(start, T):
    """Eval mode, --attn-window 8: where the window covers every key column (``start + T <= 8``: a forward
    of 8 tokens, or a cached step whose columns end at column 8) there is no mask (None: plain causal
    attention, SDPA's causal kernels); one column more and the mask is the window's: query column ``q``
    sees key ``k`` iff ``k <= q < k + 8``."""
    from gptspeed.model import KVCache

    model = tiny(attn_window=8).eval()
    idx = torch.randint(0, 50000, (1, T), generator=torch.Generator().manual_seed(6))
    kv = None
    if start:
        kv = KVCache(model.config.n_layer, model.config.block_size)
        kv.start = start
    mask = model.attention_mask(idx, kv)
    if start + T <= 8:
        assert mask is None
    else:
        want = [[k <= q < k + 8 for k in range(start + T)] for q in range(start, start + T)]
        assert mask.shape == (1, 1, T, start + T) and mask[0, 0].tolist() == want


@pytest.mark.parametrize("doc_mask", [False, True], ids=["alone", "doc-mask"])
@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_sliding_window_attention_attends_each_token_over_its_last_w_tokens_only(attention, doc_mask):
    """--attn-window: each attention layer's output is softmax attention over the keys of the window
    rule (:func:`window_rule`), computed by hand in fp64 from q, k, v of the layer's weights. Eval mode
    uses the final window (1, 5, or 12 = T: plain causal); training mode the window set last by
    ``set_attn_window`` (1, 5, 12, 32, under a final window of 32)."""
    idx = torch.randint(0, 50000, (2, 12), generator=torch.Generator().manual_seed(4))
    idx[0, [0, 6]] = EOT_TOKEN
    idx[1, [3, 4, 10]] = EOT_TOKEN

    def check(model, window):
        layers = {f"h{i}": block.attn for i, block in enumerate(model.transformer.h)}
        allowed = window_rule(idx, window, doc_mask)
        for name, (x, out) in layer_io(model, layers, idx).items():
            want = attend_by_hand(layers[name], *heads_by_hand(layers[name], x), allowed)
            torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} W={window}: {m}")

    for window in (1, 5, 12):
        check(paper_model(attn_window=window, doc_mask=doc_mask, attention=attention), window)
    model = paper_model(attn_window=32, doc_mask=doc_mask, attention=attention).train()
    for window in (1, 5, 12, 32):
        model.set_attn_window(window)
        check(model, window)
    model.eval()  # eval mode: the final window, whatever the training window last was
    model.set_attn_window(3)
    check(model, 32)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_cached_decode_step_attends_to_the_last_w_positions_only(attention, pos_emb):
    """--attn-window 3 over 2 layers: a token's logits depend on the 2 * (3 - 1) = 4 tokens before it
    and on no earlier one. Each cached decode step gives the logits of the cache-free forward over
    the whole sequence; changing the tokens further back than 4 changes no cached step's logits,
    changing the 4th one back does."""
    from gptspeed.model import KVCache

    model = tiny(attn_window=3, attention=attention, pos_emb=pos_emb).eval()
    seq = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(7))

    def cached_logits(seq, prompt=10):
        kv = KVCache(model.config.n_layer, model.config.block_size)
        out = [model(seq[:, :prompt], kv=kv, logits_at=(slice(None), -1))[0]]
        kv.start = prompt
        for t in range(prompt, seq.size(1)):
            out.append(model(seq[:, t : t + 1], pos=torch.tensor([t]), kv=kv, logits_at=(slice(None), -1))[0])
            kv.start += 1
        return torch.stack(out, dim=1)  # (1, 11, V): the logits after 10, 11, .., 20 tokens

    with torch.no_grad():
        got = cached_logits(seq)
        free = torch.stack([model(seq[:, :t])[0][:, -1] for t in range(10, 21)], dim=1)
        torch.testing.assert_close(got, free, rtol=1e-5, atol=1e-5)
        far = seq.clone()
        far[0, :15] = torch.randint(0, 50257, (15,), generator=torch.Generator().manual_seed(8))
        torch.testing.assert_close(cached_logits(far)[:, -1], got[:, -1], rtol=0, atol=0)  # 5+ back: unseen
        near = seq.clone()
        near[0, 15] = (seq[0, 15] + 1) % 50257  # 4 back from the last token: seen
        assert not torch.allclose(cached_logits(near)[:, -1], got[:, -1])


def test_the_window_is_refused_in_one_line_past_the_sequence_length_and_by_export():
    with pytest.raises(GptspeedError, match=r"^--attn-window 64 is the final attention window .* --seq-len 32"):
        GPTConfig(**dict(TINY_MODEL, attn_window=64)).validate()
    with pytest.raises(GptspeedError, match="--attn-window-start must be at least 1"):
        GPTConfig(**dict(TINY_MODEL, attn_window=16, attn_window_start=0)).validate()
    assert GPTConfig(**dict(TINY_MODEL, attn_window=16)).non_gpt2_switches() == ["--attn-window 16"]
    from gptspeed.hf.export import check_exportable  # no exported modeling code computes the window (yet)

    with pytest.raises(GptspeedError, match="^the run uses --attn-window 16,"):
        check_exportable(GPTConfig(**dict(TINY_MODEL, attn_window=16)), "the run")
    assert_user_error(
        run_main("train", "--attn-window", "64", "--seq-len", "32", "--device", "cpu"), "--attn-window 64"
    )
    model = tiny(attn_window=8)
    with pytest.raises(ValueError, match="outside 1 .. 8"):
        model.set_attn_window(9)
    assert GPTConfig(**dict(TINY_MODEL, attn_window=8)).buffer_bytes() == 8 == model.attn_window_now.element_size()


def test_the_attention_window_in_effect_is_not_saved():
    """The training window (``set_attn_window``) is a pure function of the step: not in the state dict, whose
    keys are those of the same model without ``attn_window``; a model loading it keeps its own window."""
    model = tiny(attn_window=8, block_size=16)
    model.set_attn_window(3)
    state = model.state_dict()
    assert "attn_window_now" not in state
    assert set(state) == set(tiny(block_size=16).state_dict())
    fresh = tiny(attn_window=8, block_size=16)
    fresh.load_state_dict(state)
    assert int(fresh.attn_window_now) == 8 and int(model.attn_window_now) == 3


def test_a_run_whose_window_grows_across_the_resume_point_resumes_to_the_bit(shakespeare_data, tmp_path):
    """--seq-len 256 --attn-window 256 --attn-window-start 64 over 6 steps: windows 128, 128, 128, 256,
    256, 256 (64 + 32 * step, rounded up to 128); a run resumed from its checkpoint at step 3 trains
    steps 3..5 with the windows of the run never stopped, to the bit."""
    from gptspeed.schedules import attn_window_at

    flags = dict(
        TINY_MODEL,
        block_size=256,
        attn_window=256,
        attn_window_start=64,
        softmax="data",
        data=str(shakespeare_data),
        batch_size=2,
        max_steps=6,
        save_every=3,
        eval_every=0,
        log_every=1,
        device="cpu",
        dtype="float32",
        warmup_steps=1,
    )
    cfg = build_train_config("pico", dict(flags, out=str(tmp_path / "full")))
    assert [attn_window_at(s, cfg) for s in range(6)] == [128, 128, 128, 256, 256, 256]
    fit(cfg, echo=False)
    part = tmp_path / "part"
    part.mkdir()
    for name in ("ckpt_00000003.pt", "ckpt_00000003.json", "config.json"):
        (part / name).write_bytes((tmp_path / "full" / name).read_bytes())
    fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    full, resumed = train_losses(tmp_path / "full"), train_losses(part)
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("doc_mask", [False, True], ids=["alone", "doc-mask"])
def test_the_block_mask_of_cuda_applies_the_same_rule(doc_mask):
    """The FlexAttention ``BlockMask`` a CUDA training forward builds (``GPT._block_mask``), built here
    from CPU token ids and run by FlexAttention's unfused CPU path: attention over the keys of the
    window rule, for a window given as an int (eval) or a 0-dim tensor (training), against the
    masked softmax written out in fp64. A batch-independent rule gives one mask for the batch."""
    from torch.nn.attention.flex_attention import flex_attention

    model = tiny(attn_window=32, doc_mask=doc_mask)
    idx = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(6))
    idx[0, [5, 20]] = EOT_TOKEN
    idx[1, [0, 13]] = EOT_TOKEN
    q, k, v = torch.randn(3, 2, 2, 32, 16, generator=torch.Generator().manual_seed(7)).unbind(0)
    for window in (1, 7, torch.tensor(7), torch.tensor(20), 32):
        block_mask = model._block_mask(idx, window)
        assert block_mask.kv_num_blocks.size(0) == (2 if doc_mask else 1)
        allowed = window_rule(idx, int(window), doc_mask)[:, None]  # (B, 1, T, T)
        scores = (q.double() @ k.double().transpose(-1, -2) / 4.0).masked_fill(~allowed, float("-inf"))
        want = scores.softmax(-1) @ v.double()
        got = flex_attention(q, k, v, block_mask=block_mask)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"W={window}: {m}")


@pytest.mark.cuda
def test_cuda_sliding_window_through_flexattention_compiled_and_eager():
    """On a GPU (FlexAttention's block mask): each attention layer's output in a training forward
    equals the window rule's masked softmax computed by hand (fp64, on the CPU) for the windows the
    trainer sets; compiled (inductor), the windows 128 .. 512 run the graphs of the first, each loss within fp32
    tolerance of the eager one's and the smaller windows giving other losses."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY_MODEL, n_layer=2, block_size=512, attn_window=512, doc_mask=True))).cuda()
    idx = torch.randint(0, 50000, (2, 512), generator=torch.Generator().manual_seed(3))
    idx[0, [0, 100, 300]] = EOT_TOKEN
    idx = idx.cuda()
    layers = {f"h{i}": block.attn for i, block in enumerate(model.transformer.h)}
    for window in (3, 128, 200):
        model.set_attn_window(window)
        allowed = window_rule(idx.cpu(), window, True).cuda()
        for name, (x, out) in layer_io(model, layers, idx).items():
            want = attend_by_hand(layers[name], *heads_by_hand(layers[name], x), allowed)  # fp64 on the GPU
            torch.testing.assert_close(out, want.float(), rtol=2e-4, atol=2e-4, msg=lambda m: f"{name}: {m}")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    losses, graphs = [], []
    for window in (128, 256, 384, 512):
        model.set_attn_window(window)
        got = compiled(idx, idx)[1]
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got, model(idx, idx)[1], rtol=1e-4, atol=1e-4)
        losses.append(got.item())
    assert len(set(losses)) == 4
    assert graphs == graphs[:1] * 4 and not counters["recompiles"], (graphs, dict(counters["recompiles"]))
    torch._dynamo.reset()


@pytest.mark.parametrize("doc_mask", [False, True], ids=["alone", "doc-mask"])
def test_an_eager_forward_with_a_block_mask_runs_masked_sdpa_not_flexattentions_unfused_path(monkeypatch, doc_mask):
    """Where FlexAttention's block mask is built (CUDA; forced here on the CPU), an eval-mode forward run eagerly
    (evaluation under ``eager()``, HellaSwag) with a final window of 8 below the 32 tokens never calls
    ``flex_attention`` (its unfused reference path materialises B*H*T*T scores): it attends through masked SDPA
    with the rule's bool mask (:func:`gptspeed.model.dense_mask`), and its loss equals the training path's --
    the compiled model (FlexAttention traced by dynamo) at the same window -- and the CPU's own bool-mask path."""
    import torch.nn.attention.flex_attention as flex

    model = paper_model(attn_window=8, doc_mask=doc_mask)
    idx = with_documents(2, 32)
    cpu_loss = model(idx, idx)[1]
    monkeypatch.setattr(GPT, "_flex_device", staticmethod(lambda idx: True))
    torch._dynamo.reset()
    model.train()  # the training window (set_attn_window's buffer) at the final 8: the same rule
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "flex_attention called without torch.compile")  # it warns eagerly
        train_loss = torch.compile(model, backend="eager", dynamic=False)(idx, idx)[1]
    torch._dynamo.reset()
    calls = []
    monkeypatch.setattr(flex, "flex_attention", lambda *a, **k: calls.append(a) or pytest.fail("unfused flex path"))
    with torch.no_grad():  # as evaluation runs
        eval_loss = model.eval()(idx, idx)[1]
    assert calls == []
    torch.testing.assert_close(eval_loss, train_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eval_loss, cpu_loss, rtol=1e-6, atol=1e-6)
    assert model.attention_mask(idx).seq_lengths == (32, 32)  # the block mask, as on CUDA


def test_the_document_mask_starts_documents_at_the_configured_eot_token():
    """A model of another tokenizer separates documents at its own <|endoftext|> (GPTConfig.eot_token), in a
    forward and with the KV cache: what follows it does not see what came before; GPT-2's 50256 is an ordinary id."""
    from gptspeed.model import KVCache

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, valid_vocab_size=60, eot_token=7)
    cfg.doc_mask = True
    model = GPT(cfg).eval()
    a = torch.tensor([[1, 2, 3, 7, 4, 5]])
    b = torch.tensor([[9, 9, 9, 7, 4, 5]])
    with torch.no_grad():
        la, lb = model(a)[0], model(b)[0]
    assert torch.allclose(la[:, 3:], lb[:, 3:], atol=1e-6) and not torch.allclose(la[:, :3], lb[:, :3])
    assert document_ids(a, 7).tolist() == [[0, 0, 0, 1, 1, 1]] and document_ids(a).tolist() == [[0] * 6]
    kv = KVCache(1, 8)
    assert kv.segments(b, 7)[0].tolist() == [[0, 0, 0, 1, 1, 1]]


def test_data_softmax_loss_called_alone_gives_the_mean_of_its_per_position_losses():
    """``GPT.data_softmax_loss(h, targets)`` without a reduction (its documented default, the mean) is the 0-dim
    mean of the ``(B, T)`` per-position losses of ``reduction="none"``, and the training forward's loss."""
    model = data_softmax_model("plain")
    idx = IDS[torch.randint(0, len(IDS), (2, 8), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        h = model.hidden_states(idx)
        mean, each = model.data_softmax_loss(h, idx), model.data_softmax_loss(h, idx, "none")
        assert mean.shape == () and each.shape == (2, 8)
        torch.testing.assert_close(mean, each.mean())
        torch.testing.assert_close(mean, model(idx, idx)[1])


def test_a_model_of_another_tokenizer_masks_documents_at_its_eot_with_the_kv_cache_and_the_block_mask(monkeypatch):
    """GPTConfig.eot_token (here 7) separates documents on every mask path of a forward: a prefill through the KV
    cache and FlexAttention's block mask (built where it would be on CUDA, forced here; run eagerly, through its
    dense mask ``(B, 1, T, S)``, the bool mask's rule) give the logits of the plain forward's bool mask."""
    from gptspeed.model import KVCache, attention_allowed, dense_mask

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, valid_vocab_size=60, eot_token=7)
    cfg.doc_mask = True
    model = GPT(cfg).eval()
    idx = torch.tensor([[1, 2, 3, 7, 4, 5], [7, 9, 9, 7, 4, 7]])
    with torch.no_grad():
        want = model(idx)[0]
        cached = model(idx, kv=KVCache(1, 8))[0]
        monkeypatch.setattr(GPT, "_flex_device", staticmethod(lambda idx: True))
        flex = model(idx)[0]
        dense = dense_mask(model.attention_mask(idx))  # the block mask's rule, token-exact: (B, 1, T, S)
    torch.testing.assert_close(cached, want)
    torch.testing.assert_close(flex, want)
    assert torch.equal(dense, attention_allowed(idx, documents=True, eot=7))
