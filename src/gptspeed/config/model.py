"""The ``model`` group of settings: :class:`GPTConfig`, the shape of a GPT-2 model and its switches."""

from __future__ import annotations

from dataclasses import dataclass

from gptspeed.config.checks import check_fields, setting_flag, settings_off_default
from gptspeed.config.declare import (
    ATTENTIONS,
    GPT2_VOCAB_SIZE,
    LOSSES,
    MLPS,
    NORMS,
    PADDED_VOCAB_SIZE,
    POS_EMBS,
    RESIDUAL_DTYPES,
    SOFTMAXES,
    _f,
)
from gptspeed.errors import GptspeedError


@dataclass
class GPTConfig:
    """Shape of a GPT-2 model.

    ``vocab_size`` is the number of rows of the embedding / LM head (50304 = 50257 padded to a
    multiple of 64 by default, which suits tensor cores); ``valid_vocab_size`` is the number of
    ids the tokenizer can emit (50257). Rows in between are padding: their logits are set to -inf,
    so they are never predicted or sampled and receive no gradient.
    """

    block_size: int = _f(
        1024,
        "sequence length T (also the model's number of positions)",
        flag="--seq-len",
        min=1,
        run_defining=True,
        init_from="source",
        export="gpt2",
    )
    vocab_size: int = _f(
        PADDED_VOCAB_SIZE,
        "embedding rows; 50257 padded up to 50304 (a multiple of 64) by default",
        min=1,
        run_defining=True,
        init_from="source",
        export="gpt2",
    )
    valid_vocab_size: int = _f(
        GPT2_VOCAB_SIZE,
        "token ids the tokenizer emits (GPT-2's 50,257)",
        min=1,
        run_defining=True,
        cli=False,
        init_from="source",
        export="gpt2",
    )
    eot_token: int = _f(
        GPT2_VOCAB_SIZE - 1,
        "the id of <|endoftext|>, which starts each document (GPT-2's 50256; else the data's, from its manifest)",
        min=0,
        run_defining=True,
        cli=False,
        init_from="source",
        export="gpt2",
    )
    tokenizer: str = _f(
        "gpt2",
        "the data's tokenizer: gpt2, a tiktoken encoding, or sha256:HEX of a tokenizer.json (copied into the run)",
        run_defining=True,
        cli=False,
        init_from="source",
        export="gpt2",
    )
    n_layer: int = _f(12, "transformer blocks L", min=1, run_defining=True, init_from="source", export="gpt2")
    n_head: int = _f(12, "attention heads H", min=1, run_defining=True, init_from="source", export="gpt2")
    n_embd: int = _f(
        768, "embedding width C (divisible by n_head)", min=1, run_defining=True, init_from="source", export="gpt2"
    )
    attention: str = _f(
        "sdpa",
        "sdpa (F.scaled_dot_product_attention, flash kernels on GPU) | manual",
        choices=ATTENTIONS,
        init_from="kept",
        export="gpt2",
    )
    loss: str = _f(
        "auto",
        "auto (fused on a CPU, plain elsewhere) | fused (chunked linear + cross-entropy, no full "
        "logits) | plain | liger (Liger-Kernel's fused linear + cross-entropy, Hsu et al. 2024; CUDA only)",
        choices=LOSSES,
        init_from="kept",
        export="gpt2",
    )
    residual_dtype: str = _f(
        "float32",
        "float32 | bfloat16: the residual stream between the blocks under bf16 "
        "autocast (bfloat16: the embeddings' sum cast once, so every residual add and every "
        "activation saved along the stream is bf16, half the bytes; as the modded-nanogpt "
        "speedrun); bfloat16 needs --dtype bfloat16 (or auto resolving to it)",
        choices=RESIDUAL_DTYPES,
        init_from="kept",
        export="gpt2",
    )
    softmax: str = _f(
        "full",
        "full (over the 50,257 GPT-2 tokens) | data (only over the token ids the training data "
        "holds, e.g. 11,707 for tiny Shakespeare: a 4x cheaper LM head for small CPU runs; tokens outside "
        "it have probability 0, in gptspeed and in its export-hf)",
        choices=SOFTMAXES,
        run_defining=True,
        init_from="kept",
        export="gpt2",  # --softmax data: export-hf writes gptspeed's modeling code, the ids in config.json
    )
    # the modern-GPT switches (issue 32); the defaults are GPT-2's. export="switch": off its default, the export
    # carries gptspeed's modeling code (non_gpt2_switches). No init_from: GPT-2's weights cannot take it -- rotary
    # positions have no wpe, RMSNorm no bias; QK-norm, an untied head, value embeddings and U-net skips have
    # tensors of their own; zero-init projections are an initialisation the loaded weights replace
    pos_emb: str = _f(
        "learned",
        "learned (GPT-2's position embeddings) | rope (rotary embeddings of queries and keys; "
        "Su et al. 2021, RoFormer)",
        choices=POS_EMBS,
        run_defining=True,
        export="switch",
    )
    rope_theta: float = _f(
        10000.0,
        "--pos-emb rope: the base of the rotary frequencies",
        min=1,
        min_open=True,
        finite=True,
        text="a finite number above 1",
        min_note="the frequencies base^(-2i/d) fall from 1 radian a token only for a base above 1 (Su et al. "
        "2021, RoFormer): at 1 they are all 1, below it they grow",
        only_with={"pos_emb": "rope"},
        run_defining=True,
        init_from="kept",  # inert without --pos-emb rope, which --init-from refuses
        export="gpt2",  # inert without --pos-emb rope, a switch: the export's config.json carries it
    )
    qk_norm: bool = _f(
        False,
        "RMS-normalise queries and keys per head before attention (Dehghani et al. 2023)",
        kind="bool",
        run_defining=True,
        export="switch",
    )
    mlp: str = _f(
        "gelu",
        "gelu (GPT-2's, tanh approximation) | relu2 (ReLU squared; So et al. 2021, Primer)",
        choices=MLPS,
        run_defining=True,
        export="switch",
    )
    norm: str = _f(
        "layernorm",
        "layernorm (GPT-2's) | rmsnorm (Zhang & Sennrich 2019; no bias, no mean)",
        choices=NORMS,
        run_defining=True,
        export="switch",
    )
    tie_embeddings: bool = _f(
        True,
        "the LM head shares the token embedding's weights (GPT-2; Press & Wolf 2017); "
        "--no-tie-embeddings: an LM head of its own",
        kind="bool",
        run_defining=True,
        export="switch",
    )
    zero_init_proj: bool = _f(
        False,
        "initialise the blocks' output projections (and an untied LM head) to zero, as "
        "the modded-nanogpt speedrun does",
        kind="bool",
        run_defining=True,
        export="gpt2",
    )
    logit_softcap: float = _f(
        0.0,
        "tanh soft-capping of the logits at this value, cap * tanh(logits / cap) (Gemma 2; 0 = off); 15 is the "
        "modded-nanogpt speedrun's 30 * sigmoid(logits / 7.5), which equals 15 * tanh(logits / 15) + 15",
        min=1,
        off=0.0,
        text="0 (off) or at least 1",
        min_note="a cap under 1 holds every logit within +-1, so no token is more than e^2 times as likely as "
        "another: the model cannot predict",
        run_defining=True,
        init_from="kept",
        export="switch",
    )
    doc_mask: bool = _f(
        False,
        "attention never crosses <|endoftext|>: each document of a packed window attends only "
        "to itself (FlexAttention's block mask on CUDA, an equivalent masked SDPA elsewhere)",
        kind="bool",
        run_defining=True,
        init_from="kept",
        export="switch",
    )
    value_embeds: int = _f(
        0,
        "value embeddings: N token embeddings mixed, with learned gates, into the attention values of "
        "the first N and the last N blocks (block i and block n_layer-N+i share embedding i; the "
        "modded-nanogpt speedrun: 3); 0 = off",
        min=0,
        run_defining=True,
        export="switch",
    )
    unet_skips: bool = _f(
        False,
        "U-net skip connections: each block of the second half adds, with a learned weight, the output "
        "of its mirror block of the first half (the modded-nanogpt speedrun)",
        kind="bool",
        run_defining=True,
        export="switch",
    )
    attn_window: int = _f(
        0,
        "sliding-window attention: each token attends to at most the last N tokens, itself included "
        "(Beltagy et al. 2020, Longformer), the window growing linearly during training from "
        "--attn-window-start to N, rounded up to a multiple of 128 tokens (the modded-nanogpt speedrun's "
        "window warm-up); evaluation and sampling use N; FlexAttention's block mask on CUDA, an "
        "equivalent masked SDPA elsewhere; at most --seq-len; 0 = off (full causal attention)",
        min=0,
        run_defining=True,
        init_from="kept",  # a mask: no tensors of its own. No export: no exported modeling code computes it (yet)
    )
    attn_window_start: int = _f(
        128,
        "--attn-window: the window at step 0 (taken as --attn-window where larger), growing linearly to "
        "--attn-window at --max-steps",
        min=1,
        needs="attn_window",
        below=("attn_window", "the window would not grow"),
        run_defining=True,
        init_from="kept",
    )

    def validate(self) -> None:
        """Raise :class:`GptspeedError` (one line) if the shape is not a valid GPT: every field's
        declared rule (:func:`check_fields`), then the rules between fields. Whether the model fits
        in memory is checked where it is built, on its device (:func:`gptspeed.step.build_model`)."""
        check_fields(self)
        if self.n_embd % self.n_head != 0:
            raise GptspeedError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                "each head gets n_embd / n_head channels"
            )
        head_dim = self.n_embd // self.n_head
        if self.pos_emb == "rope" and head_dim % 2:
            raise GptspeedError(
                f"--pos-emb rope rotates pairs of channels: the head dimension n_embd / n_head = "
                f"{self.n_embd} / {self.n_head} = {head_dim} must be even; change --n-embd or --n-head"
            )
        if self.value_embeds > self.n_layer // 2:
            raise GptspeedError(
                f"--value-embeds {self.value_embeds} mixes into the first and the last {self.value_embeds} blocks: "
                f"at most n_layer / 2 = {self.n_layer // 2} with --n-layer {self.n_layer}"
            )
        if self.unet_skips and self.n_layer < 2:
            raise GptspeedError(
                "--unet-skips joins blocks of the first half to the second: it needs --n-layer 2 or more"
            )
        if self.attn_window > self.block_size:
            raise GptspeedError(
                f"--attn-window {self.attn_window} is the final attention window in tokens: at most the "
                f"sequence length --seq-len {self.block_size} (--attn-window {self.block_size} is full causal attention)"
            )
        if self.vocab_size < self.valid_vocab_size:
            raise GptspeedError(
                f"vocab_size ({self.vocab_size}) is smaller than the tokenizer's "
                f"{self.valid_vocab_size} tokens; use {self.valid_vocab_size} or more (50304 pads to a multiple of 64)"
            )

    def num_params(self) -> int:
        """Parameters of the model of this shape (:class:`gptspeed.model.GPT`), counted without
        building it: the size check before building uses it."""
        C = self.n_embd
        norm = 2 * C if self.norm == "layernorm" else C  # a gain, and LayerNorm's bias
        # per block: ln_1, c_attn (3C^2 + 3C), attn c_proj (C^2 + C), ln_2, c_fc (4C^2 + 4C), mlp c_proj (4C^2 + C)
        per_block = 12 * C * C + 9 * C + 2 * norm
        embeddings = self.vocab_size * C * (1 if self.tie_embeddings else 2) + (
            self.block_size * C if self.pos_emb == "learned" else 0
        )
        extra = self.value_embeds * self.vocab_size * C + 2 * self.value_embeds * 2  # the embeddings, 2 gates a block
        extra += self.n_layer // 2 if self.unet_skips else 0  # one weight a skip
        return embeddings + self.n_layer * per_block + norm + extra  # + ln_f

    def non_gpt2_switches(self) -> list[str]:
        """The flags of the switches by which this model is not GPT-2's architecture (what
        transformers' ``GPT2LMHeadModel`` cannot load), as ``--flag value``: empty for GPT-2. Every
        setting off its default except those declared ``export="gpt2"`` (``--zero-init-proj`` only
        changes the initial weights, so it is not among them); an undeclared one is (fails closed)."""
        return [f"{setting_flag(n)} {getattr(self, n)}" for n in settings_off_default(self, "export", ("gpt2",))]

    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers: ``--attention manual``'s causal mask (T x T bools per block),
        ``--softmax data``'s token ids (int64), ``--attn-window``'s current window (one int64)."""
        mask = self.n_layer * self.block_size**2 if self.attention == "manual" else 0
        window = 8 if self.attn_window else 0
        return mask + (8 * self.valid_vocab_size if self.softmax == "data" else 0) + window
