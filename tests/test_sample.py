"""``gptspeed.sample``: text generation, with and without a KV cache, from a run or a Hugging Face GPT-2."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import gptspeed.sample as sample_mod
from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import Runtime
from gptspeed.sample import _window_inputs, generate, generate_cached, left_pad, sample_next, sample_text
from gptspeed.step import format_bytes
from gptspeed.tokenizer import decode, encode

from support.cli import assert_user_error, run_main
from support.hf_models import write_run_pico

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(attention="sdpa", block_size=32, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=32, attention=attention)).eval()


def run(gen_fn, model, idx, n, seed=1, **kw):
    g = torch.Generator().manual_seed(seed)
    return torch.stack(list(gen_fn(model, idx, n, generator=g, **kw)), dim=1)


@pytest.fixture
def run_dir(tmp_path):
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    save_checkpoint(tmp_path, {"step": 3, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return tmp_path


def tiny_peaked(block_size: int = 64) -> GPT:
    """A tiny GPT whose next-token distributions are far from uniform (a fresh one's are nearly
    uniform over 50k tokens, where temperature and top-k barely change a seeded draw)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
    return model


def reference_tokens(
    model: GPT, prompt: list[int], n: int, temperature: float, top_k, seed: int, autocast=None
) -> list[int]:
    """The docstrings' sampling, step by step on the whole context (no cache): the last position's
    logits / temperature, the top_k largest kept (torch.topk, sorted), softmax, one multinomial
    draw from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ctx = torch.tensor([seq[-model.config.block_size :]])
            with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
                logits = model(ctx, logits_at=(slice(None), -1))[0][0].float()  # the last position's only
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                values, indices = torch.topk(logits, top_k)
                seq.append(int(indices[torch.multinomial(F.softmax(values, dim=-1), 1, generator=g)]))
            else:
                seq.append(int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)))
    return seq[len(prompt) :]


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


# ------------------------------------------------------------------------------ sample_text
def loaded(model=None):
    return (model or tiny_peaked(256), {"run": "r", "step": 3})


# ------------------------------------------------------------------------------ what sample_text asks for
class Recorder:
    """generate / generate_cached replaced by a recorder of their arguments that yields ``tokens``."""

    def __init__(self, monkeypatch, tokens=(464, 318)):
        self.calls = []
        for name in ("generate", "generate_cached"):
            monkeypatch.setattr(sample_mod, name, self.fake(name))
        self.tokens = tokens

    def fake(self, name):
        def gen(model, idx, n, **kw):
            self.calls.append((name, idx.clone(), n, kw))
            for t in self.tokens[:n]:
                yield torch.full((idx.size(0),), t)

        return gen


def byte_tokens(text: str) -> list[int]:
    """``text`` as GPT-2's single-byte tokens: a multi-byte character spans several tokens."""
    from gptspeed.tokenizer import get_encoding

    enc = get_encoding()
    return [enc.encode_single_token(bytes([b])) for b in text.encode()]


# ------------------------------------------------------------------------------ on the runtime's device
META = Runtime(device=torch.device("meta"), dtype="float32", autocast_dtype=None, compile=False)  # not the CPU


# ---------------------------------------------------------------------------------- sampling
def draws(logits: torch.Tensor, n: int, temperature: float, top_k):
    from gptspeed.sample import sample_next

    g = torch.Generator().manual_seed(0)
    return sample_next(logits.expand(n, -1).clone(), temperature, top_k, g)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 50)])
def test_same_tokens_as_the_cache_free_path(attention, temperature, top_k):
    model = tiny(attention)
    idx = torch.randint(0, 50257, (3, 5), generator=torch.Generator().manual_seed(2))
    # 5 + 40 tokens > block_size 32: also covers the window recompute past the cache's end
    ref = run(generate, model, idx, 40, temperature=temperature, top_k=top_k)
    got = run(generate_cached, model, idx, 40, temperature=temperature, top_k=top_k)
    assert torch.equal(ref, got)


def test_prompts_of_different_lengths_in_one_batch():
    model = tiny()
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22], [31, 32, 33, 34]]
    idx, pad = left_pad(prompts)
    assert pad.tolist() == [0, 5, 3]
    batch = run(generate_cached, model, idx, 35, temperature=0, pad=pad)  # crosses block_size too
    for row, prompt in enumerate(prompts):
        alone = run(generate, model, torch.tensor([prompt]), 35, temperature=0)
        assert torch.equal(batch[row], alone[0])


def test_prompt_longer_than_block_size_is_cropped_like_the_reference():
    model = tiny(block_size=16)
    idx = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(3))
    assert torch.equal(run(generate, model, idx, 5), run(generate_cached, model, idx, 5))


def test_works_with_a_compiled_model():
    # backend "eager" checks graph capture of the decode step without the minutes inductor takes on a CPU
    model = tiny()
    idx, pad = left_pad([[1, 2, 3, 4], [5, 6]])
    ref = run(generate_cached, model, idx, 12, temperature=0, pad=pad)
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(run(generate_cached, compiled, idx, 12, temperature=0, pad=pad, compile="eager"), ref)


def test_bfloat16_autocast_runs():
    model = tiny()
    idx = torch.randint(0, 50257, (2, 4), generator=torch.Generator().manual_seed(4))
    out = run(generate_cached, model, idx, 6, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert out.shape == (2, 6) and int(out.max()) < 50257


def test_sample_text_streams_one_row_and_prints_batches(run_dir):
    out = io.StringIO()
    texts = sample_text(run=str(run_dir), prompts=["Hello"], max_new_tokens=8, device="cpu", out=out)
    assert len(texts) == 1 and out.getvalue() == "Hello" + texts[0] + "\n"
    cache_free = sample_text(
        run=str(run_dir), prompts=["Hello"], max_new_tokens=8, device="cpu", kv_cache=False, out=io.StringIO()
    )
    assert cache_free == texts
    out = io.StringIO()
    texts = sample_text(
        run=str(run_dir), prompts=["Hello", "Once upon a time"], num_samples=2, max_new_tokens=4, device="cpu", out=out
    )
    assert len(texts) == 4 and out.getvalue().count("--- sample") == 4 and "(step 3)" in out.getvalue()


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
    with pytest.raises(
        GptspeedError,
        match="^the model's logits are not finite \\(NaN or infinite\\): its weights have "
        "diverged or are corrupt; sample from an earlier checkpoint or a healthy model$",
    ):
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


@pytest.mark.parametrize("top_k", [None, 3], ids=["whole-vocabulary", "top-k"])
def test_sample_next_draws_without_warnings(top_k):
    """Sampling warns about nothing (a warning per token would flood a user's terminal): softmax is
    asked for over the vocabulary explicitly (torch warns when it has to guess the dimension). The
    draw is the docstring's: softmax(logits / temperature) over the top_k or all, one multinomial."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sample_next(logits, 0.7, top_k, torch.Generator().manual_seed(1))
    assert [str(w.message) for w in caught] == [], "sample_next warned while sampling"
    g, scaled = torch.Generator().manual_seed(1), logits / 0.7
    if top_k is None:
        want = torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=g).squeeze(1)
    else:
        values, indices = torch.topk(scaled, top_k, dim=-1)
        want = indices.gather(1, torch.multinomial(F.softmax(values, dim=-1), 1, generator=g)).squeeze(1)
    assert torch.equal(got, want), "sample_next did not draw from softmax(logits / temperature)"


# ------------------------------------------------------------------------------ generate defaults
@pytest.mark.parametrize("fn", [generate, generate_cached])
def test_generate_defaults_to_temperature_1_and_no_top_k(fn):
    model = tiny_peaked()
    prompt = [464, 3290, 373]
    got = [int(t) for t in fn(model, torch.tensor([prompt]), 12, generator=torch.Generator().manual_seed(4))]
    assert got == reference_tokens(model, prompt, 12, 1.0, None, seed=4)


def test_generate_cached_compiles_only_when_asked_and_then_dynamic(monkeypatch):
    calls = []

    def fake_compile(model, **kw):
        calls.append(kw)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    model, idx = tiny_peaked(), torch.tensor([[1, 2, 3]])
    ref = list(generate_cached(model, idx, 3, temperature=0))
    assert calls == []
    assert list(generate_cached(model, idx, 3, temperature=0, compile=True)) == ref
    assert list(generate_cached(model, idx, 3, temperature=0, compile="eager")) == ref
    assert calls == [dict(dynamic=True, backend="inductor"), dict(dynamic=True, backend="eager")]


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
    texts = sample_text(
        loaded=(model, info),
        prompts=["Hi"],
        max_new_tokens=6,
        device="cpu",
        dtype="bfloat16",
        temperature=1.0,
        top_k=0,
        seed=3,
        out=io.StringIO(),
    )
    want = reference_tokens(
        model, encode("Hi"), 6, 1.0, None, seed=3, autocast=torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert texts == [decode(want)]


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_new_tokens=-1),
        dict(num_samples=0),
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
    ],
)
def test_sample_text_refuses_bad_numbers(kw):
    with pytest.raises(
        GptspeedError,
        match=r"^--max-new-tokens, --top-k and --temperature must be >= 0 "
        r"\(--temperature finite\), --num-samples >= 1$",
    ):
        sample_text(loaded=loaded(), device="cpu", dtype="float32", out=io.StringIO(), **kw)


def test_sample_text_takes_the_smallest_numbers_allowed():
    """0 new tokens, temperature 0 (greedy), top_k 0 (no restriction), one sample: all fine."""
    assert sample_text(
        loaded=loaded(), prompts=["a"], max_new_tokens=0, device="cpu", dtype="float32", out=io.StringIO()
    ) == [""]
    model, info = loaded()
    got = sample_text(
        loaded=(model, info),
        prompts=["a"],
        max_new_tokens=4,
        temperature=0,
        top_k=0,
        num_samples=1,
        device="cpu",
        dtype="float32",
        out=io.StringIO(),
    )
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
    with pytest.raises(
        GptspeedError,
        match=r"^--no-kv-cache needs prompts of equal token length \(it has no padding "
        r"mask\)$",
    ):
        sample_text(loaded=loaded(), prompts=prompts, kv_cache=False, device="cpu", dtype="float32", out=io.StringIO())


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
        assert [t.tolist() for t in generate_cached(model, idx, 4, temperature=0)] == [
            t.tolist()
            for t in generate_cached(model, idx, 4, temperature=0, pad=torch.zeros(2, dtype=torch.long, device="cpu"))
        ]
        assert [t.tolist() for t in generate_cached(model, idx, 4, temperature=0, pad=pad)] == want
        pos, mask = _window_inputs(pad, 1, 2)
        assert pos.device.type == mask.device.type == "cpu"


@pytest.mark.parametrize("kv_cache", [True, False])
def test_sample_text_hands_the_sampler_the_runs_settings(monkeypatch, kv_cache):
    rec = Recorder(monkeypatch)
    prompts = ["Hello", "Hello world"] if kv_cache else ["Hello"]
    sample_text(
        loaded=loaded(),
        prompts=prompts,
        max_new_tokens=2,
        temperature=0.7,
        top_k=5,
        seed=9,
        device="cpu",
        dtype="bfloat16",
        kv_cache=kv_cache,
        out=io.StringIO(),
    )
    ((name, idx, n, kw),) = rec.calls
    want_idx, want_pad = left_pad([encode(p) for p in prompts])
    assert name == ("generate_cached" if kv_cache else "generate") and n == 2 and torch.equal(idx, want_idx)
    assert kw["temperature"] == 0.7 and kw["top_k"] == 5
    assert isinstance(kw["autocast"], torch.autocast) and kw["autocast"].fast_dtype == torch.bfloat16
    assert torch.equal(kw["generator"].get_state(), torch.Generator().manual_seed(9).get_state())
    if kv_cache:
        assert torch.equal(kw["pad"], want_pad) and kw["compile"] is False


def test_sample_text_compiles_the_cached_sampler_when_asked(monkeypatch):
    rec = Recorder(monkeypatch)
    sample_text(
        loaded=loaded(),
        prompts=["Hi"],
        max_new_tokens=1,
        device="cpu",
        dtype="float32",
        compile=True,
        out=io.StringIO(),
    )
    assert rec.calls[0][3]["compile"] is True


def test_sample_text_loads_the_run_or_model_it_is_given(monkeypatch):
    asked = []
    model, info = loaded()
    monkeypatch.setattr(
        sample_mod, "load_any_model", lambda rt, run, init_from: asked.append((run, init_from)) or (model, info)
    )
    sample_text(run="some/run", prompts=["Hi"], max_new_tokens=1, device="cpu", dtype="float32", out=io.StringIO())
    sample_text(init_from="gpt2", prompts=["Hi"], max_new_tokens=1, device="cpu", dtype="float32", out=io.StringIO())
    assert asked == [("some/run", None), (None, "gpt2")]


def test_load_any_model_of_a_run_says_which_run_and_step(tmp_path):
    from gptspeed.checkpoint import save_checkpoint
    from gptspeed.config import preset
    from gptspeed.runtime import resolve_runtime

    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    weights = GPT(cfg.model).state_dict()
    save_checkpoint(tmp_path, {"step": 7, "model": weights, "config": cfg.to_dict()})
    model, info = sample_mod.load_any_model(resolve_runtime("cpu", "float32", False), run=tmp_path)
    assert info == {"run": str(tmp_path), "step": 7} and not model.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), weights.values()))


def test_one_row_streams_whole_characters_as_they_come(monkeypatch):
    """Each write of the stream is whole characters (never a cut U+FFFD), and it writes as tokens
    arrive, not all at the end."""
    tokens = byte_tokens("ab\u00e9c\u4e2dd")  # é: 2 bytes, 中: 3 bytes
    Recorder(monkeypatch, tokens)
    writes = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    out = Out()
    texts = sample_text(
        loaded=loaded(), prompts=["x"], max_new_tokens=len(tokens), device="cpu", dtype="float32", out=out
    )
    assert texts == ["ab\u00e9c\u4e2dd"] and out.getvalue() == "x" + texts[0] + "\n"
    assert not any("\ufffd" in w for w in writes)
    assert writes[:5] == ["x", "a", "b", "\u00e9", "c"]


@pytest.mark.parametrize(
    "info, where",
    [({"run": "r", "step": 5}, "step 5"), ({"init_from": "gpt2", "step": None}, "gpt2"), ({"step": None}, "")],
)
def test_several_rows_are_printed_under_numbered_headers_naming_the_source(monkeypatch, info, where):
    Recorder(monkeypatch, (464, 318))
    out = io.StringIO()
    texts = sample_text(
        loaded=(loaded()[0], info), prompts=["A", "B"], max_new_tokens=2, device="cpu", dtype="float32", out=out
    )
    assert out.getvalue() == "".join(
        f"--- sample {i} ({where}) ---\n{p}{t}\n" for i, (p, t) in enumerate(zip(["A", "B"], texts), 1)
    )


def test_sample_text_keeps_the_top_200_by_default():
    """A fresh model's nearly flat distribution, where the top-k cut moves every seeded draw."""
    torch.manual_seed(0)
    flat = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    texts = sample_text(
        loaded=(flat, {"run": "r", "step": 1}), max_new_tokens=20, device="cpu", dtype="float32", out=io.StringIO()
    )
    assert texts == [decode(reference_tokens(flat, encode("\n"), 20, 0.8, 200, seed=1337))]
    assert texts != [decode(reference_tokens(flat, encode("\n"), 20, 0.8, 201, seed=1337))]  # the test can tell


def test_sample_text_in_float32_samples_without_autocast(monkeypatch):
    rec = Recorder(monkeypatch)
    sample_text(loaded=loaded(), prompts=["Hi"], max_new_tokens=1, device="cpu", dtype="float32", out=io.StringIO())
    assert not isinstance(rec.calls[0][3]["autocast"], torch.autocast)


def test_load_model_puts_the_model_on_the_runtimes_device(tmp_path):
    """On a GPU the model must be moved there (else every step runs on the CPU, or fails against
    the GPU's batch): here the runtime's device is meta, a device other than the CPU."""
    from gptspeed.checkpoint import save_checkpoint
    from gptspeed.config import preset

    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    save_checkpoint(tmp_path, {"step": 7, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    model, ckpt = sample_mod.load_model(tmp_path, META)
    assert {p.device.type for p in model.parameters()} == {"meta"}, "load_model left the model off rt.device"
    assert not model.training and ckpt["step"] == 7


def test_sample_text_makes_the_batch_and_the_generator_on_the_runtimes_device(monkeypatch):
    """On a GPU the prompts' batch, its padding and the generator must be on the GPU with the model
    (torch.multinomial refuses a CPU generator for CUDA probabilities): they are made on the device
    the runtime resolves to, here meta (not the CPU). No generator can be made on meta: a stand-in
    records the device it is asked for."""
    model_info = loaded()
    monkeypatch.setattr(sample_mod, "resolve_runtime", lambda *a, **k: META)
    asked = []

    class Generator:
        def __init__(self, device=None):
            asked.append(device)

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(torch, "Generator", Generator)
    rec = Recorder(monkeypatch)
    sample_text(loaded=model_info, prompts=["Hello", "Hello world"], max_new_tokens=2, seed=5, out=io.StringIO())
    ((_, idx, _, kw),) = rec.calls
    assert idx.device.type == kw["pad"].device.type == "meta", "the prompts' batch is not on rt.device"
    assert asked == [META.device] and kw["generator"].seed == 5, "the generator is not made on rt.device"


@pytest.mark.parametrize("temperature, top_k", [(0.8, 2), (0.8, None), (1.3, 3), (1.0, 5)])
def test_sampling_draws_from_softmax_over_temperature_restricted_to_top_k(temperature, top_k):
    """Top-k ignored put 32% of draws outside the top 2; temperature applied twice moved p(top)
    from 0.777 to 0.829. 20,000 draws: each frequency within 5 standard errors of the reference."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    ref = F.softmax(logits[0].double() / temperature, dim=-1)
    if top_k is not None:
        keep = torch.topk(ref, top_k).indices
        mask = torch.zeros_like(ref, dtype=torch.bool)
        mask[keep] = True
        ref = torch.where(mask, ref, torch.zeros_like(ref))
        ref = ref / ref.sum()
    n = 20_000
    counts = np.bincount(draws(logits, n, temperature, top_k).numpy(), minlength=logits.size(1))
    freq = counts / n
    se = np.sqrt(np.maximum(ref.numpy() * (1 - ref.numpy()), 1e-12) / n)
    for i, (f, p, s) in enumerate(zip(freq, ref.numpy(), se)):
        if p == 0:
            assert counts[i] == 0, f"token {i} is outside the top {top_k} but was drawn {counts[i]} times"
        else:
            assert abs(f - p) < 5 * s, (
                f"token {i}: frequency {f:.4f}, softmax(logits / {temperature}) top-{top_k} gives {p:.4f}"
            )


def test_top_1_and_temperature_0_are_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g)
    from gptspeed.sample import sample_next

    assert torch.equal(sample_next(logits, 1.0, 1, g), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 0.0, None, g), logits.argmax(-1))


# ------------------------------------------------------------------------------ arguments and memory
OK_ARGS = dict(max_new_tokens=1, temperature=0.8, top_k=0, num_samples=1, kv_cache=True)


@pytest.mark.parametrize(
    "prompts", ["abc", ["a", 3], ("a", None)], ids=["a-text", "a-number-in-a-list", "none-in-a-tuple"]
)
def test_prompts_must_be_a_list_or_tuple_of_texts(prompts):
    """A bare text (its characters are texts) and a list holding a non-text are both refused."""
    with pytest.raises(GptspeedError) as e:
        sample_mod.check_sample_arguments(prompts, **OK_ARGS)
    assert str(e.value) == f"prompts must be a list of texts, got {prompts!r}"
    sample_mod.check_sample_arguments(["a", "b"], **OK_ARGS)
    sample_mod.check_sample_arguments(("a",), **OK_ARGS)


@pytest.mark.parametrize(
    "name, message",
    [
        ("prompts", "prompts must be a list of texts, got "),
        ("max_new_tokens", "--max-new-tokens must be an integer, got "),
        ("top_k", "--top-k must be an integer, got "),
        ("num_samples", "--num-samples must be an integer, got "),
        ("temperature", "--temperature must be a number (0: greedy), got "),
        ("kv_cache", "kv_cache must be True or False, got "),
    ],
    ids=["prompts", "max_new_tokens", "top_k", "num_samples", "temperature", "kv_cache"],
)
def test_a_value_of_the_wrong_type_with_a_long_repr_is_cut_to_a_300_character_line(name, message):
    """A wrong-type argument is named in one line, its repr cut so the whole message is at most 300 characters:
    a huge value does not flood the error."""
    value = ["a", 7] * 100 if name == "prompts" else "x" * 400  # a repr of 800 / 402 characters
    kw = {**OK_ARGS, **({} if name == "prompts" else {name: value})}
    with pytest.raises(GptspeedError) as e:
        sample_mod.check_sample_arguments(value if name == "prompts" else ["a"], **kw)
    assert str(e.value) == (message + repr(value))[:300] and len(str(e.value)) == 300


def test_max_new_tokens_goes_up_to_2_to_the_20_inclusive():
    """The documented range is 0..MAX_NEW_TOKENS, a bound included: 2**20 = 1,048,576."""
    sample_mod.check_sample_arguments(["a"], **{**OK_ARGS, "max_new_tokens": 2**20})
    with pytest.raises(GptspeedError) as e:
        sample_mod.check_sample_arguments(["a"], **{**OK_ARGS, "max_new_tokens": 2**20 + 1})
    assert str(e.value) == "--max-new-tokens must be at most 1,048,576, got 1,048,577"


@pytest.mark.parametrize(
    "rows, length, kv_cache, cache_dtype, doc_mask",
    [
        (3, 20, True, torch.float32, False),
        (2, 5, True, torch.float32, False),
        (2, 5, True, torch.bfloat16, False),
        (2, 5, True, torch.float16, True),
        (3, 20, False, torch.float32, False),
    ],
    ids=["past-block-size", "within-block-size", "bf16-cache", "fp16-cache-doc-ids", "no-cache"],
)
def test_rows_fit_in_exactly_the_bytes_generation_allocates(monkeypatch, rows, length, kv_cache, cache_dtype, doc_mask):
    """The documented lower bound is the bytes of the tensors generate_cached allocates, measured on
    meta from their shapes: per layer a key and a value (rows, heads, block_size, head_dim) in the
    dtype attention computes in -- the cache is allocated whole at the prefill, however short the
    sequences --, the int64 document ids (rows, block_size) with the document mask, the int64 token
    ids (rows, length) and one fp32 row of logits per row; no cache without the KV cache. Exactly
    that much memory fits, a byte less is refused, in one line naming both amounts."""
    import gptspeed.step

    config = GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=32, doc_mask=doc_mask)
    key = torch.empty(rows, 2, config.block_size, 16, dtype=cache_dtype, device="meta")
    seg = torch.empty(rows, config.block_size, dtype=torch.long, device="meta")
    ids = torch.empty(rows, length, dtype=torch.long, device="meta")
    logits = torch.empty(rows, 50304, dtype=torch.float32, device="meta")
    cache = (2 * config.n_layer * key.nbytes + doc_mask * seg.nbytes) if kv_cache else 0
    need = cache + ids.nbytes + logits.nbytes
    assert config.vocab_size == 50304
    memory = []
    monkeypatch.setattr(gptspeed.step, "device_memory_available", lambda device: (memory[-1], "free on the GPU"))
    cpu = torch.device("cpu")

    def check():
        sample_mod.check_rows_fit(config, rows, length, cpu, kv_cache=kv_cache, cache_dtype=cache_dtype)

    memory.append(need)
    check()
    memory.append(need - 1)
    with pytest.raises(GptspeedError, match=f"^sampling {rows} rows of up to {length} tokens needs at least "):
        check()
    if kv_cache and cache_dtype == torch.float32 and not doc_mask:  # the defaults: the KV cache, in fp32
        with pytest.raises(GptspeedError, match=r"\(KV cache and logits\)"):
            sample_mod.check_rows_fit(config, rows, length, cpu)
    memory.append(1000)
    with pytest.raises(GptspeedError) as e:
        check()
    what = "KV cache and logits" if kv_cache else "token ids and logits"
    assert str(e.value) == (
        f"sampling {rows} rows of up to {length} tokens needs at least {format_bytes(need)} ({what}), "
        "more than the 1000 B free on the GPU: lower --num-samples, the number of prompts or --max-new-tokens"
    )


@pytest.mark.parametrize("dtype, kv_cache, cache_dtype", [("bfloat16", True, torch.bfloat16), ("float32", False, None)])
def test_sample_text_checks_the_memory_of_the_cache_it_will_make(monkeypatch, dtype, kv_cache, cache_dtype):
    """sample_text asks check_rows_fit about its rows (prompts x samples), their longest length (the
    longest prompt's tokens plus the new ones) and the cache it will make: one in the autocast dtype,
    or none with kv_cache False."""
    asked = []
    monkeypatch.setattr(sample_mod, "check_rows_fit", lambda *a, **k: asked.append((a[1:3], k)))
    prompts = ["Hi", "Hello there"] if kv_cache else ["Hi", "Hi"]  # the cache-free path pads nothing
    sample_text(
        loaded=loaded(), prompts=prompts, num_samples=3, max_new_tokens=2, device="cpu", dtype=dtype,
        kv_cache=kv_cache, out=io.StringIO(),
    )  # fmt: skip
    length = max(len(encode(p)) for p in prompts) + 2
    assert asked[0][0] == (6, length)
    assert asked[0][1]["kv_cache"] is kv_cache
    assert not kv_cache or asked[0][1]["cache_dtype"] == cache_dtype


def test_load_any_model_of_a_hugging_face_folder_says_so_and_puts_it_on_the_runtimes_device(tmp_path):
    """info is {"init_from": the source, "step": None} (no step for HF weights), and the model is
    moved to the runtime's device (here meta, not the CPU it is built on) in eval mode."""
    from gptspeed.hf.export import export_hf

    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    save_checkpoint(run_folder, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    folder = str(export_hf(run_folder, tmp_path / "hf"))
    model, info = sample_mod.load_any_model(META, init_from=folder)
    assert info == {"init_from": folder, "step": None}
    assert {p.device.type for p in model.parameters()} == {"meta"} and not model.training


@pytest.mark.parametrize("kv", [[], ["--no-kv-cache"]])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_sample_of_a_diverged_checkpoint_is_one_line(tmp_path, kv, temperature):
    run = write_run_pico(tmp_path / "run", poison=float("nan"))
    res = run_main(
        "sample",
        "--run",
        str(run),
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--temperature",
        temperature,
        *kv,
    )
    assert_user_error(res, "logits are not finite")


def test_sample_next_refuses_impossible_rows_and_overflowing_temperatures():
    from gptspeed.sample import sample_next

    ok = torch.tensor([[0.0, 1.0, -math.inf]])
    assert sample_next(ok, 0, None, None).tolist() == [1]
    for logits in (
        torch.tensor([[0.0, math.nan]]),
        torch.tensor([[0.0, math.inf]]),
        torch.full((1, 3), -math.inf),
    ):  # every token impossible
        with pytest.raises(GptspeedError, match="not finite"):
            sample_next(logits, 1.0, None, None)
    with pytest.raises(GptspeedError, match="--temperature 1e-40 is too small"):
        sample_next(torch.tensor([[0.0, 30.0]]), 1e-40, 2, None)


def test_run_generate_takes_sample_texts_defaults():
    """``Run.generate`` is ``gptspeed sample`` from Python: every option it shares with
    :func:`gptspeed.sample.sample_text` has the same default (and the CLI's are sample_text's: tests/test_cli.py)."""
    import inspect

    from gptspeed.api import Run

    def defaults(f):
        return {n: p.default for n, p in inspect.signature(f).parameters.items() if p.default is not p.empty}

    generate, sample = defaults(Run.generate), defaults(sample_mod.sample_text)
    shared = set(generate) & set(sample)
    assert shared >= {"max_new_tokens", "temperature", "top_k", "num_samples", "seed", "kv_cache"}
    assert {n: generate[n] for n in shared} == {n: sample[n] for n in shared}


def test_prompts_of_several_lengths_are_left_padded_with_the_models_own_eot():
    """A model of a small vocabulary of its own (64 ids, <|endoftext|> 7) samples prompts of different token
    lengths in one batch: the padding is its own <|endoftext|>, an id of its vocabulary (GPT-2's 50256 is not)."""
    from gptspeed.runtime import resolve_runtime

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, valid_vocab_size=60, eot_token=7)
    model = GPT(cfg).eval()
    rows = [[1, 2, 3, 4], [5]]
    tokens = sample_mod._generate_rows(
        model, resolve_runtime("cpu", "float32", False), rows, 3, temperature=1.0, top_k=0, seed=1, kv_cache=True
    )
    new = torch.stack(list(tokens), dim=1)  # (rows, 3)
    assert new.shape == (2, 3) and bool((new < 60).all())
