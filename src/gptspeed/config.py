"""Run configuration: dataclasses, presets and validation.

A run is described by :class:`RunConfig` = model shape (:class:`GPTConfig`) +
:class:`OptimConfig` + :class:`TrainConfig` + :class:`RuntimeConfig`. Every field is a command-line
flag (``n_layer`` -> ``--n-layer``; the help text is the field's ``help`` metadata). A preset fills
all of them; flags given on the command line override the preset; :meth:`RunConfig.validate`
checks the result before anything runs and raises :class:`GptspeedError` with one line.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from gptspeed.configio import config_yaml, read_config_file
from gptspeed.errors import GptspeedError, show_value

# This module imports no torch: `gptspeed train --help` and configuration errors answer at once.
GPT2_VOCAB_SIZE = 50257  # ids the GPT-2 tokenizer emits; 50256 is <|endoftext|>
PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 64 (tensor-core friendly; build-nanogpt)
AUTO_BATCH_SIZE = 0  # how --batch-size auto is stored in the configuration
ATTENTIONS = ("sdpa", "manual")
POS_EMBS = ("learned", "rope")  # --pos-emb: GPT-2's learned position embeddings, or rotary (Su et al. 2021)
MLPS = ("gelu", "relu2")  # --mlp: GPT-2's GELU (tanh approximation), or ReLU squared (So et al. 2021)
NORMS = ("layernorm", "rmsnorm")  # --norm: GPT-2's LayerNorm, or RMSNorm (Zhang & Sennrich 2019)
LR_SCHEDULES = (
    "cosine",
    "wsd",
)  # --lr-schedule: warm-up then cosine; or warm-up, stable, decay (Hagele et al. 2024)  # --attention: F.scaled_dot_product_attention, or a masked softmax written out
SOFTMAXES = ("full", "data")  # --softmax: over the whole vocabulary, or the token ids of the training data
# --loss: auto = gptspeed.loss.resolve_loss (fused on a CPU, plain elsewhere); liger = Liger-Kernel's fused
# linear + cross-entropy (CUDA only)
LOSSES = ("auto", "fused", "plain", "liger")
# --residual-dtype: the dtype of the residual stream between the blocks under bf16 autocast (fp32, or bf16 as the
# modded-nanogpt speedrun keeps its whole stream)
RESIDUAL_DTYPES = ("float32", "bfloat16")

# --optimizer: the names of gptspeed.optim.OPTIMIZERS, whose register_optimizer appends here (each entry there
# says how it is built, whether it skips a non-finite step on the device, takes a GradScaler, its verify tolerance)
OPTIMIZERS: list[str] = ["adamw", "muon"]
DTYPES = ("auto", "float32", "tf32", "bfloat16", "float16")
DEVICES = ("auto", "cuda", "mps", "cpu")
COMPILE_MODES = ("model", "blocks")
COMPILE_TUNINGS = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
CHECKPOINTING = ("none", "selective", "full")
# --sdpa-backend: which F.scaled_dot_product_attention kernel runs (torch.nn.attention.SDPBackend)
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
TRACKERS = ("jsonl", "tensorboard", "wandb")  # --log-to; jsonl (metrics.jsonl) is always on

# Bounds of the settings, checked by RunConfig.validate before anything runs (docs/reliability.md):
MAX_SEED = 2**63 - 1  # torch.manual_seed takes 64 bits, numpy's generators non-negative integers: both take 0..2**63-1
MAX_COUNT = 2**53  # any other count or size setting: exact in every JSON reader (and a float64), far above any run
# --loader-workers: threads that each keep 4 batches ready. One thread slicing memory-mapped shards keeps up with a
# GPU; a fixed bound (not this machine's CPU count) keeps a configuration valid on every machine it is resumed on
MAX_LOADER_WORKERS = 64
MAX_GRAD_ACCUM = 1 << 16  # micro-batches per optimizer step: 65,536 (the gpt2 preset at B=1 needs 512)
MAX_THREADS = 4096  # --threads: a bound, not this machine's count (a configuration stays valid on every machine)
MAX_DIST_TIMEOUT_S = 30 * 86400.0  # --dist-timeout-s: 30 days (torch converts it to int64 milliseconds)
ATTN_WINDOW_MULTIPLE = 128  # --attn-window's schedule moves in steps of 128 tokens: FlexAttention's block size

# How a model setting meets GPT-2's weights, declared on each GPTConfig field (gptspeed.hf reads them). A field
# declared neither way fails closed: off its default, --init-from and export-hf refuse it.
# init_from=: "source" (the GPT-2 source decides it: the shape) | "kept" (any value fits GPT-2's weights; kept)
INIT_FROM_KINDS = ("source", "kept")
# export=: "gpt2" (any value is still GPT-2's function: a GPT2LMHeadModel) | "switch" (off its default, the export
# carries gptspeed's modeling code, gptspeed.hf_modeling, which computes it)
EXPORT_KINDS = ("gpt2", "switch")


# What a setting acts with, declared on it (:func:`_f`) and checked by :func:`check_companions` on the settings a
# user gives (a flag, a --config file's changed value, a make_config keyword): no setting is accepted only to do
# nothing (docs/reliability.md). needs: a setting that must be on (not 0, off, None or its declared ``off``);
# only_with: settings that must hold the given values (a :class:`Where`); replaced_by: a setting that, when on,
# replaces it; below: (setting, why) -- its value as the run uses it (:func:`value_in_effect`) below that one's;
# starts: on a warm-up's steps, its start setting (whose ``below`` is then checked when the steps are given).
COMPANION_KEYS = ("needs", "only_with", "replaced_by", "below", "starts")


@dataclass(frozen=True)
class Where:
    """A condition on a setting's value, for ``only_with`` (:func:`_f`): ``text`` says it (the error line
    and docs/settings.md: "--sampling random acts only with --data a prepared folder"), ``test(value)``
    decides it, ``fix`` says how to meet it (default: give the setting such a value)."""

    text: str
    test: collections.abc.Callable[[Any], bool]
    fix: str = ""

    def __str__(self) -> str:
        return self.text


# --data's kinds (data.sources.STREAM_PREFIXES: jsonl:PATH / hf:NAME stream; anything else is a prepared folder;
# config imports no data module, a test checks the prefixes agree)
STREAM_PREFIXES = ("jsonl:", "hf:")
PREPARED = Where(
    "a prepared folder, not a jsonl:/hf: stream (read in order, without a val split)",
    lambda d: not d.startswith(STREAM_PREFIXES),
    "prepare it (gptspeed prepare) and give that folder",
)
STREAM = Where("a jsonl:/hf: stream", lambda d: d.startswith(STREAM_PREFIXES))
HF_STREAM = Where("an hf: stream", lambda d: d.startswith("hf:"))
WANDB = Where("naming wandb", lambda v: "wandb" in parse_log_to(v), "add wandb to --log-to")


def _conditions(only_with: dict[str, Any] | None) -> dict[str, Where] | None:
    """``only_with`` as declared (a value, a tuple of values, or a :class:`Where`, by setting) as
    :class:`Where` conditions."""
    if not only_with:
        return None
    out = {}
    for name, want in only_with.items():
        if not isinstance(want, Where):
            values = want if isinstance(want, tuple) else (want,)
            want = Where(" | ".join(map(_shown, values)), lambda v, values=values: v in values)
        out[name] = want
    return out


def _shown(value: Any) -> str:
    """A value as a flag takes it: on / off for a switch."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _f(
    default,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    finite: bool = False,
    text: str | None = None,
    max_note: str | None = None,
    min_note: str | None = None,
    off: Any = None,
    needs: str | None = None,
    only_with: dict[str, Any] | None = None,
    replaced_by: str | None = None,
    below: tuple[str, str] | None = None,
    starts: str | None = None,
    run_defining: bool = False,
    cli: bool = True,
    init_from: str | None = None,
    export: str | None = None,
    **meta,
):
    """A setting, declared once: its default and ``--help`` text, and everything derived from it --
    the flag (``flag``, default ``--`` + the name with dashes; ``cli=False``: none), the allowed
    ``choices``, the range (``min`` (exclusive with ``min_open``), ``max``; ``finite``: also no
    inf/nan below the range check; ``text``: what the error line says it must be, e.g. ``in [0,
    1)``; ``max_note``: the reason shown after "at most N"; ``min_note``: the reason shown when it
    is below its minimum; ``off``: the value that turns it off, accepted outside the range), what it
    acts with (:data:`COMPANION_KEYS`, checked on the settings a user gives by
    :func:`check_companions`: ``needs``, ``only_with``, ``replaced_by``, ``below``, ``starts``), and whether it
    defines the run (``run_defining``: a resume that changes it is refused, :func:`run_defining_diff`). A model
    setting also declares how it meets GPT-2's weights: ``init_from`` (:data:`INIT_FROM_KINDS`: what
    ``--init-from`` does with it) and ``export`` (:data:`EXPORT_KINDS`: how ``export-hf`` carries it);
    undeclared, only its default is accepted by either (:func:`settings_off_default`). Other
    ``meta``: ``kind`` (``flag``: store_true; ``bool``: --x/--no-x), ``parse`` (``batch_size``:
    a number or ``auto``), ``path=True`` (a file or folder: ``~`` expanded, :func:`expand_path_setting`).
    The CLI (gptspeed.cli), YAML and JSON files, :func:`gptspeed.api.make_config`, ``--print-config``,
    the resume check and the bench's rungs all read these; :meth:`RunConfig.validate` enforces them."""
    rules = dict(choices=choices, min=min, max=max, min_open=min_open, finite=finite, text=text, max_note=max_note)
    rules.update(min_note=min_note, off=off, needs=needs, only_with=_conditions(only_with), replaced_by=replaced_by)
    rules.update(below=below, starts=starts)
    assert init_from in (None, *INIT_FROM_KINDS) and export in (None, *EXPORT_KINDS), (init_from, export)
    gpt2 = {k: v for k, v in dict(init_from=init_from, export=export).items() if v is not None}
    return field(
        default=default,
        metadata={
            "help": help,
            "flag": flag,
            "run_defining": run_defining,
            "cli": cli,
            **{k: v for k, v in rules.items() if v is not None and v is not False},
            **gpt2,
            **meta,
        },
    )


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


def _group_lr(help: str, replaced_by: str | None = None):
    """A param group's own peak learning rate (``--embed-lr``, ``--head-lr``, ``--scalar-lr``, replaced by
    its ``--GROUP-lr-ratio`` when that is given), or that ratio: None follows ``--lr``; else a positive
    finite number, run-defining."""
    return _f(
        None,
        help,
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        replaced_by=replaced_by,
        run_defining=True,
    )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (GPT-3 paper, appendix B)."""

    lr: float = _f(
        6e-4,
        "peak learning rate",
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        run_defining=True,
    )
    min_lr_ratio: float = _f(
        0.1,
        "final learning rate as a fraction of --lr (cosine decay target)",
        min=0,
        max=1,
        text="in [0, 1]",
        run_defining=True,
    )
    warmup_steps: int = _f(715, "linear warm-up steps", min=0, replaced_by="warmup_ratio", run_defining=True)
    warmup_ratio: float | None = _f(
        None,
        "linear warm-up as a fraction of --max-steps (e.g. 0.05); replaces --warmup-steps when given",
        min=0,
        max=1,
        max_note=None,
        text="in [0, 1)",
        run_defining=True,
    )
    lr_schedule: str = _f(
        "cosine",
        "cosine (warm-up, then cosine decay to --min-lr-ratio; GPT-3) | wsd (warm-up, "
        "stable at --lr, then linear decay over the last --decay-ratio of the steps; Hagele et al. "
        "2024)",
        choices=LR_SCHEDULES,
        run_defining=True,
    )
    decay_ratio: float = _f(
        0.2,
        "--lr-schedule wsd: the share of --max-steps that decays (the cooldown)",
        min=0,
        max=1,
        text="in [0, 1]",
        only_with={"lr_schedule": "wsd"},
        run_defining=True,
    )
    weight_decay: float = _f(
        0.1, "AdamW weight decay, applied to tensors with 2 or more dims only", min=0, run_defining=True
    )
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1, text="in [0, 1)", run_defining=True)
    beta2: float = _f(0.95, "AdamW beta2", min=0, max=1, text="in [0, 1)", run_defining=True)
    eps: float = _f(
        1e-8, "AdamW epsilon", min=0, min_open=True, finite=True, text="a positive finite number", run_defining=True
    )
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)", min=0, run_defining=True)
    fused_adamw: bool | None = _f(None, "fused AdamW kernel (default: where the device supports it)", kind="bool")
    optimizer: str = _f(
        "adamw",
        "adamw | muon (Muon for the blocks' 2-D weights at --muon-lr, AdamW at --lr for "
        "embeddings, head, gains and biases; Jordan et al. 2024, as modded-nanogpt; Muon cannot skip a "
        "non-finite step on the device, so that check costs one host-device sync a step)",
        choices=OPTIMIZERS,
        run_defining=True,
    )
    muon_lr: float = _f(
        0.02,
        "Muon peak learning rate (scaled by sqrt(max(1, rows/cols)); same schedule as --lr)",
        min=0,
        min_open=True,
        text="positive",
        only_with={"optimizer": "muon"},
        run_defining=True,
    )
    muon_momentum: float = _f(
        0.95,
        "Muon (Nesterov) momentum",
        min=0,
        max=1,
        text="in [0, 1)",
        only_with={"optimizer": "muon"},
        run_defining=True,
    )
    muon_momentum_warmup: int = _f(
        0,
        "steps over which Muon's momentum rises linearly from --muon-momentum-start to --muon-momentum (the "
        "modded-nanogpt speedrun: 0.85 to 0.95 over 300 steps); 0 = off",
        min=0,
        off=0,
        only_with={"optimizer": "muon"},
        below=("max_steps", "the run would end inside the warm-up, never at --muon-momentum"),
        run_defining=True,
    )
    muon_momentum_start: float = _f(
        0.85,
        "--muon-momentum-warmup's first momentum",
        min=0,
        max=1,
        text="in [0, 1)",
        needs="muon_momentum_warmup",
        run_defining=True,
    )
    embed_lr: float | None = _group_lr(
        "AdamW peak learning rate of the token, position and value embeddings (default: --lr); with --head-lr and "
        "--scalar-lr, the speedrun's per-group Adam rates",
        replaced_by="embed_lr_ratio",
    )
    head_lr: float | None = _group_lr(
        "AdamW peak learning rate of the untied LM head (needs --no-tie-embeddings; default: --lr)",
        replaced_by="head_lr_ratio",
    )
    scalar_lr: float | None = _group_lr(
        "AdamW peak learning rate of the gains and biases (tensors of under 2 dims; default: --lr)",
        replaced_by="scalar_lr_ratio",
    )
    embed_lr_ratio: float | None = _group_lr("--embed-lr as a multiple of --lr; replaces --embed-lr when given")
    head_lr_ratio: float | None = _group_lr("--head-lr as a multiple of --lr; replaces --head-lr when given")
    scalar_lr_ratio: float | None = _group_lr("--scalar-lr as a multiple of --lr; replaces --scalar-lr when given")

    def group_lr(self, group: str) -> float | None:
        """The peak learning rate of param group ``group`` (``embed``, ``head`` or ``scalar``): its
        ``--GROUP-lr-ratio`` times ``--lr`` when given, else its ``--GROUP-lr``; None: ``--lr``."""
        ratio = getattr(self, f"{group}_lr_ratio")
        return ratio * self.lr if ratio is not None else getattr(self, f"{group}_lr")


@dataclass
class TrainConfig:
    """What to train on, how long, in which batches, and how to log and save."""

    data: str = _f(
        "",
        "prepared data folder (from `gptspeed prepare`), or jsonl:PATH / hf:NAME to train straight "
        "from a document stream (tokenized while training; no val split); default: tiny Shakespeare, "
        "shipped with gptspeed and prepared into the cache on first use",
        path=True,
    )
    text_field: str = _f(
        "text",
        "jsonl:/hf: streams: the JSON field / column / dataset feature holding the text",
        only_with={"data": STREAM},
        run_defining=True,
    )
    hf_name: str | None = _f(
        None,
        "hf: streams: the dataset configuration (e.g. sample-10BT)",
        only_with={"data": HF_STREAM},
        run_defining=True,
    )
    split: str = _f("train", "hf: streams: the dataset split", only_with={"data": HF_STREAM}, run_defining=True)
    out: str = _f("", "run folder: checkpoints, metrics.jsonl, config.json", path=True)
    batch_size: int = _f(
        16,
        "micro-batch size B (sequences per forward/backward), or auto: the largest power of two "
        "that fits in GPU memory with a 10% margin and divides the global batch (CUDA only; probed once per GPU "
        "model and configuration, cached in $GPTSPEED_CACHE/batch_size.json)",
        parse="batch_size",
        min=1,
        run_defining=True,
    )
    total_batch_tokens: int | None = _f(
        None,
        "tokens per optimizer step; gradient accumulation = this / (B * T * world size) (default B*T)",
        min=1,
        text="positive",
        run_defining=True,
    )
    batch_warmup_steps: int = _f(
        0,
        "batch-size warm-up: the tokens per optimizer step rise linearly from --batch-start-tokens to "
        "--total-batch-tokens over the first N steps, in whole micro-batches (GPT-3, Brown et al. 2020, "
        "appendix B; the modded-nanogpt speedrun's batch-size schedule); 0 = off",
        min=0,
        off=0,
        below=("max_steps", "the run would end inside the warm-up, never training at --total-batch-tokens"),
        starts="batch_start_tokens",
        run_defining=True,
    )
    batch_start_tokens: int | None = _f(
        None,
        "--batch-warmup-steps: the tokens of step 0 (rounded down to whole micro-batches, at least one; taken as "
        "--total-batch-tokens where larger; default: one micro-batch per process)",
        min=1,
        text="positive",
        needs="batch_warmup_steps",
        below=("total_batch_tokens", "the batch warm-up would change nothing"),
        run_defining=True,
    )
    seq_len_warmup_steps: int = _f(
        0,
        "sequence-length warm-up: each micro-batch's B x T tokens are trained as shorter sequences, their "
        "length rising linearly from --seq-len-start to --seq-len over the first N steps, in halvings of "
        "--seq-len (each length compiles once) (Li, Zhang & He 2022, sequence length warm-up); 0 = off",
        min=0,
        off=0,
        below=("max_steps", "the run would end inside the warm-up, never training at --seq-len"),
        starts="seq_len_start",
        run_defining=True,
    )
    seq_len_start: int = _f(
        64,
        "--seq-len-warmup-steps: the sequence length of step 0 (taken as --seq-len where larger; rounded up "
        "to a halving of --seq-len)",
        min=1,
        needs="seq_len_warmup_steps",
        below=("block_size", "the sequence-length warm-up would change nothing"),
        run_defining=True,
    )
    max_steps: int = _f(19073, "optimizer steps to train for", min=1)
    log_every: int = _f(10, "log a record every N steps", min=1)
    eval_every: int = _f(
        250, "evaluate val loss every N steps (0 = only at start and end)", min=0, off=0, only_with={"data": PREPARED}
    )
    eval_tokens: int = _f(
        1 << 20, "val tokens per evaluation (0 = the whole val split)", min=0, only_with={"data": PREPARED}
    )
    save_every: int = _f(1000, "write a checkpoint every N steps (0 = only at the end and on interrupt)", min=0)
    keep_checkpoints: int = _f(2, "keep the newest K checkpoints", min=1)
    resume: bool = _f(False, "continue from the newest valid checkpoint in --out", kind="flag")
    force_resume: bool = _f(
        False,
        "resume even if the configuration or data changed (the run is then no longer exact)",
        kind="flag",
        needs="resume",
    )
    on_nan: str = _f(
        "stop",
        "a step with a non-finite loss or gradient never updates the weights; then "
        "stop (keep the last good checkpoint) or skip (count it and go on; a run that skips half its steps "
        "stops)",
        choices=("stop", "skip"),
    )
    init_from: str = _f(
        "",
        "start from a Hugging Face GPT-2's weights (a folder, or gpt2 | gpt2-medium | gpt2-large "
        "| gpt2-xl, downloaded): its shape replaces the preset's; training starts at step 0",
        path=True,
    )
    hellaswag_every: int = _f(0, "HellaSwag accuracy every N steps and at the end (0 = never)", min=0)
    hellaswag_examples: int = _f(
        0,
        "HellaSwag validation examples per evaluation during training (0 = all 10,042)",
        min=0,
        needs="hellaswag_every",
    )
    eval_bpb: bool = _f(
        False,
        "each evaluation also gives the val bits per byte (val_bpb in metrics.jsonl: nats over ln 2 times the "
        "UTF-8 bytes of the same val tokens, as nanochat reports it; a second pass over --eval-tokens)",
        kind="bool",
    )
    stop_at_val_loss: float | None = _f(
        None,
        "end the run at the first evaluation (every --eval-every steps) whose "
        "val loss is at or below this (nats/token): time to a target, as the "
        "modded-nanogpt speedrun measures it; a --resume of a run that reached it trains no further",
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        needs="eval_every",
        only_with={"data": PREPARED},
    )
    ema_tail_ratio: float = _f(
        0.0,
        "tail weight averaging: over the last share of --max-steps keep an exponential moving average of the "
        "weights (fp32, on the device) and evaluate, save for eval / sample / export-hf the blend "
        "(1 - --ema-blend) x weights + --ema-blend x average; the raw weights still train and resume "
        "(modded-nanogpt's tail EMA readout, track 3 record #45); 0 = off",
        min=0,
        max=1,
        off=0,
        text="in [0, 1]",
        run_defining=True,
    )
    ema_horizon: float | None = _f(
        None,
        "--ema-tail-ratio: the average's time constant in steps (each step moves it 1/N of the way to the "
        "weights; default: a fifth of the tail, so the weights it starts from weigh under 1% at the end)",
        min=1,
        min_open=True,
        finite=True,
        text="a finite number above 1",
        needs="ema_tail_ratio",
        run_defining=True,
    )
    ema_blend: float = _f(
        0.6,
        "--ema-tail-ratio: the average's share of the weights evaluated and exported (1 = the average alone; "
        "modded-nanogpt: 0.6)",
        min=0,
        min_open=True,
        max=1,
        text="in (0, 1]",
        needs="ema_tail_ratio",
        run_defining=True,
    )
    sampling: str = _f(
        "sequential",
        "order of the training windows: sequential (shard order) or random "
        "(a permutation per epoch, seeded by --seed; resumable)",
        choices=("sequential", "random"),
        off="sequential",
        only_with={"data": PREPARED},
        run_defining=True,
    )
    align_to_docs: bool = _f(
        False,
        "batches aligned to document starts: each row of --seq-len tokens starts at an <|endoftext|> (the "
        "rest of a document begun inside the previous row is skipped when shorter than a row; a longer "
        "one goes on in whole rows), as the modded-nanogpt speedrun aligns its batches to BOS; a prepared "
        "folder only",
        kind="bool",
        run_defining=True,
    )
    loader_workers: int = _f(
        -1,
        "background threads preparing batches ahead into pinned memory (0 = in the "
        "training loop; -1 = auto: 1 on CUDA, 0 elsewhere; at most 64); the batches do not depend on it",
        min=-1,
        text="-1 (auto), 0 or more",
        max=MAX_LOADER_WORKERS,
        max_note="each keeps 4 batches ready; one keeps up with a GPU",
    )
    log_to: str = _f(
        "jsonl",
        "where metrics records go, comma-separated: jsonl (RUN_DIR/metrics.jsonl, always on), "
        "tensorboard (RUN_DIR/tensorboard; pip install 'gptspeed[tensorboard]'), wandb (Weights & Biases; "
        "pip install 'gptspeed[wandb]'; WANDB_MODE=offline needs no account)",
    )
    wandb_project: str = _f("gptspeed", "W&B project (with --log-to wandb)", only_with={"log_to": WANDB})
    wandb_run_name: str = _f(
        "",
        "W&B run name (default: the run folder's name); the W&B run id is kept in "
        "RUN_DIR/wandb_run_id, so --resume continues the same W&B run",
        only_with={"log_to": WANDB},
    )


@dataclass
class RuntimeConfig:
    """Where and how the computation runs. These may change between a run and its resume."""

    device: str = _f("auto", "auto | cuda | mps | cpu", choices=DEVICES)
    dtype: str = _f(
        "auto",
        "auto | float32 | tf32 | bfloat16 | float16: the autocast precision (auto: bf16 on a CUDA GPU that has "
        "it, else fp16 with a GradScaler; on a CPU bf16 only where it multiplies bf16 natively, amx_bf16 or "
        "avx512_bf16, else fp32; fp32 on MPS; tf32: fp32 with TF32 tensor-core matmuls)",
        choices=DTYPES,
    )
    compile: bool | None = _f(
        None,
        "torch.compile the model (default: on for CUDA; on a CPU only in bf16 with native bf16 matmuls and "
        "for runs past compiling's ~100-step break-even; compiled graphs are cached in $GPTSPEED_CACHE/inductor)",
        kind="bool",
    )
    seed: int = _f(
        1337,
        "random seed for initialisation and --sampling random (0 to 2**63-1)",
        min=0,
        max=MAX_SEED,
        text=f"an integer from 0 to {MAX_SEED:,} (2**63 - 1)",
        run_defining=True,
    )
    peak_tflops: float | None = _f(
        None,
        "device peak TFLOPS for MFU (default: from the built-in table)",
        min=0,
        min_open=True,
        finite=True,
        text="positive",
    )
    compile_mode: str = _f(
        "model",
        "what torch.compile compiles: model (one graph) | blocks (each transformer block "
        "separately: identical blocks compile once, much faster compile)",
        choices=COMPILE_MODES,
    )
    compile_tuning: str = _f(
        "default",
        "torch.compile mode: default | max-autotune (searches matmul configs; "
        "CUDA graphs) | max-autotune-no-cudagraphs | reduce-overhead (CUDA graphs)",
        choices=COMPILE_TUNINGS,
    )
    coordinate_descent_tuning: bool = _f(
        False,
        "inductor's coordinate-descent tuning: each generated Triton kernel's block sizes searched "
        "around its heuristic config, timed on the device (torch._inductor.config.coordinate_descent_tuning; "
        "already part of --compile-tuning max-autotune*). Set in modded-nanogpt's 2024 records; a longer "
        "compile. CUDA and --compile only (the CPU's C++ kernels have nothing to tune)",
        kind="flag",
    )
    activation_checkpointing: str = _f(
        "none",
        "recompute activations in backward to save memory: none | selective "
        "(keep matmul and attention outputs, recompute the rest) | full (keep only "
        "each block's input)",
        choices=CHECKPOINTING,
    )
    sdpa_backend: str = _f(
        "auto",
        "F.scaled_dot_product_attention kernel: auto (PyTorch picks: cuDNN's on an "
        "H100 with torch 2.11, measured) | flash | cudnn | efficient | math; a named one runs "
        "alone, and a run it cannot serve stops at start",
        choices=SDPA_BACKENDS,
    )
    fp8: bool = _f(
        False,
        "FP8 matmuls (torchao float8 training, tensorwise) for the blocks' Linear layers large "
        "enough to gain (Hopper / Ada GPUs only; pip install 'gptspeed[fp8]')",
        kind="flag",
    )
    fp8_lm_head: bool = _f(
        False,
        "FP8 matmul (torchao float8 training, tensorwise) for the LM head, the largest "
        "matmul (n_embd x vocab_size); the tied embedding lookup stays fp32. Needs --loss plain "
        "(the one path that calls the head), --softmax full, n_embd and vocab_size multiples of "
        "16 (Hopper / Ada GPUs only; pip install 'gptspeed[fp8]'); with or without --fp8",
        kind="flag",
    )
    cast_weights_once: bool = _f(
        False,
        "keep the bf16 copy of the weights between the micro-steps of an optimizer "
        "step: cast (and, over several GPUs, all-gathered) once a step instead of once a "
        "micro-step, at the memory of one bf16 copy of the weights (FSDP2's "
        "reshard_after_forward=False and set_reshard_after_backward; needs --parallel fsdp, "
        "which one process may use, and --dtype bfloat16)",
        kind="flag",
    )
    keep_freed_memory: bool | None = _f(
        None,
        "CPU runs: glibc's malloc keeps freed memory for the next step "
        "instead of page-faulting large buffers in again (default: on for a CPU "
        "device)",
        kind="bool",
    )
    threads: int = _f(
        0,
        "CPU runs: PyTorch's intra-op threads (torch.set_num_threads); 0 = PyTorch's default, one per physical core",
        min=0,
        max=MAX_THREADS,
        max_note="more than any CPU has",
        only_with={"device": Where("cpu (or auto on a machine without a GPU)", lambda d: d in ("auto", "cpu"))},
    )
    parallel: str = _f(
        "auto",
        "auto | none | ddp | fsdp: multi-process training under torchrun (auto: ddp when WORLD_SIZE > 1)",
        choices=("auto", "none", "ddp", "fsdp"),
    )
    dist_timeout_s: float = _f(
        600.0,
        "seconds to wait for the other processes (rendezvous, collectives)",
        min=0,
        min_open=True,
        finite=True,
        text="a positive number of seconds",
        max=MAX_DIST_TIMEOUT_S,
        max_note="30 days",
    )


GROUPS = {"model": GPTConfig, "optim": OptimConfig, "train": TrainConfig, "runtime": RuntimeConfig}
#: every setting by name -> its dataclass field (names are unique across the groups)
FIELDS = {f.name: f for cls in GROUPS.values() for f in dataclasses.fields(cls)}
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
# every companion a setting declares is a setting (a misspelt one would switch its rule off)
assert all(
    other in FIELDS
    for f in FIELDS.values()
    for other in [f.metadata.get(k) for k in ("needs", "replaced_by", "starts")]
    + [*(f.metadata.get("only_with") or {})]
    + [(f.metadata.get("below") or ("max_steps",))[0]]
    if other is not None
), "a companion names no setting"
# Settings that name a file or folder (``path=True``): expand_path_setting expands their ``~``
PATH_SETTINGS = frozenset(name for name, f in FIELDS.items() if f.metadata.get("path"))


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    preset: str = "gpt2"

    def groups(self):
        return {"model": self.model, "optim": self.optim, "train": self.train, "runtime": self.runtime}

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.train.batch_size * self.model.block_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, source: str = "configuration") -> RunConfig:
        """Rebuild from :meth:`to_dict` output (a checkpoint's or config.json's). Raises
        GptspeedError naming ``source`` for anything malformed: not a dict, a group that is not an
        object, an unknown field (or one of another group), a value of the wrong type. A missing
        group or field takes its default; top-level keys other than the four groups and ``preset``
        (``derived``, ``environment``, an imported model's ``source``) are not settings: ignored."""
        if not isinstance(d, dict):
            raise GptspeedError(f"{source}: expected a JSON object, got {type(d).__name__}")
        built = {}
        for name, cls_ in GROUPS.items():
            values = d.get(name, {})
            if not isinstance(values, dict):
                raise GptspeedError(f"{source}: '{name}' must be an object, got {type(values).__name__}")
            built[name] = cls_(**{k: _typed(cls_, k, v, source) for k, v in values.items()})
        preset_name = d.get("preset", "custom")
        if not isinstance(preset_name, str):
            raise GptspeedError(f"{source}: 'preset' must be a string")
        return cls(**built, preset=preset_name)

    def apply_file(self, path: str) -> RunConfig:
        """A copy with the settings of a config file applied (:func:`read_config_file`: YAML, or
        JSON for a ``.json`` file): nested like config.json (``{"model": {"n_layer": 4}, "optim":
        {...}}``) or flat (``{"n_layer": 4, "lr": 1e-3}``); ``preset``, ``derived`` and
        ``environment`` are not settings and are ignored here. Raises GptspeedError (one line) for
        an unreadable file, an unknown setting (naming the nearest valid one) or a wrong type."""
        source = f"config file {path}"
        flat: dict[str, Any] = {}
        for k, v in read_config_file(path).items():
            if k in self.groups():
                if not isinstance(v, dict):
                    raise GptspeedError(f"{source}: {k!r} must be a mapping of settings, got {v!r}"[:300])
                flat.update(v)
            elif k not in ("preset", "derived", "environment"):
                flat[k] = v
        return self.override(check_settings(flat, source))

    def override(self, values: dict[str, Any]) -> RunConfig:
        """A copy with fields replaced by name (flat: ``{"n_layer": 4, "lr": 1e-3}``). Every value a
        configuration gets from a preset's user -- a flag, a config file, :func:`gptspeed.api.make_config`
        -- comes through here: a path-valued setting has its ``~`` expanded (:func:`expand_path_setting`)."""
        cfg = copy.deepcopy(self)
        for name, value in values.items():
            for group in cfg.groups().values():
                if name in {f.name for f in dataclasses.fields(group)}:
                    setattr(group, name, expand_path_setting(name, value))
                    break
            else:
                raise KeyError(name)
        return cfg

    def warmup_steps(self) -> int:
        """Warm-up steps in effect: ``round(warmup_ratio * max_steps)`` when a ratio is given, else
        ``optim.warmup_steps``."""
        if self.optim.warmup_ratio is not None:
            return round(self.optim.warmup_ratio * self.train.max_steps)
        return self.optim.warmup_steps

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-steps per optimizer step; raises GptspeedError if the batch does not divide."""
        per_step = self.tokens_per_micro_batch * world_size
        total = self.train.total_batch_tokens or per_step
        if total % per_step != 0:
            raise GptspeedError(
                f"--total-batch-tokens {total} is not a multiple of batch_size * seq_len * world_size "
                f"= {self.train.batch_size} * {self.model.block_size} * {world_size} = {per_step}"
            )
        if total // per_step > MAX_GRAD_ACCUM:
            raise GptspeedError(
                f"--total-batch-tokens {total:,} takes {total // per_step:,} micro-batches of batch_size * seq_len * "
                f"world_size = {per_step:,} tokens per optimizer step, more than {MAX_GRAD_ACCUM:,}: lower "
                "--total-batch-tokens or raise --batch-size"
            )
        return total // per_step

    def validate(self, world_size: int | None = None, given: collections.abc.Collection[str] | None = None) -> None:
        """Check everything that can be checked before touching data or devices, for ``world_size``
        processes (None: as torchrun's environment says, :func:`world_from_env`): every field's
        declared type, choices and range (:func:`check_fields`), then the rules between fields, then
        that no setting the user gave does nothing (:func:`check_companions`; ``given``: their names,
        default :meth:`user_settings`).
        Called once, where a configuration is resolved (:func:`gptspeed.configure.build_train_config`;
        :func:`gptspeed.api.train`, whose configuration a user may have changed since; the bench's
        rungs and tuned configurations; :func:`gptspeed.resume.resolve_run` after ``--batch-size
        auto`` sets B): what runs it relies on it. GptspeedError naming the setting."""
        if world_size is None:
            world_size = world_from_env()[1]
        self.model.validate()
        for group in (self.optim, self.train, self.runtime):
            check_fields(group)
        t, r = self.train, self.runtime
        if self.runtime.fp8:
            from gptspeed.fp8 import check_fp8_shapes  # imports torch: only when --fp8 is asked for

            check_fp8_shapes(t.batch_size, self.model.block_size, self.model)
        if self.runtime.fp8_lm_head:
            from gptspeed.fp8 import check_fp8_lm_head  # imports torch: only when --fp8-lm-head is asked for

            check_fp8_lm_head(t.batch_size, self.model.block_size, self.model)
        if self.model.residual_dtype == "bfloat16" and r.dtype not in ("auto", "bfloat16"):
            raise GptspeedError(
                f"--residual-dtype bfloat16 needs bf16 autocast; this run has --dtype {r.dtype}: use "
                "--dtype bfloat16, or --residual-dtype float32"
            )
        if r.cast_weights_once and (r.parallel != "fsdp" or r.dtype not in ("auto", "bfloat16")):
            raise GptspeedError(
                f"--cast-weights-once keeps FSDP2's bf16 weights between micro-steps: it needs "
                f"--parallel fsdp (one process may use it) and --dtype bfloat16; this run has "
                f"--parallel {r.parallel} --dtype {r.dtype}"
            )
        if self.optim.group_lr("head") is not None and self.model.tie_embeddings:
            raise GptspeedError(
                "--head-lr is the untied LM head's learning rate; this run ties the head to the token "
                "embedding: add --no-tie-embeddings, or use --embed-lr for the tied weight"
            )
        parse_log_to(t.log_to)
        check_tail_average(t)
        if r.sdpa_backend != "auto" and self.model.attention != "sdpa":
            raise GptspeedError(
                f"--sdpa-backend {r.sdpa_backend} chooses the kernel of --attention sdpa; this run "
                f"has --attention {self.model.attention}"
            )
        if t.batch_size == AUTO_BATCH_SIZE:
            if t.total_batch_tokens is None:
                raise GptspeedError("--batch-size auto needs --total-batch-tokens (the global batch to keep)")
            if t.total_batch_tokens % (self.model.block_size * world_size):
                raise GptspeedError(
                    f"--total-batch-tokens {t.total_batch_tokens} is not a multiple of seq_len * "
                    f"world_size = {self.model.block_size * world_size}"
                )
        else:
            self.grad_accum_steps(world_size)
        names = self.user_settings(given)
        check_companions(self, names, world_size)
        self._validated_as = (world_size, self.to_dict())  # what validate_if_changed compares
        self._given = names

    def user_settings(self, given: collections.abc.Collection[str] | None = None) -> frozenset[str]:
        """The settings the user gave, by name: ``given`` where the caller knows them
        (:func:`gptspeed.configure.build_train_config`: the flags, a config file's changed values); else
        those of the last :meth:`validate` and any changed since (``cfg.optim.decay_ratio = 0.3`` after
        :func:`gptspeed.api.make_config`); else, for a configuration never validated, those differing
        from its preset's (the defaults where its preset is none of :data:`PRESETS`)."""
        if given is not None:
            return frozenset(name for name in given if name in FIELDS)
        before = getattr(self, "_validated_as", None)
        if before is not None:
            return getattr(self, "_given", frozenset()) | {
                name for name in FIELDS if before[1][_GROUP_OF[name]][name] != _value(self, name)
            }
        return frozenset(changed_settings(PRESETS.get(self.preset) or RunConfig(), self))

    def validate_if_changed(self, world_size: int | None = None) -> None:
        """:meth:`validate`, unless it passed on this configuration as it is now (no setting changed
        since) for as many processes: :func:`gptspeed.api.train` takes a configuration that was
        resolved and validated by :func:`gptspeed.api.make_config`, and that its user may have
        changed since (``cfg.optim.optimizer = "lion"``). GptspeedError as :meth:`validate`."""
        if world_size is None:
            world_size = world_from_env()[1]
        if getattr(self, "_validated_as", None) != (world_size, self.to_dict()):
            self.validate(world_size)

    def run_defining(self) -> dict[str, Any]:
        """The settings that define the run (declared ``run_defining``), by name: a resume that
        changes one of them would not continue the same run (:func:`run_defining_diff`)."""
        return {
            name: getattr(group, name)
            for group in self.groups().values()
            for name, f in {f.name: f for f in dataclasses.fields(group)}.items()
            if f.metadata.get("run_defining")
        }


def check_fields(group: Any) -> None:
    """Every field of one configuration group (``GPTConfig``, ``OptimConfig``, ...) against what it
    declares (:func:`_f`): its type and choices (:func:`_typed`), then, for a number, the range --
    an integer without a range of its own at most :data:`MAX_COUNT` and every float finite, so no
    count reaches a tensor, a timer, an allocation or an error message out of range. GptspeedError,
    one line naming the flag."""
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        if value is None and _accepts_none(type(group), f.name):
            continue
        if value == AUTO_BATCH_SIZE and f.metadata.get("parse") == "batch_size":
            continue  # --batch-size auto: resolved on the device before training
        flag = setting_flag(f.name)
        _typed(type(group), f.name, value, flag, context=False)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        meta = f.metadata
        if isinstance(value, int) and "max" not in meta and value > MAX_COUNT:
            raise GptspeedError(f"{flag} must be at most {MAX_COUNT:,} (2**53), got {show_value(value)}")
        _check_range(flag, value, meta)
        if isinstance(value, float) and not math.isfinite(value):
            raise GptspeedError(f"{flag} must be a finite number, got {value}")


def _check_range(flag: str, value: float, meta: Any) -> None:
    """GptspeedError when ``value`` is outside the range a field declares (``min``, ``min_open``,
    ``finite``, ``max``; ``text`` says what it must be, ``max_note`` why the maximum, ``min_note`` why the
    minimum); its ``off`` value is accepted outside it."""
    if "off" in meta and value == meta["off"]:
        return
    lo, hi = meta.get("min"), meta.get("max")
    low = lo is not None and (value <= lo if meta.get("min_open") else value < lo)
    if low or (meta.get("finite") and not math.isfinite(value)):
        default = "at least 1" if lo == 1 else "0 or more" if lo == 0 else f"at least {lo}"
        why = f": {meta['min_note']}" if low and meta.get("min_note") else ""
        raise GptspeedError(f"{flag} must be {meta.get('text') or default}, got {show_value(value)}{why}")
    if hi is not None and (value >= hi if meta.get("text", "").endswith(")") else value > hi):
        if meta.get("max_note") or not meta.get("text"):
            note = f" ({meta['max_note']})" if meta.get("max_note") else ""
            raise GptspeedError(f"{flag} must be at most {hi:,.0f}{note}, got {show_value(value)}")
        raise GptspeedError(f"{flag} must be {meta['text']}, got {show_value(value)}")


# how a warm-up's schedule rounds a start value (gptspeed.schedules), for value_in_effect's error lines
_ROUNDED = {
    "seq_len_start": "rounded up to a halving of --seq-len",
    "attn_window_start": f"rounded up to a multiple of {ATTN_WINDOW_MULTIPLE} tokens, at most --attn-window",
    "batch_start_tokens": "rounded down to whole micro-batches of --batch-size x --seq-len x processes",
}


def value_in_effect(cfg: RunConfig, name: str, world_size: int = 1) -> Any:
    """The value setting ``name`` takes in the run ``cfg`` describes, where a warm-up's schedule rounds it
    (:mod:`gptspeed.schedules` at step 0; ``tests/test_config.py`` checks they agree): ``--seq-len-start`` up
    to a halving of ``--seq-len``; ``--attn-window-start`` up to a multiple of :data:`ATTN_WINDOW_MULTIPLE`
    tokens, at most the window; ``--batch-start-tokens`` (default one micro-batch) in whole micro-batches of
    ``world_size`` processes, at least one and at most the full batch; ``--total-batch-tokens``, default one
    micro-batch a process -- both None while ``--batch-size auto`` leaves the micro-batch unknown. Any other
    setting: its value."""
    m, t = cfg.model, cfg.train
    if name == "seq_len_start":
        T, start = m.block_size, min(t.seq_len_start, m.block_size)
        return min(T >> k for k in range(T.bit_length()) if (T >> k) << k == T and T >> k >= start)
    if name == "attn_window_start":
        W, step = m.attn_window, ATTN_WINDOW_MULTIPLE
        return min(W, -(-min(m.attn_window_start, W) // step) * step)
    if name in ("batch_start_tokens", "total_batch_tokens"):
        micro = t.batch_size * m.block_size * world_size
        if not micro:
            return None
        full = max(1, (t.total_batch_tokens or micro) // micro)
        start = min(full, max(1, (t.batch_start_tokens or micro) // micro))
        return (full if name == "total_batch_tokens" else start) * micro
    return _value(cfg, name)


def check_tail_average(t: TrainConfig) -> None:
    """GptspeedError when ``--ema-tail-ratio`` is on but its tail holds fewer than 2 of ``--max-steps``: the
    average would be the last weights, so the setting would do nothing."""
    if t.ema_tail_ratio and round(t.ema_tail_ratio * t.max_steps) < 2:
        raise GptspeedError(
            f"--ema-tail-ratio {t.ema_tail_ratio:g} of --max-steps {t.max_steps} averages "
            f"{round(t.ema_tail_ratio * t.max_steps)} step(s), so it would change nothing: "
            f"give at least {2 / t.max_steps:.3g}, or drop it"
        )


def setting_on(cfg: RunConfig, name: str) -> bool:
    """Whether setting ``name`` is on in ``cfg``: not None, off, 0 or empty, nor its declared ``off`` value
    (``--sampling sequential``)."""
    value, meta = _value(cfg, name), FIELDS[name].metadata
    return value not in (None, False, 0, "") and not ("off" in meta and value == meta["off"])


def _value(cfg: RunConfig, name: str) -> Any:
    return getattr(getattr(cfg, _GROUP_OF[name]), name)


def _as_flag(name: str, value: Any) -> str:
    """Setting ``name`` at ``value`` as its flag says it: ``--seq-len-start 32``, ``--unet-skips``, ``--no-qk-norm``."""
    flag = setting_flag(name)
    if isinstance(value, bool):
        off = "--no-" + flag[2:] if FIELDS[name].metadata.get("kind") == "bool" else f"no {flag}"
        return flag if value else off
    return f"{flag} unset" if value in (None, "") else f"{flag} {value}"


def inert_reason(cfg: RunConfig, name: str) -> str | None:
    """Why setting ``name`` does nothing in ``cfg`` by what it declares it acts with (``needs``,
    ``only_with``, ``replaced_by``; :func:`_f`), as the one line :func:`check_companions` raises (what is
    wrong, what to do); None when it acts."""
    meta, this, flag = FIELDS[name].metadata, _as_flag(name, _value(cfg, name)), setting_flag(name)
    needs = meta.get("needs")
    if needs and not setting_on(cfg, needs):
        nflag, nvalue = setting_flag(needs), _value(cfg, needs)
        has = "" if isinstance(nvalue, bool) else f" (this run has {_as_flag(needs, nvalue)})"
        return f"{this} does nothing without {nflag}{has}: {'add' if isinstance(nvalue, bool) else 'set'} {nflag}, or drop {flag}"
    for other, where in (meta.get("only_with") or {}).items():
        if not where.test(value := _value(cfg, other)):
            oflag = setting_flag(other)
            fix = where.fix or f"give {oflag} {where}"
            return (
                f"{this} acts only with {oflag} {where}; this run has {_as_flag(other, value)}: {fix}, or drop {flag}"
            )
    replaced_by = meta.get("replaced_by")
    if replaced_by and setting_on(cfg, replaced_by):
        return f"{this} does nothing: {_as_flag(replaced_by, _value(cfg, replaced_by))} replaces it; give one of them"
    return None


def _below_reason(cfg: RunConfig, name: str, world_size: int) -> str | None:
    """The one line when setting ``name``'s value in effect is not below the setting its ``below`` names
    (:func:`value_in_effect`), or None."""
    target, why = FIELDS[name].metadata["below"]
    x, y = value_in_effect(cfg, name, world_size), value_in_effect(cfg, target, world_size)
    if x is None or y is None or x < y:
        return None

    def shown(n: str, effect: Any) -> str:
        raw = _value(cfg, n)
        if raw is None:
            return f"{setting_flag(n)} unset ({effect:,} in effect)"
        return _as_flag(n, raw) + (f" ({_ROUNDED[n]}: {effect:,})" if effect != raw else "")

    flag, tflag = setting_flag(name), setting_flag(target)
    least = copy.deepcopy(cfg)  # at its least value: does lowering it help at all?
    setattr(getattr(least, _GROUP_OF[name]), name, FIELDS[name].metadata.get("min", 0))
    fix = f"lower {flag} or raise {tflag}" if value_in_effect(least, name, world_size) < y else f"raise {tflag}"
    return f"{shown(name, x)} is not below {shown(target, y)}: {why}; {fix}"


def _given_on(cfg: RunConfig, name: str) -> bool:
    """Whether a given setting asks for something: not None or False, nor its declared ``off`` value."""
    value, meta = _value(cfg, name), FIELDS[name].metadata
    return value is not None and value is not False and not ("off" in meta and value == meta["off"])


def check_companions(cfg: RunConfig, given: collections.abc.Collection[str], world_size: int = 1) -> None:
    """GptspeedError (one line: what is wrong, what to do) for a setting the user gave (``given``: the
    names set by a flag, a ``--config`` file or a make_config keyword) that would do nothing in ``cfg``, as
    each setting declares (:data:`COMPANION_KEYS`): without the setting it ``needs`` on, without the values
    its ``only_with`` names, beside the setting it is ``replaced_by``, or -- given, or the warm-up whose
    start it ``starts`` given -- not ``below`` the setting it warms up to. A setting given at its ``off``
    value asks for nothing. What a preset or recipe set and the user did not give is not checked: it is
    theirs (docs/reliability.md)."""
    started_by = {f.metadata["starts"]: name for name, f in FIELDS.items() if f.metadata.get("starts")}
    for name, f in FIELDS.items():
        meta = f.metadata
        own = name in given and _given_on(cfg, name)
        if own and (why := inert_reason(cfg, name)):
            raise GptspeedError(why)
        needs, warm_up = meta.get("needs"), started_by.get(name)
        acts = setting_on(cfg, needs) if needs else own
        asked = own or (warm_up in given and setting_on(cfg, warm_up))
        if meta.get("below") and acts and asked and (why := _below_reason(cfg, name, world_size)):
            raise GptspeedError(why)


def drop_inert(cfg: RunConfig, names: collections.abc.Collection[str], base: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with each setting of ``names`` that does nothing in it (:func:`inert_reason`) set
    back to its value in ``base``: a recipe's setting the user's own made inert (``--recipe modern
    --lr-schedule cosine``: the recipe's ``--decay-ratio``) is not kept, so the configuration holds nothing
    that does nothing, and its ``--print-config`` reads back as the same run."""
    out = copy.deepcopy(cfg)
    for name in names:
        if _given_on(out, name) and inert_reason(out, name):
            setattr(getattr(out, _GROUP_OF[name]), name, _value(base, name))
    return out


def companions_text(meta: Any) -> str:
    """What a setting's declaration (its field's ``meta``) says it acts with (:data:`COMPANION_KEYS`), in
    words, for docs/settings.md: "only with --lr-schedule wsd", "needs --seq-len-warmup-steps", "replaced by
    --warmup-ratio", "below --seq-len"; empty when it acts alone."""
    parts = [f"needs `{setting_flag(meta['needs'])}`"] if meta.get("needs") else []
    parts += [f"only with `{setting_flag(k)}` {w}" for k, w in (meta.get("only_with") or {}).items()]
    parts += [f"replaced by `{setting_flag(meta['replaced_by'])}`"] if meta.get("replaced_by") else []
    if meta.get("below"):
        parts.append(f"below `{setting_flag(meta['below'][0])}` (else {meta['below'][1]})")
    parts += [f"warms up from `{setting_flag(meta['starts'])}`"] if meta.get("starts") else []
    unless = f"unless `{_shown(meta['off'])}`: " if parts and "off" in meta else ""  # its off value asks nothing
    return unless + "; ".join(parts)


def changed_settings(a: RunConfig, b: RunConfig) -> set[str]:
    """The names of the settings whose values differ between ``a`` and ``b``."""
    return {name for name in FIELDS if _value(a, name) != _value(b, name)}


def settings_off_default(config: Any, key: str, accepted: tuple[str, ...]) -> list[str]:
    """The names of the fields of the dataclass instance ``config`` (its own class's fields: a subclass's
    too) whose value is not their default and whose declaration ``key`` in the field's metadata
    (``init_from`` / ``export``, :func:`_f`) is not in ``accepted``. An undeclared field counts: what
    ``--init-from`` and ``export-hf`` refuse fails closed for a setting added without a declaration."""
    return [
        f.name
        for f in dataclasses.fields(config)
        if f.metadata.get(key) not in accepted and getattr(config, f.name) != _field_default(f)
    ]


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def setting_flag(name: str) -> str:
    """The command-line flag of setting ``name`` (``block_size`` -> ``--seq-len``, ``max_steps`` -> ``--max-steps``)."""
    f = FIELDS.get(name)
    return (f.metadata.get("flag") if f is not None else None) or "--" + name.replace("_", "-")


def check_seed(seed: Any, flag: str = "--seed") -> int:
    """``seed`` if it is an integer from 0 to :data:`MAX_SEED`, which every consumer takes
    (``torch.manual_seed``, ``torch.Generator.manual_seed``, ``numpy.random.default_rng``, the
    loader's ``--sampling random``); else GptspeedError naming ``flag``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise GptspeedError(f"{flag} must be an integer from 0 to {MAX_SEED:,} (2**63 - 1), got {show_value(seed)}")
    return seed


def expand_path_setting(name: str, value: Any) -> Any:
    """``value`` of setting ``name`` with a leading ``~`` expanded (``os.path.expanduser``) when the
    setting is a path (``path=True`` in its field: ``out``, ``data``, ``init_from``); for
    ``data``, the path after ``jsonl:`` too (``hf:NAME`` is a dataset name, left alone). Other
    settings and non-strings are returned unchanged."""
    if not isinstance(value, str) or name not in PATH_SETTINGS:
        return value
    if name == "data" and value.startswith("jsonl:"):
        return "jsonl:" + os.path.expanduser(value[len("jsonl:") :])
    if name == "data" and value.startswith("hf:"):
        return value
    return os.path.expanduser(value)


def field_type(cls, name: str) -> type:
    """The Python type of field ``name`` of configuration dataclass ``cls`` (``int``, ``float``,
    ``str`` or ``bool``): the first member of its annotation (``int | None`` -> ``int``). The
    one place annotations are read: the CLI's argument types and :func:`_typed` both use it."""
    ann = {f.name: f for f in dataclasses.fields(cls)}[name].type
    ann = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    return {"int": int, "float": float, "str": str, "bool": bool}[ann.split("|")[0].strip()]


def _accepts_none(cls, name: str) -> bool:
    ann = {f.name: f for f in dataclasses.fields(cls)}[name].type
    return "None" in (ann if isinstance(ann, str) else str(ann))


def _typed(cls, name: str, value: Any, source: str, context: bool = True) -> Any:
    """``value`` checked against the annotation and the ``choices`` of field ``name`` of dataclass
    ``cls``; GptspeedError "SOURCE: NAME must be ..." (with ``context=False``: "SOURCE must be ...",
    ``source`` being the flag, and a float's range left to :func:`check_fields`)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        home = [
            g for g, c in GROUPS.items() if cls in GROUPS.values() and name in {f.name for f in dataclasses.fields(c)}
        ]
        hint = f" (a setting of the '{home[0]}' group)" if home else did_you_mean(str(name)[:100])
        raise GptspeedError(f"{source}: unknown setting {show_value(name)}{hint}"[:300])
    if value is None and _accepts_none(cls, name):
        return None
    if value == "auto" and fields[name].metadata.get("parse") == "batch_size":
        return AUTO_BATCH_SIZE
    what = f"{source}: {name}" if context else source
    base = field_type(cls, name)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[base]
    if not ok:
        raise GptspeedError(f"{what} must be {base.__name__}, got {show_value(value)}"[:300])
    if base is float:
        value = float(value)
        if context and not math.isfinite(value):
            raise GptspeedError(f"{what} must be a finite number, got {value}")
    choices = fields[name].metadata.get("choices")
    if choices and value not in choices:
        raise GptspeedError(f"{what} must be one of {', '.join(choices)}, got {show_value(value)}"[:300])
    return value


def did_you_mean(name: str, candidates: tuple[str, ...] | list[str] | None = None) -> str:
    """`` (did you mean 'x'?)`` naming the nearest of ``candidates`` (default: every setting's
    name, where a model flag's own name -- ``seq_len`` for ``--seq-len`` -- leads to its
    setting), or nothing."""
    import difflib

    if candidates is None:
        aliases = {f.metadata["flag"][2:].replace("-", "_"): n for n, f in FIELDS.items() if f.metadata.get("flag")}
        if aliases.get(name, name) != name:
            return f" (did you mean {aliases[name]!r}?)"
        candidates = list(FIELDS)
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_settings(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Flat settings (``{"n_layer": 4, "lr": 1e-3}``) checked against the configuration's
    fields: returned with their values typed (an int for a float field becomes a float, ``auto``
    for ``batch_size`` becomes :data:`AUTO_BATCH_SIZE`). Raises GptspeedError (one line, naming
    ``source``) for an unknown name -- with the nearest valid one -- or a value of the wrong type."""
    owners = {
        f.name: cls for cls in (GPTConfig, OptimConfig, TrainConfig, RuntimeConfig) for f in dataclasses.fields(cls)
    }
    checked = {}
    for k, v in values.items():
        if not isinstance(k, str) or k not in owners:
            raise GptspeedError(f"{source}: unknown setting {show_value(k)}{did_you_mean(str(k)[:100])}"[:300])
        checked[k] = _typed(owners[k], k, v, source)
    return checked


def parse_log_to(text: str) -> tuple[str, ...]:
    """The trackers ``--log-to`` names besides ``jsonl`` (which is always on): ``text`` is
    comma-separated (``"tensorboard,wandb"``; case, blanks and repeats ignored), the order kept.
    Raises GptspeedError naming the nearest valid tracker for an unknown one."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in TRACKERS:
            raise GptspeedError(
                f"--log-to: unknown tracker {name!r}{did_you_mean(name, TRACKERS)}: choose from {', '.join(TRACKERS)}"
            )
        if name != "jsonl" and name not in names:
            names.append(name)
    return tuple(names)


def config_to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as the YAML file ``gptspeed train --print-config`` prints: every setting, nested by
    group (model, optim, train, runtime) under the preset's name, so that ``--config FILE``
    reproduces the run (:func:`gptspeed.configio.config_yaml`). ``--batch-size auto`` is written as ``auto``."""
    d = cfg.to_dict()
    if d["train"]["batch_size"] == AUTO_BATCH_SIZE:
        d["train"]["batch_size"] = "auto"
    return config_yaml({"preset": d.pop("preset"), **d})


def parse_batch_size(text: str) -> int:
    """CLI type for ``--batch-size``: a positive integer, or ``auto`` (stored as
    :data:`AUTO_BATCH_SIZE` = 0). ``argparse.ArgumentTypeError`` (argparse's one-line usage error)
    for anything else."""
    import argparse

    if text == "auto":
        return AUTO_BATCH_SIZE
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r}")
    return value


def parse_seed(text: str) -> int:
    """CLI type of every seed flag (``sample --seed``, ``prepare --shuffle-seed``, ``bench --seed``):
    an integer from 0 to :data:`MAX_SEED` (:func:`check_seed`); ``argparse.ArgumentTypeError`` (argparse's
    one-line usage error) for anything else. ``train --seed`` is checked by :meth:`RunConfig.validate`."""
    import argparse

    try:
        return check_seed(int(text))
    except (ValueError, GptspeedError):
        raise argparse.ArgumentTypeError(
            f"must be an integer from 0 to {MAX_SEED:,} (2**63 - 1), got {text[:40]!r}"
        ) from None


def run_defining_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Names of the run-defining settings (declared ``run_defining=True``, :meth:`RunConfig.run_defining`)
    that differ between ``a`` and ``b``; a model setting is named ``model.NAME``."""
    ra, rb = a.run_defining(), b.run_defining()
    model = {f.name for f in dataclasses.fields(GPTConfig)}
    return [f"model.{k}" if k in model else k for k in ra if ra[k] != rb[k]]


def world_from_env() -> tuple[int, int]:
    """``(rank, world_size)`` as torchrun sets them (RANK, WORLD_SIZE); ``(0, 1)`` without torchrun.
    GptspeedError if they are not integers or the rank is out of range."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise GptspeedError(f"RANK / WORLD_SIZE are not integers ({e}): launch with torchrun") from e
    if world < 1 or not 0 <= rank < world:
        raise GptspeedError(f"RANK {rank} / WORLD_SIZE {world} are inconsistent: launch with torchrun")
    return rank, world


# ---------------------------------------------------------------------------------------- presets
def _preset(model: dict, optim: dict | None = None, train: dict | None = None) -> RunConfig:
    return RunConfig(model=GPTConfig(**model), optim=OptimConfig(**(optim or {})), train=TrainConfig(**(train or {})))


# GPT-2 shapes from Radford et al. 2019 (table 2); learning rates from GPT-3 (Brown et al. 2020,
# table 2.1) for the same sizes; 524,288 tokens per step and 715 warm-up steps as build-nanogpt
# (GPT-3's 0.5M batch and 375M warm-up tokens); 19,073 steps = 10B tokens.
_GPT2_TRAIN = dict(total_batch_tokens=524_288, max_steps=19_073)
PRESETS: dict[str, RunConfig] = {
    # seconds on a CPU: for tests and smoke runs
    "pico": _preset(
        dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
        dict(lr=1e-3, warmup_steps=5),
        dict(batch_size=8, max_steps=50, log_every=5, eval_every=25, eval_tokens=2048, save_every=0),
    ),
    # minutes on a laptop CPU: the README's quickstart on tinyshakespeare
    # --softmax data: tiny Shakespeare holds 11,707 of GPT-2's 50,257 tokens, and the full LM head was ~89% of a
    # step's FLOPs; the 4x cheaper head buys 350 steps in the time 200 took (benchmarks/LOG.md, "quickstart")
    "nano": _preset(
        dict(n_layer=4, n_head=4, n_embd=128, block_size=128, softmax="data"),
        dict(lr=2e-3, warmup_steps=20),
        dict(batch_size=16, max_steps=350, log_every=10, eval_every=175, eval_tokens=32768, save_every=175),
    ),
    "gpt2": _preset(dict(n_layer=12, n_head=12, n_embd=768), dict(lr=6e-4), dict(batch_size=16, **_GPT2_TRAIN)),
    "gpt2-medium": _preset(dict(n_layer=24, n_head=16, n_embd=1024), dict(lr=3e-4), dict(batch_size=16, **_GPT2_TRAIN)),
    "gpt2-large": _preset(dict(n_layer=36, n_head=20, n_embd=1280), dict(lr=2.5e-4), dict(batch_size=8, **_GPT2_TRAIN)),
    "gpt2-xl": _preset(dict(n_layer=48, n_head=25, n_embd=1600), dict(lr=2e-4), dict(batch_size=4, **_GPT2_TRAIN)),
}
for _name, _cfg in PRESETS.items():
    _cfg.preset = _name


# Named recipes (``gptspeed train --recipe NAME``, bench race's arms): settings applied on top of the preset,
# before a config file and the flags. gpt2: the architecture and schedule of GPT-2 as the presets have them.
# modern: Muon with the speedrun lineage's architecture switches, the combination that won the race on the CPU at
# the nano preset (benchmarks/LOG.md, "Time to quality"; alone, QK-norm and RMSNorm did not help there): rotary
# positions, QK-norm, ReLU², RMSNorm, a WSD schedule. Muon refuses float16, so on a GPU without bf16 it needs
# --dtype float32 (or --optimizer adamw). Left out
# because they lost there: the untied head (1.05x the step time), logit soft-capping (1.19x); with zero-initialised
# projections, the three together took more steps to the target, not fewer (docs/race.md). Each stays a switch.
RECIPES: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "modern": dict(
        optimizer="muon", pos_emb="rope", qk_norm=True, mlp="relu2", norm="rmsnorm", lr_schedule="wsd", decay_ratio=0.4
    ),
}
# modern + the speedrun's value embeddings and per-group Adam rates, with a short warm-up (the speedrun's Muon runs
# without one). Tuned at the nano preset on a 100-step budget (docs/race.md): rates of 6e-3 (3x nano's --lr) and a 2-step
# warm-up, declared relative to --lr and --max-steps so they scale with the preset (at gpt2: 1.8e-3, 2% of the steps)
RECIPES["speedrun"] = dict(
    RECIPES["modern"], value_embeds=1, embed_lr_ratio=3.0, scalar_lr_ratio=3.0, warmup_ratio=0.02
)
# a recipe's setting on the left yields to the one on the right given by a config file or a flag, which it would replace
RECIPE_YIELDS = {f"{g}_lr_ratio": f"{g}_lr" for g in ("embed", "head", "scalar")} | {"warmup_ratio": "warmup_steps"}


def recipe(name: str, given: collections.abc.Collection[str] = ()) -> dict[str, Any]:
    """The settings of recipe ``name`` (:data:`RECIPES`), less those that would replace a setting in
    ``given`` (the flat names a config file and the flags set after it: :data:`RECIPE_YIELDS`, so
    ``--recipe speedrun --warmup-steps 5`` warms up over 5 steps); GptspeedError naming the recipes for
    another name."""
    if name not in RECIPES:
        raise GptspeedError(
            f"unknown recipe {name!r}: choose one of {', '.join(RECIPES)}{did_you_mean(name, list(RECIPES))}"
        )
    return {k: v for k, v in RECIPES[name].items() if RECIPE_YIELDS.get(k) not in given}


def preset(name: str) -> RunConfig:
    """A fresh copy of the named preset; GptspeedError for an unknown name."""
    if name not in PRESETS:
        raise GptspeedError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
