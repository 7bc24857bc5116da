"""Text generation, with and without a KV cache, from a run or a Hugging Face GPT-2.

:func:`generate` is the reference: every step re-reads the last ``block_size`` tokens.
:func:`generate_cached` keeps each layer's keys and values (Pope et al. 2022, "Efficiently Scaling
Transformer Inference"; the layout of gpt-fast / nanoGPT forks): one forward over the prompt
(prefill), then one token per step, so a step costs O(T) attention instead of O(T^2) and no
recomputation of earlier positions. It draws the same tokens as :func:`generate` for the same
seed (fp32; tested), takes several prompts of different lengths at once (left-padded, with
per-row positions and a padding mask), and past ``block_size`` falls back to recomputing the
window of the last ``block_size`` tokens each step, exactly as :func:`generate` does.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import torch
from torch.nn import functional as F

from gptspeed.checkpoint import load_latest_run
from gptspeed.config import check_seed
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, KVCache
from gptspeed.options import DeviceOptions, SampleOptions
from gptspeed.parallelize import unwrap
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.tokenizer import EOT_TOKEN


def load_model(run_dir: str | Path, rt: Runtime) -> tuple[GPT, dict]:
    """The model of the newest checkpoint in ``run_dir``, on ``rt.device``, in eval mode: its tail average's
    blend when it holds one (``--ema-tail-ratio``, :func:`gptspeed.averaging.readout_state`; then
    ``checkpoint["readout"]`` is ``"tail average"``). Returns ``(model, checkpoint)``; GptspeedError if there is none."""
    ckpt, cfg = load_latest_run(Path(run_dir))
    from gptspeed.checkpoint import checkpoint_path, load_part
    from gptspeed.step import check_model_fits

    check_model_fits(cfg)  # a checkpoint's configuration is input too: a shape that cannot fit is one line
    model = GPT(cfg.model)
    from gptspeed.averaging import readout_state  # --ema-tail-ratio: the tail average's blend, once it started

    load_part(checkpoint_path(Path(run_dir), int(ckpt["step"])), "model", model, readout_state(ckpt))
    model.to(rt.device).eval()
    return model, ckpt


def load_any_model(rt: Runtime, run: str | Path | None = None, init_from: str | None = None) -> tuple[GPT, dict]:
    """The model of a run folder (``run``: newest checkpoint) or of a Hugging Face GPT-2
    (``init_from``: folder or name, see :func:`gptspeed.hf.load.resolve_source`), on ``rt.device`` in
    eval mode. Returns ``(model, info)`` with ``info`` = ``{"run" | "init_from", "step"}``
    (``step`` None for HF weights), and ``"weights": "tail average"`` for a run's tail average's blend.

    Raises:
        GptspeedError: neither or both given; the run or model cannot be loaded.
    """
    if (run is None) == (init_from is None):
        raise GptspeedError("give either --run RUN_DIR or --init-from MODEL (a folder or gpt2, gpt2-medium, ...)")
    if run is not None:
        model, ckpt = load_model(run, rt)
        averaged = {"weights": "tail average"} if ckpt["readout"] == "tail average" else {}  # --ema-tail-ratio
        return model, {"run": str(run), "step": ckpt["step"], **averaged}
    from gptspeed.hf.load import load_hf_model

    model, _ = load_hf_model(init_from)
    return model.to(rt.device).eval(), {"init_from": init_from, "step": None}


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from ``logits`` ``(B, V)`` float: greedy (argmax) when ``temperature`` is
    0, else softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (Fan et al.
    2018), one ``torch.multinomial`` draw per row. Returns ``(B,)`` int64.

    With ``top_k`` the draw is made among the k candidates only (a k-way multinomial instead of
    one over the whole vocabulary: on a CPU that is most of a small model's step).

    Raises:
        GptspeedError: a row's largest logit is NaN or infinite (the model's weights diverged or
            are corrupt: NaN, +inf, or every token at -inf), or becomes infinite once divided by
            ``temperature``: one line, where ``torch.multinomial`` would raise (or argmax pick noise).
    """
    top = logits.amax(dim=-1)  # NaN if any logit is NaN; +inf; -inf when no token is possible
    if not bool(torch.isfinite(top).all()):
        raise GptspeedError(
            "the model's logits are not finite (NaN or infinite): its weights have diverged or are "
            "corrupt; sample from an earlier checkpoint or a healthy model"
        )
    if temperature == 0:
        return logits.argmax(dim=-1)
    if not bool(torch.isfinite(top / temperature).all()):
        raise GptspeedError(
            f"--temperature {temperature:g} is too small for these logits (they overflow once divided "
            "by it): use a larger one, or 0 for greedy decoding"
        )
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        values, indices = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted
        probs = F.softmax(values, dim=-1)
        choice = torch.multinomial(probs, 1, generator=generator)  # (B, 1) in [0, k)
        return indices.gather(1, choice).squeeze(1)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    autocast=None,
) -> Iterator[torch.Tensor]:
    """Autoregressive sampling without a KV cache (each step re-reads the last ``block_size``
    tokens). ``idx`` is ``(B, T0)`` int64; yields each new column ``(B,)`` int64 as it is drawn.

    ``temperature`` 0 is greedy decoding; ``top_k`` keeps the k most likely tokens (Fan et al.
    2018). Vocabulary padding has -inf logits (see :class:`GPT`), so it is never drawn.
    """
    block_size = unwrap(model).config.block_size
    for _ in range(max_new_tokens):
        ctx = idx[:, -block_size:]
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = model(ctx, logits_at=LAST)[0].float()  # (B, V): the last position only
        nxt = sample_next(logits, temperature, top_k, generator)
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        yield nxt


# ---------------------------------------------------------------------------------------- KV cache
LAST = (slice(None), -1)  # ``logits_at`` for the last position of every row


def left_pad(
    prompts: list[list[int]], pad_id: int = EOT_TOKEN, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one ``(B, T0)`` int64 batch, right-aligned (left-padded with
    ``pad_id``), and the pad count per row ``(B,)`` int64. Raises ValueError on an empty prompt."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T0 = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_id] * (T0 - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    pad = torch.tensor([T0 - len(p) for p in prompts], dtype=torch.long, device=device)
    return idx, pad


def _window_inputs(pad: torch.Tensor, start: int, T: int):
    """Positions ``(B, T)`` and attention mask (None without padding) for columns start..start+T-1."""
    cols = torch.arange(start, start + T, device=pad.device)
    pos = (cols[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
    if not bool((pad > 0).any()):
        return pos, None
    keys = torch.arange(start + T, device=pad.device)
    real = keys[None, :] >= pad[:, None]  # (B, S): key columns that are not padding
    causal = keys[None, :] <= cols[:, None]  # (T, S)
    self_ = keys[None, :] == cols[:, None]  # a padding query attends to itself, never to nothing
    allowed = causal[None] & (real[:, None, :] | self_[None])  # (B, T, S)
    return pos, allowed[:, None]  # (B, 1, T, S)


@torch.no_grad()
def generate_cached(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    autocast=None,
    pad: torch.Tensor | None = None,
    compile: bool | str = False,
) -> Iterator[torch.Tensor]:
    """Autoregressive sampling with a KV cache; same contract and same tokens as :func:`generate`.

    ``idx`` ``(B, T0)`` int64; ``pad`` ``(B,)`` int64 = left-padding columns per row (from
    :func:`left_pad`; None = no padding). Yields each new column ``(B,)`` int64. The keys and
    values live in a :class:`gptspeed.model.KVCache` that the model's attention layers fill.
    ``model`` may be a ``torch.compile``-d GPT (its module is used); ``compile`` True (inductor)
    or a backend name compiles the one-token decode step with dynamic shapes (the prefill runs
    eagerly).
    Cost past ``block_size``: every further step recomputes the last ``block_size`` tokens (the
    learned absolute positions of GPT-2 make a shifted cache wrong), as the cache-free path does.
    """
    m: GPT = unwrap(model)
    S = m.config.block_size
    B = idx.size(0)
    pad = torch.zeros(B, dtype=torch.long, device=idx.device) if pad is None else pad.to(idx.device)
    step = m
    if compile:
        step = torch.compile(m, dynamic=True, backend="inductor" if compile is True else compile)
    cache = KVCache(m.config.n_layer, S)
    seq, pad_w = idx, pad
    for i in range(max_new_tokens):
        with autocast if autocast is not None else contextlib.nullcontext():
            if i == 0 or cache.start == S:  # prefill, or the window is full: recompute it
                window = seq[:, -S:]
                pad_w = (pad - (seq.size(1) - window.size(1))).clamp(min=0)
                pos, cache.mask = _window_inputs(pad_w, 0, window.size(1))
                cache.start = 0
                logits = m(window, pos=pos, kv=cache, logits_at=LAST)[0]
                cache.start = window.size(1)
            else:
                pos, cache.mask = _window_inputs(pad_w, cache.start, 1)
                logits = step(seq[:, -1:], pos=pos, kv=cache, logits_at=LAST)[0]
                cache.start += 1
            logits = logits.float()  # (B, V)
        nxt = sample_next(logits, temperature, top_k, generator)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        yield nxt


# ------------------------------------------------------------------------------------- the command
MAX_NEW_TOKENS = 1 << 20  # --max-new-tokens: a million tokens is hours of sampling; beyond is a mistake


def check_sample_arguments(prompts, *, max_new_tokens, temperature, top_k, num_samples, kv_cache) -> None:
    """GptspeedError (one line) for sampling arguments of the wrong type or range -- what the CLI's
    parser checks, for :func:`sample_text`'s and :meth:`gptspeed.api.Run.generate`'s callers:
    ``prompts`` a list of texts; ``max_new_tokens``, ``top_k`` and ``num_samples`` integers (not
    bools), ``temperature`` a number, ``kv_cache`` a bool; then the ranges: ``max_new_tokens``
    0..:data:`MAX_NEW_TOKENS`, ``top_k`` >= 0 (0: all), ``num_samples`` >= 1, ``temperature``
    finite and >= 0 (0: greedy)."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise GptspeedError(f"prompts must be a list of texts, got {prompts!r}"[:300])
    for name, value in (("--max-new-tokens", max_new_tokens), ("--top-k", top_k), ("--num-samples", num_samples)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise GptspeedError(f"{name} must be an integer, got {value!r}"[:300])
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise GptspeedError(f"--temperature must be a number (0: greedy), got {temperature!r}"[:300])
    if not isinstance(kv_cache, bool):
        raise GptspeedError(f"kv_cache must be True or False, got {kv_cache!r}"[:300])
    if max_new_tokens < 0 or num_samples < 1 or not temperature >= 0 or not math.isfinite(temperature) or top_k < 0:
        raise GptspeedError(
            "--max-new-tokens, --top-k and --temperature must be >= 0 (--temperature finite), --num-samples >= 1"
        )
    if max_new_tokens > MAX_NEW_TOKENS:
        raise GptspeedError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS:,}, got {max_new_tokens:,}")


def check_rows_fit(
    config, rows: int, length: int, device: torch.device, *, kv_cache: bool = True, cache_dtype=torch.float32
) -> None:
    """GptspeedError (one line) when ``rows`` sequences of up to ``length`` tokens cannot be sampled
    in the memory ``device`` has -- a lower bound: with ``kv_cache``, the cache
    :func:`generate_cached` allocates whole at the prefill (a key and a value ``(rows, n_head,
    block_size, head_dim)`` per layer in ``cache_dtype``, the dtype attention computes in: fp32, or
    bf16/fp16 under autocast; the document ids ``(rows, block_size)`` int64 with ``doc_mask``); the
    token ids ``(rows, length)`` int64 and one fp32 row of logits per row. A ``--num-samples`` of
    millions was killed by the kernel's OOM killer."""
    from gptspeed.step import device_memory_available, format_bytes

    cache = 0
    if kv_cache:
        element = torch.empty((), dtype=cache_dtype).element_size()
        cache = config.block_size * (element * 2 * config.n_layer * config.n_embd + 8 * config.doc_mask)
    need = rows * (cache + 8 * length + 4 * config.vocab_size)
    available, what = device_memory_available(device)
    if available is not None and need > available:
        raise GptspeedError(
            f"sampling {rows:,} rows of up to {length:,} tokens needs at least {format_bytes(need)} "
            f"({'KV cache and logits' if kv_cache else 'token ids and logits'}), more than the "
            f"{format_bytes(available)} {what}: lower --num-samples, the number of prompts or --max-new-tokens"
        )


def sample_text(
    *,
    run: str | None = None,
    init_from: str | None = None,
    prompts: list[str] | None = SampleOptions.prompts,
    max_new_tokens: int = SampleOptions.max_new_tokens,
    temperature: float = SampleOptions.temperature,
    top_k: int = SampleOptions.top_k,
    num_samples: int = SampleOptions.num_samples,
    seed: int = SampleOptions.seed,
    device: str = DeviceOptions.device,
    dtype: str = DeviceOptions.dtype,
    kv_cache: bool = SampleOptions.kv_cache,
    compile: bool = SampleOptions.compile,
    out: TextIO | None = None,
    loaded: tuple[GPT, dict] | None = None,
) -> list[str]:
    """``gptspeed sample``: continue each prompt ``num_samples`` times, all rows in one batch.

    ``loaded``: a model already loaded by :func:`load_any_model` (``(model, info)``, on the device
    ``device`` resolves to), used instead of loading ``run`` / ``init_from`` again
    (:meth:`gptspeed.api.Run.generate` keeps its model between calls).

    One row is streamed to ``out`` (default stdout) as it is generated, whole characters at a
    time; several rows are printed one after another when the batch is done, each under a
    ``--- sample i ---`` header. Returns the generated texts (prompts excluded), row by row.

    Prompts are encoded and samples decoded with the run's tokenizer
    (:func:`gptspeed.run_tokenizer.eval_tokenizer`: for ``init_from``, the export's own, else GPT-2's).

    Raises:
        GptspeedError: bad numbers, an empty prompt, or the model or its tokenizer cannot be loaded.
    """
    from gptspeed.run_tokenizer import eval_tokenizer
    from gptspeed.tokenizer import decode, encode

    out = out or sys.stdout
    prompts = ["\n"] if prompts is None or (isinstance(prompts, list) and not prompts) else prompts
    check_sample_arguments(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        num_samples=num_samples,
        kv_cache=kv_cache,
    )
    check_seed(seed, "--seed")  # before the model loads: torch.Generator.manual_seed takes 64 bits
    tok = eval_tokenizer(run, init_from=init_from)
    encode, decode = (encode, decode) if tok is None else (tok.encode, tok.decode)
    encoded = [encode(p) for p in prompts]
    if not all(encoded):
        raise GptspeedError("a --prompt encodes to no tokens: give some text")
    rt = resolve_runtime(device, dtype, compile=compile)
    model, info = loaded if loaded is not None else load_any_model(rt, run, init_from)
    length = max(map(len, encoded)) + max_new_tokens
    cache_dtype = rt.autocast_dtype or torch.float32
    check_rows_fit(
        unwrap(model).config, len(prompts) * num_samples, length, rt.device, kv_cache=kv_cache, cache_dtype=cache_dtype
    )
    rows = [(p, e) for p, e in zip(prompts, encoded) for _ in range(num_samples)]
    sampling = dict(temperature=temperature, top_k=top_k, seed=seed, kv_cache=kv_cache)
    tokens = _generate_rows(model, rt, [e for _, e in rows], max_new_tokens, **sampling)
    if len(rows) == 1:
        return [_stream_row(tokens, rows[0][0], out, decode)]
    where = f"step {info['step']}" if info["step"] is not None else info.get("init_from", "")
    return _print_rows(tokens, [p for p, _ in rows], where, out, decode)


def _generate_rows(
    model: GPT, rt: Runtime, rows: list[list[int]], max_new_tokens: int, *, temperature, top_k, seed, kv_cache
) -> Iterator[torch.Tensor]:
    """:func:`sample_text`'s tokens: the token id lists ``rows`` left-padded into one batch
    (:func:`left_pad`) and continued by :func:`generate_cached` (``kv_cache``) or :func:`generate`
    on ``rt``, drawn from a generator seeded with ``seed``; yields each step's new tokens, ``(rows,)``
    int64. GptspeedError: without the KV cache, prompts of different token lengths."""
    idx, pad = left_pad(rows, pad_id=unwrap(model).config.eot_token, device=rt.device)
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    kw = dict(temperature=temperature, top_k=top_k or None, generator=gen, autocast=rt.autocast())
    if not kv_cache and bool((pad > 0).any()):
        raise GptspeedError("--no-kv-cache needs prompts of equal token length (it has no padding mask)")
    if kv_cache:
        return generate_cached(model, idx, max_new_tokens, pad=pad, compile=rt.compile, **kw)
    return generate(model, idx, max_new_tokens, **kw)


def _stream_row(tokens: Iterator[torch.Tensor], prompt: str, out: TextIO, decode: Callable[[list[int]], str]) -> str:
    """Write ``prompt``, then one row's text to ``out`` as ``tokens`` (``(1,)`` a step) come, whole
    characters at a time (a token that ends inside a UTF-8 character waits for the next), then a
    newline. Returns the generated text (``decode``: the run tokenizer's)."""
    new: list[int] = []
    shown = 0
    out.write(prompt)
    for tok in tokens:
        new.extend(tok.tolist())
        text = decode(new[shown:])
        if not text.endswith("\ufffd"):  # write whole characters only
            out.write(text)
            out.flush()
            shown = len(new)
    out.write(decode(new[shown:]) + "\n")
    out.flush()
    return decode(new)


def _print_rows(
    tokens: Iterator[torch.Tensor], prompts: list[str], where: str, out: TextIO, decode: Callable[[list[int]], str]
) -> list[str]:
    """Collect every row of ``tokens`` (``(rows,)`` a step), then write each row to ``out`` under a
    ``--- sample i (where) ---`` header, its prompt before its text. Returns the texts, row by row."""
    new: list[list[int]] = [[] for _ in prompts]
    for tok in tokens:
        for r, t in enumerate(tok.tolist()):
            new[r].append(t)
    texts = [decode(n) for n in new]
    for r, (prompt, text) in enumerate(zip(prompts, texts)):
        out.write(f"--- sample {r + 1} ({where}) ---\n{prompt}{text}\n")
    out.flush()
    return texts
