"""The training step: one object that ``gptspeed train``, the bench's ladder rows, its verify rungs,
the ``--batch-size auto`` probe and the tests all build the same way, from a :class:`RunConfig` and
a resolved :class:`~gptspeed.runtime.Runtime`.

:class:`TrainStep` checks every rule of the step where it is built -- before anything touches the
device -- then builds the model's parallel / compiled wrapper (:func:`gptspeed.parallelize.parallelize`),
the optimizer and the GradScaler. Calling it runs one optimizer step over its micro-batches:
``forward_backward`` per micro-batch, then ``optimizer_step``. Compare torchtitan's
``Trainer.train_step`` / ``forward_backward_step``. The trainer (:mod:`gptspeed.trainer`) adds data,
the run folder, checkpoints and logging around it; the bench (:mod:`gptspeed.bench.worker`) adds
its timers. Neither reaches inside.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch

from gptspeed.config import RunConfig
from gptspeed.distributed import grad_sync_control
from gptspeed.errors import GptspeedError
from gptspeed.loss import liger_problem, resolve_loss
from gptspeed.metrics import reset_peak_memory
from gptspeed.model import GPT
from gptspeed.optim import build_optimizer, optimizer_spec
from gptspeed.parallelize import allow_static_graphs, check_cuda_graphs, parallelize, uses_cuda_graphs
from gptspeed.runtime import Runtime, sdpa_backend_problem, sdpa_backend_scope
from gptspeed.schedules import seq_lens

Batch = tuple[torch.Tensor, torch.Tensor]


# Bytes a trained parameter holds on its device: fp32 weight (4) + fp32 gradient (4) + AdamW's two fp32
# moments (8). Muon keeps one moment for the blocks' matrices: 16 is the most either needs.
TRAINING_BYTES_PER_PARAM = 16


def build_model(cfg: RunConfig, rt: Runtime | None = None) -> GPT:
    """A fresh GPT of ``cfg.model``, its weights drawn after ``torch.manual_seed(cfg.runtime.seed)``
    (the same initial weights in every process of every run with that seed).

    Before anything is allocated, :func:`check_model_fits` compares what the model needs with the
    memory there is (on ``rt``'s device when given; else the RAM the fp32 weights are built in).
    Running out of memory while building all the same (another process took it meanwhile) is
    a GptspeedError too. Both are one line giving the estimate and the memory."""
    check_model_fits(cfg, rt)
    torch.manual_seed(cfg.runtime.seed)
    try:
        return GPT(cfg.model)
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        params = cfg.model.num_params()
        raise GptspeedError(
            f"out of memory while building the model ({params:,} parameters, "
            f"{format_bytes(4 * params)} of fp32 weights; {format_bytes(host_memory_available())} of "
            "RAM available now): lower --n-layer / --n-embd, or free memory"
        ) from None


def is_out_of_memory(e: BaseException) -> bool:
    """True for the ways PyTorch and Python report an allocation that failed: ``MemoryError``,
    ``torch.OutOfMemoryError`` (CUDA), and the CPU allocator's RuntimeError ("DefaultCPUAllocator:
    can't allocate memory", "... out of memory")."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def format_bytes(n: int | None) -> str:
    """``n`` bytes as ``"1.50 GiB"`` (B, KiB, MiB, GiB, TiB, PiB); ``"?"`` for None."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} PiB"


def host_memory_available() -> int | None:
    """Bytes of RAM this process can still take: Linux's ``MemAvailable`` (free plus reclaimable
    cache, /proc/meminfo), else the machine's physical memory (``os.sysconf``), capped by the
    cgroup's limit (a container's ``memory.max`` less its ``memory.current``). None when unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
            avail = min(avail, max(0, int(limit) - usage))
        break
    return avail


def device_memory_available(device: torch.device) -> tuple[int | None, str]:
    """``(bytes, what)``: the memory a model built now can take on ``device`` -- free memory on a
    CUDA GPU (``torch.cuda.mem_get_info``), the recommended working set on MPS, the RAM
    available on a CPU (:func:`host_memory_available`) -- and how to name it. ``bytes`` is None
    when unknown."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # (a runtime that names CUDA where there is none: nothing to measure)
            return None, "free on the GPU"
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # PyTorch's, reusable
        return free + cached, f"free on {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        return (recommended() if recommended else None), "the MPS device can use"
    return host_memory_available(), "of RAM available"


class ModelTooLarge(GptspeedError):
    """:func:`check_model_fits`' refusal (a GptspeedError: one line); the ``--batch-size auto``
    probe takes it as a micro-batch that does not fit."""


def check_model_fits(cfg: RunConfig, rt: Runtime | None = None) -> None:
    """:class:`ModelTooLarge` (one line: the estimate and the memory) when the model of ``cfg`` cannot fit,
    checked from its shape alone (:meth:`~gptspeed.config.GPTConfig.num_params`), before it is built.

    Training on ``rt``'s device needs at least :data:`TRAINING_BYTES_PER_PARAM` bytes a parameter
    (sharded over the ranks under FSDP), the model's buffers, and the activations each block
    keeps for the backward even with full activation checkpointing: its input, ``B x T x C`` in
    the compute dtype (2 bytes at least). The model is built on the CPU first, so its fp32 weights
    must also fit in the RAM available. Without ``rt``, only that. These are lower bounds: a run
    that passes may still run out of memory in its first step (``--batch-size auto`` finds the
    batch that fits on a GPU), but one that fails here never could have run."""
    m = cfg.model
    params = m.num_params()
    shape = (
        f"n_layer {m.n_layer}, n_embd {m.n_embd}, vocab_size {m.vocab_size}, seq_len {m.block_size}: "
        f"{params:,} parameters"
    )
    fix = "lower --n-layer / --n-embd / --vocab-size / --seq-len"
    weights = 4 * params + m.buffer_bytes()
    host = host_memory_available()
    if host is not None and weights > host:
        raise ModelTooLarge(
            f"the model ({shape}) needs {format_bytes(weights)} of RAM for its fp32 weights alone, "
            f"more than the {format_bytes(host)} of RAM available: {fix}"
        )
    if rt is None:
        return
    shards = rt.world_size if rt.parallel == "fsdp" else 1
    state = -(-TRAINING_BYTES_PER_PARAM * params // shards) + m.buffer_bytes()
    activations = 2 * max(1, cfg.train.batch_size) * m.block_size * m.n_embd * m.n_layer
    available, what = device_memory_available(rt.device)
    if available is not None and state + activations > available:
        sharded = f", sharded over {shards} ranks" if shards > 1 else ""
        raise ModelTooLarge(
            f"the model ({shape}) needs at least {format_bytes(state + activations)} on {rt.device.type} to train: "
            f"{format_bytes(state)} for its weights, gradients and optimizer state ({TRAINING_BYTES_PER_PARAM} bytes a "
            f"parameter{sharded}) and {format_bytes(activations)} for activations at --batch-size "
            f"{max(1, cfg.train.batch_size)}, more than the {format_bytes(available)} {what}: {fix} / --batch-size"
        )


def compile_toolchain_problem(device_type: str, env: dict[str, str] | None = None) -> str | None:
    """Why ``torch.compile`` (TorchInductor) cannot build its kernels for a ``device_type`` GPU here,
    or None. Triton (the kernels inductor writes for a GPU) compiles a small C launcher with the
    system's C compiler against Python's headers on its first compile, so both must be on the
    machine, and triton itself. None off CUDA (a CPU's inductor checks for its C++ compiler itself)."""
    if device_type != "cuda":
        return None
    env = os.environ if env is None else env
    fix = "; or run with --no-compile"
    if importlib.util.find_spec("triton") is None:
        return "torch.compile on a GPU needs triton (it ships with PyTorch's CUDA wheels: pip install triton)" + fix
    cc = env.get("CC")
    if not ((cc and shutil.which(cc)) or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        return (
            "torch.compile on a GPU needs a C compiler for Triton's launcher (none of $CC, cc, gcc, clang is on "
            "PATH): install one, e.g. apt-get install gcc" + fix
        )
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.exists():
        return (
            f"torch.compile on a GPU needs Python's headers for Triton's launcher ({include} is missing): install "
            "them, e.g. apt-get install python3-dev" + fix
        )
    return None


def check_step(cfg: RunConfig, rt: Runtime, accum: int) -> None:
    """Every rule of the step that needs the resolved runtime, as one-line GptspeedErrors: CUDA graphs
    with gradient accumulation (:func:`gptspeed.parallelize.check_cuda_graphs`), FP8 (``--fp8``,
    ``--fp8-lm-head``) without torchao or on a device without FP8 tensor cores, ``--fp8-lm-head``
    with a loss that resolves to a path other than plain on this device
    (:func:`gptspeed.fp8.check_fp8_lm_head_loss`), ``--residual-dtype bfloat16`` where the
    resolved dtype is not bf16, Muon with a GradScaler, and torch.compile on a GPU
    without triton, a C compiler or Python's headers (:func:`compile_toolchain_problem`). The
    configuration's own rules are :meth:`RunConfig.validate`'s, checked where it is built."""
    r = cfg.runtime
    check_cuda_graphs(rt, r.compile_tuning, accum, cfg.train.batch_size * cfg.model.block_size * rt.world_size)
    if r.fp8 or r.fp8_lm_head:
        flag = "--fp8" if r.fp8 else "--fp8-lm-head"
        if importlib.util.find_spec("torchao") is None:
            raise GptspeedError(f"{flag} needs torchao, which is not installed: pip install 'gptspeed[fp8]'")
        from gptspeed.fp8 import check_fp8_device, check_fp8_lm_head_loss

        check_fp8_device(rt.device) if r.fp8 else check_fp8_device(rt.device, flag)
        if r.fp8_lm_head:
            check_fp8_lm_head_loss(cfg.model.loss, resolve_loss(cfg.model.loss, rt.device_type), rt.device_type)
    if cfg.model.residual_dtype == "bfloat16" and rt.autocast_dtype is not torch.bfloat16:
        why = f" ({rt.dtype_reason})" if rt.dtype_reason else ""
        raise GptspeedError(
            f"--residual-dtype bfloat16 needs bf16 autocast; this run computes in {rt.dtype}{why}: use "
            "--dtype bfloat16, or --residual-dtype float32"
        )
    if cfg.model.loss == "liger" and (problem := liger_problem(rt.device_type)):
        raise GptspeedError(problem)
    if rt.use_grad_scaler and not optimizer_spec(cfg.optim.optimizer).grad_scaler:
        raise GptspeedError(
            f"--optimizer {cfg.optim.optimizer} does not support float16 (loss scaling): use --dtype bfloat16"
        )
    problem = compile_toolchain_problem(rt.device_type) if rt.compile else None
    if problem:
        raise GptspeedError(problem)
    m = cfg.model
    problem = sdpa_backend_problem(
        r.sdpa_backend, rt.device, rt.autocast_dtype or torch.float32, m.n_head, m.n_embd // m.n_head, m.block_size
    )
    if problem:
        raise GptspeedError(problem)


class StepAbandoned(Exception):
    """A step left unfinished on a stop signal (:meth:`TrainStep.__call__`): ``done`` of its
    ``accum`` micro-batches had run; their gradients were dropped and nothing was stepped, so the
    weights and optimizer state are those of the last finished step. ``failed``: the exception a
    micro-batch raised after the stop was asked (e.g. inductor's ``CppCompileError`` when the
    signal, sent to the whole process group, also killed the C++ compiler building its kernels),
    or None when the step was left between micro-batches."""

    def __init__(self, done: int, accum: int, failed: BaseException | None = None):
        super().__init__(f"step abandoned after {done} of {accum} micro-batches")
        self.done, self.accum, self.failed = done, accum, failed


class TrainStep:
    """One optimizer step of a run, built from its configuration; ``step(next_batch)`` runs it.

    Building (in this order): :func:`check_step` (every rule, before the device is touched), the
    model (``model``, or :func:`build_model`), its wrapper (:func:`gptspeed.parallelize.parallelize`:
    FP8, activation checkpointing, DDP / FSDP2, compile with ``backend``), the optimizer
    (:func:`gptspeed.optim.build_optimizer`) and the GradScaler (float16 only). Micro-batches per
    step: ``cfg.grad_accum_steps(rt.world_size)``.

    Attributes: ``model`` (the plain module, to save and load), ``train_model`` (what runs),
    ``optimizer``, ``skips_on_device`` (fused AdamW: a non-finite step is skipped without a sync),
    ``scaler``, ``accum``, ``params``.

    ``model``: a module to train instead of a fresh GPT; its ``forward(x, y)`` returns
    ``(logits_or_None, loss)``. Raises GptspeedError for a combination gptspeed refuses.
    """

    def __init__(self, cfg: RunConfig, rt: Runtime, *, model: torch.nn.Module | None = None, backend: str = "inductor"):
        self.cfg, self.rt = cfg, rt
        self.accum = cfg.grad_accum_steps(rt.world_size)
        check_step(cfg, rt, self.accum)
        r = cfg.runtime
        if r.threads and rt.device_type == "cpu":  # before the model is built: its init runs on these threads too
            torch.set_num_threads(r.threads)
        self.model = build_model(cfg, rt) if model is None else model
        self.train_model = parallelize(
            self.model,
            rt,
            compile_mode=r.compile_mode,
            compile_tuning=r.compile_tuning,
            coordinate_descent_tuning=r.coordinate_descent_tuning,
            activation_checkpointing=r.activation_checkpointing,
            fp8=r.fp8,
            fp8_lm_head=r.fp8_lm_head,
            cast_weights_once=r.cast_weights_once,
            backend=backend,
        )
        if rt.compile:  # a static graph per length (parallelize), one for evaluation, one spare
            allow_static_graphs(len(seq_lens(cfg)) + 2)
        self.sync = grad_sync_control(self.train_model, keep_weights=r.cast_weights_once)
        optim = cfg.optim
        if rt.parallel == "fsdp" and rt.use_grad_scaler:
            # ShardedGradScaler's found_inf has shape [1], which fused AdamW's step-count update rejects
            # (torch 2.13): the foreach AdamW, stepped only when no rank overflowed (one sync per step)
            optim = dataclasses.replace(optim, fused_adamw=False)
        self.optimizer, self.skips_on_device = build_optimizer(self.model, optim, rt.device_type)
        self.scaler = make_scaler(rt)
        self.params = list(self.model.parameters())
        self.cuda_graphs = uses_cuda_graphs(rt, r.compile_tuning)
        self.train_model.train()

    def attention(self):
        """The run's ``--sdpa-backend`` as a context manager (:func:`gptspeed.runtime.sdpa_backend_scope`):
        the forwards of training, evaluation and HellaSwag run inside it; nothing outside them sees it."""
        return sdpa_backend_scope(self.cfg.runtime.sdpa_backend)

    def __call__(
        self,
        next_batch: Callable[[], Batch],
        stop: Callable[[], bool] | None = None,
        *,
        accum: int | None = None,
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over ``accum`` micro-batches (default :attr:`accum`; the trainer passes
        :func:`gptspeed.schedules.grad_accum_at` of the step) from ``next_batch() -> (x, y)`` (each ``(B, T)``
        int64 on the device), each trained as sequences of ``seq_len`` tokens (default ``T``; see
        :meth:`forward_backward`). Returns device tensors ``(loss, grad_norm, bad)``: the mean loss over
        the micro-batches (this rank's), and :meth:`optimizer_step`'s two. No host read.

        ``stop`` (one process only: a rank that left the step alone would leave the others waiting
        in its gradient all-reduce) is asked before each micro-batch: when it says True the step is
        abandoned -- the gradients accumulated so far are dropped, nothing is stepped -- and
        :class:`StepAbandoned` is raised, so a stop signal waits for one micro-batch, not a whole step.
        A micro-batch that raises once ``stop`` says True (a terminal's Ctrl-C or ``timeout``'s SIGTERM
        reach the whole process group, so the compiler children of a compile under way die with it)
        is left the same way, the exception kept as ``StepAbandoned.failed``: the signal's stop, not a
        crash. Running out of memory is never taken for the stop (it is its own one line)."""
        accum = self.accum if accum is None else accum
        loss = torch.zeros((), device=self.rt.device)
        for i in range(accum):
            if stop is not None and stop():
                self.optimizer.zero_grad(set_to_none=True)
                raise StepAbandoned(i, accum)
            x, y = next_batch()
            try:
                loss += self.forward_backward(x, y, last_micro_step=i == accum - 1, accum=accum, seq_len=seq_len)
            except Exception as e:
                if stop is None or not stop() or is_out_of_memory(e):
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                raise StepAbandoned(i, accum, failed=e) from e
        grad_norm, bad = self.optimizer_step(loss)
        return loss, grad_norm, bad

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        last_micro_step: bool,
        accum: int | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch ``x``, ``y`` ``(B, T)`` int64; gradients are
        accumulated into ``.grad`` (scaled by 1/``accum``, the step's micro-batches, default
        :attr:`accum`; and by the GradScaler's scale with float16) and reduced across ranks only when
        ``last_micro_step``. ``seq_len`` (a divisor of ``T``; ``--seq-len-warmup-steps``): the same
        tokens trained as ``(B * T / seq_len, seq_len)`` sequences (a view, no copy), so the mean loss
        is over the same targets. Returns this micro-batch's share of the step's mean loss: a 0-dim
        fp32 device tensor (no sync)."""
        if seq_len is not None and seq_len != x.shape[-1]:
            x, y = x.reshape(-1, seq_len), y.reshape(-1, seq_len)
        sync = self.sync(last_micro_step) if self.sync is not None else contextlib.nullcontext()
        with sync:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.rt.autocast(), self.attention():  # torch.compile fixes the kernel when it traces
                _, loss = self.train_model(x, y)
            loss = loss / (self.accum if accum is None else accum)
            self.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale (float16), clip to ``--grad-clip``, step, zero the gradients. Returns device
        tensors ``(grad_norm, bad)``: the global gradient norm before clipping (the same on every
        rank; under FSDP2 the DTensor norm made whole) and a bool that is True when the step's
        ``loss`` or the gradient was not finite on any rank -- then the weights and optimizer state
        are left as they were. AdamW skips on the device (its ``found_inf`` argument, the mechanism
        GradScaler uses): no host-device sync; Muon has no such argument, so its flag is read (one
        sync); with float16 the GradScaler skips overflowing steps (all ranks together under FSDP2)."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        loss_ok = self._finite_on_every_rank(loss)
        if self.scaler.is_enabled():
            bad = ~loss_ok  # overflowing fp16 gradients are the scaler's business
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            bad = ~(loss_ok & torch.isfinite(grad_norm))
            if self.skips_on_device:
                self.optimizer.found_inf = bad.float()
                self.optimizer.step()
            elif not bad.item():
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, bad

    def _finite_on_every_rank(self, loss: torch.Tensor) -> torch.Tensor:
        """Device bool: ``loss`` is finite on every rank (one scalar all-reduce, no host sync)."""
        if not self.rt.distributed:
            return torch.isfinite(loss)
        import torch.distributed as dist

        not_ok = (~torch.isfinite(loss)).to(torch.float32)
        dist.all_reduce(not_ok, op=dist.ReduceOp.MAX)
        return not_ok == 0


def make_scaler(rt: Runtime):
    """A ``torch.amp.GradScaler`` (enabled for float16 only). Under FSDP2 the sharded variant,
    which all-reduces ``found_inf`` so every rank skips the same overflowing steps
    (``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``)."""
    if rt.parallel == "fsdp" and rt.use_grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(rt.device_type)
    return torch.amp.GradScaler(rt.device_type, enabled=rt.use_grad_scaler)


def agree_min(rt: Runtime, value: int) -> int:
    """The smallest ``value`` over all ranks (one all-reduce); ``value`` itself in one process."""
    if not rt.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def auto_batch_size(cfg: RunConfig, rt: Runtime, say=print) -> int:
    """``--batch-size auto`` (the one adapter, for ``train`` and the bench): the micro-batch
    :func:`gptspeed.batchsize.resolve_auto_batch` finds for this configuration on ``rt.device``.
    Each probe builds a :class:`TrainStep` afresh at micro-batch ``b`` (one micro-step per step)
    and takes two full training steps on random tokens. The probe runs eagerly even when the run
    compiles: one compile per probed size would cost minutes, and the compiled step (fused
    kernels) needs no more memory than the eager one, so the eager fit is a safe lower bound. With
    several ranks every probe's verdict and the final choice are agreed (the minimum over ranks).
    The device's peak-memory counter is reset afterwards, so the run's reported peak is its own,
    not the probe's. GptspeedError off CUDA."""
    from gptspeed.batchsize import resolve_auto_batch

    one = copy.deepcopy(cfg)
    one.train.batch_size = 1
    check_model_fits(one, rt)  # a model that cannot train even at micro-batch 1 is said as such, not probed
    T = cfg.model.block_size
    sequences = cfg.train.total_batch_tokens // T if cfg.train.total_batch_tokens else None
    probe_rt = dataclasses.replace(rt, compile=False)
    if rt.parallel == "ddp":  # DDP adds gradient buckets only (within the safety margin): probe unwrapped
        probe_rt = dataclasses.replace(probe_rt, parallel="none")

    def make_step(b: int):
        probe_cfg = copy.deepcopy(cfg)
        probe_cfg.train.batch_size = b
        probe_cfg.train.total_batch_tokens = None
        try:
            step = TrainStep(probe_cfg, probe_rt)
        except ModelTooLarge as e:  # the size check's verdict on b: the probe's "does not fit"
            raise torch.cuda.OutOfMemoryError(str(e)) from None
        x = torch.randint(0, cfg.model.valid_vocab_size, (b, T + 1), device=rt.device)
        return lambda: step(lambda: (x[:, :-1], x[:, 1:]))

    r = cfg.runtime
    settings = {
        "model": dataclasses.asdict(cfg.model),
        "dtype": rt.dtype,
        "compile": rt.compile,
        "optimizer": cfg.optim.optimizer,
        "world_size": rt.world_size,
        "parallel": rt.parallel,
        "compile_mode": r.compile_mode,
        "compile_tuning": r.compile_tuning,
        "activation_checkpointing": r.activation_checkpointing,
        "fp8": r.fp8,
        "fp8_lm_head": r.fp8_lm_head,
        "sdpa_backend": r.sdpa_backend,
    }
    b = resolve_auto_batch(rt.device, settings, sequences, make_step, say=say, agree=lambda v: agree_min(rt, v))
    reset_peak_memory(rt.device)
    return b
