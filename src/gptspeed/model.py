"""GPT-2, as OpenAI released it, in one file -- and the modern switches, each off by default.

Pre-LayerNorm transformer blocks, GELU with the tanh approximation, learned position embeddings,
the LM head tied to the token embedding, and GPT-2's initialisation (N(0, 0.02), residual
projections scaled by 1/sqrt(2 * n_layer)). Parameter names follow Hugging Face's
``GPT2LMHeadModel`` (``transformer.h.0.attn.c_attn.weight`` ...), so weights map one to one
(HF stores Conv1D weights transposed: ``[in, out]`` where ``nn.Linear`` has ``[out, in]``).

The switches of :class:`GPTConfig` the modded-nanogpt speedrun and its kin use, each a flag:
rotary position embeddings (``pos_emb="rope"``; Su et al. 2021), RMS-normalised queries and keys
(``qk_norm``; Dehghani et al. 2023), ReLU² (``mlp="relu2"``; So et al. 2021), RMSNorm
(``norm="rmsnorm"``; Zhang & Sennrich 2019), an untied LM head, zero-initialised output
projections, tanh logit soft-capping (``logit_softcap``; Gemma 2), attention that never crosses
``<|endoftext|>`` (``doc_mask``), sliding-window attention whose window grows during training
(``attn_window``; :meth:`GPT.set_attn_window`), and a bf16 residual stream under bf16 autocast
(``residual_dtype="bfloat16"``, :meth:`GPT.hidden_states`).

Sources: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", and OpenAI's
``gpt-2/src/model.py``; layout as in nanoGPT. This module knows nothing of devices, precision
(beyond the residual stream's dtype under an autocast set by its caller), compilation or
parallelism: :mod:`gptspeed.runtime` applies those from outside.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptspeed.config import GPTConfig  # noqa: F401  (GPTConfig is part of this module's API)
from gptspeed.loss import chunked_loss
from gptspeed.tokenizer import EOT_TOKEN


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for positions ``pos`` (``(T,)`` or ``(B, T)`` int64): ``cos``, ``sin``
    of ``pos * theta ** (-2i / head_dim)`` for ``i < head_dim / 2``, fp32, shaped to broadcast over
    ``(B, H, T, head_dim / 2)``: ``(1, 1, T, Q/2)`` or ``(B, 1, T, Q/2)``. Su et al. 2021, RoFormer."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (..., T, Q/2)
    angles = angles[None, None] if angles.dim() == 2 else angles[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the channel pairs ``(x[..., i], x[..., i + Q/2])`` of ``x`` ``(B, H, T, Q)`` by the
    angles of :func:`rope_cos_sin` (the GPT-NeoX / Llama "rotate half" layout); same shape and dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def make_norm(config: GPTConfig) -> nn.Module:
    """The block's normalisation: ``nn.LayerNorm`` (GPT-2's) or ``nn.RMSNorm`` (a gain, no bias)."""
    return nn.LayerNorm(config.n_embd) if config.norm == "layernorm" else nn.RMSNorm(config.n_embd)


class KVCache:
    """Keys and values of every layer for one batch, for generation (Pope et al. 2022,
    "Efficiently Scaling Transformer Inference"; the cache lives in the attention layers, as in
    litgpt / gpt-fast). ``k[i]``, ``v[i]`` are ``(B, H, S, Q)`` with ``S = size``, allocated at the
    first write in the dtype attention computes in (fp32, or bf16/fp16 under autocast).

    Before each forward the caller sets ``start`` (cache columns already filled: the new tokens
    go to columns ``start .. start+T-1``) and ``mask``: None (no padding: a causal prefill when
    ``start`` is 0, or one new token that sees every filled column) or a bool
    ``(B, 1, T, start+T)``, True where attention is allowed.
    """

    def __init__(self, n_layer: int, size: int):
        self.size = size
        self.start = 0
        self.mask: torch.Tensor | None = None
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.seg: torch.Tensor | None = None  # (B, size) document ids of the filled columns (doc_mask only)

    def segments(self, idx: torch.Tensor, eot: int = EOT_TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
        """``doc_mask``: the document ids of the new tokens ``idx`` ``(B, T)`` (continuing those of
        the filled columns: :func:`document_ids` with separator id ``eot``) stored at ``start ..
        start+T-1``; returns them and the ids of columns ``0 .. start+T-1``."""
        B, T = idx.shape
        if self.seg is None:
            self.seg = torch.zeros(B, self.size, dtype=torch.long, device=idx.device)
        before = self.seg[:, self.start - 1 : self.start] if self.start else 0
        new = before + document_ids(idx, eot)
        self.seg[:, self.start : self.start + T] = new
        return new, self.seg[:, : self.start + T]

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``i``'s new ``k``, ``v`` ``(B, H, T, Q)`` at columns ``start .. start+T-1``;
        return its keys and values for columns ``0 .. start+T-1``."""
        if self.k[i] is None:
            B, H, _, Q = k.shape
            self.k[i] = k.new_empty(B, H, self.size, Q)
            self.v[i] = v.new_empty(B, H, self.size, Q)
        end = self.start + k.size(2)
        self.k[i][:, :, self.start : end] = k
        self.v[i][:, :, self.start : end] = v
        return self.k[i][:, :, :end], self.v[i][:, :, :end]


def document_ids(idx: torch.Tensor, eot: int = EOT_TOKEN) -> torch.Tensor:
    """``(B, T)`` int64: which document of its row each token belongs to, counting from 0. A
    document starts at its ``<|endoftext|>`` (id ``eot``: GPT-2's 50256, or the data's tokenizer's,
    ``GPTConfig.eot_token``; gptspeed writes each as ``[EOT, *text]``); tokens before a row's first
    EOT are the tail of an earlier document (id 0)."""
    return (idx == eot).long().cumsum(dim=1)


def document_mask(idx: torch.Tensor, kv: KVCache | None = None) -> torch.Tensor:
    """``doc_mask``'s attention mask for token ids ``idx`` ``(B, T)``: bool ``(B, 1, T, S)``, True
    where query ``t`` may attend key ``s`` -- causal, within the same document, and (with a
    :class:`KVCache`) among the columns its ``mask`` allows; ``S`` is ``T``, or the filled columns."""
    return attention_allowed(idx, kv, documents=True)


def attention_allowed(
    idx: torch.Tensor,
    kv: KVCache | None = None,
    *,
    documents: bool = False,
    window: int | torch.Tensor | None = None,
    eot: int = EOT_TOKEN,
) -> torch.Tensor:
    """The bool attention mask of masked SDPA (and of ``--attention manual``) for token ids ``idx``
    ``(B, T)`` at columns ``start .. start+T-1`` (``kv.start``, else 0): ``(B | 1, 1, T, S)``, ``S =
    start + T``, True where query column ``q`` may attend key column ``k``: ``k <= q`` (causal); with
    ``documents``, in the same document (:func:`document_ids`, separator id ``eot``; ``doc_mask``); with ``window`` ``W`` (an
    int or a 0-dim int tensor: ``attn_window``), ``q - k < W``: at most the last ``W`` tokens, itself
    included (sliding-window attention, Beltagy et al. 2020, "Longformer"); with a :class:`KVCache`,
    among the columns its ``mask`` allows. Batch-independent rules give a ``(1, 1, T, S)`` mask."""
    start = kv.start if kv is not None else 0
    T = idx.size(1)
    q = torch.arange(start, start + T, device=idx.device)[:, None]  # (T, 1) query columns
    k = torch.arange(start + T, device=idx.device)[None, :]  # (1, S) key columns
    allowed = k <= q  # (T, S)
    if window is not None:
        allowed = allowed & (q - k < window)
    allowed = allowed[None, None]  # (1, 1, T, S)
    if documents:
        seg_q, seg_k = kv.segments(idx, eot) if kv is not None else (document_ids(idx, eot),) * 2
        allowed = allowed & (seg_q[:, :, None] == seg_k[:, None, :])[:, None]  # (B, 1, T, S)
    if kv is not None and kv.mask is not None:
        allowed = allowed & kv.mask
    return allowed


def dense_mask(block_mask) -> torch.Tensor:
    """The bool mask ``(B | 1, 1, T, S)`` (True: may attend) of a FlexAttention ``BlockMask``'s rule
    (its ``mask_mod``, token-exact), for a forward that runs eagerly: FlexAttention outside
    ``torch.compile`` takes its unfused reference path, which materialises the ``B*H*T*S`` scores
    (PyTorch's ``flex_attention`` docs); masked SDPA with this mask runs a fused kernel instead."""
    from torch.nn.attention.flex_attention import create_mask

    T, S = block_mask.seq_lengths
    B = block_mask.kv_num_blocks.size(0)
    return create_mask(block_mask.mask_mod, B, 1, T, S, device=block_mask.kv_num_blocks.device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, C) -> (B, T, C)``; with a :class:`KVCache`, the
    new positions attend to the cached ones too."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.attention = config.attention
        self.qk_norm = config.qk_norm
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v projections, fused
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        k = config.value_embeds
        if k and (layer < k or layer >= config.n_layer - k):  # mixes a value embedding into v: its two gates
            self.ve_gates = nn.Parameter(torch.tensor([0.5, 0.5]))
        if config.attention == "manual":
            mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("causal_mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        kv: KVCache | None = None,
        rope: tuple | None = None,
        mask: torch.Tensor | None = None,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rope``: :func:`rope_cos_sin`'s tables; ``mask``: a bool ``(B | 1, 1, T, S)`` (True: may
        attend) or a FlexAttention ``BlockMask`` (``doc_mask``, ``attn_window``), replacing the causal mask; ``ve``: the
        tokens' value embedding ``(B, T, C)`` (``value_embeds``), mixed into the values as ``g0 * v + g1 *
        ve`` with the layer's learned gates ``ve_gates`` (initially 0.5 and 0.5; the modded-nanogpt
        speedrun's value embeddings)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        if ve is not None:  # value embeddings (the speedrun's): gated, per token, before the cache keeps v
            g = self.ve_gates.to(v.dtype)
            v = g[0] * v + g[1] * ve.to(v.dtype)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Q)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Q)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Q)
        if self.qk_norm:  # Dehghani et al. 2023: bounded attention logits
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv is not None:  # generation: attend to the cached columns as well
            k, v = kv.update(self.layer, k, v)  # (B, H, start+T, Q)
        y = self._attend(q, k, v, kv, mask)  # (B, H, T, Q)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)

    def _attend(self, q, k, v, kv: KVCache | None, mask) -> torch.Tensor:
        T = q.size(2)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a FlexAttention BlockMask (CUDA)
            if torch.compiler.is_compiling():  # FlexAttention's fused kernel, compiled with the model
                from torch.nn.attention.flex_attention import flex_attention

                return flex_attention(q, k, v, block_mask=mask)
            mask = dense_mask(mask)  # eager (eval under eager(), --no-compile): masked SDPA, not flex's B*H*T*T path
        if kv is not None and mask is None:
            if kv.mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)  # prefill from column 0, or 1 token
            return F.scaled_dot_product_attention(q, k, v, attn_mask=kv.mask)
        if self.attention == "sdpa":
            # Flash / memory-efficient kernels where the device has them (Dao et al. 2022); a mask: the others
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, S)
        allowed = mask if mask is not None else self.causal_mask[:, :, :T, :T]
        att = att.masked_fill(~allowed, float("-inf"))
        return F.softmax(att, dim=-1) @ v  # (B, H, T, Q)


class ReLUSquared(nn.Module):
    """``relu(x) ** 2`` (So et al. 2021, "Primer"; the modded-nanogpt speedrun's MLP activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class MLP(nn.Module):
    """Position-wise feed-forward: ``(B, T, C) -> (B, T, 4C) -> (B, T, C)``, GELU (tanh) or ReLU²."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU(approximate="tanh") if config.mlp == "gelu" else ReLUSquared()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        kv: KVCache | None = None,
        rope: tuple | None = None,
        mask: torch.Tensor | None = None,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, rope, mask, ve)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 language model.

    ``forward(idx, targets=None, *, pos=None, kv=None, logits_at=None, return_logits=False,
    reduction="mean")``: ``idx`` is ``(B, T)`` int64 token ids with ``T <= block_size``.

    - With ``targets`` ``(B, T)`` int64 it returns ``(None, loss)``: the mean cross-entropy over
      all positions as a 0-dim fp32 tensor; with ``reduction="none"``, each position's ``(B, T)``
      fp32 (nats; +inf for a ``softmax="data"`` target outside its ids), by the same loss path --
      the fused path's without gradients (evaluation; ``--loss liger``'s runs it too). The
      training forward returns no logits, so under ``torch.compile`` AOTAutograd never materialises a zero gradient for a ``(B, T, V)`` output
      nobody uses (1.65 GB at GPT-2 124M, B=16, in bf16). ``return_logits=True`` returns them
      too, ``(B, T, vocab_size)``, where the loss path computes them: with ``config.loss``
      resolving to ``"fused"`` (:func:`gptspeed.loss.resolve_loss`) or ``softmax="data"`` they
      are never materialised and ``None`` stays in their place (see
      :func:`gptspeed.loss.fused_linear_cross_entropy`).
    - Without targets it returns ``(logits, None)``: ``(B, T, vocab_size)`` in the compute dtype
      with the padded columns at -inf; or, with ``logits_at`` (an index into the hidden states'
      first two dimensions, e.g. ``(slice(None), -1)`` for the last position of every row, or
      ``(rows, cols)`` index tensors), only the logits at those positions ``(..., vocab_size)``.
    - ``pos``: positions ``(B, T)`` or ``(T,)`` int64 (default ``0 .. T-1``); ``kv``: a
      :class:`KVCache` for generation.

    Everything goes through ``forward``, so data-parallel wrappers (FSDP2 all-gathers the root's
    parameters in its forward hook) and ``torch.compile`` see every use of the model.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        config.validate()
        self.config = config
        parts = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if config.pos_emb == "learned":
            parts["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        parts.update(h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]), ln_f=make_norm(config))
        if config.value_embeds:  # lookups, as wte: N(0, 0.02) by _init_weights, AdamW's embedding group
            parts["ve"] = nn.ModuleList(
                nn.Embedding(config.vocab_size, config.n_embd) for _ in range(config.value_embeds)
            )
        self.transformer = nn.ModuleDict(parts)
        if config.unet_skips:  # one weight a skip, initially 1 (the speedrun's)
            self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying (Press & Wolf 2017)
        if config.softmax == "data":  # the token ids the softmax covers: all until set_softmax_ids (or a checkpoint)
            self.register_buffer("softmax_ids", torch.arange(config.valid_vocab_size))
        if config.attn_window:  # the training forwards' window: set_attn_window (a tensor, so compile never recompiles)
            self.register_buffer("attn_window_now", torch.tensor(config.attn_window), persistent=False)
        self.apply(self._init_weights)
        if config.zero_init_proj:  # the speedrun's: each block starts as the identity, the head predicting uniform
            for module in self.modules():
                if getattr(module, "RESIDUAL_SCALE_INIT", False):
                    torch.nn.init.zeros_(module.weight)
            if not config.tie_embeddings:
                torch.nn.init.zeros_(self.lm_head.weight)

    def set_softmax_ids(self, ids) -> None:
        """``--softmax data``: the token ids (sorted, unique, ``< valid_vocab_size``; int64 ``(K,)``)
        the softmax covers -- those of the training data. Every other token gets probability 0:
        logits -inf when sampling, an infinite loss as a target. The token embedding keeps all
        ``vocab_size`` rows (an input may be any token); the LM head computes only ``K`` logits,
        ``K / vocab_size`` of the full head's FLOPs. ValueError for ids that are not sorted and unique
        or out of range; AttributeError on a model built with ``softmax="full"``."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.softmax_ids.device).flatten()
        if (
            ids.numel() == 0
            or bool((ids[1:] <= ids[:-1]).any())
            or int(ids[0]) < 0
            or int(ids[-1]) >= self.config.valid_vocab_size
        ):
            raise ValueError(f"softmax ids must be sorted, unique and in [0, {self.config.valid_vocab_size})")
        self.softmax_ids = ids

    def set_attn_window(self, window: int) -> None:
        """``attn_window``: the window (tokens) of the training-mode forwards from now on -- the trainer
        sets :func:`gptspeed.schedules.attn_window_at` of each step before it. Written in place into a 0-dim
        int64 buffer (not saved: a pure function of the step) that the mask reads on the device, so a
        ``torch.compile``-d model never recompiles for a new window and no step waits on the host.
        Eval-mode forwards (evaluation, HellaSwag, sampling) use the final window, ``attn_window``; a
        model never given one trains with it too. A no-op when the switch is off; ValueError for a
        window outside ``1 .. attn_window``."""
        final = self.config.attn_window
        if not final:
            return
        if not 1 <= window <= final:
            raise ValueError(f"attention window {window} outside 1 .. {final} (--attn-window)")
        self.attn_window_now.fill_(window)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        ids = state_dict.get(prefix + "softmax_ids")
        if ids is not None and hasattr(self, "softmax_ids") and ids.shape != self.softmax_ids.shape:
            self.softmax_ids = torch.empty_like(ids, device=self.softmax_ids.device)  # sized by the checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 (OpenAI gpt-2/src/model.py): weights N(0, 0.02), position embeddings N(0, 0.01),
        # residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3).
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            std = 0.01 if "wpe" in self.transformer and module is self.transformer.wpe else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            torch.nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; with ``non_embedding`` the learned position embeddings are excluded (the
        token embedding stays: tied, it is also the LM head's weight). This is the N of MFU's 6N."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, ``6N + 12 * L * H * Q * T`` (PaLM appendix B; nanoGPT), N the
        weights that multiply: with an untied head the token embedding is a lookup, not a matmul, and
        is left out (counted, it put GPT-2 124M at 1.087e9 instead of 8.55e8 and MFU ~27% high)."""
        c = self.config
        T = seq_len or c.block_size
        n = self.num_params()
        if not c.tie_embeddings:
            n -= self.transformer.wte.weight.numel()
        if c.value_embeds:  # lookups too
            n -= sum(e.weight.numel() for e in self.transformer.ve)
        if c.softmax == "data":  # the LM head multiplies by K of its vocab_size rows
            n -= (c.vocab_size - self.softmax_ids.numel()) * c.n_embd
        return 6 * n + 12 * c.n_layer * c.n_embd * T

    def hidden_states(
        self, idx: torch.Tensor, pos: torch.Tensor | None = None, kv: KVCache | None = None
    ) -> torch.Tensor:
        """Final-LayerNorm output ``(B, T, C)`` for token ids ``idx`` ``(B, T)`` at positions ``pos``
        (``(B, T)`` or ``(T,)``, default ``0 .. T-1``), through the cache ``kv`` if given. Called
        by :meth:`forward`; call it directly only on an unwrapped model.

        The residual stream ``x`` between the blocks is fp32 (the embeddings' dtype; under autocast
        each block's output, bf16, is added to it in fp32), or, with ``residual_dtype="bfloat16"``
        under bf16 autocast, bf16: the embeddings' sum is cast once, so every residual add and every
        tensor saved for backward along the stream holds half the bytes (the modded-nanogpt
        speedrun keeps its whole residual stream in bf16). Outside bf16 autocast (an fp32
        evaluation or sampling of such a run) the stream stays fp32: the weights are fp32 and
        nothing would multiply a bf16 input."""
        c = self.config
        B, T = idx.shape
        if T > c.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {c.block_size}")
        if pos is None:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)  # (B, T, C)
        if c.pos_emb == "learned":
            x = x + self.transformer.wpe(pos)
        if c.residual_dtype == "bfloat16" and self._bf16_autocast(x):
            x = x.to(torch.bfloat16)  # once: every residual add below, and what it saves for backward, is bf16
        rope = rope_cos_sin(pos, c.n_embd // c.n_head, c.rope_theta) if c.pos_emb == "rope" else None
        mask = self.attention_mask(idx, kv) if c.doc_mask or c.attn_window else None
        extra = (kv, rope, mask) if (kv, rope, mask) != (None, None, None) else ()
        if not (c.value_embeds or c.unet_skips):
            for block in self.transformer.h:
                x = block(x, *extra)
            return self.transformer.ln_f(x)  # (B, T, C)
        return self.transformer.ln_f(self._speedrun_blocks(x, idx, extra))  # (B, T, C)

    def _speedrun_blocks(self, x: torch.Tensor, idx: torch.Tensor, extra: tuple) -> torch.Tensor:
        """The blocks with the modded-nanogpt speedrun's value embeddings and U-net skips: block ``i <
        N`` and block ``n_layer - N + i`` get value embedding ``i`` of the tokens (``value_embeds`` = N);
        with ``unet_skips`` each block ``j`` of the last ``n_layer // 2`` first adds ``skip_weights[m] *``
        the output of its mirror block ``n_layer // 2 - 1 - m`` (``m = j - (n_layer - n_layer // 2)``;
        Ronneberger et al. 2015's U-net, as the speedrun joins its layers)."""
        c, n = self.config, self.config.n_layer
        k, half = c.value_embeds, n // 2 if c.unet_skips else 0
        ves = [e(idx) for e in self.transformer.ve] if k else []  # (B, T, C) each
        kv, rope, mask = extra or (None, None, None)
        skips = []
        for i, block in enumerate(self.transformer.h):
            if i >= n - half:
                x = x + self.skip_weights[i - (n - half)].to(x.dtype) * skips.pop()
            ve = ves[i] if i < k else ves[i - (n - k)] if i >= n - k and k else None
            x = block(x, kv, rope, mask, ve)
            if i < half:
                skips.append(x)
        return x

    @staticmethod
    def _bf16_autocast(x: torch.Tensor) -> bool:
        """Whether bf16 autocast is on for ``x``'s device type (``torch.compile`` guards on it)."""
        kind = x.device.type
        return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16

    def attention_mask(self, idx: torch.Tensor, kv: KVCache | None = None):
        """The mask of ``doc_mask`` and ``attn_window`` (:func:`attention_allowed`'s rule): on CUDA
        without a cache FlexAttention's block mask (only the blocks the rule allows are computed; under
        ``torch.compile`` its fused kernel, run eagerly -- evaluation under ``eager()``, HellaSwag,
        ``--no-compile`` -- the same rule as masked SDPA's bool mask, :func:`dense_mask`), else
        the bool mask of masked SDPA; None where nothing but causality is left (an eval-mode window
        covering every column, without ``doc_mask``). The window: in training mode the buffer
        :meth:`set_attn_window` fills (a tensor: one graph whatever its value), in eval mode the final
        ``attn_window``."""
        c = self.config
        window = None
        if c.attn_window:
            window = self.attn_window_now if self.training else c.attn_window
            if isinstance(window, int) and window >= idx.size(1) + (kv.start if kv is not None else 0):
                window = None  # every column is within it: plain causal attention
        if window is None and not c.doc_mask:
            return None
        if kv is None and self._flex_device(idx):
            return self._block_mask(idx, window)
        return attention_allowed(idx, kv, documents=c.doc_mask, window=window, eot=c.eot_token)

    @staticmethod
    def _flex_device(idx: torch.Tensor) -> bool:
        """Whether a forward over ``idx`` builds FlexAttention's block mask: on CUDA (its kernels)."""
        return idx.is_cuda

    def _block_mask(self, idx: torch.Tensor, window):
        """FlexAttention's ``BlockMask`` of :func:`attention_allowed`'s rule for a forward without a
        cache over ``idx`` ``(B, T)`` (CUDA; ``window``: an int, a 0-dim tensor or None): per row with
        ``doc_mask``, one for the whole batch otherwise. Token-exact: the modded-nanogpt speedrun's
        window is whole 128-token blocks of keys; here a window of ``W`` tokens is ``q - k < W``."""
        from torch.nn.attention.flex_attention import create_block_mask

        seg = document_ids(idx, self.config.eot_token) if self.config.doc_mask else None

        def allowed(b, h, q, k):
            ok = k <= q
            if seg is not None:
                ok = ok & (seg[b, q] == seg[b, k])
            if window is not None:
                ok = ok & (q - k < window)
            return ok

        B, T = idx.shape
        return create_block_mask(allowed, B if seg is not None else None, None, T, T, device=idx.device)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head on hidden states ``(..., C)`` -> ``(..., vocab_size)``, soft-capped with
        ``logit_softcap``, padded columns -inf (and, with ``softmax="data"``, every column outside
        :meth:`set_softmax_ids`' ids)."""
        cap = self.config.logit_softcap
        if self.config.softmax == "data":
            part = F.linear(h, self.lm_head.weight[self.softmax_ids])  # (..., K), the compute dtype
            if cap:
                part = cap * torch.tanh(part / cap)
            # The full row takes the matmul's dtype: under autocast ``h`` (a LayerNorm output) is fp32
            # while the matmul gives bf16/fp16, and index_put needs the two to agree.
            full = part.new_full((*h.shape[:-1], self.config.vocab_size), float("-inf"))
            full[..., self.softmax_ids] = part
            return full
        logits = self.lm_head(h)
        if cap:  # Gemma 2's soft cap, before the padding is masked (tanh(-inf) would be -1, not -inf)
            logits = cap * torch.tanh(logits / cap)
        valid = self.config.valid_vocab_size
        if self.config.vocab_size > valid:
            if getattr(self.lm_head, "returns_view", False) and not cap:
                # A head whose matmul returns a view made inside an autograd Function (torchao's FP8
                # matmul, gptspeed.fp8): autograd forbids writing into it, so the mask makes a new
                # tensor (under torch.compile it fuses into the loss's read of the logits).
                padding = torch.arange(self.config.vocab_size, device=logits.device) >= valid
                return logits.masked_fill(padding, float("-inf"))
            # In-place on the matmul output: costs a write of the padded columns only
            # (B*T*47 elements at 50304), and the matmul's backward does not need its output.
            logits[..., valid:] = float("-inf")
        return logits

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        pos: torch.Tensor | None = None,
        kv: KVCache | None = None,
        logits_at=None,
        return_logits: bool = False,
        reduction: str = "mean",
    ):
        h = self.hidden_states(idx, pos, kv)  # (B, T, C)
        if targets is None:
            return self.logits(h if logits_at is None else h[logits_at]), None
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        if self.config.softmax == "data":
            return None, self.data_softmax_loss(h, targets, reduction)
        lce = chunked_loss(self.config.loss, h.device.type, reduction)
        if lce is not None:
            loss = lce(
                h.view(-1, h.size(-1)),
                self.lm_head.weight,
                targets.reshape(-1),
                self.config.valid_vocab_size,
                softcap=self.config.logit_softcap,
            )
            return None, loss.view(targets.shape) if reduction == "none" else loss
        logits = self.logits(h)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), reduction=reduction)
        return (logits if return_logits else None), loss.view(targets.shape) if reduction == "none" else loss

    def data_softmax_loss(self, h: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Mean cross-entropy over the ``K`` ids of ``softmax_ids`` only: the LM head's rows of those
        ids (a gather; their gradient scatters back into the tied embedding), targets mapped to their
        position among them (``searchsorted``). A target outside them has probability 0, so the loss
        is then +inf -- on the device, without a sync. ``h`` ``(B, T, C)``; ``targets`` ``(B, T)``;
        ``reduction="none"``: each position's ``(B, T)`` instead, +inf where the target is outside."""
        ids = self.softmax_ids
        t = targets.reshape(-1)
        where = torch.searchsorted(ids, t).clamp_(max=ids.numel() - 1)  # (N,) position among the K ids
        outside = ids[where] != t  # (N,)
        weight = self.lm_head.weight[ids]  # (K, C)
        x = h.reshape(-1, h.size(-1))
        cap = self.config.logit_softcap
        lce = chunked_loss(self.config.loss, h.device.type, reduction)
        if lce is not None:
            loss = lce(x, weight, where, softcap=cap)
        else:
            logits = F.linear(x, weight).float()
            loss = F.cross_entropy(cap * torch.tanh(logits / cap) if cap else logits, where, reduction=reduction)
        if reduction == "none":
            return torch.where(outside, torch.full_like(loss, float("inf")), loss).view(targets.shape)
        return torch.where(outside.any(), torch.full_like(loss, float("inf")), loss)
