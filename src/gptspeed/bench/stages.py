"""The optimization ladder: one rung per technique, each a change to the run configuration.

A rung (:class:`Stage`) is a name and ``delta``: settings of :class:`gptspeed.config.RunConfig`
by name (``{"dtype": "tf32"}``, ``{"batch_size": "auto"}``), checked where the rung is declared as
a config file's settings are (:func:`gptspeed.config.check_settings`: the name, the type, the
choices) and, with the rest of the configuration, by :meth:`RunConfig.validate` where it runs
(:func:`gptspeed.bench.worker.run_config`). ``applies(device, compile_backend)`` returns None, or
the reason the rung is skipped. A row runs with :data:`BASELINE` plus the deltas of every
*applicable* rung up to and including it, so adding a technique is one entry in :data:`STAGES`,
and a row means the same thing whichever rows ``--stages`` selects. What a row records
(:func:`record`), its label (:func:`switches`) and the settings two rows differ by
(:func:`differences`) are derived from these settings and the flags :mod:`gptspeed.config`
declares for them.

The first seven rungs are Karpathy's build-nanogpt ladder (video "Let's reproduce GPT-2 (124M)",
2024; repository karpathy/build-nanogpt): fp32 -> TF32 -> bf16 autocast -> torch.compile -> flash
attention -> vocabulary 50304 -> fused AdamW. Later issues append theirs: fused linear +
cross-entropy, then issue 7's --batch-size auto, FP8, Muon, per-block compile and max-autotune.
Muon changes the optimizer, not the step's speed much: its row is there to show its cost per step
(Newton-Schulz iterations); its gain, time to a loss, is measured by benchmarks/muon_vs_adamw.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptspeed.config import AUTO_BATCH_SIZE, FIELDS, GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, check_settings, setting_flag
from gptspeed.cpu import cpu_has_native_bf16
from gptspeed.errors import GptspeedError
from gptspeed.optim import OPTIMIZERS, fused_adamw_available
from gptspeed.runtime import bf16_supported

# The ladder's first rung, as settings of the run configuration: build-nanogpt's starting point (fp32, eager,
# the manual attention, the tokenizer's 50,257 embedding rows, AdamW without the fused kernel, the full-logits
# loss). Every other setting a rung changes starts at the configuration's default.
BASELINE: dict[str, Any] = check_settings(
    {
        "dtype": "float32",
        "compile": False,
        "attention": "manual",
        "vocab_size": GPT2_VOCAB_SIZE,
        "fused_adamw": False,
        "loss": "plain",
    },
    "the bench's baseline",
)


def baseline_with(**changes: Any) -> dict[str, Any]:
    """:data:`BASELINE` with ``changes`` (settings by name, checked as a rung's are)."""
    return {**BASELINE, **check_settings(changes, "bench settings")}


# Relative tolerance of a loss against the fp32 reference's on the same batches from the same
# weights, by the least precise format the rung's matmuls run in (:func:`loss_rtol`): the ladder checks
# step 0 with it, ``bench verify`` every step of a short trajectory (max over steps of
# |loss - loss_ref| / loss_ref). Why these numbers (benchmarks/README.md, "bench verify"):
# - float32: rungs that change only the order of summation (compile, SDPA, padded vocabulary, fused
#   AdamW, the chunked loss) differ on the CPU by <= 2e-7 relative over 20 steps (2 layers, width 64)
#   and <= 3e-6 over 13 (nano on Shakespeare) (measured); 1e-4 leaves >= 30x for GPU kernels that
#   split reductions differently.
# - tf32 keeps 10 mantissa bits (unit roundoff 2^-11 = 4.9e-4), 8x finer than bf16: 2e-3.
# - bfloat16 keeps 7 (2^-8 = 3.9e-3); float16 10 bits but a narrow range, handled by the GradScaler:
#   1e-2 for both, i.e. 0.1 nats at a loss of 10. Mixed-precision loss curves are reported to track
#   fp32 within run-to-run noise (Micikevicius et al. 2018); the CPU measured 3e-5 over 20 steps
#   (emulated bf16). How sharp that is: benchmarks/README.md, "bench verify".
# - fp8 (e4m3: 3 mantissa bits, per-tensor scaling) in the blocks' matmuls or the LM head's: 2e-2.
# - an optimizer may hold its rungs to a looser tolerance of its own (gptspeed.optim.OptimizerSpec.verify_rtol):
#   Muon orthogonalises its update with Newton-Schulz iterations in bf16, which turns summation-order
#   differences into bf16 rounding differences, so it declares bf16's 1e-2 whatever the rung's dtype
#   (measured on the CPU: fp32 Muon rungs 4e-5 / 7e-5 off the fp32 Muon reference after 13 steps, nano
#   on Shakespeare -- ~50x the AdamW rungs' 1e-6, near fp32's 1e-4).
LOSS_RTOL = {"float32": 1e-4, "tf32": 2e-3, "bfloat16": 1e-2, "float16": 1e-2, "fp8": 2e-2}


def loss_rtol(settings: dict[str, Any], updates: bool = True) -> float:
    """The relative loss tolerance (:data:`LOSS_RTOL`) for a rung with these settings (a rung's, or
    a row's :func:`record`): the loosest of its dtype's, fp8's when ``fp8`` or ``fp8_lm_head`` is on
    and, when the compared losses follow optimizer steps (``updates``), its optimizer's own
    ``verify_rtol``."""
    rtol = LOSS_RTOL.get(settings.get("dtype", "float32"), LOSS_RTOL["bfloat16"])
    if settings.get("fp8") or settings.get("fp8_lm_head"):
        rtol = max(rtol, LOSS_RTOL["fp8"])
    spec = OPTIMIZERS.get(settings.get("optimizer", FIELDS["optimizer"].default))
    if updates and spec is not None and spec.verify_rtol is not None:
        rtol = max(rtol, spec.verify_rtol)
    return rtol


def _always(device: torch.device, compile_backend: str) -> str | None:
    return None


def _tf32(device: torch.device, compile_backend: str) -> str | None:
    if device.type != "cuda":
        return f"TF32 is an NVIDIA tensor-core format (Ampere or newer); {device.type} has none"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"TF32 needs compute capability 8.0 (Ampere) or newer; this GPU is {major}.{minor}"
    return None


def _bf16(device: torch.device, compile_backend: str) -> str | None:
    if device.type == "cpu":
        if not cpu_has_native_bf16():  # the one answer gptspeed train's --dtype auto uses too
            return "this CPU has no native bf16 support (AVX512-BF16 / AMX); autocast would only emulate it"
        return None
    if not bf16_supported(device):
        return f"bf16 is not supported on this {device.type} device (needs Ampere or newer)"
    return None


def _compile(device: torch.device, compile_backend: str) -> str | None:
    if compile_backend != "inductor":
        return None
    if device.type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if not (shutil.which(cxx) or shutil.which("c++") or shutil.which("clang++")):
            return "torch.compile (inductor) on a CPU needs a C++ compiler (g++ or clang++) on PATH"
    from gptspeed.step import compile_toolchain_problem  # the rule gptspeed train checks: triton, cc, Python.h

    return compile_toolchain_problem(device.type)


def _fused_adamw(device: torch.device, compile_backend: str) -> str | None:
    if not fused_adamw_available(device.type):
        return f"torch.optim.AdamW(fused=True) has no kernel for {device.type}"
    return None


def _cuda_only(what: str):
    def applies(device: torch.device, compile_backend: str) -> str | None:
        return None if device.type == "cuda" else f"{what} needs CUDA; not {device.type}"

    return applies


def _fp8(device: torch.device, compile_backend: str) -> str | None:
    if device.type != "cuda":
        return f"FP8 tensor cores need an NVIDIA GPU (Ada / Hopper); not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 tensor cores need compute capability 8.9 or newer; this GPU is {major}.{minor}"
    if importlib.util.find_spec("torchao") is None:
        return "FP8 training needs torchao, which is not installed: pip install 'gptspeed[fp8]'"
    return None


@dataclass(frozen=True)
class Stage:
    """One rung: ``delta`` (settings of the run configuration by name) is applied on top of every
    applicable rung before it; it is checked as a config file's settings are when the rung is
    declared (an unknown name, a wrong type or a value outside the choices fails at import).

    ``applies(device, compile_backend)`` returns None when the stage can run on ``device`` and
    otherwise the one-line reason it is skipped. ``source`` says where the technique comes from.
    ``label``: what a row's :func:`switches` call the value the rung sets (default: its name).
    ``base`` (only for :data:`VERIFY_EXTRAS`): apply ``delta`` to that ladder stage's settings
    instead of to the rung before.
    """

    name: str
    description: str
    delta: dict[str, Any] = field(default_factory=dict)
    applies: Callable[[torch.device, str], str | None] = _always
    source: str = ""
    base: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", check_settings(self.delta, f"bench stage {self.name!r}"))


def _cuda_compile_tuning(device: torch.device, compile_backend: str) -> str | None:
    """Why a ``torch.compile`` mode of inductor's for CUDA (max-autotune, reduce-overhead, ...) does
    not run here, or None."""
    if device.type != "cuda":
        return f"this torch.compile mode tunes Triton matmul kernels / CUDA graphs; not {device.type}"
    if compile_backend != "inductor":
        return f"torch.compile modes are inductor's; the compile backend is {compile_backend}"
    return _compile(device, compile_backend)


STAGES: tuple[Stage, ...] = (
    Stage(
        "baseline",
        "fp32, manual attention, vocab 50257, eager, plain AdamW, full-logits loss",
        {},
        source="build-nanogpt ladder, first rung",
    ),
    Stage(
        "tf32",
        "TF32 tensor cores for fp32 matmuls",
        {"dtype": "tf32"},
        _tf32,
        source="torch.set_float32_matmul_precision('high')",
    ),
    Stage(
        "bf16",
        "bf16 autocast (fp32 master weights)",
        {"dtype": "bfloat16"},
        _bf16,
        source="torch.autocast; Micikevicius et al. 2018",
    ),
    Stage("compile", "torch.compile the model", {"compile": True}, _compile, source="torch.compile (TorchInductor)"),
    Stage(
        "flash",
        "F.scaled_dot_product_attention (flash kernels)",
        {"attention": "sdpa"},
        source="Dao et al. 2022, FlashAttention; torch SDPA",
        label="sdpa",
    ),
    Stage(
        "vocab-pad",
        f"vocabulary padded {GPT2_VOCAB_SIZE} -> {PADDED_VOCAB_SIZE}",
        {"vocab_size": PADDED_VOCAB_SIZE},
        source="build-nanogpt ('nice numbers')",
        label=f"vocab{PADDED_VOCAB_SIZE}",
    ),
    Stage("fused-adamw", "AdamW(fused=True)", {"fused_adamw": True}, _fused_adamw, source="torch.optim.AdamW docs"),
    Stage(
        "fused-ce",
        "chunked linear + cross-entropy, no full logits",
        {"loss": "fused"},
        source="Liger-Kernel (Hsu et al. 2024); Wijmans et al. 2024",
    ),
    # issue 7: beyond the seeds on one GPU
    Stage(
        "batch-auto",
        "largest power-of-two micro-batch that fits (probed, cached)",
        {"batch_size": "auto"},
        _cuda_only("--batch-size auto (an out-of-memory probe)"),
        source="gptspeed.batchsize",
    ),
    Stage(
        "fp8",
        "FP8 (e4m3 / e5m2, per-tensor scaling) matmuls in the blocks' Linear layers",
        {"fp8": True},
        _fp8,
        source="Micikevicius et al. 2022, FP8 Formats for Deep Learning; torch._scaled_mm",
    ),
    Stage(
        "muon",
        "Muon for the blocks' 2-D weights, AdamW for the rest",
        {"optimizer": "muon"},
        source="Jordan et al. 2024 (Muon); torch.optim.Muon; modded-nanogpt",
    ),
    Stage(
        "compile-blocks",
        "torch.compile each transformer block (compile once, reuse)",
        {"compile_mode": "blocks"},
        _compile,
        source="torch.compile regional compilation recipe",
    ),
    Stage(
        "max-autotune",
        "torch.compile mode max-autotune (tuned matmuls, CUDA graphs)",
        {"compile_tuning": "max-autotune"},
        _cuda_compile_tuning,
        source="torch.compile docs",
    ),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
# The seeds' rungs: build-nanogpt's ladder, fp32 -> ... -> fused AdamW. The last one is what
# ``gptspeed train`` runs on CUDA with no speed flag (bf16, compile, SDPA, vocabulary 50304, fused
# AdamW, the plain loss), so these rungs are also "the default's switches", one at a time.
SEED_STAGES = STAGE_NAMES[: STAGE_NAMES.index("fused-adamw") + 1]
ALL_STAGES = "all"  # --stages all: every rung


def _bf16_cuda(device: torch.device, compile_backend: str) -> str | None:
    if device.type != "cuda":
        return f"a bf16 residual stream on CUDA's default settings needs CUDA; not {device.type}"
    return _bf16(device, compile_backend)


def _fp16(device: torch.device, compile_backend: str) -> str | None:
    if device.type != "cuda":
        return (
            f"float16 autocast + GradScaler is the path of CUDA GPUs without bf16 (V100, T4); "
            f"gptspeed does not run it on {device.type}"
        )
    return None


# Rungs only ``bench verify`` runs: other ways to train that a user can pick with a flag, checked
# against the same fp32 reference. Not in the ladder (they are alternatives, not cumulative steps).
VERIFY_EXTRAS: tuple[Stage, ...] = (
    Stage(
        "fp16",
        "float16 autocast with a GradScaler (--dtype auto on GPUs without bf16)",
        {"dtype": "float16"},
        _fp16,
        source="torch.amp.GradScaler; Micikevicius et al. 2018",
        base="baseline",
    ),
    Stage(
        "sdpa-cudnn",
        "fused-adamw's settings (CUDA's default) with cuDNN attention (--sdpa-backend cudnn)",
        {"sdpa_backend": "cudnn"},
        _cuda_only("cuDNN attention"),
        source="torch.nn.attention.SDPBackend.CUDNN_ATTENTION",
        base="fused-adamw",
    ),
    Stage(
        "fp16-fused-ce",
        "fused-ce's settings in float16 (GradScaler + the chunked loss)",
        {"dtype": "float16"},
        _fp16,
        source="torch.amp.GradScaler",
        base="fused-ce",
    ),
    Stage(
        "reduce-overhead",
        "fused-ce's settings, torch.compile mode reduce-overhead (CUDA graphs)",
        {"compile": True, "compile_tuning": "reduce-overhead"},
        _cuda_compile_tuning,
        source="torch.compile docs",
        base="fused-ce",
    ),
    Stage(
        "max-autotune-no-cudagraphs",
        "fused-ce's settings, torch.compile mode max-autotune-no-cudagraphs",
        {"compile": True, "compile_tuning": "max-autotune-no-cudagraphs"},
        _cuda_compile_tuning,
        source="torch.compile docs",
        base="fused-ce",
    ),
    # the LM head is the largest matmul (768 x 50304 at 124M); fused-adamw's settings call it (--loss plain)
    Stage(
        "fp8-lm-head",
        "fused-adamw's settings (CUDA's default) with an FP8 LM head (--fp8-lm-head)",
        {"fp8_lm_head": True},
        _fp8,
        source="torchao float8 training; modded-nanogpt speedrun (FP8 head)",
        base="fused-adamw",
    ),
    Stage(
        "bf16-residual",
        "fused-adamw's settings (CUDA's default) with a bf16 residual stream (--residual-dtype bfloat16)",
        {"residual_dtype": "bfloat16"},
        _bf16_cuda,
        source="modded-nanogpt speedrun (bf16 residual stream)",
        base="fused-adamw",
    ),
)
VERIFY_EXTRA_NAMES = tuple(s.name for s in VERIFY_EXTRAS)
# Every setting a rung changes, in the order the rungs first change it: what a row records (:func:`record`)
SWITCHES = tuple(dict.fromkeys([*BASELINE, *(k for st in (*STAGES, *VERIFY_EXTRAS) for k in st.delta)]))
_DTYPE_LABEL = {"float32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "float16": "fp16"}


def _recorded(name: str, value: Any) -> tuple[str, Any]:
    """How a row records one setting: as it is, except ``batch_size``, recorded as ``batch_auto``
    (``--batch-size auto`` or not: the micro-batch itself is the bench's, the same for every row)."""
    return ("batch_auto", value == AUTO_BATCH_SIZE) if name == "batch_size" else (name, value)


def record(settings: dict[str, Any]) -> dict[str, Any]:
    """A rung's settings as its row records them (``settings`` in ladder.json and verify.json): every
    setting of :data:`SWITCHES`, at the configuration's default where the rung leaves it alone."""
    return dict(_recorded(name, settings.get(name, FIELDS[name].default)) for name in SWITCHES)


# (recorded setting, value) -> its name in a row's label: the label (else the name) of the first rung that sets it
_LABELS = {}
for _st in (*STAGES, *VERIFY_EXTRAS):
    for _item in (_recorded(k, v) for k, v in _st.delta.items() if k != "dtype"):
        _LABELS.setdefault(_item, _st.label or _st.name)


def _label(name: str, value: Any) -> str:
    """The label of a recorded setting's value: the rung's that sets it, else from the setting's flag
    (``--compile`` on: ``compile``; ``--loss liger``: ``loss-liger``)."""
    flag = setting_flag(name).removeprefix("--")
    return _LABELS.get((name, value)) or (flag if value is True else f"{flag}-{value}")


def switches(recorded: dict[str, Any]) -> str:
    """Every switch a row ran with (``recorded``: its :func:`record`), as one label: the dtype, then
    each setting that differs from the baseline's, in :data:`SWITCHES` order, e.g.
    ``bf16+compile+sdpa+vocab50304+fused-adamw+fused-ce``; ``fp32`` for the baseline."""
    base = record(BASELINE)
    parts = [_DTYPE_LABEL.get(recorded["dtype"], recorded["dtype"])]
    return "+".join(parts + [_label(k, v) for k, v in recorded.items() if k != "dtype" and v != base.get(k)])


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The settings in which two rows' records differ, named by their flags (``compile``,
    ``vocab-size``, ``batch-auto``), in :data:`SWITCHES` order."""
    return [setting_flag(k).removeprefix("--") for k in a if a[k] != b.get(k)]


@dataclass
class PlannedRow:
    """A ladder row before it runs: ``settings`` (the run configuration's, by name) is None when
    the stage does not apply; ``skip_reason`` is set when it does not apply or was not selected."""

    stage: Stage
    settings: dict[str, Any] | None
    skip_reason: str | None


def parse_stage_list(text: str | None, allowed: tuple[str, ...] = STAGE_NAMES) -> list[str] | None:
    """``"baseline,bf16"`` -> ``["baseline", "bf16"]``; None or ``"all"`` -> None (all). GptspeedError
    for a name not in ``allowed`` or an empty one."""
    if text is None or text.strip() == ALL_STAGES:
        return None
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise GptspeedError(
            f"unknown stage(s) {', '.join(repr(b) for b in bad) or repr(text)} in --stages: "
            f"choose from {', '.join(allowed)} (or {ALL_STAGES})"
        )
    return names


def plan_ladder(
    device: torch.device, selected: list[str] | None = None, compile_backend: str = "inductor"
) -> list[PlannedRow]:
    """Every stage of :data:`STAGES`, in order, with the cumulative settings it runs with."""
    rows = []
    settings = dict(BASELINE)
    for stage in STAGES:
        reason = stage.applies(device, compile_backend)
        if reason is not None:
            rows.append(PlannedRow(stage, None, reason))
            continue
        settings = {**settings, **stage.delta}
        not_selected = selected is not None and stage.name not in selected
        rows.append(PlannedRow(stage, settings, "not selected (--stages)" if not_selected else None))
    return rows


def stage_settings(name: str, device: torch.device, compile_backend: str = "inductor") -> dict[str, Any]:
    """The cumulative settings of one stage on ``device``; GptspeedError if unknown or skipped."""
    if name not in STAGE_NAMES:
        raise GptspeedError(f"unknown stage {name!r}: choose from {', '.join(STAGE_NAMES)}")
    row = next(r for r in plan_ladder(device, None, compile_backend) if r.stage.name == name)
    if row.settings is None:
        raise GptspeedError(f"stage {name!r} does not apply on {device.type}: {row.skip_reason}")
    return row.settings
