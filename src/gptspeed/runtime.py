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


def parallelize(model: torch.nn.Module, rt: Runtime, *, compile_mode: str = "model", compile_tuning: str = "default",
                activation_checkpointing: str = "none", fp8: bool = False,
                backend: str = "inductor") -> torch.nn.Module:
    """Move ``model`` to the device and apply, from outside, in this order: FP8 Linear layers
    (``fp8``, :func:`gptspeed.fp8.convert_to_float8`), activation checkpointing per block
    (:func:`apply_activation_checkpointing`) and compilation if ``rt.compile``.

    ``compile_mode``: ``model`` compiles the whole model into one graph; ``blocks`` compiles each
    transformer block in place (``nn.Module.compile``): the blocks are identical, so dynamo
    traces one and reuses the code for the rest (cache hits on the same code object and guards),
    cutting compile time roughly by the number of layers; the embeddings and the loss then run
    eagerly. ``compile_tuning`` is torch.compile's ``mode`` (None for "default"). ``backend``:
    torch.compile's backend (tests use "eager" / "aot_eager").

    Returns the module to call for training and evaluation; the original ``model`` (same
    parameters, same state-dict keys) stays the one to save and load. GptspeedError (one line)
    for ``fp8`` on a device without FP8 tensor cores or an unknown option.
    """
    if compile_mode not in ("model", "blocks"):
        raise GptspeedError(f"--compile-mode must be model or blocks, got {compile_mode!r}")
    if fp8:
        from gptspeed.fp8 import check_fp8_device, convert_to_float8

        check_fp8_device(rt.device)
        convert_to_float8(model)
    model.to(rt.device)
    apply_matmul_precision(rt)
    apply_activation_checkpointing(model, activation_checkpointing)
    if not rt.compile:
        return model
    mode = None if compile_tuning == "default" else compile_tuning
    if compile_mode == "blocks":
        for block in model.transformer.h:
            block.compile(backend=backend, mode=mode)
        return model
    return torch.compile(model, backend=backend, mode=mode)


def _selective_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing policy: keep the outputs of matmuls and attention
    (expensive to recompute: O(T C^2) and O(T^2 C)), recompute everything else (LayerNorm, GELU,
    bias adds, views: cheap, memory-bound). Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models") keep the matmuls and recompute attention's softmax
    core; with flash attention that core already stores no T x T matrix, so its output is kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_mm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            save.add(packet.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint every transformer block's activations (``torch.utils.checkpoint``, non-reentrant),
    in place, by wrapping each block's ``forward``; parameters and state-dict keys are unchanged.

    ``none``: nothing. ``full``: each block keeps only its input and recomputes its whole forward
    during backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): about one
    extra forward (~33% more FLOPs) for activation memory O(L * B*T*C) instead of ~O(L * 34 B*T*C).
    ``selective``: torch's selective activation checkpointing
    (``create_selective_checkpoint_contexts``) with :func:`_selective_policy`: matmul and attention
    outputs are kept, the pointwise ops recomputed (Korthikanti et al. 2022): most of the memory of
    the pointwise intermediates saved for a few % more time. Works eagerly and under
    torch.compile. Only while training (``torch.is_grad_enabled()``); eval runs the plain forward.
    GptspeedError for an unknown mode.
    """
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise GptspeedError(f"--activation-checkpointing must be none, selective or full, got {mode!r}")
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)

    for block in model.transformer.h:
        inner = type(block).forward.__get__(block)

        def forward(x, _inner=inner):
            if not torch.is_grad_enabled():
                return _inner(x)
            if context_fn is None:
                return checkpoint(_inner, x, use_reentrant=False)
            return checkpoint(_inner, x, use_reentrant=False, context_fn=context_fn)

        block.forward = forward
