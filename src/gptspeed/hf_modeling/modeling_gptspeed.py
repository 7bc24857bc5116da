"""A gptspeed GPT in transformers (written by ``gptspeed export-hf``; self-contained: it needs torch
>= 2.4 and transformers, not gptspeed). ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` loads it (config.json's ``auto_map``); its forward computes what gptspeed's
``GPT`` computes, switch for switch, and the parameter names are gptspeed's own
(``transformer.h.0.attn.c_attn.weight``, ``nn.Linear`` weights ``[out, in]``).

GPT-2's pre-norm blocks (Radford et al. 2019), and the switches of the run, from config.json:

- ``pos_emb``: ``learned`` absolute positions, or ``rope``: rotary embeddings of queries and keys
  (Su et al. 2021), the channel pairs ``(i, i + head_dim / 2)`` rotated ("rotate half", as GPT-NeoX
  and Llama), base ``rope_theta``, computed in fp32;
- ``qk_norm``: queries and keys RMS-normalised per head, no gain (Dehghani et al. 2023);
- ``mlp``: ``gelu`` (tanh approximation) or ``relu2``, ``relu(x) ** 2`` (So et al. 2021); the MLP is
  4 x n_embd wide, not gated, with biases;
- ``norm``: ``layernorm`` or ``rmsnorm`` (a gain, no bias; epsilon the dtype's machine epsilon,
  as ``torch.nn.RMSNorm``'s default);
- ``tie_embeddings``: the LM head is the token embedding, else ``lm_head.weight`` of its own;
- ``logit_softcap``: logits ``cap * tanh(logits / cap)`` (Gemma 2; 0 = off);
- ``doc_mask``: attention never crosses ``<|endoftext|>`` (``eot_token_id``): a document starts at
  its EOT, and each token attends only to the earlier tokens of its own document, as gptspeed's
  training, evaluation and sampling do. A token's document depends on every token before it, so
  with a KV cache the first layer's cached keys carry one more channel, 1.0 where the token is an
  EOT (exact in any dtype): the documents of the cached tokens are counted from it, and it follows
  every reordering or cropping the cache undergoes (beam search, assisted decoding);
- ``value_embeds`` N: the modded-nanogpt speedrun's value embeddings, N token embeddings
  (``transformer.ve.i``) mixed into the attention values of the first N and the last N blocks
  (block i and block n_layer - N + i share embedding i) as ``g0 * v + g1 * ve`` with the block's
  two gates ``attn.ve_gates``;
- ``unet_skips``: the speedrun's U-net skips, each block of the last n_layer // 2 first adding
  ``skip_weights[m]`` times the output of its mirror block of the first half.
- ``softmax_ids``: a ``--softmax data`` run's head covers only the ids of its training data: every
  other id of the tokenizer's gets logit -inf (probability 0, never generated), after the soft-cap,
  as gptspeed computes it; ids added later by ``resize_token_embeddings`` are not masked.

transformers' fine-tuning hooks work: ``resize_token_embeddings`` resizes the value embeddings with
the token embedding (new rows: the mean of the old ones), so new ids work everywhere;
``gradient_checkpointing_enable()`` recomputes each block in the backward pass (training without a
cache); ``attn_implementation="sdpa"`` is accepted -- the attention always is
``F.scaled_dot_product_attention`` -- and ``"eager"`` too, computing the same.

Positions past ``n_positions`` (the run's sequence length): ``learned`` has no embedding for them (an
IndexError, as GPT-2's), ``rope`` computes them but the model was never trained there; gptspeed's
sampler instead slides its window to the last ``n_positions`` tokens.

Inputs: ``input_ids`` ``(B, T)`` int64; ``attention_mask`` ``(B, S)`` (1: a token, 0: padding; S the
cached plus the new tokens): a padding key is never attended to, a padding query attends to itself;
``position_ids`` ``(B, T)``, by default counted from each row's first token that is not padding (so a
left-padded row computes as if unpadded, as gptspeed's sampler pads). Output:
``CausalLMOutputWithPast`` with ``logits`` ``(B, T, vocab_size)`` in the model's dtype, ``loss``
(the mean next-token cross-entropy) when ``labels`` are given (``-100``: ignored).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_gptspeed import GptspeedConfig

# transformers 5 names the cache ``cache`` (argument and output field); 4.x ``past_key_values``
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * theta ** (-2i / head_dim)``, fp32, ``(B, 1, T, head_dim / 2)``, for
    positions ``pos`` ``(B, T)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    angles = (pos.to(torch.float32)[..., None] * inv_freq)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, T, Q)`` with its channel pairs ``(i, i + Q/2)`` rotated, computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def make_norm(config: GptspeedConfig) -> nn.Module:
    return nn.LayerNorm(config.n_embd) if config.norm == "layernorm" else nn.RMSNorm(config.n_embd)


def _resized(old: nn.Embedding, rows: int) -> nn.Embedding:
    """A copy of ``old`` with ``rows`` rows: the first ones ``old``'s, any new ones the mean of them."""
    new = nn.Embedding(rows, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        n = min(rows, old.num_embeddings)
        new.weight[:n] = old.weight[:n]
        new.weight[n:] = old.weight.mean(dim=0)
    return new


class GptspeedAttention(nn.Module):
    def __init__(self, config: GptspeedConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.qk_norm = config.qk_norm
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        n, k = config.n_layer, config.value_embeds
        if k and (layer_idx < k or layer_idx >= n - k):  # mixes a value embedding into v
            self.ve_gates = nn.Parameter(torch.tensor([0.5, 0.5]))

    def forward(self, x, rope, mask, cache, eot=None, ve=None):
        """``mask``: the attention mask -- None for plain causal attention from the first column (or one
        new token that sees every cached one), else bool ``(B | 1, 1, T, S)``, True where a query may
        attend -- or, in the first layer, the function making it from the EOT flags ``(B, S)`` of all
        ``S`` columns; ``eot``: the new tokens' EOT flags ``(B, T)`` (``doc_mask``; first layer only),
        kept in the cache as an extra key channel; ``ve``: the tokens' value embedding ``(B, T, C)``
        (``value_embeds``). Returns the output and the mask, for the next layer."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        if ve is not None:
            g = self.ve_gates.to(v.dtype)
            v = g[0] * v + g[1] * ve.to(v.dtype)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None and eot is not None:  # the EOT flags ride in the cache with the keys
            k = torch.cat((k, eot[:, None, :, None].to(k.dtype).expand(B, self.n_head, T, 1)), dim=-1)
            k, v = cache.update(k, v, self.layer_idx)
            eot, k = k[:, 0, :, -1] > 0.5, k[..., :-1]
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if callable(mask):
            mask = mask(eot)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C)), mask


class GptspeedMLP(nn.Module):
    def __init__(self, config: GptspeedConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.relu2 = config.mlp == "relu2"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        h = self.c_fc(x)
        return self.c_proj(F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh"))


class GptspeedBlock(nn.Module):
    def __init__(self, config: GptspeedConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = GptspeedAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = GptspeedMLP(config)

    def forward(self, x, rope, mask, cache, eot=None, ve=None):
        a, mask = self.attn(self.ln_1(x), rope, mask, cache, eot, ve)
        x = x + a
        return x + self.mlp(self.ln_2(x)), mask


class GptspeedTransformer(nn.Module):
    """Embeddings, blocks and the final norm: ``(B, T)`` token ids -> ``(B, T, n_embd)``."""

    def __init__(self, config: GptspeedConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.pos_emb == "learned":
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GptspeedBlock(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config)
        if config.value_embeds:
            self.ve = nn.ModuleList(nn.Embedding(config.vocab_size, config.n_embd) for _ in range(config.value_embeds))
        self.gradient_checkpointing = False  # transformers' gradient_checkpointing_enable() sets it

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, skip_weights=None):
        """Hidden states ``(B, T, n_embd)``; ``skip_weights``: the U-net skips' weights (``unet_skips``)."""
        c = self.config
        past = cache.get_seq_length() if cache is not None else 0
        B, T = input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(
                f"attention_mask must be a 2D padding mask (batch, cached + new tokens) = {(B, past + T)}, "
                f"not {tuple(attention_mask.shape)} (a static cache's 4D mask is not supported)"
            )
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
            if attention_mask is not None:  # counted from each row's first real token
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        x = self.wte(input_ids)
        if c.pos_emb == "learned":
            x = x + self.wpe(position_ids)
        rope = rope_cos_sin(position_ids, c.n_embd // c.n_head, c.rope_theta) if c.pos_emb == "rope" else None
        eot = input_ids == c.eot_token_id if c.doc_mask else None

        def make_mask(eot_all):  # called in the first layer, once the cache gave the cached tokens' EOT flags
            return self.attention_mask(eot_all, attention_mask, past, T, input_ids.device)

        n, k = c.n_layer, c.value_embeds
        half = n // 2 if c.unet_skips else 0
        ves = [e(input_ids) for e in self.ve] if k else []
        mask, skips = make_mask, []
        checkpointed = self.gradient_checkpointing and self.training and cache is None
        if checkpointed:  # the mask made once, up front: a recomputed block gets the same tensors
            mask = make_mask(eot)
        for i, block in enumerate(self.h):
            if i >= n - half:  # the U-net skip from the mirror block of the first half
                x = x + skip_weights[i - (n - half)].to(x.dtype) * skips.pop()
            ve = ves[i] if i < k else ves[i - (n - k)] if k and i >= n - k else None
            if checkpointed:
                x, mask = self._gradient_checkpointing_func(block.__call__, x, rope, mask, None, None, ve)
            else:
                x, mask = block(x, rope, mask, cache, eot if i == 0 else None, ve)
            if i < half:
                skips.append(x)
        return self.ln_f(x)

    def attention_mask(self, eot, attention_mask, past: int, T: int, device):
        """None (causal from column 0, or one new token that sees every cached one), or bool
        ``(B | 1, 1, T, past + T)``: causal, within each document (``doc_mask``: ``eot`` ``(B, past +
        T)`` flags the EOTs of every column), padding keys masked (a padding query sees itself)."""
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        if eot is None and not padded and (past == 0 or T == 1):
            return None
        cols = torch.arange(past, past + T, device=device)[:, None]  # (T, 1) the new tokens' columns
        keys = torch.arange(past + T, device=device)[None, :]  # (1, S)
        allowed = (keys <= cols)[None]  # (1, T, S)
        if eot is not None:  # a document starts at its EOT
            doc = eot.long().cumsum(dim=1)  # (B, S)
            allowed = allowed & (doc[:, past:, None] == doc[:, None, :])
        if padded:
            allowed = allowed & (attention_mask.bool()[:, None, :] | (keys == cols)[None])
        return allowed[:, None]


class GptspeedForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GptspeedConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GptspeedBlock"]
    _supports_cache_class = True
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # the attention is F.scaled_dot_product_attention, whatever is asked

    def __init__(self, config: GptspeedConfig):
        super().__init__(config)
        self.transformer = GptspeedTransformer(config)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.unet_skips:
            self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2))
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return None if self.config.tie_embeddings else self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize of the token embedding (and of an untied head), with the value
        embeddings resized to the same rows: new rows the mean of the old ones. Returns the token
        embedding."""
        emb = super().resize_token_embeddings(*args, **kwargs)
        rows = emb.num_embeddings
        if self.config.value_embeds:
            self.transformer.ve = nn.ModuleList(_resized(e, rows) for e in self.transformer.ve)
        return emb

    def _mask_unseen(self, logits):
        """``logits`` ``(..., V)`` with the ids outside ``config.softmax_ids`` (among the first
        ``softmax_vocab``: the exported vocabulary) at -inf: a ``--softmax data`` run's head."""
        ids = self.config.softmax_ids
        if ids is None:
            return logits
        unseen = getattr(self, "_unseen", None)
        if unseen is None or unseen.device != logits.device or unseen.numel() != logits.size(-1):
            unseen = torch.ones(logits.size(-1), dtype=torch.bool, device=logits.device)
            unseen[torch.as_tensor(ids, dtype=torch.long, device=logits.device)] = False
            unseen[self.config.softmax_vocab :] = False  # ids added by resize_token_embeddings
            self._unseen = unseen
        return logits.masked_fill(unseen, float("-inf"))

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        cache=None,
        labels=None,
        use_cache=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.transformer.gradient_checkpointing and self.training:
            use_cache = False  # a checkpointed block is recomputed: it must not write a cache twice
        if cache is None and use_cache:
            cache = DynamicCache()
        h = self.transformer(input_ids, attention_mask, position_ids, cache, getattr(self, "skip_weights", None))
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        weight = self.transformer.wte.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = F.linear(h, weight)
        cap = self.config.logit_softcap
        if cap:
            logits = cap * torch.tanh(logits / cap)
        logits = self._mask_unseen(logits)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()
