"""What ``bench verify`` watches while a rung trains: host-device syncs, compilation, the SDPA kernel.

Each is a small piece usable on its own (the ``cuda``-marked tests use :func:`sdpa_backend`):

- :class:`SyncCounter`: ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA
  call warn ("called a synchronizing CUDA operation"); the counter records those warnings, both
  the ones raised as Python warnings (with the Python line that synchronised) and the ones C++
  prints on stderr (e.g. from autograd's backward threads, which have no Python warning handler).
  CUDA only: a CPU has no asynchronous queue to synchronise with.
- :class:`CompileWatch`: graph breaks and recompiles counted by TorchDynamo itself
  (``torch._dynamo.utils.counters`` and ``get_compilation_metrics()``: a compile id ``F/A`` with
  attempt ``A > 0`` is a recompile of frame ``F``, with dynamo's reason).
- :func:`sdpa_backend`: which ``F.scaled_dot_product_attention`` implementation ran, from the
  operator and kernel names a ``torch.profiler`` trace recorded.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10/cuda: warn_or_error_on_sync()


class SyncCounter:
    """Context manager counting synchronising CUDA operations in its body.

    ``count``: the number of warnings ``torch.cuda.set_sync_debug_mode("warn")`` produced (an
    ``int`` after exit); ``sites``: ``{"file.py:line": n}`` for the ones raised in Python (the
    line that called the synchronising operation); ``other_stderr``: what else was printed on
    stderr meanwhile (kept, not lost). ``set_mode`` is the function that switches the mode (the
    default is PyTorch's; tests on a CPU pass a stand-in). Source: ``torch.cuda.set_sync_debug_mode``
    (PyTorch docs, "CUDA semantics").
    """

    def __init__(self, set_mode: Callable[[str], None] | None = None):
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.count: int | None = None
        self.sites: dict[str, int] = {}
        self.other_stderr = ""

    def __enter__(self) -> SyncCounter:
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        sys.stderr.flush()
        self._tmp = tempfile.TemporaryFile()
        self._saved_fd = os.dup(2)
        os.dup2(self._tmp.fileno(), 2)
        self.set_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.set_mode("default")
        finally:
            sys.stderr.flush()
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._tmp.seek(0)
            text = self._tmp.read().decode(errors="replace")
            self._tmp.close()
            self._catch.__exit__(*exc)
        ours = [w for w in self._records if SYNC_MESSAGE in str(w.message)]
        self.sites = dict(Counter(f"{w.filename}:{w.lineno}" for w in ours).most_common())
        lines = text.splitlines()
        self.count = len(ours) + sum(SYNC_MESSAGE in line for line in lines)
        self.other_stderr = "\n".join(line for line in lines if SYNC_MESSAGE not in line)
        for w in self._records:  # give back every other warning
            if w not in ours:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _dynamo_state() -> tuple[int, dict[str, int]]:
    from torch._dynamo.utils import counters

    breaks: dict[str, int] = {}
    for key in ("graph_break", "unimplemented"):  # dynamo files graph breaks under both names
        for reason, n in counters.get(key, {}).items():
            breaks[reason] = breaks.get(reason, 0) + n
    return counters["frames"].get("total", 0) if "frames" in counters else 0, breaks


_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


class CompileWatch:
    """Graph breaks and recompiles from the moment it is created (process-wide dynamo counters).

    Call :meth:`step_done` after each training step; :meth:`result` returns ``{"graph_breaks":
    int, "graph_break_reasons": [str], "recompiles": int, "recompile_reasons": [str],
    "frames_compiled": int, "frames_compiled_per_step": [int]}``. Relies on
    ``torch._dynamo.utils.counters`` / ``get_compilation_metrics`` (PyTorch's own compile
    metrics; internal API, so a missing one is reported, not fatal).
    """

    def __init__(self):
        import torch._dynamo.utils as dynamo_utils

        self._utils = dynamo_utils
        self._frames0, self._breaks0 = _dynamo_state()
        self._metrics0 = self._metric_ids()
        self._per_step: list[int] = []
        self._last = self._frames0

    def _metric_ids(self) -> set[int]:
        get = getattr(self._utils, "get_compilation_metrics", None)
        return {id(m) for m in get()} if get else set()

    def step_done(self) -> None:
        frames, _ = _dynamo_state()
        self._per_step.append(frames - self._last)
        self._last = frames

    def result(self) -> dict[str, Any]:
        frames, breaks = _dynamo_state()
        new_breaks = {r: n - self._breaks0.get(r, 0) for r, n in breaks.items() if n > self._breaks0.get(r, 0)}
        recompiles: list[str] = []
        get = getattr(self._utils, "get_compilation_metrics", None)
        for m in get() if get else []:
            if id(m) in self._metrics0:
                continue
            match = _COMPILE_ID.search(str(getattr(m, "compile_id", "") or ""))
            if match and int(match.group(2)) > 0:
                recompiles.append(
                    f"{m.compile_id} {getattr(m, 'co_name', '?')}: "
                    f"{(getattr(m, 'recompile_reason', None) or 'no reason recorded').strip()}"
                )
        return {
            "graph_breaks": sum(new_breaks.values()),
            "graph_break_reasons": [r.strip().splitlines()[0][:200] for r in new_breaks],
            "recompiles": len(recompiles),
            "recompile_reasons": [r[:300] for r in recompiles],
            "frames_compiled": frames - self._frames0,
            "frames_compiled_per_step": self._per_step,
        }


# (backend, name fragments) checked in this order: cuDNN's kernels may also say "flash".
_SDPA_OPS = (
    ("cudnn", ("_scaled_dot_product_cudnn_attention",)),
    ("flash", ("_scaled_dot_product_flash_attention", "_flash_attention_forward")),
    ("mem-efficient", ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward")),
    ("math", ("_scaled_dot_product_attention_math",)),
)
_SDPA_KERNELS = (
    ("cudnn", ("cudnn",)),
    ("flash", ("flash_fwd", "flash::", "flash_bwd")),
    ("mem-efficient", ("fmha", "efficient_attention")),
)


def sdpa_backend(names: Iterable[str]) -> dict[str, Any]:
    """Which SDPA implementation ran, from profiler event names (operators and kernels).

    Returns ``{"backend": "flash" | "cudnn" | "mem-efficient" | "math" | None, "evidence":
    [names]}``. The ATen operator (``aten::_scaled_dot_product_flash_attention`` etc., also the
    CPU's ``..._flash_attention_for_cpu``) decides; CUDA kernel names (``flash_fwd_kernel``,
    ``fmha_*``) are the fallback. ``None``: no SDPA operator or kernel in the trace.
    """
    names = sorted(set(names))
    lowered = [(n, n.lower()) for n in names]
    for table in (_SDPA_OPS, _SDPA_KERNELS):
        for backend, fragments in table:
            hits = [n for n, low in lowered if any(f in low for f in fragments)]
            if hits:
                return {"backend": backend, "evidence": hits[:5]}
    return {"backend": None, "evidence": []}


def profiled_names(fn: Callable[[], Any], device_type: str) -> list[str]:
    """Run ``fn()`` once under ``torch.profiler`` (CPU, plus CUDA on a GPU) and return the names
    of every operator and kernel it recorded."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return sorted({e.name for e in prof.events()})
