"""The host CPU: its bf16 matmul flags (/proc/cpuinfo), the dtype and compile defaults they give
on a CPU (measured: benchmarks/LOG.md), and glibc's allocator kept from returning a step's
freed memory (``mallopt`` through ctypes)."""

from __future__ import annotations

import functools

import torch


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
    through fp32 and run slower than fp32 itself (measured: benchmarks/LOG.md, issue 14).

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
    touch. Measured at GPT-2 124M, B=4, T=64 on a 2-core AMD EPYC (benchmarks/LOG.md, issue 14):
    the step's ``fill_`` of two such buffers took ~200 ms of a ~2.1 s step. tcmalloc (LD_PRELOAD)
    removes the same cost; this does it in-process with glibc's documented knobs (mallopt(3),
    the ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables).

    The heap grows to the step's peak in the first steps (measured: within ~10 steps of two such
    buffers); from then on a step's buffers are reused without a page fault (tests/test_runtime.py).
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


#: ``compile=None`` on a CPU turns ``torch.compile`` on only where it was measured to pay, and
#: only for runs that repay the compile. Measured (benchmarks/LOG.md): bf16 autocast on a CPU
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
        return False, (
            f"off: on a CPU torch.compile was measured no faster than eager in {dtype} (benchmarks/LOG.md, issue 14)"
        )
    if not cpu_has_native_bf16(cpuinfo):
        return False, "off: bf16 without native bf16 matmuls is emulated; compiling it was measured slower"
    n = CPU_BF16_COMPILE_BREAK_EVEN_STEPS
    if planned_steps is None:
        return False, f"off: the run's length is unknown (compiling repays itself after ~{n} bf16 steps on a CPU)"
    if planned_steps > n:
        return True, f"on: {planned_steps:,} planned steps > the ~{n}-step break-even of compiling (bf16, native)"
    return False, f"off: {planned_steps:,} planned steps <= the ~{n}-step break-even of compiling (bf16, native)"
