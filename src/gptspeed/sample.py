"""Text generation (with and without a KV cache) and checkpoint evaluation.

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
from pathlib import Path
from typing import Iterator, TextIO

import torch
from torch.nn import functional as F

from gptspeed.checkpoint import load_latest
from gptspeed.config import RunConfig
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.tokenizer import EOT_TOKEN


def load_model(run_dir: str | Path, rt: Runtime) -> tuple[GPT, dict]:
    """The model of the newest checkpoint in ``run_dir``, on ``rt.device``, in eval mode.
    Returns ``(model, checkpoint)``; GptspeedError if there is none."""
    ckpt = load_latest(Path(run_dir))
    cfg = RunConfig.from_dict(ckpt["config"])
    model = GPT(cfg.model)
    model.load_state_dict(ckpt["model"])
    model.to(rt.device).eval()
    return model, ckpt


def load_any_model(rt: Runtime, run: str | Path | None = None, init_from: str | None = None) -> tuple[GPT, dict]:
    """The model of a run folder (``run``: newest checkpoint) or of a Hugging Face GPT-2
    (``init_from``: folder or name, see :func:`gptspeed.hf.resolve_source`), on ``rt.device`` in
    eval mode. Returns ``(model, info)`` with ``info`` = ``{"run" | "init_from", "step"}``
    (``step`` None for HF weights).

    Raises:
        GptspeedError: neither or both given; the run or model cannot be loaded.
    """
    if (run is None) == (init_from is None):
        raise GptspeedError("give either --run RUN_DIR or --init-from MODEL (a folder or gpt2, gpt2-medium, ...)")
    if run is not None:
        model, ckpt = load_model(run, rt)
        return model, {"run": str(run), "step": ckpt["step"]}
    from gptspeed.hf import load_hf_model

    model, _ = load_hf_model(init_from)
    return model.to(rt.device).eval(), {"init_from": init_from, "step": None}


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``logits`` ``(B, V)`` float: greedy (argmax) when ``temperature`` is
    0, else softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (Fan et al.
    2018), one ``torch.multinomial`` draw per row. Returns ``(B,)`` int64.

    With ``top_k`` the draw is made among the k candidates only (a k-way multinomial instead of
    one over the whole vocabulary: on a CPU that is most of a small model's step)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        values, indices = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted
        probs = F.softmax(values, dim=-1)
        choice = torch.multinomial(probs, 1, generator=generator)  # (B, 1) in [0, k)
        return indices.gather(1, choice).squeeze(1)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             autocast=None) -> Iterator[torch.Tensor]:
    """Autoregressive sampling without a KV cache (each step re-reads the last ``block_size``
    tokens). ``idx`` is ``(B, T0)`` int64; yields each new column ``(B,)`` int64 as it is drawn.

    ``temperature`` 0 is greedy decoding; ``top_k`` keeps the k most likely tokens (Fan et al.
    2018). Vocabulary padding has -inf logits (see :class:`GPT`), so it is never drawn.
    """
    for _ in range(max_new_tokens):
        ctx = idx[:, -model.config.block_size :]
        with autocast if autocast is not None else contextlib.nullcontext():
            h = model.hidden_states(ctx)
            logits = model.logits(h[:, -1, :]).float()  # (B, V): the last position only
        nxt = sample_next(logits, temperature, top_k, generator)
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        yield nxt


# ---------------------------------------------------------------------------------------- KV cache
class KVCache:
    """Keys and values of every layer for one batch: ``k[i]``, ``v[i]`` are ``(B, H, S, Q)`` with
    ``S = block_size``, allocated at the first write in the dtype attention computes in (fp32, or
    bf16/fp16 under autocast). Column ``j`` holds sequence column ``j`` of the current window."""

    def __init__(self, n_layer: int):
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    def write(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``(B, H, T, Q)`` at columns ``start .. start+T-1`` of layer ``i``;
        return that layer's keys and values for columns ``0 .. start+T-1``."""
        if self.k[i] is None:
            B, H, _, Q = k.shape
            self.k[i] = k.new_empty(B, H, size, Q)
            self.v[i] = v.new_empty(B, H, size, Q)
        end = start + k.size(2)
        self.k[i][:, :, start:end] = k
        self.v[i][:, :, start:end] = v
        return self.k[i][:, :, :end], self.v[i][:, :, :end]


def cached_forward(model: GPT, idx: torch.Tensor, pos: torch.Tensor, start: int, cache: KVCache,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """Final-LayerNorm hidden states ``(B, T, C)`` for new tokens ``idx`` ``(B, T)`` int64 at cache
    columns ``start .. start+T-1`` and positions ``pos`` ``(B, T)`` int64, attending to the cached
    columns before them; their keys and values are written to ``cache``.

    ``mask`` is None (no padding: causal prefill when ``start`` is 0, or one new token that sees
    every cached column) or a bool ``(B, 1, T, start+T)``, True where attention is allowed.
    Mirrors :meth:`GPT.hidden_states` / ``Block.forward`` step for step; the cache-equality test
    catches any drift between the two.
    """
    B, T = idx.shape
    assert mask is not None or start == 0 or T == 1, "a multi-token step after column 0 needs a mask"
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(pos)  # (B, T, C)
    C = x.size(-1)
    for i, block in enumerate(tr.h):
        attn = block.attn
        H = attn.n_head
        q, k, v = attn.c_attn(block.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, Q)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, Q)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, Q)
        K, V = cache.write(i, start, k, v, model.config.block_size)  # (B, H, start+T, Q)
        if mask is None:
            y = F.scaled_dot_product_attention(q, K, V, is_causal=T > 1)  # (B, H, T, Q)
        else:
            y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        x = x + attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        x = x + block.mlp(block.ln_2(x))
    return tr.ln_f(x)  # (B, T, C)


def left_pad(prompts: list[list[int]], pad_id: int = EOT_TOKEN,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
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
def generate_cached(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                    top_k: int | None = None, generator: torch.Generator | None = None, autocast=None,
                    pad: torch.Tensor | None = None, compile: bool | str = False) -> Iterator[torch.Tensor]:
    """Autoregressive sampling with a KV cache; same contract and same tokens as :func:`generate`.

    ``idx`` ``(B, T0)`` int64; ``pad`` ``(B,)`` int64 = left-padding columns per row (from
    :func:`left_pad`; None = no padding). Yields each new column ``(B,)`` int64. ``model`` may be
    a ``torch.compile``-d GPT (its module is used); ``compile`` True (inductor) or a backend name
    compiles the one-token decode step with dynamic shapes (the prefill runs eagerly).
    Cost past ``block_size``: every further step recomputes the last ``block_size`` tokens (the
    learned absolute positions of GPT-2 make a shifted cache wrong), as the cache-free path does.
    """
    m: GPT = getattr(model, "_orig_mod", model)
    S = m.config.block_size
    B = idx.size(0)
    pad = torch.zeros(B, dtype=torch.long, device=idx.device) if pad is None else pad.to(idx.device)
    step = cached_forward
    if compile:
        step = torch.compile(cached_forward, dynamic=True, backend="inductor" if compile is True else compile)
    cache = KVCache(m.config.n_layer)
    seq, filled, pad_w = idx, 0, pad
    for i in range(max_new_tokens):
        with autocast if autocast is not None else contextlib.nullcontext():
            if i == 0 or filled == S:  # prefill, or the window is full: recompute it
                window = seq[:, -S:]
                pad_w = (pad - (seq.size(1) - window.size(1))).clamp(min=0)
                pos, mask = _window_inputs(pad_w, 0, window.size(1))
                h = cached_forward(m, window, pos, 0, cache, mask)
                filled = window.size(1)
            else:
                pos, mask = _window_inputs(pad_w, filled, 1)
                h = step(m, seq[:, -1:], pos, filled, cache, mask)
                filled += 1
            logits = m.logits(h[:, -1, :]).float()  # (B, V)
        nxt = sample_next(logits, temperature, top_k, generator)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        yield nxt


# ------------------------------------------------------------------------------------- the command
def sample_text(*, run: str | None = None, init_from: str | None = None, prompts: list[str] | None = None,
                max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 200, num_samples: int = 1,
                seed: int = 1337, device: str = "auto", dtype: str = "auto", kv_cache: bool = True,
                compile: bool = False, out: TextIO | None = None) -> list[str]:
    """``gptspeed sample``: continue each prompt ``num_samples`` times, all rows in one batch.

    One row is streamed to ``out`` (default stdout) as it is generated, whole characters at a
    time; several rows are printed one after another when the batch is done, each under a
    ``--- sample i ---`` header. Returns the generated texts (prompts excluded), row by row.

    Raises:
        GptspeedError: bad numbers, an empty prompt, or the model cannot be loaded.
    """
    from gptspeed.tokenizer import decode, encode

    out = out or sys.stdout
    prompts = prompts or ["\n"]
    if max_new_tokens < 0 or num_samples < 1 or temperature < 0 or top_k < 0:
        raise GptspeedError("--max-new-tokens, --top-k and --temperature must be >= 0, --num-samples >= 1")
    encoded = [encode(p) for p in prompts]
    if not all(encoded):
        raise GptspeedError("a --prompt encodes to no tokens: give some text")
    rt = resolve_runtime(device, dtype, compile=compile)
    model, info = load_any_model(rt, run, init_from)
    rows = [(p, e) for p, e in zip(prompts, encoded) for _ in range(num_samples)]
    idx, pad = left_pad([e for _, e in rows], device=rt.device)
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    kw = dict(temperature=temperature, top_k=top_k or None, generator=gen, autocast=rt.autocast())
    if not kv_cache and bool((pad > 0).any()):
        raise GptspeedError("--no-kv-cache needs prompts of equal token length (it has no padding mask)")
    tokens = (generate_cached(model, idx, max_new_tokens, pad=pad, compile=rt.compile, **kw) if kv_cache
              else generate(model, idx, max_new_tokens, **kw))
    new: list[list[int]] = [[] for _ in rows]
    stream = len(rows) == 1
    if stream:
        out.write(rows[0][0])
    shown = 0
    for tok in tokens:
        for r, t in enumerate(tok.tolist()):
            new[r].append(t)
        if stream:
            text = decode(new[0][shown:])
            if not text.endswith("\ufffd"):  # write whole characters only
                out.write(text)
                out.flush()
                shown = len(new[0])
    texts = [decode(n) for n in new]
    if stream:
        out.write(decode(new[0][shown:]) + "\n")
    else:
        where = f"step {info['step']}" if info["step"] is not None else info.get("init_from", "")
        for r, ((prompt, _), text) in enumerate(zip(rows, texts)):
            out.write(f"--- sample {r + 1} ({where}) ---\n{prompt}{text}\n")
    out.flush()
    return texts


def evaluate_run(run_dir: str | Path | None = None, data_dir: str | Path | None = None, *,
                 init_from: str | None = None, hellaswag: bool = False, hellaswag_file: str | None = None,
                 max_examples: int = 0,
                 batch_size: int = 8, max_tokens: int = 0, device: str = "auto", dtype: str = "auto") -> dict:
    """``gptspeed eval``: for the newest checkpoint of ``run_dir`` (or the HF model ``init_from``),
    the val loss on the val split of ``data_dir`` (``step``, ``val_loss``, ``perplexity``,
    ``tokens``, ``run``, ``data``) and/or, with ``hellaswag``, HellaSwag accuracy under
    ``"hellaswag"`` (see :func:`gptspeed.eval.hellaswag.evaluate_hellaswag`; ``max_examples`` 0 = all;
    ``hellaswag_file`` a jsonl in the same format instead of the official file, implies ``hellaswag``).

    Raises:
        GptspeedError: nothing to evaluate, bad sizes, missing data or model.
    """
    from gptspeed.data import find_shards
    from gptspeed.train import evaluate

    hellaswag = hellaswag or hellaswag_file is not None
    if data_dir is None and not hellaswag:
        raise GptspeedError("nothing to evaluate: give --data DIR (val loss) and/or --hellaswag")
    if batch_size < 1:
        raise GptspeedError(f"--batch-size must be at least 1, got {batch_size}")
    if max_examples < 0:
        raise GptspeedError(f"--max-examples must be 0 (all) or more, got {max_examples}")
    rt = resolve_runtime(device, dtype, compile=False)
    shards = find_shards(data_dir, "val") if data_dir is not None else None
    items = None
    if hellaswag:
        from gptspeed.eval.hellaswag import load_hellaswag

        items = load_hellaswag(hellaswag_file, max_examples=max_examples)
    model, info = load_any_model(rt, run_dir, init_from)
    result: dict = {**info}
    if shards is not None:
        loss, n = evaluate(model, rt, shards, batch_size, model.config.block_size, max_tokens)
        result.update(val_loss=loss, perplexity=math.exp(loss), tokens=n, data=str(data_dir))
    if items is not None:
        from gptspeed.eval.hellaswag import evaluate_hellaswag

        result["hellaswag"] = evaluate_hellaswag(model, items, device=rt.device, autocast=rt.autocast(),
                                                 batch_examples=batch_size)
    return result
