"""Device, precision and compilation, applied to a model from outside.

The model (:mod:`gptspeed.model`) knows nothing of these; :func:`resolve_runtime` turns the
user's ``--device/--dtype/--compile`` into a :class:`Runtime`, and :func:`parallelize` applies it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from gptspeed.errors import GptspeedError


@dataclass
class Runtime:
    """Resolved execution settings.

    ``dtype`` is the user-facing name (float32, tf32, bfloat16, float16); ``autocast_dtype`` the
    dtype matmuls run in under ``torch.autocast`` (None: no autocast, parameters and activations
    fp32). Parameters always stay fp32 (mixed precision keeps fp32 master weights).
    """

    device: torch.device
    dtype: str
    autocast_dtype: torch.dtype | None
    compile: bool

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def use_grad_scaler(self) -> bool:
        """float16 needs loss scaling (Micikevicius et al. 2018, torch.amp.GradScaler)."""
        return self.autocast_dtype is torch.float16

    def autocast(self):
        """Context manager running the forward pass in the chosen precision."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def synchronize(self) -> None:
        """Wait for queued device work (before reading a wall-clock timer)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device_type == "mps":
            torch.mps.synchronize()


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda (this process's LOCAL_RANK) > mps > cpu; GptspeedError if unavailable."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise GptspeedError("--device cuda: no CUDA GPU is visible to PyTorch (try --device cpu)")
        return torch.device("cuda", _local_rank())
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise GptspeedError("--device mps: Apple MPS is not available here (try --device cpu)")
        return torch.device("mps")
    if name == "cpu":
        return torch.device("cpu")
    raise GptspeedError(f"unknown device {name!r}: use auto, cuda, mps or cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type in ("cpu", "mps")


def resolve_runtime(device: str = "auto", dtype: str = "auto", compile: bool | None = None) -> Runtime:
    """Validate and resolve the execution settings; raises GptspeedError (one line) on a bad mix.

    ``dtype=auto``: bfloat16 autocast on CUDA GPUs that support it (Ampere and newer), float16
    with a GradScaler on older CUDA GPUs, float32 on CPU and MPS. ``compile=None``: on for CUDA
    (kernel fusion pays there), off elsewhere (compiling takes longer than a short CPU run saves).
    """
    dev = resolve_device(device)
    if dtype == "auto":
        if dev.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float32"
    if dtype == "tf32" and dev.type != "cuda":
        raise GptspeedError(f"--dtype tf32 needs an NVIDIA GPU (Ampere or newer); on {dev.type} use float32 or bfloat16")
    if dtype == "float16" and dev.type == "cpu":
        raise GptspeedError("--dtype float16 is not supported on a CPU: use bfloat16 or float32")
    if dtype == "bfloat16" and not bf16_supported(dev):
        raise GptspeedError(f"--dtype bfloat16 is not supported on this {dev.type} device: use float16 or float32")
    autocast_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if compile is None:
        compile = dev.type == "cuda"
    return Runtime(device=dev, dtype=dtype, autocast_dtype=autocast_dtype, compile=compile)


def apply_matmul_precision(rt: Runtime) -> None:
    """TF32 for fp32 matmuls when asked for (``tf32``) or when autocasting (then the remaining
    fp32 matmuls may use it too, as nanoGPT does); exact fp32 otherwise.
    See ``torch.set_float32_matmul_precision``."""
    allow = rt.dtype in ("tf32", "bfloat16", "float16") and rt.device_type == "cuda"
    torch.set_float32_matmul_precision("high" if allow else "highest")
    if rt.device_type == "cuda":
        torch.backends.cudnn.allow_tf32 = allow


def parallelize(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """Move ``model`` to the device and compile it if asked. Returns the module to call for
    training; the original ``model`` (same parameters) stays the one to save and load."""
    model.to(rt.device)
    apply_matmul_precision(rt)
    if rt.compile:
        return torch.compile(model)
    return model
