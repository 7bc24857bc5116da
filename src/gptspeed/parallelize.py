"""How a model is wrapped for training, from outside (torchtitan style): FP8 conversion, activation
checkpointing, DDP or FSDP2, then ``torch.compile`` -- with its kernel cache, its CUDA-graph rules --
and :func:`unwrap`, the one place that knows how to get the plain module back."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptspeed.config import CHECKPOINTING, COMPILE_MODES
from gptspeed.errors import GptspeedError
from gptspeed.runtime import Runtime, apply_matmul_precision


def compile_cache_dir() -> Path:
    """Where compiled kernels persist across runs: ``$GPTSPEED_CACHE/inductor`` (default
    ``~/.cache/gptspeed/inductor``), unless ``TORCHINDUCTOR_CACHE_DIR`` is set (then that)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    root = os.environ.get("GPTSPEED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gptspeed")
    return Path(root) / "inductor"


def use_compile_cache() -> Path:
    """Point TorchInductor's caches at :func:`compile_cache_dir` (``TORCHINDUCTOR_CACHE_DIR``, read
    when inductor first compiles) and make sure its FX-graph cache is on, so a second run of the
    same model and settings loads the compiled graphs instead of compiling them again. Its
    default, ``/tmp/torchinductor_$USER``, does not survive a reboot or a /tmp cleaner. Returns
    the folder. Source: PyTorch's "Compile Time Caching in torch.compile" tutorial
    (https://pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html).

    A folder that cannot be made or written (``$GPTSPEED_CACHE`` a file, under ``/proc``, read-only)
    is not fatal: the run compiles into a temporary folder instead (removed at exit, so the next run
    compiles again), with a one-line note on rank 0; GptspeedError only when no temporary folder
    can be made either."""
    path = compile_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".gptspeed-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        try:
            fallback = Path(tempfile.mkdtemp(prefix="gptspeed-inductor-"))
        except OSError as e2:
            raise GptspeedError(
                f"torch.compile needs a folder for its kernels: the compile cache {path} cannot be "
                f"made ({e.strerror or e}), nor a temporary folder ({e2.strerror or e2}): set "
                "$GPTSPEED_CACHE to a writable folder, or run with --no-compile"
            ) from None
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: the compile cache {path} cannot be made ({e.strerror or e}): compiling into {fallback}, "
                "which is not kept for the next run; set $GPTSPEED_CACHE to a writable folder",
                flush=True,
            )
        path = fallback
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return path


def unwrap(module: torch.nn.Module, *, keep_ddp: bool = False) -> torch.nn.Module:
    """The module under ``torch.compile`` and DDP wrappers (FSDP2 shards in place: itself); with
    ``keep_ddp``, under ``torch.compile`` only (the DDP wrapper, whose ``no_sync`` is needed). The one
    place that knows how a compiled model hides its module (``OptimizedModule._orig_mod``)."""
    module = getattr(module, "_orig_mod", module)
    if keep_ddp:
        return module
    return getattr(module, "module", module) if is_ddp(module) else module


def eager():
    """Context manager: every ``torch.compile``-d function and module runs eagerly inside it
    (``torch.compiler.set_stance("force_eager")``), so shapes seen only here (a partial last eval
    batch, HellaSwag rows) never trigger a recompile."""
    return torch.compiler.set_stance("force_eager")


def allow_static_graphs(graphs: int) -> None:
    """Raise dynamo's per-function cache (``torch._dynamo.config.recompile_limit``, 8 by default) to at
    least ``graphs`` compiled graphs, so the static graphs a run needs (one per
    ``--seq-len-warmup-steps`` length, one for evaluation) are all compiled: past the limit dynamo
    would run the function eagerly for every later shape -- the full length, that is, the rest of the
    run. Never lowers it."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)


def is_ddp(module) -> bool:
    """Whether ``module`` is a ``DistributedDataParallel`` wrapper (used by :mod:`gptspeed.distributed` too)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


CUDA_GRAPH_TUNINGS = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


def uses_cuda_graphs(rt: Runtime, compile_tuning: str) -> bool:
    """Whether the compiled model replays CUDA graphs (``reduce-overhead`` / ``max-autotune`` on CUDA)."""
    return rt.compile and rt.device_type == "cuda" and compile_tuning in CUDA_GRAPH_TUNINGS


def cuda_graphs_refusal(
    compile_tuning: str, grad_accum_steps: int, tokens_per_micro_step: int | None = None
) -> str | None:
    """Why ``compile_tuning`` cannot run with ``grad_accum_steps`` micro-steps (one line), or None:
    every replay of a CUDA-graph backward writes its gradients into the same static buffers, so the
    second micro-step overwrites the gradients of the first that ``.grad`` still points to (PyTorch
    raises "accessing tensor output of CUDAGraphs that has been overwritten"; older versions
    silently kept the last micro-batch only). Names the alternatives that work: the same tuning
    without CUDA graphs, or a global batch of one micro-step per process -- lowering
    ``--total-batch-tokens`` to ``tokens_per_micro_step`` (B x T x processes), since raising the
    micro-batch until it covers GPT-2's 0.5M-token batch cannot fit in memory."""
    if compile_tuning in CUDA_GRAPH_TUNINGS and grad_accum_steps > 1:
        batch = f" {tokens_per_micro_step:,} (B x T x processes)" if tokens_per_micro_step else " B x T x processes"
        return (
            f"--compile-tuning {compile_tuning} uses CUDA graphs, which cannot accumulate gradients over "
            f"{grad_accum_steps} micro-steps: use --compile-tuning max-autotune-no-cudagraphs, or lower "
            f"--total-batch-tokens to{batch} so that one micro-step makes a step (a smaller global batch "
            "changes the run)"
        )
    return None


def check_cuda_graphs(
    rt: Runtime, compile_tuning: str, grad_accum_steps: int, tokens_per_micro_step: int | None = None
) -> None:
    """GptspeedError (:func:`cuda_graphs_refusal`'s line) for a run that would replay CUDA graphs
    (:func:`uses_cuda_graphs`) with gradient accumulation."""
    reason = cuda_graphs_refusal(compile_tuning, grad_accum_steps, tokens_per_micro_step)
    if reason and uses_cuda_graphs(rt, compile_tuning):
        raise GptspeedError(reason)


def parallelize(
    model: torch.nn.Module,
    rt: Runtime,
    *,
    compile_mode: str = "model",
    compile_tuning: str = "default",
    coordinate_descent_tuning: bool = False,
    activation_checkpointing: str = "none",
    fp8: bool = False,
    fp8_lm_head: bool = False,
    cast_weights_once: bool = False,
    backend: str = "inductor",
) -> torch.nn.Module:
    """Move ``model`` to the device and apply, from outside, in this order: FP8 Linear layers
    (``fp8``: the blocks'; ``fp8_lm_head``: the LM head; :func:`gptspeed.fp8.convert_to_float8`),
    activation checkpointing per block
    (:func:`apply_activation_checkpointing`), data parallelism (``rt.parallel``), and compilation
    if ``rt.compile``.

    ``cast_weights_once`` (FSDP2 only): the blocks and the root keep their unsharded (bf16) weights from
    forward to backward (``reshard_after_forward=False``); with :func:`gptspeed.distributed.grad_sync_control`
    keeping them between micro-steps too, they are cast once per optimizer step.

    ``rt.parallel``: ``ddp`` wraps the model in ``DistributedDataParallel`` (gradients
    all-reduced in buckets during backward; ``device_ids`` on CUDA); ``fsdp`` applies FSDP2
    ``fully_shard`` to every transformer block and then the root, in place, so ``model``'s
    parameters become DTensors sharded on dim 0 across ranks (save them with
    :mod:`torch.distributed.checkpoint`), with ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` under ``dtype bfloat16``, else fp32 throughout. ``init_distributed``
    must have run. Sources: PyTorch DDP notes (https://pytorch.org/docs/stable/notes/ddp.html) and
    the FSDP2 docs (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).

    Before compiling, :func:`use_compile_cache` points TorchInductor's caches at
    ``$GPTSPEED_CACHE/inductor``, so a later run of the same model starts warm.

    ``compile_mode``: ``model`` compiles the whole (wrapped) model into one graph; ``blocks``
    compiles each transformer block in place (``nn.Module.compile``): the blocks are identical, so
    dynamo traces one and reuses the code for the rest, cutting compile time roughly by the number
    of layers; the embeddings and the loss then run eagerly. ``compile_tuning`` is torch.compile's
    ``mode`` (None for "default"); ``coordinate_descent_tuning`` adds inductor's option of that name to
    the mode's own (``torch._inductor.list_mode_options``: torch.compile takes a mode or options, not both).
    ``backend``: torch.compile's backend (tests use "eager"; the option is inductor's, passed to it alone). Shapes are
    static (``dynamic=False``): a new input shape -- each length of ``--seq-len-warmup-steps`` -- compiles
    a graph of its own, specialised to it, instead of dynamo's automatic dynamic shapes turning the
    second shape seen into one dynamic-shape graph for the rest of the run (torch.compile docs,
    "dynamic"); :func:`allow_static_graphs` makes room for them.

    Returns the module to call for training and evaluation; the original ``model`` (same
    parameters, same state-dict keys) stays the one to save and load. GptspeedError (one line)
    for ``fp8`` or ``fp8_lm_head`` on a device without FP8 tensor cores or an unknown option.
    """
    if compile_mode not in COMPILE_MODES:  # a library caller's typo; a RunConfig was validated where built
        raise GptspeedError(f"--compile-mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    if fp8 or fp8_lm_head:
        from gptspeed.fp8 import check_fp8_device, convert_to_float8

        check_fp8_device(rt.device) if fp8 else check_fp8_device(rt.device, "--fp8-lm-head")
        convert_to_float8(model, blocks=fp8, lm_head=fp8_lm_head)
    if any(p.device != rt.device for p in model.parameters()):
        model.to(rt.device)
    apply_matmul_precision(rt)
    apply_activation_checkpointing(model, activation_checkpointing)
    train_model = wrap_data_parallel(model, rt, cast_weights_once)
    if not rt.compile:
        return train_model
    use_compile_cache()
    how = compile_options(compile_tuning, coordinate_descent_tuning and backend == "inductor")
    if compile_mode == "blocks":  # dynamic=False: one static graph per shape (see the docstring)
        for block in model.transformer.h:
            block.compile(backend=backend, dynamic=False, **how)
        return train_model
    return torch.compile(train_model, backend=backend, dynamic=False, **how)


def wrap_data_parallel(model: torch.nn.Module, rt: Runtime, cast_weights_once: bool = False) -> torch.nn.Module:
    """``model`` under ``rt.parallel``'s data parallelism (see :func:`parallelize`): the
    ``DistributedDataParallel`` wrapper (``ddp``), ``model`` itself sharded in place (``fsdp``: every
    block, then the root), or ``model`` as it is."""
    train_model = model
    if rt.parallel == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        ids = [rt.device.index] if rt.device_type == "cuda" else None
        # no buffers change in training (the causal mask is constant): nothing to broadcast per forward
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_sync_buffers = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
        train_model = DistributedDataParallel(model, device_ids=ids, **no_sync_buffers)
    elif rt.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if rt.dtype == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        keep = {"reshard_after_forward": False} if cast_weights_once else {}  # backward reuses the forward's copy
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, **keep)
        fully_shard(model, mp_policy=mp, **keep)  # embeddings (tied with the LM head), final norm
    return train_model


def compile_options(compile_tuning: str, coordinate_descent_tuning: bool) -> dict[str, Any]:
    """torch.compile's ``mode`` or ``options`` keyword for ``--compile-tuning`` and
    ``--coordinate-descent-tuning``: ``{"mode": None}`` for the default, ``{"mode": m}`` for another mode,
    and with coordinate-descent tuning ``{"options": {**the mode's options, "coordinate_descent_tuning":
    True}}`` (``torch._inductor.list_mode_options``; torch.compile refuses a mode and options together)."""
    mode = None if compile_tuning == "default" else compile_tuning
    if not coordinate_descent_tuning:
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode or "default"), "coordinate_descent_tuning": True}}


def _selective_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing policy: keep the outputs of matmuls and attention
    (expensive to recompute: O(T C^2) and O(T^2 C)), recompute everything else (LayerNorm, GELU,
    bias adds, views: cheap, memory-bound). Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models") keep the matmuls and recompute attention's softmax
    core; with flash attention that core already stores no T x T matrix, so its output is kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_mm.default,
    }
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            save.add(packet.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint every transformer block's activations, in place: each block of
    ``model.transformer.h`` is replaced by PyTorch's ``checkpoint_wrapper`` around it
    (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, non-reentrant
    ``torch.utils.checkpoint``; as torchtitan applies it). The wrapper passes every argument of the
    block's ``forward`` through (``block(x, kv)``); its state-dict hooks keep the keys unchanged,
    so checkpoints load either way, and attribute access reaches the block (``h[0].mlp``).

    ``none``: nothing. ``full``: each block keeps only its input and recomputes its whole forward
    during backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): about one
    extra forward (~33% more FLOPs) for activation memory O(L * B*T*C) instead of ~O(L * 34 B*T*C).
    ``selective``: torch's selective activation checkpointing
    (``create_selective_checkpoint_contexts``) with :func:`_selective_policy`: matmul and attention
    outputs are kept, the pointwise ops recomputed (Korthikanti et al. 2022): most of the memory of
    the pointwise intermediates saved for a few % more time. Works eagerly and under
    torch.compile; without gradients (eval) nothing is saved, so nothing is recomputed.
    GptspeedError for an unknown mode.
    """
    if mode == "none":
        return
    if mode not in CHECKPOINTING:
        raise GptspeedError(f"--activation-checkpointing must be one of {', '.join(CHECKPOINTING)}, got {mode!r}")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    extra = (
        {}
        if mode == "full"
        else {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}
    )
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, **extra)
