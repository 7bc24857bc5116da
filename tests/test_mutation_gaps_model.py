"""gptspeed.model where the mutation check (tools/mutation/README.md) found it unguarded: the
``--softmax data`` ids' checks and a target beyond the largest id, and explicit devices honoured
when the default device is another one. Tiny models, no subprocess."""

import math

import pytest
import torch

from gptspeed.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=32, block_size=16), **kw})


@pytest.mark.parametrize("bad", [[1, 5, 3], [0, 5, 50257], [2, 2, 9]])
def test_softmax_ids_out_of_order_or_range_anywhere_are_refused(bad):
    """Checked over every neighbouring pair and at the last id, not just against the first."""
    model = GPT(small(softmax="data"))
    with pytest.raises(ValueError, match=r"^softmax ids must be sorted, unique and in \[0, 50257\)$"):
        model.set_softmax_ids(bad)


def test_softmax_ids_of_any_integer_like_input_are_int64_where_the_model_is():
    model = GPT(small(softmax="data"))
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
    model = GPT(small(softmax="data", loss=loss))
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
    model = GPT(small(doc_mask=True, attention=attention, block_size=32)).eval()
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
    model = GPT(small(doc_mask=True, block_size=32)).eval()
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
    model = GPT(small(doc_mask=True, attention=attention, pos_emb=pos_emb)).eval()
    plain = GPT(small(doc_mask=False, attention=attention, pos_emb=pos_emb)).eval()
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
    model = GPT(small(softmax="data", logit_softcap=cap))
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
    model = GPT(small(softmax="data"))
    model.set_softmax_ids([4, 9, 1000])
    weights = {k: torch.randn_like(v) for k, v in GPT(small()).state_dict().items()}
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
    full = GPT(small())
    data = GPT(small(softmax="data"))
    data.set_softmax_ids([3, 11, 25])
    c = data.config
    want = 6 * (c.vocab_size - 3) * c.n_embd
    assert full.flops_per_token(8) - data.flops_per_token(8) == want, (
        f"the data softmax should save 6*(V-K)*C = {want} FLOPs per token"
    )


# ------------------------------------------------------------------ what the switches do to the outputs
def test_rope_makes_the_output_depend_on_the_order_of_the_tokens_before():
    """Causal attention with no position information is blind to the order of earlier tokens: the
    output at position 2 of [a, b, c] and [b, a, c] would be the same. With --pos-emb rope (no
    learned positions) the rotations are the only position information, in every block: the two
    must differ."""
    torch.manual_seed(0)
    for n_layer in (1, 2):
        model = GPT(small(n_layer=n_layer, pos_emb="rope")).eval()
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
        model = GPT(small(qk_norm=qk_norm)).eval()
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
        m = MLP(small(mlp=mlp))
        with torch.no_grad():
            torch.testing.assert_close(m(x), m.c_proj(act(m.c_fc(x))), msg=f"--mlp {mlp}")


def test_the_manual_attentions_causal_mask_is_not_saved_with_the_weights():
    """The mask is rebuilt from block_size: a state dict (checkpoint, export) holds weights only."""
    model = GPT(small(attention="manual"))
    assert any(name.endswith("causal_mask") for name, _ in model.named_buffers())
    assert not [k for k in model.state_dict() if k.endswith("causal_mask")], "the causal mask was saved"


@pytest.mark.parametrize("T", [1, 2, 3])
def test_a_cached_prefill_of_any_length_is_causal(T):
    """A prompt of T tokens through a fresh cache gives the cache-free logits (T=2 included: the
    first token must not see the second)."""
    from gptspeed.model import KVCache

    torch.manual_seed(0)
    model = GPT(small()).eval()
    x = torch.tensor([[5, 9, 3]])[:, :T]
    with torch.no_grad():
        free = model(x)[0]
        cached = model(x, kv=KVCache(1, 8))[0]
    torch.testing.assert_close(cached, free, atol=1e-5, rtol=1e-5)


def test_the_training_forward_returns_the_loss_alone_unless_logits_are_asked_for():
    torch.manual_seed(0)
    model = GPT(small(loss="plain"))  # the path that computes logits (the fused one never makes them)
    x, y = torch.tensor([[5, 9, 3]]), torch.tensor([[9, 3, 7]])
    logits, loss = model(x, y)
    assert logits is None and loss.ndim == 0, "with targets the forward returns no logits by default"
    logits, again = model(x, y, return_logits=True)
    assert logits is not None and logits.shape == (1, 3, 50304)
    torch.testing.assert_close(again, torch.nn.functional.cross_entropy(logits.view(-1, 50304)[:, :50257], y.view(-1)))


def test_a_sequence_longer_than_the_block_is_refused_naming_both_lengths():
    model = GPT(small())
    with pytest.raises(ValueError, match=r"^sequence length 17 exceeds block_size 16$"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("layer", ["CausalSelfAttention", "Block"])
def test_a_layer_made_alone_caches_into_layer_0(layer):
    """An attention layer or a block built outside a GPT (no layer index given) reads and writes
    layer 0 of a KV cache: the same output with the cache as without, layer 0 filled to its size."""
    import gptspeed.model as m

    torch.manual_seed(0)
    module = getattr(m, layer)(small()).eval()
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
    model = GPT(small(tie_embeddings=False))
    for name, weight, std in (("wte", model.transformer.wte.weight, 0.02), ("wpe", model.transformer.wpe.weight, 0.01)):
        w = weight.detach()
        n = w.numel()
        assert abs(float(w.mean())) < 5 * std / math.sqrt(n), f"{name}: mean {float(w.mean()):.4g}, not 0"
        assert float(w.std()) == pytest.approx(std, rel=0.25 if n < 1000 else 0.02), f"{name}: std {float(w.std()):.4g}"
