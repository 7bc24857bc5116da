"""The knobs ``gptspeed bench --tune`` turns: each a setting of the run configuration and the values to
try from the best configuration found so far, on this device.

A :class:`Knob` gives, for the search's current state (:class:`TuneState`), the deltas to try (settings
by name, as a config file would set them) or the one-line reason it has nothing to try here. Every
delta is a setting ``gptspeed train`` already has, so whatever the search keeps can be written to a
``--config`` file. Order matters: the search is greedy, one knob at a time from the best so far, in
the order of :func:`knobs_for` (on CUDA by the expected gain per minute of compiling, the longest
compile -- inductor's matmul search -- last).

The expected gains are estimates for GPT-2 124M on an H100 (issue "Every GPU minute decisive"): a
larger micro-batch +3-6%, FP8 for the LM head +3-6% (modded-nanogpt's records), a bf16 residual
stream +2-4%, max-autotune 0-4%, CUDA graphs +1-3%, Liger's loss -8% to +2%, FP8 in the blocks'
768-wide layers -5% to +3%. None is measured yet; ``--tune`` is how they get measured.
"""

from __future__ import annotations

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
    must divide them and the user's global batch) and ``auto``: what ``--dtype auto`` and
    ``--compile`` unset resolve to on this device (:func:`gptspeed.runtime.resolve_runtime`)."""

    device: torch.device
    user: RunConfig
    best: dict[str, Any]
    sequences: int
    auto: dict[str, Any]

    def value(self, name: str) -> Any:
        """Setting ``name`` under the best settings: a kept delta's value, else the user's."""
        if name in self.best:
            return self.best[name]
        return next(getattr(g, name) for g in self.user.groups().values() if hasattr(g, name))

    def resolved(self, name: str) -> Any:
        """:meth:`value` with ``auto`` / unset resolved as a run on this device resolves it (dtype,
        compile from :attr:`auto`; the loss path from :func:`gptspeed.loss.resolve_loss`)."""
        value = self.value(name)
        if value in ("auto", None) and name in self.auto:
            return self.auto[name]
        if name == "loss":
            from gptspeed.loss import resolve_loss

            return resolve_loss(value, self.device.type)
        return value

    def global_sequences(self) -> int:
        """Sequences per optimizer step of the user's run on one process."""
        return self.user.grad_accum_steps(1) * self.user.train.batch_size


@dataclass(frozen=True)
class Knob:
    """One setting the search turns. ``values(state)`` returns the deltas to try from ``state.best``
    (in order), or a string: why the knob has nothing to try here. ``until_no_gain``: stop at the
    first value that does not fit or is not faster (the micro-batch: each is larger than the last)."""

    name: str
    description: str
    source: str
    values: Callable[[TuneState], list[Delta] | str]
    until_no_gain: bool = False


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
    def values(state: TuneState) -> list[Delta] | str:
        now = state.resolved(name)
        return [{name: v} for v in options if v != now] or f"{name} is already {now}"

    return values


def _switch_on(name: str) -> Callable[[TuneState], list[Delta] | str]:
    def values(state: TuneState) -> list[Delta] | str:
        return "already on" if state.value(name) else [{name: True}]

    return values


def _residual(state: TuneState) -> list[Delta] | str:
    if state.resolved("dtype") != "bfloat16":
        return f"a bf16 residual stream needs --dtype bfloat16; this run computes in {state.resolved('dtype')}"
    return _choices("residual_dtype", ("bfloat16",))(state)


def _cast_once(state: TuneState) -> list[Delta] | str:
    if state.resolved("dtype") != "bfloat16":
        return (
            f"FSDP2's bf16 copy of the weights needs --dtype bfloat16; this run computes in {state.resolved('dtype')}"
        )
    if state.global_sequences() // state.value("batch_size") == 1:
        return "one micro-step a step: the weights are already cast once a step"
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


def _compile_tuning(mode: str) -> Callable[[TuneState], list[Delta] | str]:
    def values(state: TuneState) -> list[Delta] | str:
        now = state.resolved("compile_tuning")
        return f"--compile-tuning is already {now}" if now != "default" else [{"compile_tuning": mode}]

    return values


CUDA_KNOBS: tuple[Knob, ...] = (  # by expected gain per minute of compiling; inductor's matmul search last
    Knob(
        "micro-batch",
        "raise the micro-batch B (same global batch: fewer, larger micro-steps)",
        "build-nanogpt: raise the batch to fill memory after each saving",
        _cuda_only(_micro_batch),
        until_no_gain=True,
    ),
    Knob(
        "fp8-lm-head",
        "FP8 matmul for the tied LM head (the largest matmul)",
        "modded-nanogpt records; torchao float8",
        _cuda_only(_switch_on("fp8_lm_head")),
    ),
    Knob("residual-dtype", "a bf16 residual stream", "modded-nanogpt", _cuda_only(_residual)),
    Knob(
        "cast-weights-once",
        "the bf16 weights cast once a step, not once a micro-step (one-process FSDP2 keeps "
        "its unsharded copy between micro-steps)",
        "FSDP2 set_reshard_after_backward",
        _cuda_only(_cast_once),
    ),
    Knob(
        "sdpa-backend",
        "the attention kernel",
        "torch.nn.attention.SDPBackend",
        _cuda_only(_choices("sdpa_backend", ("cudnn", "flash", "efficient"))),
    ),
    Knob(
        "loss",
        "the loss path: plain (full logits), liger (Liger-Kernel), fused (gptspeed's chunked)",
        "Liger-Kernel (Hsu et al. 2024); Wijmans et al. 2024",
        _cuda_only(_choices("loss", ("plain", "liger", "fused"))),
    ),
    Knob(
        "fp8",
        "FP8 matmuls in the blocks' Linear layers large enough to gain",
        "torchao float8 (tensorwise)",
        _cuda_only(_switch_on("fp8")),
    ),
    Knob(
        "cuda-graphs",
        "torch.compile mode reduce-overhead (CUDA graphs: one launch per graph)",
        "torch.compile docs",
        _cuda_only(_compile_tuning("reduce-overhead")),
    ),
    Knob(
        "compile-tuning",
        "torch.compile mode max-autotune-no-cudagraphs (inductor searches matmul configs)",
        "torch.compile docs",
        _cuda_only(_compile_tuning("max-autotune-no-cudagraphs")),
    ),
)
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
)


def knobs_for(device: torch.device) -> tuple[Knob, ...]:
    """The knobs of ``device``'s kind, in search order: CUDA's, or the CPU's (MPS takes the CPU's
    but threads)."""
    return CUDA_KNOBS if device.type == "cuda" else CPU_KNOBS
