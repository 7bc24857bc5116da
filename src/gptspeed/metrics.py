"""Measurement: device peaks and MFU, memory, environment, and the run log (console + JSONL)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gptspeed
from gptspeed.fileio import write_text_atomic

# Dense (no sparsity) peak TFLOPS from the vendors' datasheets, by dtype family: "bf16" covers bf16 and
# fp16 tensor-core matmuls (with FP32 accumulation, the one PyTorch uses), "tf32" the TF32 tensor cores
# (AMD: its TF32 matrix rate), "fp32" plain FP32 (a card without TF32 cores gets its FP32 rate there).
# NVIDIA quotes tensor-core figures "with sparsity"; the dense peak is half of that. Sources, each the
# datasheet or architecture whitepaper of the card:
#   A100 / A800: NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe: 312 bf16, 156 tf32, 19.5 fp32);
#     A800 has A100's compute (its datasheet: the same figures, a slower NVLink).
#   H100 SXM / H100 NVL / H100 PCIe: NVIDIA H100 Tensor Core GPU datasheet (SXM: 1,979 bf16 / 989 tf32
#     with sparsity, 67 fp32; NVL: 1,671 / 835, 60; PCIe: 1,513 / 756, 51). H800: NVIDIA H800 datasheet,
#     H100's SXM and PCIe columns. GH200: NVIDIA GH200 Grace Hopper datasheet, the H100 SXM figures.
#   H200 SXM / H200 NVL: NVIDIA H200 Tensor Core GPU datasheet (SXM: H100 SXM's peaks; NVL: 1,671 /
#     835 with sparsity, 60 fp32).
#   B200: NVIDIA HGX B200 datasheet, per GPU (4.5 PF bf16 / 2.2 PF tf32 with sparsity, 75 fp32).
#   L40S: NVIDIA L40S datasheet (362.05 bf16, 183 tf32 dense, 91.6 fp32); L40: NVIDIA L40 datasheet
#     (181.05 bf16, 90.5 tf32, 90.5 fp32).
#   RTX A6000: NVIDIA Ampere GA102 whitepaper, appendix (154.8 bf16, 77.4 tf32, 38.7 fp32); A40: NVIDIA
#     A40 datasheet (149.7 bf16, 74.8 tf32, 37.4 fp32).
#   RTX 6000 Ada, RTX 4090: NVIDIA Ada Lovelace whitepaper, appendix (FP32-accumulate bf16 364.2 and
#     165.2; tf32 182.1 and 82.6; fp32 91.1 and 82.6).
#   RTX 5090: NVIDIA RTX Blackwell GPU architecture whitepaper, appendix (209.5 bf16 with FP32
#     accumulate, 104.8 tf32, 104.8 fp32).
#   MI300X / MI325X: AMD Instinct MI300X and MI325X datasheets (1,307.4 bf16, 653.7 tf32, 163.4 fp32
#     matrix); MI250X: AMD Instinct MI250X datasheet (383 bf16, no TF32: its 95.7 fp32 matrix rate).
#   L4: NVIDIA L4 datasheet (242 bf16 / 120 tf32 with sparsity, 30.3 fp32). RTX 3090: NVIDIA Ampere GA102
#     whitepaper, appendix (71 bf16 with FP32 accumulate, 35.6 tf32, 35.6 fp32). V100 SXM2 / PCIe: NVIDIA
#     V100 datasheet (125 / 112 "tensor performance", fp16 tensor cores, no bf16/tf32: 15.7 / 14 fp32). T4:
#     NVIDIA T4 datasheet (65 mixed-precision FP16/FP32, 8.1 fp32).
#   A10G (AWS's variant of the A10; NVIDIA publishes no A10G datasheet): Baseten, "NVIDIA A10 vs A10G for
#     ML model inference" (https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/): 70
#     bf16/fp16 tensor, 35 tf32, 35 fp32 -- "the A10 prioritizes tensor compute, while the A10G has a higher
#     CUDA core performance", so not the A10's datasheet (125 / 62.5 / 31.2, which this table used to give).
#     The same figures follow from GA102's rates: 80 SMs x 4 tensor cores x 64 FP32-accumulate FMAs a clock
#     (GeForce's rate, as the RTX 3090's 71) x 2 x 1.71 GHz = 70.0; 80 x 128 FP32 lanes x 2 x 1.71 = 35.0.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "L40S": {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "RTX A6000": {"bf16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "A40": {"bf16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "RTX 6000 Ada": {"bf16": 364.2, "tf32": 182.1, "fp32": 91.1},
    "RTX 5090": {"bf16": 209.5, "tf32": 104.8, "fp32": 104.8},
    "MI300X": {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "tf32": 95.7, "fp32": 95.7},
    "A10G": {"bf16": 70.0, "tf32": 35.0, "fp32": 35.0},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100 SXM2": {"bf16": 125.0, "tf32": 15.7, "fp32": 15.7},
    "V100 PCIe": {"bf16": 112.0, "tf32": 14.0, "fp32": 14.0},
    "T4": {"bf16": 65.0, "tf32": 8.1, "fp32": 8.1},
}
# ``torch.cuda.get_device_name`` strings (ROCm's included) as each card reports them, matched whole
# (``re.fullmatch``, case-blind): a card a pattern does not describe gets no MFU (pass --peak-tflops)
# rather than a neighbour's peak (an H100 NVL is not an H100 SXM). The memory size is free where a
# family ships several; the form factor never is.
DEVICE_NAMES: dict[str, str] = {
    r"NVIDIA A100[- ]SXM4[- ](40|80)GB": "A100",
    r"NVIDIA A100[- ]PCIE[- ](40|80)GB|NVIDIA A100 (40|80)GB PCIe": "A100",
    r"NVIDIA A800[- ]SXM4[- ](40|80)GB|NVIDIA A800 (40|80)GB PCIe": "A100",
    r"NVIDIA H100 (80|94|96)GB HBM3|NVIDIA H100 SXM5 (64|80|94|96)GB|NVIDIA H100": "H100 SXM",
    r"NVIDIA H100 PCIe": "H100 PCIe",
    r"NVIDIA H100 NVL": "H100 NVL",
    r"NVIDIA H800|NVIDIA H800 (80GB HBM3|SXM5 80GB)": "H100 SXM",
    r"NVIDIA H800 PCIe": "H100 PCIe",
    r"NVIDIA GH200( (96|120|144|480)GB( HBM3e?)?)?": "H100 SXM",
    r"NVIDIA H200|NVIDIA H200 141GB HBM3e|NVIDIA H200 SXM 141GB": "H200 SXM",
    r"NVIDIA H200 NVL": "H200 NVL",
    r"NVIDIA B200": "B200",
    r"NVIDIA L40S": "L40S",
    r"NVIDIA L40": "L40",
    r"NVIDIA RTX A6000": "RTX A6000",
    r"NVIDIA A40": "A40",
    r"NVIDIA RTX 6000 Ada Generation": "RTX 6000 Ada",
    r"NVIDIA GeForce RTX 5090": "RTX 5090",
    r"AMD Instinct MI300X( VF)?|AMD Instinct MI325X( VF)?": "MI300X",
    r"AMD Instinct MI250X(/MI250)?": "MI250X",
    r"NVIDIA A10G": "A10G",
    r"NVIDIA L4": "L4",
    r"NVIDIA GeForce RTX 4090": "RTX 4090",
    r"NVIDIA GeForce RTX 3090": "RTX 3090",
    r"Tesla V100-SXM2-(16|32)GB": "V100 SXM2",
    r"Tesla V100-PCIE-(16|32)GB": "V100 PCIe",
    r"Tesla T4": "T4",
}
DTYPE_FAMILY = {"bfloat16": "bf16", "float16": "bf16", "tf32": "tf32", "float32": "fp32"}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_flops(device: torch.device, dtype: str, override_tflops: float | None = None) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for ``dtype`` and where the figure came from.

    Returns ``(flops_per_s or None, source)``. The fallback for a device not in
    :data:`PEAK_TFLOPS` (and for CPUs and MPS, whose peaks vary too much to tabulate) is None:
    MFU is then not reported unless ``--peak-tflops`` gives the figure.
    """
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, f"no peak table for {device.type}; pass --peak-tflops to report MFU"
    return peak_flops_for_name(device_name(device), dtype)


def peak_flops_for_name(name: str, dtype: str) -> tuple[float | None, str]:
    """:func:`peak_flops` for a device named ``name`` as ``torch.cuda.get_device_name`` reports it,
    matched whole against the patterns of :data:`DEVICE_NAMES` (case-blind). Returns ``(FLOP/s or None,
    source)``: the card's datasheet entry of :data:`PEAK_TFLOPS` for ``dtype``'s family, or None and the
    line that names ``--peak-tflops``."""
    key = next((k for pattern, k in DEVICE_NAMES.items() if re.fullmatch(pattern, name.strip(), re.IGNORECASE)), None)
    if key is None:
        return None, f"{name} not in the peak table; pass --peak-tflops to report MFU"
    family = DTYPE_FAMILY.get(dtype, "fp32")
    return PEAK_TFLOPS[key][family] * 1e12, f"{key} {family} datasheet"


def memory_stats(device: torch.device) -> tuple[int | None, int | None]:
    """``(peak_bytes, total_bytes)``: CUDA peak allocated by PyTorch and the card's memory; MPS
    driver allocation; CPU the process's peak resident set and the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.driver_allocated_memory(), None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    return peak, total


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`memory_stats`' peak afresh on a CUDA device (``torch.cuda.reset_peak_memory_stats``),
    e.g. after a ``--batch-size auto`` probe, so the peak reported is the run's own. A CPU's peak
    resident set cannot be reset; MPS reports current allocation, nothing to reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def pace_clock() -> float:
    """The clock :class:`FirstPace` reads (``time.monotonic``; a test replaces it)."""
    return time.monotonic()


class FirstPace:
    """Says, within seconds of a slow start, how long the work ahead will take, measured on its own
    first units: ``tick()`` is called as each unit (a micro-step's batch, an evaluation batch) starts.
    The second unit's time (the first holds warm-up and any compilation) times ``units`` is the work's
    estimate; when it is at least ``min_s`` seconds, ``say(line(unit_s, total_s))`` is called once, as
    the third unit starts. A fast start says nothing.

    ``line``: ``(seconds a unit, seconds in all) -> str``; ``clock``: seconds, monotonic (default
    :func:`pace_clock`)."""

    def __init__(self, say: Callable[[str], None], units: int, line, min_s: float, clock=None):
        self.say, self.units, self.line, self.min_s = say, units, line, min_s
        self.clock = clock or (lambda: pace_clock())
        self.starts: list[float] = []

    def tick(self) -> None:
        if len(self.starts) >= 3:
            return
        self.starts.append(self.clock())
        if len(self.starts) == 3:
            unit_s = self.starts[2] - self.starts[1]
            if unit_s * self.units >= self.min_s:
                self.say(self.line(unit_s, unit_s * self.units))

    def wrap(self, f: Callable | None):
        """``f`` (a batch source, or ``stop``), ticking before each call; None stays None's ``lambda: False``."""

        def ticking(*args, **kwargs):
            self.tick()
            return f(*args, **kwargs) if f is not None else False

        return ticking


def first_step_pace(say, cfg, step: int, accum: int, cpu: bool) -> FirstPace:
    """The :class:`FirstPace` of a run's first step: a line when a step takes 10 s or more (e.g. GPT-2
    124M's 524,288-token steps on a laptop), giving a step's time, the run's, and on a CPU the preset
    that trains in minutes."""
    t, T = cfg.train, cfg.model.block_size

    def line(unit_s: float, step_s: float) -> str:
        steps = t.max_steps - step
        hint = (
            "; for a quick run on a CPU: --preset nano (a 10M-parameter model, minutes)"
            if cpu and cfg.preset not in ("nano", "pico")
            else ""
        )
        return (
            f"step {step + 1}: a micro-step of {t.batch_size} x {T} tokens takes {unit_s:.1f} s here, so a step "
            f"({accum} micro-steps) about {format_duration(step_s)} and the run's {steps:,} steps about "
            f"{format_duration(step_s * steps)}{hint}"
        )

    return FirstPace(say, accum, line, min_s=10.0)


def eval_pace(say, cfg, batches: int) -> FirstPace:
    """The :class:`FirstPace` of the step-0 val loss: a line when it takes 30 s or more."""

    def line(unit_s: float, total_s: float) -> str:
        return (
            f"step 0: an evaluation batch takes {unit_s:.1f} s here, so the {batches:,} batches of "
            f"--eval-tokens {cfg.train.eval_tokens:,} about {format_duration(total_s)} (a smaller --eval-tokens "
            "evaluates fewer)"
        )

    return FirstPace(say, batches, line, min_s=30.0)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Code version, library versions and hardware, for every log and benchmark."""
    env = {
        "gptspeed": gptspeed.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device_name(device),
        "device_type": device.type,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["device_count"] = torch.cuda.device_count()
    return env


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h >= 48:
        return f"{h // 24}d{h % 24:02d}h"
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _si(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_record(r: dict[str, Any], show_documents: bool = True) -> str:
    """One console line for a metrics record (see docs/formats.md, "metrics.jsonl"); ``show_documents``
    False leaves out the documents count (a one-document corpus: it says nothing)."""
    parts = [f"step {r['step']:>{len(str(r['max_steps']))}}/{r['max_steps']}"]
    if r.get("train_loss") is not None:
        parts.append(f"loss {r['train_loss']:.4f}")
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}" + _by_source(r, "val_loss", ".4f"))
    if r.get("val_bpb") is not None:
        parts.append(f"bpb {r['val_bpb']:.4f}" + _by_source(r, "val_bpb", ".4f"))
    if r.get("hellaswag_acc_norm") is not None:
        parts.append(f"hellaswag {100 * r['hellaswag_acc_norm']:.2f}%")
    if r.get("lr") is not None:
        parts.append(f"lr {r['lr']:.2e}")
    if r.get("grad_norm") is not None:
        parts.append(f"norm {r['grad_norm']:.2f}")
    if r.get("step_ms") is not None:
        parts.append(f"{r['step_ms']:.1f} ms")
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("mem_peak_bytes") is not None:
        mem = f"mem {r['mem_peak_bytes'] / 2**30:.2f} GiB"
        if r.get("mem_frac") is not None:
            mem += f" ({100 * r['mem_frac']:.0f}%)"
        parts.append(mem)
    parts.append(f"tokens {_si(r['tokens'])}")
    if show_documents and r.get("documents") is not None:
        parts.append(f"docs {r['documents']:,}" + _by_source(r, "documents", ","))
    if r.get("eta_s") is not None:
        eta = f"ETA {format_duration(r['eta_s'])}"
        if r.get("epoch_eta_s") is not None:  # only when the epoch ends before the run does
            eta += f" (epoch ends in {format_duration(r['epoch_eta_s'])})"
        parts.append(eta)
    return " | ".join(parts)


def _by_source(r: dict[str, Any], key: str, spec: str) -> str:
    """`` (A 3.1000, B 3.4500)``: a mixture's ``KEY/NAME`` fields of record ``r``
    (:mod:`gptspeed.data.mixture`), or "" for one folder."""
    each = [f"{k[len(key) + 1 :]} {v:{spec}}" for k, v in r.items() if k.startswith(key + "/") and v is not None]
    return f" ({', '.join(each)})" if each else ""


class Throughput:
    """Step time, tokens/s, MFU and time to go, measured over the steps since the last record.

    Args:
        tokens_per_step: tokens one optimizer step trains on, all ranks together.
        flops_per_token: training FLOPs per token (:meth:`gptspeed.model.GPT.flops_per_token`).
        peak_flops: one device's peak FLOP/s (None: MFU is not reported).
        world_size: processes (devices) sharing the work.
        max_steps: the run's last step (for the ETA).
        clock: seconds, monotonic (``time.perf_counter``; tests pass a fake one).
        tokens_between: ``(first, last) -> tokens`` of steps ``first`` to ``last - 1``, all ranks
            (:func:`gptspeed.schedules.tokens_between` under a batch-size warm-up; default: ``tokens_per_step``
            each), for the ETA.

    Call :meth:`restart` when the clock should (re)start (after start-up, and after each record:
    evaluation is never timed), :meth:`step_done` after each optimizer step (with its tokens where they
    differ from ``tokens_per_step``), and :meth:`measure`
    at a record (after synchronising the device). ``wait_s`` arguments are the loader's running
    total of seconds spent waiting for batches. The first record of a process carries
    ``includes_warmup`` (its interval includes compilation and warm-up).
    """

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        world_size: int,
        max_steps: int,
        clock=time.perf_counter,
        tokens_between: Callable[[int, int], int] | None = None,
    ):
        self.tokens_per_step, self.fpt, self.peak = tokens_per_step, flops_per_token, peak_flops
        self.world_size, self.max_steps, self.clock = world_size, max_steps, clock
        self.tokens_between = tokens_between or (lambda first, last: max(0, last - first) * tokens_per_step)
        self.steps = self.tokens = 0
        self.flops = 0.0
        self.t0 = clock()
        self.wait0 = 0.0
        self.warm = False

    def restart(self, wait_s: float = 0.0) -> None:
        self.t0, self.steps, self.tokens, self.flops, self.wait0 = self.clock(), 0, 0, 0.0, wait_s

    def step_done(self, tokens: int | None = None, flops_per_token: float | None = None) -> None:
        """One optimizer step done: ``tokens`` it trained on (default ``tokens_per_step``) at
        ``flops_per_token`` training FLOPs each (default the constructor's: a step of another sequence
        length, e.g. under ``--seq-len-warmup-steps``, passes its own, whose attention term is smaller)."""
        self.steps += 1
        tokens = self.tokens_per_step if tokens is None else tokens
        self.tokens += tokens
        self.flops += tokens * (self.fpt if flops_per_token is None else flops_per_token)

    def measure(self, step: int, epoch_tokens_left: float | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        """Fields of a metrics record for the interval since :meth:`restart`: ``step_ms`` (mean
        wall ms per optimizer step), ``data_wait_ms`` (mean ms per step the loop waited for its
        batches), ``tokens_per_s`` (whole job) and ``tokens_per_s_per_device``,
        ``mfu`` (the steps' training FLOPs per second over ``peak * world_size``: ``flops_per_token *
        tokens/s`` when every step ran at the constructor's FLOPs per token; each step's own otherwise;
        None without a peak),
        ``eta_s`` (seconds to ``max_steps``: the tokens left at this tokens/s), ``epoch_eta_s`` (seconds
        to the end of the current epoch, given ``epoch_tokens_left``; None when unknown or when the run
        ends first), ``includes_warmup`` (the first interval of a process)."""
        dt = (self.clock() - self.t0) / max(1, self.steps)
        tokens = self.tokens / self.steps if self.steps else self.tokens_per_step  # a step's mean
        tps = tokens / dt if dt > 0 else float("inf")
        fpt = self.flops / self.tokens if self.tokens else self.fpt  # the interval's FLOPs per token
        tokens_left = self.tokens_between(step, self.max_steps)
        epoch_eta = None
        if epoch_tokens_left is not None and epoch_tokens_left < tokens_left:
            epoch_eta = epoch_tokens_left / tps
        fields = dict(
            step_ms=1000 * dt,
            data_wait_ms=1000 * (wait_s - self.wait0) / max(1, self.steps),
            tokens_per_s=tps,
            tokens_per_s_per_device=tps / self.world_size,
            mfu=fpt * tps / (self.peak * self.world_size) if self.peak else None,
            eta_s=tokens_left / tps,
            epoch_eta_s=epoch_eta,
            includes_warmup=not self.warm,
        )
        self.warm = True
        return fields


METRICS_MAX_BYTES = 1 << 30  # a metrics.jsonl larger than 1 GiB (2.5 million records) is not one


class RunLog:
    """Appends records to ``RUN_DIR/metrics.jsonl``, prints them as console lines and hands them
    to the experiment ``trackers`` (:mod:`gptspeed.trackers`: TensorBoard, W&B).

    ``trackers``: objects with ``log(record)`` and ``close()`` (:func:`gptspeed.trackers.open_trackers`).
    ``truncate_after(step)`` drops records past ``step`` (used on resume, so a run resumed from a
    checkpoint does not keep records of steps that are about to be redone). A tracker whose
    ``log`` raises is dropped with one line on stderr and training goes on: losing a tracker never
    stops a run. :meth:`close` closes the trackers (again callable).
    """

    def __init__(self, path: Path, echo: bool = True, show_documents: bool = True, trackers=()):
        self.path = Path(path)
        self.echo, self.show_documents = echo, show_documents
        self.trackers = list(trackers)

    def truncate_after(self, step: int) -> int:
        """Keep the records up to ``step`` (on resume: the steps about to be redone go; ``-1``: a
        new run starts the log afresh) and return how many lines were dropped that were not
        records.

        A record is a line holding a JSON object whose ``step`` is an integer: all :meth:`write`
        ever appends. Any other line -- a write cut short by a crash, a non-JSON line, a JSON list,
        ``{"step": "ten"}`` -- is dropped rather than kept: it belongs to no step, so it can be
        neither kept nor cut by step, and every reader of the log (``gptspeed plot``, the
        trackers, a user's script) can then take each line as a record. A line says how many
        were dropped. metrics.jsonl is the run folder's own file (a run folder holds only files
        gptspeed wrote), so nothing of the user's is lost. Never raises for a line's content; a
        metrics.jsonl that is not a regular UTF-8 file (a folder, a FIFO, binary junk) is a
        one-line GptspeedError (:func:`gptspeed.fileio.read_user_text`), and so is a failure to
        rewrite it."""
        from gptspeed.errors import GptspeedError
        from gptspeed.fileio import read_user_text

        if not os.path.lexists(self.path):
            return 0
        text = read_user_text(self.path, "metrics log", max_bytes=METRICS_MAX_BYTES)
        kept, junk, first_junk = [], 0, None
        for number, line in enumerate(text.split("\n"), 1):  # JSON lines end at "\n" only (not at U+2028)
            r = _record(line)
            if r is None:
                if line.strip():
                    junk += 1
                    first_junk = first_junk or number
                continue
            if r["step"] <= step:
                kept.append(line)
        new = "".join(k + "\n" for k in kept)
        if new != text:
            try:
                write_text_atomic(self.path, new)
            except OSError as e:
                raise GptspeedError(
                    f"cannot rewrite the metrics log {self.path}: {e.strerror or e}; it is as it "
                    "was and the newest checkpoint is intact: free some space (or fix the "
                    "folder's permissions) and run again"
                ) from None
        if junk and self.echo:
            print(
                f"{self.path}: dropped {junk} line(s) that were not metrics records (the first was line {first_junk})",
                flush=True,
            )
        return junk

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line of strict JSON (non-finite floats as ``null``), print it
        and hand it to the trackers. A failed
        append (a full disk, a removed folder, any OSError) is cut back to the last whole line
        where possible and raised as a one-line GptspeedError naming the file: the checkpoints
        are written apart from the log, so the newest one is intact and ``--resume`` goes on
        from it (:meth:`truncate_after` tidies the log then)."""
        from gptspeed.errors import GptspeedError

        line = (json.dumps(_strict_json(record), allow_nan=False) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o666)
            try:
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    done = 0
                    while done < len(line):
                        done += os.write(fd, line[done:])
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)  # no half-written record left behind
                    raise
            finally:
                os.close(fd)
        except OSError as e:
            full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
            raise GptspeedError(
                f"cannot append to the metrics log {self.path} at step {record.get('step')}: "
                f"{e.strerror or e}; the newest checkpoint is intact: "
                f"{'free some space' if full else 'make the file writable'}, then continue with "
                "--resume"
            ) from None
        if self.echo:
            print(format_record(record, self.show_documents), flush=True)
        for tracker in list(self.trackers):
            try:
                tracker.log(record)
            except Exception as e:  # noqa: BLE001 -- a tracker's failure must not stop training
                self.trackers.remove(tracker)
                _tracker_lost(tracker, f"stopped at step {record.get('step')} (training goes on)", e)

    def close(self) -> None:
        """Close every tracker (flush TensorBoard's events, finish the W&B run); errors are
        reported in one line each, never raised."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                _tracker_lost(tracker, "failed to close", e)


def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (a NaN loss of a skipped step) as None: metrics.jsonl
    is strict JSON (``null``), never ``NaN`` / ``Infinity``, which JSON readers other than
    Python's refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _record(line: str) -> dict[str, Any] | None:
    """The metrics record on ``line`` (a JSON object with an integer ``step``), or None for anything
    else: not JSON, nested too deep, not an object, or a ``step`` that is not an integer."""
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(r, dict) or isinstance(r.get("step"), bool) or not isinstance(r.get("step"), int):
        return None
    return r


def _tracker_lost(tracker, what: str, e: BaseException) -> None:
    """One line on stderr for a tracker that failed (``what``: where); never raises."""
    from gptspeed.trackers import one_line

    print(
        f"gptspeed: --log-to {getattr(tracker, 'name', type(tracker).__name__)} {what}: {one_line(e)}; "
        "metrics.jsonl has every record",
        file=sys.stderr,
        flush=True,
    )
