"""Where and in what precision a run computes: :func:`resolve_runtime` turns the user's
``--device/--dtype/--compile/--parallel`` into a :class:`Runtime` (the device, the autocast dtype,
rank and world size from torchrun's environment, and why each default was chosen).

The rest of running a model lives beside it, one concern each: :mod:`gptspeed.cpu` (the host CPU's
defaults and allocator), :mod:`gptspeed.parallelize` (FP8, activation checkpointing, DDP/FSDP2 and
``torch.compile`` applied to the plain model from outside, torchtitan style; ``unwrap``) and
:mod:`gptspeed.distributed` (the process group).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from gptspeed.config import world_from_env
from gptspeed.cpu import default_cpu_compile, default_cpu_dtype
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
    parallel: str = "none"  # none | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    dtype_reason: str = ""  # why ``dtype`` (auto) / ``compile`` (None) resolved as they did, for the start line
    compile_reason: str = ""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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


def resolve_parallel(parallel: str, world_size: int) -> str:
    """``auto`` -> ``ddp`` when ``world_size > 1``, else ``none``; ``ddp`` with one process ->
    ``none``. GptspeedError for ``none`` with
    several processes (each would train its own model) or an unknown name."""
    if parallel not in ("auto", "none", "ddp", "fsdp"):
        raise GptspeedError(f"unknown --parallel {parallel!r}: use auto, none, ddp or fsdp")
    if parallel == "auto":
        return "ddp" if world_size > 1 else "none"
    if parallel == "ddp" and world_size == 1:  # e.g. a DDP run resumed in one process: nothing to replicate
        return "none"
    if parallel == "none" and world_size > 1:
        raise GptspeedError(f"--parallel none with WORLD_SIZE {world_size}: use ddp or fsdp, or launch one process")
    return parallel


def resolve_runtime(
    device: str = "auto",
    dtype: str = "auto",
    compile: bool | None = None,
    parallel: str = "auto",
    planned_steps: int | None = None,
) -> Runtime:
    """Validate and resolve the execution settings; raises GptspeedError (one line) on a bad mix.

    Rank and world size come from torchrun's environment (:func:`world_from_env`); ``parallel``
    is resolved by :func:`resolve_parallel` (``fsdp`` is allowed with one process: it then only
    exercises the FSDP2 code path). Nothing here talks to other processes.

    ``dtype=auto``: bfloat16 autocast on CUDA GPUs that support it (Ampere and newer), float16
    with a GradScaler on older CUDA GPUs; on a CPU :func:`default_cpu_dtype` (bfloat16 where the
    CPU has native bf16 matmuls, else float32); float32 on MPS. ``compile=None``: on for CUDA
    (kernel fusion pays there); on a CPU :func:`default_cpu_compile` (only bf16 with native bf16
    matmuls, for runs of more than ~100 ``planned_steps``: the optimizer steps the run will take,
    None if unknown); off on MPS. ``dtype_reason`` / ``compile_reason`` say why, for the
    trainer's start line.
    """
    dev = resolve_device(device)
    dtype_reason = f"{dtype}: as asked"
    if dtype == "auto":
        if dev.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            dtype_reason = f"{dtype}: this GPU's fastest supported half precision"
        elif dev.type == "cpu":
            dtype, dtype_reason = default_cpu_dtype()
        else:
            dtype, dtype_reason = "float32", "float32: the default on MPS"
    if dtype == "tf32" and dev.type != "cuda":
        raise GptspeedError(
            f"--dtype tf32 needs an NVIDIA GPU (Ampere or newer); on {dev.type} use float32 or bfloat16"
        )
    if dtype == "float16" and dev.type == "cpu":
        raise GptspeedError("--dtype float16 is not supported on a CPU: use bfloat16 or float32")
    if dtype == "bfloat16" and not bf16_supported(dev):
        raise GptspeedError(f"--dtype bfloat16 is not supported on this {dev.type} device: use float16 or float32")
    autocast_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    compile_reason = "on: as asked" if compile else "off: as asked"
    if compile is None:
        if dev.type == "cpu":
            compile, compile_reason = default_cpu_compile(dtype, planned_steps)
        else:
            compile = dev.type == "cuda"
            compile_reason = "on: kernel fusion pays on CUDA" if compile else f"off: the default on {dev.type}"
    rank, world = world_from_env()
    return Runtime(
        device=dev,
        dtype=dtype,
        autocast_dtype=autocast_dtype,
        compile=compile,
        parallel=resolve_parallel(parallel, world),
        rank=rank,
        world_size=world,
        dtype_reason=dtype_reason,
        compile_reason=compile_reason,
    )


def apply_matmul_precision(rt: Runtime) -> None:
    """TF32 for fp32 matmuls when asked for (``tf32``) or when autocasting (then the remaining
    fp32 matmuls may use it too, as nanoGPT does); exact fp32 otherwise.
    See ``torch.set_float32_matmul_precision``."""
    allow = rt.dtype in ("tf32", "bfloat16", "float16") and rt.device_type == "cuda"
    torch.set_float32_matmul_precision("high" if allow else "highest")
    if rt.device_type == "cuda":
        torch.backends.cudnn.allow_tf32 = allow


# --sdpa-backend name -> the switch of torch.backends.cuda that enables it. These switches are
# process-wide and, despite their module's name, also decide the CPU's choice (flash or math).
def sdpa_backend_problem(
    name: str, device: torch.device, dtype: torch.dtype, n_head: int, head_dim: int, seq_len: int
) -> str | None:
    """Why ``--sdpa-backend name`` cannot serve this run's attention, or None.

    Runs one causal ``F.scaled_dot_product_attention`` forward and backward of the run's shape
    (batch 1, ``n_head`` heads of ``head_dim`` channels, ``seq_len`` positions, ``dtype``: the
    autocast dtype or float32) on ``device`` with only that kernel allowed
    (``torch.nn.attention.sdpa_kernel``); PyTorch's refusal (e.g. no cuDNN attention on a CPU,
    flash attention in float32 on a GPU) becomes the one-line reason. ``auto`` is never refused."""
    if name == "auto":
        return None
    import torch.nn.functional as F

    q = torch.randn(1, n_head, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with sdpa_backend_scope(name):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"--sdpa-backend {name} cannot run this attention ({n_head} heads x {head_dim} channels, T={seq_len}, "
            f"{str(dtype).removeprefix('torch.')}, {device.type}): {first[:160]}; use --sdpa-backend auto"
        )
    return None


def sdpa_backend_scope(name: str):
    """A context manager in which ``F.scaled_dot_product_attention`` may use only the named kernel
    (``torch.nn.attention.sdpa_kernel``, PyTorch's documented scoped switch); ``auto`` changes
    nothing, so PyTorch picks by its priority order. The previous choice is restored on exit, so
    a run's ``--sdpa-backend`` never outlives the run (in a test, a notebook or a library caller).
    Enter it around the forward: torch.compile fixes the kernel when it traces, and the backward
    runs the kernel the forward chose. Check the choice first with :func:`sdpa_backend_problem`:
    with one kernel allowed, an attention it cannot run raises."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([_sdpa_kernel(name)])


def _sdpa_kernel(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
