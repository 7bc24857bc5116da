"""Measurement: device peaks and MFU, memory, environment, and the run log (console + JSONL)."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import gptspeed
from gptspeed.fileio import write_text_atomic

# Dense (no sparsity) peak TFLOPS from the vendors' datasheets, by dtype family.
# "bf16" covers bf16 and fp16 tensor-core matmuls; "tf32" the TF32 tensor cores; "fp32" plain FP32.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "A10G": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"bf16": 125.0, "tf32": 15.7, "fp32": 15.7},  # fp16 tensor cores; no bf16 or tf32
    "T4": {"bf16": 65.0, "tf32": 8.1, "fp32": 8.1},
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
    name = device_name(device)
    family = DTYPE_FAMILY.get(dtype, "fp32")
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_TFLOPS[key][family] * 1e12, f"{key} {family} datasheet"
    return None, f"{name} not in the peak table; pass --peak-tflops to report MFU"


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


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
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
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _si(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_record(r: dict[str, Any]) -> str:
    """One console line for a metrics record (see README, "metrics.jsonl")."""
    parts = [f"step {r['step']:>{len(str(r['max_steps']))}}/{r['max_steps']}"]
    if r.get("train_loss") is not None:
        parts.append(f"loss {r['train_loss']:.4f}")
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
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
    parts.append(f"docs {r['documents']:,}")
    if r.get("eta_s") is not None:
        parts.append(f"ETA {format_duration(r['eta_s'])} (epoch {format_duration(r.get('epoch_eta_s'))})")
    return " | ".join(parts)


class RunLog:
    """Appends records to ``RUN_DIR/metrics.jsonl`` and prints them as console lines.

    ``truncate_after(step)`` drops records past ``step`` (used on resume, so a run resumed from a
    checkpoint does not keep records of steps that are about to be redone).
    """

    def __init__(self, path: Path, echo: bool = True):
        self.path = Path(path)
        self.echo = echo

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        write_text_atomic(self.path, "".join(k + "\n" for k in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.echo:
            print(format_record(record), flush=True)
