"""The knobs ``gptspeed bench tune`` turns: each a setting of the run configuration and the values to
try from the best configuration found so far, on this device.

A :class:`Knob` gives, for the search's current state (:class:`TuneState`), the deltas to try (settings
by name, as a config file would set them) or the one-line reason it has nothing to try here, decided
before any row runs. Every delta is a setting ``gptspeed train`` already has, so whatever the search
keeps can be written to a ``--config`` file. A delta that changes nothing as the best configuration
resolves on this device (``--sdpa-backend cudnn`` where ``auto`` already ran cuDNN's kernel, ``--loss
plain`` where ``auto`` is plain) is a *duplicate*: reported, never run (:meth:`TuneState.duplicate`).

Order matters: the search is greedy, one knob at a time from the best so far. The CUDA knobs are
tried by expected gain per second of row (:attr:`Knob.gain_per_cost`), from the table
:data:`CUDA_TABLE`: each knob's expected gain for GPT-2 124M on an H100 and its row's cost in rows of
a plain compile. These are priors, not measurements (none is measured yet: ``--tune`` is how they get
measured), each written with its source.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gptspeed.config import RunConfig
from gptspeed.cpu import cpu_has_native_bf16

Delta = dict[str, Any]


@dataclass
class TuneState:
    """What a knob needs to know: the device, the user's configuration, the best settings found so far
    (flat, by name: the kept deltas), the measured step's sequences (``sequences``: the micro-batch
    must divide them and the user's global batch), ``auto``: what ``--dtype auto`` and
    ``--compile`` unset resolve to on this device (:func:`gptspeed.runtime.resolve_runtime`), and
    ``ran``: what a row of the best configuration was seen running (``sdpa_backend``: the kernel
    ``--sdpa-backend auto`` ran, from its profile; :meth:`gptspeed.bench.tune.Tuner.measure`)."""

    device: torch.device
    user: RunConfig
    best: dict[str, Any]
    sequences: int
    auto: dict[str, Any]
    ran: dict[str, Any] = dataclasses.field(default_factory=dict)

    def value(self, name: str) -> Any:
        """Setting ``name`` under the best settings: a kept delta's value, else the user's."""
        if name in self.best:
            return self.best[name]
        return next(getattr(g, name) for g in self.user.groups().values() if hasattr(g, name))

    def resolved(self, name: str) -> Any:
        """:meth:`value` with ``auto`` / unset resolved as a run on this device resolves it (dtype,
        compile from :attr:`auto`; the SDPA kernel from :attr:`ran`; the loss path from
        :func:`gptspeed.loss.resolve_loss`; coordinate-descent tuning on under a ``--compile-tuning`` mode
        that includes it, ``torch._inductor.list_mode_options``)."""
        value = self.value(name)
        if value in ("auto", None) and name in self.ran:
            return self.ran[name]
        if value in ("auto", None) and name in self.auto:
            return self.auto[name]
        if name == "loss":
            from gptspeed.loss import resolve_loss

            return resolve_loss(value, self.device.type)
        if name == "coordinate_descent_tuning" and not value:
            from torch._inductor import list_mode_options

            return bool(list_mode_options(self.value("compile_tuning")).get("coordinate_descent_tuning"))
        return value

    def duplicate(self, delta: Delta) -> str | None:
        """Why ``delta`` changes nothing from the best configuration as it resolves here (one line), or
        None: every setting it names already resolves to the value it sets (:meth:`resolved`)."""
        if not delta or any(self.resolved(k) != v for k, v in delta.items()):
            return None
        from gptspeed.config import setting_flag

        def how(name: str, v: Any) -> str:
            now, flag = self.value(name), setting_flag(name)
            if name in self.ran and now in ("auto", None):
                return f"{flag} {now} already ran {v}'s kernel (the best row's profile)"
            if name == "coordinate_descent_tuning" and not now:
                return f"--compile-tuning {self.value('compile_tuning')} already includes it"
            return f"{flag} {now} is {v} here" if now != v else f"{flag} is already {v}"

        return "duplicate of the best so far: " + "; ".join(how(k, v) for k, v in delta.items())

    def global_sequences(self) -> int:
        """Sequences per optimizer step of the user's run on one process."""
        return self.user.grad_accum_steps(1) * self.user.train.batch_size


@dataclass(frozen=True)
class Knob:
    """One setting the search turns. ``values(state)`` returns the deltas to try from ``state.best``
    (in order), or a string: why the knob has nothing to try here. ``sizes``: each value larger than the
    last (the micro-batch): every one that fits is compared, and the first that does not fit ends the
    knob (a larger one would not fit either). ``gain``: the expected gain in tokens/s, a (low, high)
    fraction, and ``cost``: a row's seconds in rows of a plain compile (a longer compile costs more);
    both priors, with ``source``."""

    name: str
    description: str
    source: str
    values: Callable[[TuneState], list[Delta] | str]
    sizes: bool = False
    gain: tuple[float, float] = (0.0, 0.0)
    cost: float = 1.0

    @property
    def gain_per_cost(self) -> float:
        """The expected gain (the middle of :attr:`gain`) per row-cost unit: the search's order."""
        return round((self.gain[0] + self.gain[1]) / 2 / self.cost, 9)  # equal priors tie (the table's order)


def _cuda_only(values: Callable[[TuneState], list[Delta] | str]) -> Callable[[TuneState], list[Delta] | str]:
    def wrapped(state: TuneState) -> list[Delta] | str:
        if state.device.type != "cuda":
            return f"a CUDA knob; this device is {state.device.type}"
        return values(state)

    return wrapped


def _micro_batch(state: TuneState) -> list[Delta] | str:
    b = now = state.value("batch_size")
    out, glob = [], state.global_sequences()
    while (b := 2 * b) <= state.sequences and glob % b == 0:
        out.append({"batch_size": b})
    return out or f"B={now} already covers the measured step's {state.sequences} sequences"


def _choices(name: str, options: tuple[Any, ...]) -> Callable[[TuneState], list[Delta] | str]:
    """Each of ``options``; the one the best configuration already resolves to is reported as a
    duplicate by the search (:meth:`TuneState.duplicate`), not run."""

    def values(state: TuneState) -> list[Delta] | str:
        return [{name: v} for v in options]

    return values


def _switch_on(name: str) -> Callable[[TuneState], list[Delta] | str]:
    def values(state: TuneState) -> list[Delta] | str:
        return "already on" if state.value(name) else [{name: True}]

    return values


def _residual(state: TuneState) -> list[Delta] | str:
    if state.resolved("dtype") != "bfloat16":
        return f"a bf16 residual stream needs --dtype bfloat16; this run computes in {state.resolved('dtype')}"
    return _choices("residual_dtype", ("bfloat16",))(state)


#: why --cast-weights-once is not tried under whole-model compile (measured on the CPU, eager backend: 3 graph
#: breaks at 2 layers, 0 with --compile-mode blocks; tests/bench/test_tune.py runs the per-block case)
WHOLE_MODEL_COMPILE = (
    "not applicable under whole-model compile (--compile-mode model): dynamo skips FSDP2's hooks, a graph break "
    "at each sharded module, and the row would fail verification; with --compile-mode blocks it compiles clean"
)


def _cast_once(state: TuneState) -> list[Delta] | str:
    """``--parallel fsdp --cast-weights-once`` where it can win: a bf16 run with several micro-steps, not
    compiled as one graph (:data:`WHOLE_MODEL_COMPILE`; making it per-block compile here would change
    two settings in one row, and ``--compile-mode blocks`` leaves the embeddings and the loss eager)."""
    if state.resolved("dtype") != "bfloat16":
        return (
            f"FSDP2's bf16 copy of the weights needs --dtype bfloat16; this run computes in {state.resolved('dtype')}"
        )
    if state.global_sequences() // state.value("batch_size") == 1:
        return "one micro-step a step: the weights are already cast once a step"
    if state.resolved("compile") and state.value("compile_mode") == "model":
        return WHOLE_MODEL_COMPILE
    return "already on" if state.value("cast_weights_once") else [{"parallel": "fsdp", "cast_weights_once": True}]


def _cpu_dtype(state: TuneState) -> list[Delta] | str:
    now = state.resolved("dtype")
    if now == "float32" and state.device.type == "cpu" and not cpu_has_native_bf16():
        return "this CPU has no native bf16 matmuls (AVX512-BF16 / AMX): emulated bf16 runs slower than fp32"
    return [{"dtype": "bfloat16" if now == "float32" else "float32"}]


def _compile(state: TuneState) -> list[Delta] | str:
    return [{"compile": not state.resolved("compile")}]


def _threads(state: TuneState) -> list[Delta] | str:
    if state.device.type != "cpu":
        return f"CPU threads; this device is {state.device.type}"
    now = state.value("threads") or torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    options = sorted({n for n in (1, max(1, cores // 2), cores) if n != now}, reverse=True)
    return [{"threads": n} for n in options] or "one core: nothing to choose"


def _coordinate_descent(state: TuneState) -> list[Delta] | str:
    if state.device.type != "cuda":
        return (
            f"tunes inductor's Triton kernels (CUDA); this device is {state.device.type}, whose C++ kernels have none"
        )
    if not state.resolved("compile"):
        return "inductor's option: needs --compile"
    return [{"coordinate_descent_tuning": True}]


def _compile_tuning(mode: str) -> Callable[[TuneState], list[Delta] | str]:
    def values(state: TuneState) -> list[Delta] | str:
        now = state.resolved("compile_tuning")
        return f"--compile-tuning is already {now}" if now != "default" else [{"compile_tuning": mode}]

    return values


MODDED = "modded-nanogpt records (KellerJordan/modded-nanogpt, records/)"
#: The CUDA knobs with their priors (expected gain for GPT-2 124M on an H100, row cost in rows of a plain compile)
#: and sources; :data:`CUDA_KNOBS` is this table by expected gain per row-cost unit. None is measured yet.
CUDA_TABLE: tuple[Knob, ...] = (
    Knob(
        "micro-batch",
        "raise the micro-batch B (same global batch: fewer, larger micro-steps); every size that fits",
        "build-nanogpt: raise the batch to fill memory after each saving",
        _cuda_only(_micro_batch),
        sizes=True,
        gain=(0.03, 0.06),
    ),
    Knob(
        "fp8-lm-head",
        "FP8 matmul for the tied LM head (the largest matmul)",
        f"{MODDED}: the FP8 head; torchao float8",
        _cuda_only(_switch_on("fp8_lm_head")),
        gain=(0.03, 0.06),
    ),
    Knob("residual-dtype", "a bf16 residual stream", MODDED, _cuda_only(_residual), gain=(0.02, 0.04)),
    Knob(
        "cuda-graphs",
        "torch.compile mode reduce-overhead (CUDA graphs: one launch per graph)",
        "torch.compile docs",
        _cuda_only(_compile_tuning("reduce-overhead")),
        gain=(0.01, 0.03),
        cost=1.5,  # the graphs' capture on top of the compile
    ),
    Knob(
        "cast-weights-once",
        "the bf16 weights cast once a step, not once a micro-step (one-process FSDP2 keeps "
        "its unsharded copy between micro-steps)",
        "FSDP2 set_reshard_after_backward",
        _cuda_only(_cast_once),
        gain=(0.0, 0.01),  # one bf16 copy of the weights written per micro-step saved
    ),
    Knob(
        "sdpa-backend",
        "the attention kernel (auto resolved to the kernel your row ran first: that one is a duplicate)",
        "torch.nn.attention.SDPBackend",
        _cuda_only(_choices("sdpa_backend", ("cudnn", "flash", "efficient"))),
        gain=(-0.02, 0.03),
    ),
    Knob(
        "coordinate-descent",
        "inductor's coordinate-descent tuning of each Triton kernel's block sizes (--coordinate-descent-tuning)",
        f"{MODDED}: set in the 2024 records (records/120424_ValueEmbed/train_gpt2.py, 'suggested by @Chillee'), "
        "banned for new records since for its ~30-minute compile (train_gpt.py); gpt-fast sets it (generate.py)",
        _coordinate_descent,
        gain=(0.0, 0.03),
        cost=3.0,  # every Triton kernel timed at several configs
    ),
    Knob(
        "compile-tuning",
        "torch.compile mode max-autotune-no-cudagraphs (inductor searches matmul configs; coordinate descent too)",
        "torch.compile docs; torch._inductor.list_mode_options",
        _cuda_only(_compile_tuning("max-autotune-no-cudagraphs")),
        gain=(0.0, 0.04),
        cost=4.0,  # the matmul search: the longest compile
    ),
    Knob(
        "fp8",
        "FP8 matmuls in the blocks' Linear layers large enough to gain",
        "torchao float8 (tensorwise)",
        _cuda_only(_switch_on("fp8")),
        gain=(-0.05, 0.03),  # 768-wide matmuls: the casts may cost what FP8 saves
    ),
    Knob(
        "loss",
        "the loss path: plain (full logits), liger (Liger-Kernel), fused (gptspeed's chunked)",
        "Liger-Kernel (Hsu et al. 2024); Wijmans et al. 2024",
        _cuda_only(_choices("loss", ("plain", "liger", "fused"))),
        gain=(-0.08, 0.02),
    ),
)
CUDA_KNOBS: tuple[Knob, ...] = tuple(
    sorted(CUDA_TABLE, key=lambda k: -k.gain_per_cost)
)  # stable: ties keep the table's order
CPU_KNOBS: tuple[Knob, ...] = (
    Knob("dtype", "bf16 autocast or fp32", "torch.autocast; benchmarks/LOG.md issue 14", _cpu_dtype),
    Knob("compile", "torch.compile on or off", "torch.compile (TorchInductor)", _compile),
    Knob(
        "loss",
        "the loss path: plain (full logits) or fused (chunked)",
        "Wijmans et al. 2024",
        _choices("loss", ("plain", "fused")),
    ),
    Knob("threads", "PyTorch's intra-op threads", "torch.set_num_threads", _threads),
    Knob(  # listed where it cannot apply, so a CPU's report says why
        "coordinate-descent",
        "inductor's coordinate-descent tuning of each Triton kernel's block sizes (--coordinate-descent-tuning)",
        MODDED,
        _coordinate_descent,
    ),
)


def knobs_for(device: torch.device) -> tuple[Knob, ...]:
    """The knobs of ``device``'s kind, in search order: CUDA's, or the CPU's (MPS takes the CPU's
    but threads)."""
    return CUDA_KNOBS if device.type == "cuda" else CPU_KNOBS
