"""Device, precision, compilation and data parallelism, applied to a model from outside.

The model (:mod:`gptspeed.model`) knows nothing of these; :func:`resolve_runtime` turns the
user's ``--device/--dtype/--compile/--parallel`` into a :class:`Runtime`, :func:`init_distributed`
joins the process group torchrun set up, and :func:`parallelize` applies it all (torchtitan style:
DDP or FSDP2 wrap the plain model, then ``torch.compile``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

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


def _cpuinfo_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's text: x86 ``flags : ...``, ARM ``Features : ...``."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware: the x86 flags ``amx_bf16``
    (Intel AMX, Sapphire Rapids and newer) or ``avx512_bf16`` (Intel Cooper Lake / Sapphire
    Rapids, AMD Zen 4 and newer) in ``/proc/cpuinfo``. Without them bf16 matmuls are emulated
    through fp32 and run slower than fp32 itself (measured: benchmarks/README.md, issue 14).

    ``cpuinfo``: the text of /proc/cpuinfo (tests pass a fake one); None reads the file, and
    where there is none (macOS, Windows) asks PyTorch's CPU probes
    (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``), else False. ARM's
    ``bf16`` feature is not counted: its speed in PyTorch's CPU kernels has not been measured here.
    """
    if cpuinfo is None:
        return _this_cpu_has_native_bf16()
    return bool(_cpuinfo_flags(cpuinfo) & {"amx_bf16", "avx512_bf16"})


@functools.cache
def _this_cpu_has_native_bf16() -> bool:
    """:func:`cpu_has_native_bf16` of this machine, read once per process (the CPU does not change;
    ``resolve_runtime`` asks twice for a bf16 run, for its dtype and for its compile default)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_has_native_bf16(f.read())
    except OSError:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def default_cpu_dtype(cpuinfo: str | None = None) -> tuple[str, str]:
    """``(dtype, reason)`` for ``--dtype auto`` on a CPU: ``bfloat16`` autocast (matmuls in bf16;
    the loss's softmax, the master weights and AdamW stay fp32) where
    :func:`cpu_has_native_bf16`, else ``float32``."""
    if cpu_has_native_bf16(cpuinfo):
        return "bfloat16", "bfloat16: the CPU has native bf16 matmuls (amx_bf16/avx512_bf16)"
    return "float32", "float32: no native bf16 matmuls on this CPU (no amx_bf16/avx512_bf16; emulated bf16 is slower)"


def compile_cache_dir() -> Path:
    """Where compiled kernels persist across runs: ``$GPTSPEED_CACHE/inductor`` (default
    ``~/.cache/gptspeed/inductor``), unless ``TORCHINDUCTOR_CACHE_DIR`` is set (then that)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    root = os.environ.get("GPTSPEED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gptspeed")
    return Path(root) / "inductor"


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> tuple[bool, str]:
    """Make glibc's ``malloc`` keep the memory a training step frees for the next step, instead of
    handing it back to the kernel: ``mallopt(M_MMAP_MAX, 0)`` (no block of its own ``mmap``) and
    ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` (the heap's free top is not trimmed). Returns
    ``(applied, reason)`` for the start line.

    Why: glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
    ``mmap`` and ``munmap``s it on free, so a CPU step that allocates the same large buffers every
    step (GPT-2 124M: the 50304 x 768 fp32 gradients of the tied embedding, 154 MB each, and the
    activations) page-faults them in again every time: the kernel zeroes each 4 KiB page on first
    touch. Measured at GPT-2 124M, B=4, T=64 on a 2-core AMD EPYC (benchmarks/README.md, issue 14):
    the step's ``fill_`` of two such buffers took ~200 ms of a ~2.1 s step. tcmalloc (LD_PRELOAD)
    removes the same cost; this does it in-process with glibc's documented knobs (mallopt(3),
    the ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables).

    The heap grows to the step's peak in the first steps (measured: within ~10 steps of two such
    buffers); from then on a step's buffers are reused without a page fault (tests/test_runtime_cpu.py).
    The process keeps its peak heap for its lifetime (the resident size a training run has anyway).
    Not glibc (macOS, musl), or no ``mallopt``: nothing changes, ``(False, reason)``.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu_version = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        mallopt = gnu_version = None
    if mallopt is None or gnu_version is None:  # only glibc has both
        return False, "the system malloc as it is (not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return False, "the system malloc as it is (glibc refused mallopt)"
    return True, "freed memory kept for reuse (glibc mallopt: no per-buffer mmap, no trim)"


def use_compile_cache() -> Path:
    """Point TorchInductor's caches at :func:`compile_cache_dir` (``TORCHINDUCTOR_CACHE_DIR``, read
    when inductor first compiles) and make sure its FX-graph cache is on, so a second run of the
    same model and settings loads the compiled graphs instead of compiling them again. Its
    default, ``/tmp/torchinductor_$USER``, does not survive a reboot or a /tmp cleaner. Returns
    the folder. Source: PyTorch's "Compile Time Caching in torch.compile" tutorial
    (https://pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html)."""
    path = compile_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return path


#: ``compile=None`` on a CPU turns ``torch.compile`` on only where it was measured to pay, and
#: only for runs that repay the compile. Measured (benchmarks/README.md): bf16 autocast on a CPU
#: with native bf16 matmuls, nano shape, Sapphire Rapids Xeon (the CPU ladder): 1269.6 -> 802.9
#: ms/step (1.58x), warm-up 7.1 -> 54.0 s, so break-even = 46.9 s / 0.467 s = ~100 steps. In
#: float32 it paid nothing: no faster than eager at GPT-2 124M and slower at the nano shape, on
#: that Xeon (issue 14's table) and on a Zen 3 EPYC (issue 14's investigation, one thread).
CPU_BF16_COMPILE_BREAK_EVEN_STEPS = 100


def default_cpu_compile(dtype: str, planned_steps: int | None, cpuinfo: str | None = None) -> tuple[bool, str]:
    """``(compile, reason)`` for ``--compile`` unset on a CPU: on only with ``dtype`` bfloat16 on a
    CPU with native bf16 matmuls (:func:`cpu_has_native_bf16`) and more than
    :data:`CPU_BF16_COMPILE_BREAK_EVEN_STEPS` ``planned_steps`` (optimizer steps this run will
    take; None = unknown, then off). ``cpuinfo`` as for :func:`cpu_has_native_bf16`."""
    if dtype != "bfloat16":
        return False, (f"off: on a CPU torch.compile was measured no faster than eager in {dtype} "
                       "(benchmarks/README.md, issue 14)")
    if not cpu_has_native_bf16(cpuinfo):
        return False, "off: bf16 without native bf16 matmuls is emulated; compiling it was measured slower"
    n = CPU_BF16_COMPILE_BREAK_EVEN_STEPS
    if planned_steps is None:
        return False, f"off: the run's length is unknown (compiling repays itself after ~{n} bf16 steps on a CPU)"
    if planned_steps > n:
        return True, f"on: {planned_steps:,} planned steps > the ~{n}-step break-even of compiling (bf16, native)"
    return False, f"off: {planned_steps:,} planned steps <= the ~{n}-step break-even of compiling (bf16, native)"


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type in ("cpu", "mps")


def world_from_env() -> tuple[int, int]:
    """``(rank, world_size)`` as torchrun sets them (RANK, WORLD_SIZE); ``(0, 1)`` without torchrun.
    GptspeedError if they are not integers or the rank is out of range."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise GptspeedError(f"RANK / WORLD_SIZE are not integers ({e}): launch with torchrun") from e
    if world < 1 or not 0 <= rank < world:
        raise GptspeedError(f"RANK {rank} / WORLD_SIZE {world} are inconsistent: launch with torchrun")
    return rank, world


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


def resolve_runtime(device: str = "auto", dtype: str = "auto", compile: bool | None = None,
                    parallel: str = "auto", planned_steps: int | None = None) -> Runtime:
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
        raise GptspeedError(f"--dtype tf32 needs an NVIDIA GPU (Ampere or newer); on {dev.type} use float32 or bfloat16")
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
    return Runtime(device=dev, dtype=dtype, autocast_dtype=autocast_dtype, compile=compile,
                   parallel=resolve_parallel(parallel, world), rank=rank, world_size=world,
                   dtype_reason=dtype_reason, compile_reason=compile_reason)


def init_distributed(rt: Runtime, timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (``env://``: MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), NCCL on CUDA and gloo otherwise, unless one exists or ``rt`` needs none.

    ``timeout_s`` bounds the rendezvous and every later collective (``init_process_group``'s
    ``timeout``). A rank that cannot reach the rendezvous raises GptspeedError naming the address
    instead of hanging or printing a stack trace. See
    https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group
    """
    import datetime

    import torch.distributed as dist

    if rt.world_size == 1 and rt.parallel != "fsdp":
        return
    if dist.is_available() and dist.is_initialized():
        return
    if not dist.is_available():
        raise GptspeedError("this PyTorch build has no torch.distributed")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one process with --parallel fsdp, no torchrun
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rt.rank))
    os.environ.setdefault("WORLD_SIZE", str(rt.world_size))
    if rt.device_type == "cuda":
        torch.cuda.set_device(rt.device)
    backend = "nccl" if rt.device_type == "cuda" else "gloo"
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = datetime.timedelta(seconds=timeout_s)
    start = time.monotonic()
    try:
        store = restart_store(timeout)
        dist.init_process_group(backend, timeout=timeout, device_id=rt.device if rt.device_type == "cuda" else None,
                                **({"store": store, "rank": rt.rank, "world_size": rt.world_size} if store else {}))
    except (RuntimeError, ValueError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        msg = (str(e).splitlines()[0] if str(e) else type(e).__name__).rstrip(".")
        raise GptspeedError(
            f"rank {rt.rank} of {rt.world_size}: could not join the process group at {where} ({backend}) after "
            f"{time.monotonic() - start:.1f} s (timeout {timeout_s:g} s): {msg}. Check MASTER_ADDR / --rdzv-endpoint, "
            "the firewall, and that every node was launched") from e


def restart_store(timeout):
    """Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set), the rendezvous store torchrun gives
    (``torch.distributed.rendezvous("env://")``) inside a ``PrefixStore`` of this restart round;
    otherwise None (``init_process_group`` makes its own).

    Why: torchrun's agent keeps one store across restarts, and a process group writes the same keys
    every round (each rank's listening address, among them). After a rank died and torchrun
    restarted the group, a new rank could read its peer's address *from the dead round* before the
    peer wrote the new one, and fail at once in gloo's ``connectFullMesh`` ("Connection refused"):
    4 of 5 restarts failed on the CPU, 0 of 6 with the prefix (pytorch/pytorch#167288 reports the
    like for NCCL). See https://pytorch.org/docs/stable/distributed.html#torch.distributed.PrefixStore
    """
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"gptspeed/restart_{restart}/", store)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "NCCL communicator was aborted", "remote process exited")


def peer_lost(e: BaseException) -> bool:
    """Whether ``e``, raised by a collective, means another rank of the job is gone (killed, crashed,
    its node lost): a ``torch.distributed.DistError`` (``DistBackendError`` for NCCL), or gloo's
    plain RuntimeError naming a closed connection."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_LOST)


def shutdown_distributed() -> None:
    """Leave the process group if this process is in one (end of training)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def unwrap(module: torch.nn.Module, *, keep_ddp: bool = False) -> torch.nn.Module:
    """The module under ``torch.compile`` and DDP wrappers (FSDP2 shards in place: itself); with
    ``keep_ddp``, under ``torch.compile`` only (the DDP wrapper, whose ``no_sync`` is needed). The one
    place that knows how a compiled model hides its module (``OptimizedModule._orig_mod``)."""
    module = getattr(module, "_orig_mod", module)
    if keep_ddp:
        return module
    return getattr(module, "module", module) if _is_ddp(module) else module


def eager():
    """Context manager: every ``torch.compile``-d function and module runs eagerly inside it
    (``torch.compiler.set_stance("force_eager")``), so shapes seen only here (a partial last eval
    batch, HellaSwag rows) never trigger a recompile."""
    return torch.compiler.set_stance("force_eager")


def _is_ddp(module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def grad_sync_control(train_model: torch.nn.Module):
    """For gradient accumulation: ``sync(last: bool)`` returning a context manager to run one
    micro-step's forward and backward in, which reduces gradients across ranks only when ``last``
    is True -- DDP's ``no_sync()`` and FSDP2's ``set_requires_gradient_sync`` -- or None when the
    model is not data-parallel (the single-process path then pays nothing)."""
    inner = unwrap(train_model, keep_ddp=True)
    if _is_ddp(inner):
        return lambda last: contextlib.nullcontext() if last else inner.no_sync()
    from torch.distributed.fsdp import FSDPModule

    if isinstance(inner, FSDPModule):
        def sync(last: bool):
            inner.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return sync
    return None


CUDA_GRAPH_TUNINGS = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


def uses_cuda_graphs(rt: Runtime, compile_tuning: str) -> bool:
    """Whether the compiled model replays CUDA graphs (``reduce-overhead`` / ``max-autotune`` on CUDA)."""
    return rt.compile and rt.device_type == "cuda" and compile_tuning in CUDA_GRAPH_TUNINGS


def cuda_graphs_refusal(compile_tuning: str, grad_accum_steps: int) -> str | None:
    """Why ``compile_tuning`` cannot run with ``grad_accum_steps`` micro-steps (one line), or None:
    every replay of a CUDA-graph backward writes its gradients into the same static buffers, so the
    second micro-step overwrites the gradients of the first that ``.grad`` still points to (PyTorch
    raises "accessing tensor output of CUDAGraphs that has been overwritten"; older versions
    silently kept the last micro-batch only). Names the working alternative."""
    if compile_tuning in CUDA_GRAPH_TUNINGS and grad_accum_steps > 1:
        return (f"--compile-tuning {compile_tuning} uses CUDA graphs, which cannot accumulate gradients over "
                f"{grad_accum_steps} micro-steps: use --compile-tuning max-autotune-no-cudagraphs, or raise "
                "--batch-size until one micro-step makes the whole --total-batch-tokens")
    return None


def check_cuda_graphs(rt: Runtime, compile_tuning: str, grad_accum_steps: int) -> None:
    """GptspeedError (:func:`cuda_graphs_refusal`'s line) for a run that would replay CUDA graphs
    (:func:`uses_cuda_graphs`) with gradient accumulation."""
    reason = cuda_graphs_refusal(compile_tuning, grad_accum_steps)
    if reason and uses_cuda_graphs(rt, compile_tuning):
        raise GptspeedError(reason)


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
    (:func:`apply_activation_checkpointing`), data parallelism (``rt.parallel``), and compilation
    if ``rt.compile``.

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
    ``mode`` (None for "default"). ``backend``: torch.compile's backend (tests use "eager").

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
    if any(p.device != rt.device for p in model.parameters()):
        model.to(rt.device)
    apply_matmul_precision(rt)
    apply_activation_checkpointing(model, activation_checkpointing)
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
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # embeddings (tied with the LM head), final norm
    if not rt.compile:
        return train_model
    use_compile_cache()
    mode = None if compile_tuning == "default" else compile_tuning
    if compile_mode == "blocks":
        for block in model.transformer.h:
            block.compile(backend=backend, mode=mode)
        return train_model
    return torch.compile(train_model, backend=backend, mode=mode)


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
    if mode not in ("selective", "full"):
        raise GptspeedError(f"--activation-checkpointing must be none, selective or full, got {mode!r}")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    extra = {} if mode == "full" else {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                        _selective_policy)}
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, **extra)
