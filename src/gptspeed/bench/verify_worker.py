"""One ``bench verify`` rung, in this (fresh) process: :func:`verify_stage`.

The rung trains ``warmup + steps`` optimizer steps of ``grad_accum`` micro-batches from the same
initial weights (:func:`gptspeed.bench.worker.init_gpt`) on the same batches (read once, before
the first step, so every rung sees identical tensors) and records every step's loss. The last
``steps`` steps are the steady ones: timed (CUDA events, or ``perf_counter`` on a CPU) and, on
CUDA, run under :class:`gptspeed.bench.checks.SyncCounter`. Compilation is watched from the first
step (:class:`~gptspeed.bench.checks.CompileWatch`). One more step, after the trajectory, runs
under ``torch.profiler`` to see which SDPA kernel ran (rungs with ``attention="sdpa"``).

A ``--batch-size auto`` rung keeps the global batch: it reads the same micro-batches as every other
rung and cuts each step's sequences into its own micro-batch size (:func:`regroup`), so its steps
see the same tokens as its reference's and its losses are compared like any other rung's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from typing import Any

import torch

from gptspeed.bench.checks import CompileWatch, SyncCounter, profiled_names, sdpa_backend
from gptspeed.bench.worker import (
    StageSpec,
    bench_step,
    build_row,
    make_loader,
    quartiles,
    resolve_batch,
    run_config,
    timed_steps,
)
from gptspeed.distributed import init_distributed
from gptspeed.metrics import memory_stats, peak_flops, reset_peak_memory
from gptspeed.runtime import resolve_runtime

SYNCS_NOT_COUNTED = "not counted: sync counting needs CUDA (torch.cuda.set_sync_debug_mode); a CPU runs synchronously"


def sync_budget(fused: bool) -> int:
    """Host-device syncs per optimizer step the training step is designed to take: 0 with fused
    AdamW (a non-finite step is skipped on the device through ``found_inf``), 1 otherwise (the
    non-fused path and Muon read the non-finite flag once; a GradScaler with a non-fused
    optimizer reads its ``found_inf`` once). Source: :meth:`gptspeed.step.TrainStep.optimizer_step`'s docstring."""
    return 0 if fused else 1


def verify_stage(spec: StageSpec) -> dict[str, Any]:
    """Train one rung and return what ``bench verify`` compares and reports.

    Keys: ``status`` ("ok"), ``losses`` (fp32 loss of every step, ``warmup + steps`` floats),
    ``skipped`` (per step: True when the step was not applied -- non-finite, or a float16 overflow
    the GradScaler skipped), ``batch_size`` (after ``--batch-size auto``), ``grad_accum``,
    ``tokens_per_step``, ``ms_steps`` / ``ms_median`` / ``ms_q25`` / ``ms_q75`` (steady steps, ms),
    ``tokens_per_s``, ``mfu`` (None without a peak) and ``peak_flops_source``, ``peak_mem_bytes`` /
    ``mem_total_bytes``, ``syncs`` (``{"counted", "total", "per_step", "budget", "sites", "note"}``),
    ``compile`` (:meth:`CompileWatch.result`, or None when not compiled), ``sdpa``
    (:func:`sdpa_backend`'s result, or None for manual attention), ``dtype``, ``device``,
    ``grad_scaler``, ``fused_adamw``, ``params``, ``first_step_s``.

    Raises GptspeedError for a combination gptspeed refuses; torch.OutOfMemoryError propagates
    (the worker's ``main`` records it).
    """
    cfg = run_config(spec)
    rt = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.parallel)
    if rt.parallel == "fsdp":  # one process (a --tune candidate): FSDP2 needs its group of one
        init_distributed(rt, cfg.runtime.dist_timeout_s)
    spec, loader, batches = _rung_batches(spec, rt)
    feed = iter(batches)
    reset_peak_memory(rt.device)  # the peak is the training's, not the batches' loading
    watch = CompileWatch() if rt.compile else None
    train, flops_per_token = build_row(spec, rt, loader)
    skipped: list[torch.Tensor] = []

    def one_step() -> torch.Tensor:
        loss, skip = bench_step(train, lambda: next(feed))
        skipped.append(skip)
        if watch is not None:
            watch.step_done()
        return loss.detach()

    t0 = time.perf_counter()
    losses = [one_step()]
    rt.synchronize()
    first_step_s = time.perf_counter() - t0
    losses += [one_step() for _ in range(spec.warmup - 1)]
    counter = SyncCounter() if rt.device_type == "cuda" else None
    with counter or contextlib.nullcontext():
        ms, _, steady = timed_steps(one_step, spec.steps, rt)
    loss_values = torch.stack(losses + steady).float().cpu().tolist()  # one read, after the trajectory
    mem_peak, mem_total = memory_stats(rt.device)
    sdpa = None
    if cfg.model.attention == "sdpa":
        again = iter(batches)
        sdpa = sdpa_backend(profiled_names(lambda: train(lambda: next(again)), rt.device_type))

    return {
        "status": "ok",
        "losses": loss_values,
        "skipped": [bool(v) for v in torch.stack(skipped).cpu().tolist()],
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "grad_accum": spec.grad_accum,
        **_speed(ms, spec, rt, flops_per_token),
        "peak_mem_bytes": mem_peak,
        "mem_total_bytes": mem_total,
        "first_step_s": first_step_s,
        "syncs": sync_report(counter, sync_budget(train.skips_on_device), spec.steps),
        "compile": watch.result() if watch is not None else None,
        "sdpa": sdpa,
        "dtype": rt.dtype,
        "device": str(rt.device),
        "grad_scaler": rt.use_grad_scaler,
        "fused_adamw": train.skips_on_device,
        "params": sum(p.numel() for p in train.model.parameters()),
        "threads": torch.get_num_threads(),
    }


def _rung_batches(spec: StageSpec, rt) -> tuple[StageSpec, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(spec with its batch resolved, the loader, every micro-batch the rung trains on)``: the same
    tensors for every rung; with ``read_micro_batch`` (bench tune), your micro-batches, regrouped
    (:func:`regroup`) into the candidate's."""
    read = spec  # the micro-batches every rung reads
    if spec.extra.get("read_micro_batch"):  # bench tune: every candidate reads your micro-batches, then regroups
        b = spec.extra["read_micro_batch"]
        read = dataclasses.replace(spec, batch_size=b, grad_accum=spec.batch_size * spec.grad_accum // b)
    spec = resolve_batch(spec, rt, keep_global=True)  # resets the peak memory after probing
    n_batches = (read.warmup + read.steps) * read.grad_accum
    loader = make_loader(read, rt.device, n_batches=n_batches)
    batches = [loader.next_batch() for _ in range(n_batches)]
    if spec.batch_size != read.batch_size:
        batches = regroup(batches, read.grad_accum, spec.batch_size)
    return spec, loader, batches


def _speed(ms: list[float], spec: StageSpec, rt, flops_per_token: float) -> dict[str, Any]:
    """The rung's speed from its steady steps' times ``ms``: tokens per step, the step-time statistics
    (ms), tokens/s of the median and MFU (None without a peak, :func:`peak_flops`)."""
    tokens = spec.batch_size * spec.seq_len * spec.grad_accum
    median = statistics.median(ms)
    q25, q75 = quartiles(ms)
    tps = tokens / (median / 1000)
    peak, peak_source = peak_flops(rt.device, rt.dtype, spec.peak_tflops)
    return {
        "tokens_per_step": tokens,
        "ms_steps": ms,
        "ms_median": median,
        "ms_q25": q25,
        "ms_q75": q75,
        "ms_min": min(ms),
        "ms_max": max(ms),
        "tokens_per_s": tps,
        "flops_per_token": flops_per_token,
        "mfu": flops_per_token * tps / peak if peak else None,
        "peak_flops_source": peak_source,
    }


def regroup(
    batches: list[tuple[torch.Tensor, torch.Tensor]], per_step: int, micro_batch: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same sequences in other micro-batches: ``batches`` holds ``per_step`` micro-batches
    ``(x, y)`` per optimizer step; each step's rows are concatenated, in order, and cut into
    micro-batches of ``micro_batch`` rows (which must divide the step's rows). The mean loss and
    the gradient of a step are unchanged (every micro-batch has the same number of tokens)."""
    out = []
    for i in range(0, len(batches), per_step):
        step = batches[i : i + per_step]
        x, y = torch.cat([b[0] for b in step]), torch.cat([b[1] for b in step])
        if x.size(0) % micro_batch:
            raise ValueError(f"a micro-batch of {micro_batch} does not divide the {x.size(0)} sequences of a step")
        out += list(zip(x.split(micro_batch), y.split(micro_batch)))
    return out


def sync_report(counter: SyncCounter | None, budget: int, steps: int) -> dict[str, Any]:
    """``{"counted", "total", "per_step", "budget", "sites", "note"}`` from the steady steps'
    :class:`SyncCounter` (None off CUDA: not counted). Other stderr the counter caught is echoed."""
    if counter is None:
        return {
            "counted": False,
            "total": None,
            "per_step": None,
            "budget": budget,
            "sites": {},
            "note": SYNCS_NOT_COUNTED,
        }
    if counter.other_stderr.strip():
        print(counter.other_stderr, file=sys.stderr)
    return {
        "counted": True,
        "total": counter.count,
        "per_step": counter.count / steps,
        "budget": budget,
        "sites": counter.sites,
        "note": "",
    }
