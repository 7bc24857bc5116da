"""gptspeed.sample where the mutation check (tools/mutation/README.md) found it unguarded: the
padding mask against one built position by position, the defaults of ``generate`` /
``generate_cached`` / ``sample_text`` against a sampling loop written from their docstrings, the
argument checks of ``sample_text``, and what ``compile`` asks of torch.compile. Tiny models, no
subprocess."""

import io

import pytest
import torch
from torch.nn import functional as F

import gptspeed.sample as sample_mod
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.sample import _window_inputs, generate, generate_cached, left_pad, sample_next, sample_text
from gptspeed.tokenizer import decode, encode

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, n_layer=1, n_head=2, n_embd=32)).eval()


def reference_tokens(model: GPT, prompt: list[int], n: int, temperature: float, top_k, seed: int,
                     autocast=None) -> list[int]:
    """The docstrings' sampling, step by step on the whole context (no cache): the last position's
    logits / temperature, the top_k largest kept (torch.topk, sorted), softmax, one multinomial
    draw from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ctx = torch.tensor([seq[-model.config.block_size:]])
            with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
                logits = model(ctx)[0][0, -1].float()
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                values, indices = torch.topk(logits, top_k)
                seq.append(int(indices[torch.multinomial(F.softmax(values, dim=-1), 1, generator=g)]))
            else:
                seq.append(int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)))
    return seq[len(prompt):]


# ------------------------------------------------------------------------------ padding mask
def reference_mask(pad: list[int], start: int, T: int) -> torch.Tensor:
    """Allowed[b, 0, t, s] for query column start+t and key column s, from the rule: causal, and a
    padding key column is never attended to, except by a padding query to itself."""
    B, S = len(pad), start + T
    m = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            q = start + t
            for s in range(S):
                m[b, 0, t, s] = s <= q and (s >= pad[b] or s == q)
    return m


@pytest.mark.parametrize("pad, start, T", [([0, 2], 0, 4), ([1, 0, 3], 0, 5), ([2, 1], 4, 1), ([0, 1], 3, 2)])
def test_window_inputs_mask_and_positions_match_the_rule(pad, start, T):
    pos, mask = _window_inputs(torch.tensor(pad), start, T)
    assert torch.equal(mask, reference_mask(pad, start, T))
    want = torch.tensor([[max(0, start + t - p) for t in range(T)] for p in pad])
    assert torch.equal(pos, want)


def test_window_inputs_without_padding_has_no_mask():
    pos, mask = _window_inputs(torch.zeros(3, dtype=torch.long), 2, 3)
    assert mask is None and torch.equal(pos, torch.tensor([[2, 3, 4]] * 3))


# ------------------------------------------------------------------------------ left_pad
def test_left_pad_makes_int64_tensors_on_the_device_it_is_given():
    idx, pad = left_pad([[5], [6, 7, 8]], pad_id=9, device="meta")  # meta: a device that is not the CPU
    assert idx.device.type == pad.device.type == "meta" and idx.dtype == pad.dtype == torch.int64
    idx, pad = left_pad([[5], [6, 7, 8]], pad_id=9)
    assert idx.tolist() == [[9, 9, 5], [6, 7, 8]] and pad.tolist() == [2, 0]
    with pytest.raises(ValueError, match="^every prompt needs at least one token$"):
        left_pad([[1], []])


# ------------------------------------------------------------------------------ sample_next
def test_sample_next_refuses_a_row_without_a_finite_logit_among_finite_rows():
    """A row of -inf only (no possible token) next to healthy rows: the error, not a draw."""
    logits = torch.randn(3, 10)
    logits[1] = float("-inf")
    with pytest.raises(GptspeedError, match="not finite"):
        sample_next(logits, 1.0, None, torch.Generator().manual_seed(0))
    with pytest.raises(GptspeedError, match="not finite"):
        sample_next(logits, 0.0, None, None)


def test_sample_next_refuses_a_temperature_that_overflows_the_logits():
    logits = torch.tensor([[3e38, 0.0, -1.0]])  # finite, but not once divided by 0.5
    with pytest.raises(GptspeedError, match=r"^--temperature 0.5 is too small for these logits"):
        sample_next(logits, 0.5, None, torch.Generator().manual_seed(0))
    assert sample_next(torch.tensor([[1e30, 0.0]]), 2.0, None, torch.Generator().manual_seed(0)).tolist() == [0]


def test_top_k_on_a_single_row_restricts_the_draws():
    """top_k is compared with the vocabulary (the last dimension), not the number of rows: one
    row, top 2 of 50 near-equal logits, 300 draws all among the two largest."""
    logits = torch.linspace(0, 0.1, 50)[None]
    g = torch.Generator().manual_seed(0)
    got = {int(sample_next(logits, 1.0, 2, g)) for _ in range(300)}
    assert got <= {48, 49} and len(got) == 2


def test_top_k_of_the_whole_vocabulary_is_no_restriction():
    """top_k >= V draws exactly what no top_k draws, seed for seed."""
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    for k in (7, 9):
        a = sample_next(logits, 0.9, k, torch.Generator().manual_seed(5))
        b = sample_next(logits, 0.9, None, torch.Generator().manual_seed(5))
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ generate defaults
@pytest.mark.parametrize("fn", [generate, generate_cached])
def test_generate_defaults_to_temperature_1_and_no_top_k(fn):
    model = tiny()
    prompt = [464, 3290, 373]
    got = [int(t) for t in fn(model, torch.tensor([prompt]), 12, generator=torch.Generator().manual_seed(4))]
    assert got == reference_tokens(model, prompt, 12, 1.0, None, seed=4)


def test_generate_cached_compiles_only_when_asked_and_then_dynamic(monkeypatch):
    calls = []

    def fake_compile(model, **kw):
        calls.append(kw)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    model, idx = tiny(), torch.tensor([[1, 2, 3]])
    ref = list(generate_cached(model, idx, 3, temperature=0))
    assert calls == []
    assert list(generate_cached(model, idx, 3, temperature=0, compile=True)) == ref
    assert list(generate_cached(model, idx, 3, temperature=0, compile="eager")) == ref
    assert calls == [dict(dynamic=True, backend="inductor"), dict(dynamic=True, backend="eager")]


# ------------------------------------------------------------------------------ sample_text
def loaded(model=None):
    return (model or tiny(256), {"run": "r", "step": 3})


def test_sample_text_defaults_are_the_documented_ones(monkeypatch):
    """No settings given: 200 new tokens after "\\n", temperature 0.8, top_k 200, seed 1337, on the
    device "auto" resolves to, nothing compiled (torch.compile must not be called)."""
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("sample_text compiled without being asked"))
    model, info = loaded()
    out = io.StringIO()
    texts = sample_text(loaded=(model, info), dtype="float32", out=out)
    want = reference_tokens(model, encode("\n"), 200, 0.8, 200, seed=1337)
    assert texts == [decode(want)]
    assert out.getvalue() == "\n" + decode(want) + "\n"


def test_sample_text_under_bfloat16_samples_under_autocast():
    model, info = loaded()
    texts = sample_text(loaded=(model, info), prompts=["Hi"], max_new_tokens=6, device="cpu", dtype="bfloat16",
                        temperature=1.0, top_k=0, seed=3, out=io.StringIO())
    want = reference_tokens(model, encode("Hi"), 6, 1.0, None, seed=3,
                            autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert texts == [decode(want)]


@pytest.mark.parametrize("kw", [dict(max_new_tokens=-1), dict(num_samples=0), dict(temperature=-0.1),
                                dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_k=-1)])
def test_sample_text_refuses_bad_numbers(kw):
    with pytest.raises(GptspeedError, match=r"^--max-new-tokens, --top-k and --temperature must be >= 0 "
                                            r"\(--temperature finite\), --num-samples >= 1$"):
        sample_text(loaded=loaded(), device="cpu", dtype="float32", out=io.StringIO(), **kw)


def test_sample_text_takes_the_smallest_numbers_allowed():
    """0 new tokens, temperature 0 (greedy), top_k 0 (no restriction), one sample: all fine."""
    assert sample_text(loaded=loaded(), prompts=["a"], max_new_tokens=0, device="cpu", dtype="float32",
                       out=io.StringIO()) == [""]
    model, info = loaded()
    got = sample_text(loaded=(model, info), prompts=["a"], max_new_tokens=4, temperature=0, top_k=0, num_samples=1,
                      device="cpu", dtype="float32", out=io.StringIO())
    with torch.no_grad():
        seq = encode("a")
        for _ in range(4):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert got == [decode(seq[1:])]


def test_sample_text_names_the_seed_flag_and_refuses_an_empty_prompt():
    with pytest.raises(GptspeedError, match=r"^--seed must be an integer"):
        sample_text(loaded=loaded(), seed=2**64, device="cpu", dtype="float32", out=io.StringIO())
    with pytest.raises(GptspeedError, match="^a --prompt encodes to no tokens: give some text$"):
        sample_text(loaded=loaded(), prompts=["a", ""], device="cpu", dtype="float32", out=io.StringIO())


def test_sample_text_without_kv_cache_needs_equal_prompt_lengths():
    prompts = ["Hello", "Hello world"]  # 1 and 2 tokens: one column of padding
    assert [len(encode(p)) for p in prompts] == [1, 2]
    with pytest.raises(GptspeedError, match=r"^--no-kv-cache needs prompts of equal token length \(it has no padding "
                                            r"mask\)$"):
        sample_text(loaded=loaded(), prompts=prompts, kv_cache=False, device="cpu", dtype="float32",
                    out=io.StringIO())


def test_every_tensor_goes_to_the_device_asked_for_not_the_default_one():
    """With the default device set elsewhere (meta: no data), sampling draws the same tokens: each
    tensor it makes is put on the model's / the runtime's device explicitly."""
    model, info = loaded()
    kw = dict(loaded=(model, info), prompts=["ab", "a b c"], max_new_tokens=5, device="cpu", dtype="float32")
    ref = sample_text(**kw, out=io.StringIO())
    idx, pad = left_pad([[1, 2, 3], [4]])
    want = [t.tolist() for t in generate_cached(model, idx, 4, temperature=0, pad=pad)]
    with torch.device("meta"):
        assert sample_text(**kw, out=io.StringIO()) == ref
        assert [t.tolist() for t in generate_cached(model, idx, 4, temperature=0)] == \
               [t.tolist() for t in generate_cached(model, idx, 4, temperature=0, pad=torch.zeros(2, dtype=torch.long,
                                                                                                  device="cpu"))]
        assert [t.tolist() for t in generate_cached(model, idx, 4, temperature=0, pad=pad)] == want
        pos, mask = _window_inputs(pad, 1, 2)
        assert pos.device.type == mask.device.type == "cpu"
