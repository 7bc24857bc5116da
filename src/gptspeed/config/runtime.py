"""The ``runtime`` group of settings: :class:`RuntimeConfig`, where and how the computation runs."""

from __future__ import annotations

from dataclasses import dataclass

from gptspeed.config.declare import (
    CHECKPOINTING,
    COMPILE_MODES,
    COMPILE_TUNINGS,
    DEVICES,
    DTYPES,
    MAX_DIST_TIMEOUT_S,
    MAX_SEED,
    MAX_THREADS,
    SDPA_BACKENDS,
    Where,
    _f,
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
