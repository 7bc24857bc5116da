"""How a setting is declared: :func:`_f` (its default, help, flag, choices, range, companions, whether it
defines the run, what ``--init-from`` and ``export-hf`` do with it), :class:`Where` (a condition on another
setting's value), the choices and the bounds the settings name.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from typing import Any

# This module imports no torch: `gptspeed train --help` and configuration errors answer at once.
GPT2_VOCAB_SIZE = 50257  # ids the GPT-2 tokenizer emits; 50256 is <|endoftext|>
PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 64 (tensor-core friendly; build-nanogpt)
AUTO_BATCH_SIZE = 0  # how --batch-size auto is stored in the configuration
ATTENTIONS = ("sdpa", "manual")  # --attention: F.scaled_dot_product_attention, or a masked softmax written out
POS_EMBS = ("learned", "rope")  # --pos-emb: GPT-2's learned position embeddings, or rotary (Su et al. 2021)
MLPS = ("gelu", "relu2")  # --mlp: GPT-2's GELU (tanh approximation), or ReLU squared (So et al. 2021)
NORMS = ("layernorm", "rmsnorm")  # --norm: GPT-2's LayerNorm, or RMSNorm (Zhang & Sennrich 2019)
# --lr-schedule: warm-up then cosine; or warm-up, stable, decay (Hagele et al. 2024)
LR_SCHEDULES = ("cosine", "wsd")
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
