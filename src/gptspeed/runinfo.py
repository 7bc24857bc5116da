"""What a run says about itself: ``config.json`` (the final configuration, what was derived from it,
the environment), the banner it prints at start, and the command that resumes it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gptspeed.config import RunConfig
from gptspeed.fileio import write_text_atomic
from gptspeed.metrics import environment
from gptspeed.runtime import Runtime
from gptspeed.schedules import grad_accum_at, seq_len_at


def write_run_config(run_dir: Path, cfg: RunConfig, rt: Runtime, derived: dict[str, Any]) -> None:
    """``RUN_DIR/config.json``, atomically: every setting (:meth:`RunConfig.to_dict`), ``derived``
    (gradient accumulation, tokens per step, parameter counts, FLOPs per token, the run id, ...) and
    the environment (device, versions, git commit). ``--config RUN_DIR/config.json`` reproduces the
    run; ``derived`` and ``environment`` are not settings and are ignored there."""
    doc = {**cfg.to_dict(), "derived": derived, "environment": environment(rt.device)}
    write_text_atomic(Path(run_dir) / "config.json", json.dumps(doc, indent=2) + "\n")


def run_derived(trainer) -> dict[str, Any]:
    """What config.json records besides the settings, from a built :class:`gptspeed.trainer.Trainer`:
    gradient accumulation, tokens per step, parameters, FLOPs per token, the device's peak, the
    data's identity and the run id."""
    t, cfg, rt = trainer, trainer.cfg, trainer.rt
    return {
        "grad_accum_steps": t.accum,
        "tokens_per_step": t.tokens_per_step,
        "params": t.model.num_params(False),
        "params_non_embedding": t.model.num_params(),
        "flops_per_token": t.flops_per_token,
        "fused_adamw": t.skips_on_device,
        "dtype": rt.dtype,
        "compile": rt.compile,
        "device": str(rt.device),
        "world_size": rt.world_size,
        "parallel": rt.parallel,
        "warmup_steps": cfg.warmup_steps(),
        "peak_flops": t.peak,
        "peak_flops_source": t.peak_source,
        "train_tokens_per_epoch": t.loader.tokens_per_epoch,
        "data": t.data.identity,
        "run_id": t.resume.run_id,
    }


def banner(cfg: RunConfig, rt: Runtime, derived: dict[str, Any], *, malloc_reason: str, step: int) -> list[str]:
    """The lines a run prints before its first step: what runs (size, device, dtype, compile,
    optimizer, batch), why (the choices ``auto`` made), and warnings."""
    t, r = cfg.train, cfg.runtime
    B, T, W = t.batch_size, cfg.model.block_size, rt.world_size
    what = [
        f"gptspeed: {derived['params'] / 1e6:.2f}M parameters",
        f"{environment(rt.device)['device']} ({rt.device})",
        rt.dtype,
        f"compile {r.compile_mode + ' ' + r.compile_tuning if rt.compile else 'off'}",
        f"{cfg.optim.optimizer}{' (fused AdamW)' if derived['fused_adamw'] else ''}",
    ]
    what += ["fp8"] if r.fp8 else []  # the blocks' Linear layers large enough to gain (gptspeed.fp8)
    what += ["fp8 lm_head"] if r.fp8_lm_head else []
    what += ["residual bf16"] if cfg.model.residual_dtype == "bfloat16" else []
    what += [f"sdpa {r.sdpa_backend}"] if r.sdpa_backend != "auto" else []
    what += [
        f"activation checkpointing {r.activation_checkpointing}",
        f"B={B} T={T} x {derived['grad_accum_steps']} micro-steps"
        + (f" x {W} ranks ({rt.parallel})" if W > 1 else "")
        + f" = {derived['tokens_per_step']:,} tokens/step",
    ]
    if t.batch_warmup_steps:
        start = grad_accum_at(0, cfg, W) * B * T * W
        what.append(f"batch warm-up from {start:,} tokens/step over {t.batch_warmup_steps:,} steps")
    if t.seq_len_warmup_steps:
        what.append(f"seq-len warm-up from {seq_len_at(0, cfg)} over {t.seq_len_warmup_steps:,} steps")
    lines = [
        " | ".join(what),
        f"why: dtype {rt.dtype_reason or rt.dtype} | compile {rt.compile_reason or ('on' if rt.compile else 'off')} "
        f"| malloc: {malloc_reason}",
    ]
    warmup = cfg.warmup_steps()
    if warmup >= t.max_steps:
        lines.append(
            f"warning: warm-up is {warmup} steps but the run has {t.max_steps}: the learning rate never "
            f"reaches --lr {cfg.optim.lr:g}; lower --warmup-steps or give --warmup-ratio (e.g. 0.05)"
        )
    if step:
        lines.append(f"resumed from step {step}")
    if derived["peak_flops"] is None:
        lines.append(f"MFU: not reported ({derived['peak_flops_source']})")
    return lines


def resume_command(rt: Runtime, run_dir: Path) -> str:
    """The command that resumes ``run_dir`` as it ran: under torchrun, with its launcher and process
    counts (``LOCAL_WORLD_SIZE`` processes per node; the rendezvous flags of a multi-node job are
    the user's own, so they are left as ``...``)."""
    if not rt.distributed:
        return f"gptspeed train --out {run_dir} --resume"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    nodes = max(1, rt.world_size // per_node)
    launch = (
        f"torchrun --standalone --nproc_per_node {per_node}"
        if nodes == 1
        else f"torchrun --nnodes {nodes} --nproc_per_node {per_node} ..."
    )
    return f"{launch} -m gptspeed train --out {run_dir} --resume"
