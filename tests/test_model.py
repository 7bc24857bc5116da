import math

import pytest
import torch

from gptspeed.model import GPT, GPTConfig


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **kw})


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


# ------------------------------------------------------------------ --softmax data (the data's token ids only)
IDS = torch.tensor(sorted({3, 17, 198, 464, 1000, 5000, 11, 50256, 25, 262, 13}))


def data_softmax_model(loss="plain", seed=0):
    torch.manual_seed(seed)
    model = GPT(small(softmax="data", loss=loss))
    model.set_softmax_ids(IDS)
    return model


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


def test_the_training_forward_returns_no_logits_so_no_vocab_sized_gradient_is_made():
    """Issue 30 item 4: the training forward used to return the full (B, T, V) logits, which the step
    throws away; AOTAutograd then built a zero gradient for that output (1.65 GB at GPT-2 124M,
    B=16, bf16) and the backward read it."""
    torch.manual_seed(0)
    model = GPT(small(loss="plain", n_layer=1))
    idx = torch.randint(0, 50257, (2, 16))
    assert model(idx, idx)[0] is None and model(idx, idx, return_logits=True)[0].shape == (2, 16, 50304)
    assert _vocab_sized_zero_fills(model, idx) == []
    # the reference: asking for the logits too brings the zero gradient back (the count can see it)
    assert _vocab_sized_zero_fills(model, idx, return_logits=True) != []
