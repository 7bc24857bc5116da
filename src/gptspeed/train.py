"""The training loop: build the run, step, evaluate, log, checkpoint, stop cleanly.

Hot-loop rules: the loss, gradient norm and non-finite flags stay on the device and are read
(one host-device sync) only at log steps; the wall clock is read only after synchronising the
device and is stopped while evaluating; batches come from pinned memory with non-blocking copies
(see data/loader.py). What is promised about interruptions, crashes and divergence, and which
test proves it, is in docs/reliability.md.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gptspeed.checkpoint import (check_free_space, estimate_checkpoint_bytes, latest_valid_checkpoint,
                                 list_checkpoints, load_checkpoint, save_checkpoint)
from gptspeed.config import RunConfig, preset, run_defining_diff
from gptspeed.data import find_shards, load_manifest
from gptspeed.data.loader import TokenLoader, iter_eval_batches
from gptspeed.data.shards import read_header
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.metrics import RunLog, environment, format_duration, memory_stats, peak_flops
from gptspeed.model import GPT
from gptspeed.optim import build_optimizer, lr_at
from gptspeed.runtime import Runtime, parallelize, resolve_runtime


def build_train_config(preset_name: str | None, overrides: dict[str, Any], config_file: str | None = None) -> RunConfig:
    """The configuration ``gptspeed train`` runs with.

    Fresh run: the preset (default ``gpt2``), then ``config_file`` (JSON), then ``overrides``
    (flat field names, the flags given). With ``resume`` and a valid checkpoint in ``out``, the
    checkpoint's configuration is the base instead, so ``gptspeed train --out RUN --resume``
    alone continues a run; a config file and flags given still apply on top.
    """
    out = overrides.get("out")
    path = latest_valid_checkpoint(Path(out))[0] if overrides.get("resume") and out else None
    if path is not None:
        cfg = RunConfig.from_dict(load_checkpoint(path)["config"], f"checkpoint {path}")
        if preset_name is not None and preset_name != cfg.preset:
            raise GptspeedError(f"--preset {preset_name} with --resume: {out} is a {cfg.preset} run; drop --preset")
    else:
        cfg = preset(preset_name or "gpt2")
    if config_file:
        cfg = cfg.apply_file(config_file)
    cfg = cfg.override(overrides)
    if cfg.train.init_from and path is None:  # the model shape is the pretrained model's
        from gptspeed.hf import shape_for_init_from

        cfg.model = shape_for_init_from(cfg.train.init_from, cfg.model, overrides)
    return cfg


class StopFlag:
    """SIGINT / SIGTERM set ``signum``; the loop finishes its step, saves and exits 128+signum.
    A second SIGINT raises KeyboardInterrupt at once (checkpoints are written atomically, so
    nothing is corrupted)."""

    def __init__(self, say=print):
        self.signum: int | None = None
        self.say = say
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self.say(f"\n{signal.Signals(signum).name} received: finishing this step and saving a checkpoint "
                 "(Ctrl-C again to quit now)", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               rt: Runtime, next_batch, accum: int, grad_clip: float, params: list[torch.nn.Parameter],
               fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over ``accum`` micro-batches from ``next_batch() -> (x, y)``.

    Returns device tensors ``(loss, grad_norm, bad)``: the mean loss over the micro-batches (fp32),
    the global gradient norm before clipping, and a bool that is True when the loss or the
    gradient was not finite -- then the weights and optimizer state are left as they were. With a
    fused optimizer that skip happens on the device (AdamW's ``found_inf`` argument, the mechanism
    GradScaler uses), so the step has no host-device sync; the non-fused path reads ``bad``
    (one sync). With float16 the GradScaler skips steps whose scaled gradients overflow, as usual.
    """
    loss_sum = torch.zeros((), device=rt.device)
    for _ in range(accum):
        x, y = next_batch()
        with rt.autocast():
            _, loss = model(x, y)
        loss = loss / accum
        loss_sum += loss.detach()
        scaler.scale(loss).backward()
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if scaler.is_enabled():
        bad = ~torch.isfinite(loss_sum)  # overflowing fp16 gradients are the scaler's business
        scaler.step(optimizer)
        scaler.update()
    else:
        bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        if fused:
            optimizer.found_inf = bad.float()
            optimizer.step()
        elif not bad.item():
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, bad


@torch.no_grad()
def evaluate(model: torch.nn.Module, rt: Runtime, shards: list[Path], batch_size: int, seq_len: int,
             max_tokens: int = 0, max_token_id: int | None = None) -> tuple[float, int]:
    """Mean cross-entropy (nats/token) over the first ``max_tokens`` tokens of ``shards`` (0 = all).
    Returns ``(loss, tokens)``; one host-device sync at the end."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
    n = 0
    for x, y in iter_eval_batches(shards, batch_size, seq_len, max_tokens, device=rt.device,
                                  max_token_id=max_token_id):
        with rt.autocast():
            _, loss = model(x, y)
        total += loss.double() * y.numel()
        n += y.numel()
    model.train(was_training)
    return (total / n).item(), n


def _check_val_size(shards: list[Path], seq_len: int) -> None:
    longest = max(read_header(p)[1] for p in shards)
    if longest < seq_len + 1:
        raise GptspeedError(
            f"val split has {longest:,} tokens, fewer than one sequence (seq_len {seq_len} + 1): "
            "prepare more text, raise --val-fraction or lower --seq-len"
        )


def _prepare_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise GptspeedError(f"cannot write to run folder {run_dir}: {e.strerror or e}") from e
    for stale in run_dir.glob(".*.tmp"):  # left by a process killed while writing
        stale.unlink(missing_ok=True)


def data_identity(data_dir: str, shards: list[Path]) -> dict[str, Any]:
    """What identifies the training data: the manifest's input hash, else shard names and sizes."""
    manifest = load_manifest(data_dir)
    if manifest and manifest.get("input_sha256"):
        return {"input_sha256": manifest["input_sha256"], "val_fraction": manifest.get("val_fraction")}
    return {"shards": [[p.name, read_header(p)[1]] for p in shards]}


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def fit(cfg: RunConfig, echo: bool = True) -> dict[str, Any]:
    """Train as configured. Returns a summary: ``step``, ``last_train_loss``, ``last_val_loss``,
    ``skipped_steps``, ``interrupted`` (the signal number that stopped it, or None), ``run_dir``.

    Raises GptspeedError for anything the user can fix -- before the run folder is touched
    wherever it can be checked beforehand -- and when training diverges with ``on_nan=stop``.
    """
    say = print if echo else (lambda *a, **k: None)
    t_cfg = cfg.train
    if not t_cfg.data:
        raise GptspeedError("--data is required: a folder made by `gptspeed prepare`")
    if not t_cfg.out:
        raise GptspeedError("--out is required: the run folder for checkpoints and metrics")
    cfg.validate()
    rt = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile)
    run_dir = Path(t_cfg.out)
    from gptspeed.data.stream import StreamLoader, is_stream_source

    stream = is_stream_source(t_cfg.data)  # jsonl:PATH / hf:NAME: tokenized while training, no val split
    if stream:
        train_shards = val_shards = []
        data_id = {"stream": t_cfg.data}
    else:
        train_shards = find_shards(t_cfg.data, "train")
        val_shards = find_shards(t_cfg.data, "val")
        data_id = data_identity(t_cfg.data, train_shards)

    ckpt = None
    if t_cfg.resume:
        path, skipped = latest_valid_checkpoint(run_dir)
        for bad_path, reason in skipped:
            say(f"skipping {bad_path.name}: {reason}")
        if path is None:
            say(f"--resume: no valid checkpoint in {run_dir}, starting a new run")
        else:
            ckpt = load_checkpoint(path, verify=False)
            changed = run_defining_diff(RunConfig.from_dict(ckpt["config"], f"checkpoint {path}"), cfg)
            if "optimizer" not in ckpt:  # weights only (gptspeed import-hf): only the model must match
                changed = [c for c in changed if c.startswith("model.")]
            elif ckpt.get("data") != data_id:
                changed.append("data")
            if changed and not t_cfg.force_resume:
                raise GptspeedError(
                    f"cannot resume {path.name} with a different configuration ({', '.join(changed)}): "
                    "use the original settings, a new --out, or --force-resume"
                )
            if changed:
                say(f"--force-resume: continuing {path.name} with changed {', '.join(changed)}")
    elif list_checkpoints(run_dir):
        raise GptspeedError(f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose another --out")

    B, T = t_cfg.batch_size, cfg.model.block_size
    accum = cfg.grad_accum_steps()
    tokens_per_step = B * T * accum
    max_id = cfg.model.valid_vocab_size
    loader_workers = t_cfg.loader_workers if t_cfg.loader_workers >= 0 else int(rt.device.type == "cuda")
    if stream:
        loader = StreamLoader(t_cfg.data, B, T, device=rt.device, workers=max(1, loader_workers))
    else:
        loader = TokenLoader(train_shards, B, T, device=rt.device, max_token_id=max_id, sampling=t_cfg.sampling,
                             seed=cfg.runtime.seed, workers=loader_workers)
        _check_val_size(val_shards, T)
    from gptspeed.eval.hellaswag import hellaswag_hook

    hellaswag = hellaswag_hook(cfg, rt)  # None unless --hellaswag-every; loads its data now

    torch.manual_seed(cfg.runtime.seed)
    model = GPT(cfg.model)
    _prepare_run_dir(run_dir)
    check_free_space(run_dir, estimate_checkpoint_bytes(model))
    train_model = parallelize(model, rt)
    optimizer, fused = build_optimizer(model, cfg.optim, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.use_grad_scaler)
    step = skipped_steps = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        if "optimizer" in ckpt:  # absent from weights-only checkpoints (gptspeed import-hf)
            optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
            try:
                loader.load_state_dict(ckpt["loader"])
            except GptspeedError:
                if not t_cfg.force_resume:
                    raise
                say("--force-resume: the data position does not fit the new data; reading it from the start")
            torch.set_rng_state(ckpt["rng"]["torch"])
            if rt.device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(ckpt["rng"]["cuda"], rt.device)
        step, skipped_steps = ckpt["step"], ckpt.get("skipped_steps", 0)
    elif t_cfg.init_from:
        from gptspeed.hf import load_hf_weights

        say(f"initialised from {load_hf_weights(model, t_cfg.init_from)}")
    if step >= t_cfg.max_steps:
        say(f"{run_dir} is already at step {step} of {t_cfg.max_steps}: nothing to do (raise --max-steps to go on)")
        return {"step": step, "last_train_loss": None, "last_val_loss": None, "skipped_steps": skipped_steps,
                "interrupted": None, "run_dir": str(run_dir)}

    fpt = model.flops_per_token(T)
    peak, peak_source = peak_flops(rt.device, rt.dtype, cfg.runtime.peak_tflops)
    env = environment(rt.device)
    config_json = {**cfg.to_dict(), "derived": {
        "grad_accum_steps": accum, "tokens_per_step": tokens_per_step, "params": model.num_params(False),
        "params_non_embedding": model.num_params(), "flops_per_token": fpt, "fused_adamw": fused,
        "dtype": rt.dtype, "compile": rt.compile, "device": str(rt.device),
        "peak_flops": peak, "peak_flops_source": peak_source, "train_tokens_per_epoch": getattr(loader, "tokens_per_epoch", None),
        "data": data_id}, "environment": env}
    write_text_atomic(run_dir / "config.json", json.dumps(config_json, indent=2) + "\n")
    log = RunLog(run_dir / "metrics.jsonl", echo=echo)
    log.truncate_after(step if ckpt is not None else -1)

    say(f"gptspeed: {model.num_params(False) / 1e6:.2f}M parameters | {env['device']} ({rt.device}) | {rt.dtype} | "
        f"compile {'on' if rt.compile else 'off'} | fused AdamW {'on' if fused else 'off'} | "
        f"B={B} T={T} x {accum} micro-steps = {tokens_per_step:,} tokens/step")
    if ckpt is not None:
        say(f"resumed from step {step}")
    if peak is None:
        say(f"MFU: not reported ({peak_source})")

    def record(step_: int, **fields) -> dict[str, Any]:
        return {"step": step_, "max_steps": t_cfg.max_steps, "tokens": step_ * tokens_per_step,
                "documents": loader.documents, "epoch": loader.epoch + loader.epoch_progress(),
                "time_s": time.time() - wall_start, "skipped_steps": skipped_steps, **fields}

    def save() -> Path:
        return save_checkpoint(run_dir, {
            "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "loader": loader.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None},
            "config": cfg.to_dict(), "data": data_id, "skipped_steps": skipped_steps,
        }, keep=t_cfg.keep_checkpoints)

    def run_eval() -> float | None:
        if stream:
            return None
        return evaluate(train_model, rt, val_shards, B, T, t_cfg.eval_tokens, max_id)[0]

    wall_start = time.time()
    stop = StopFlag(say)
    last_train = last_val = None
    try:
        if step == 0:
            last_val = run_eval()
            log.write(record(0, val_loss=last_val))
        max_lr, min_lr = cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio
        t_last, steps_since, first_interval = time.perf_counter(), 0, True
        wait_last = loader.wait_s
        params = list(model.parameters())
        bad_count = torch.zeros((), dtype=torch.int64, device=rt.device)  # non-finite steps since last read
        first_bad = torch.full((), -1, dtype=torch.int64, device=rt.device)
        while step < t_cfg.max_steps and stop.signum is None:
            lr = lr_at(step, max_lr=max_lr, min_lr=min_lr, warmup_steps=cfg.optim.warmup_steps,
                       max_steps=t_cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, grad_norm, bad = train_step(train_model, optimizer, scaler, rt, loader.next_batch, accum,
                                                  cfg.optim.grad_clip, params, fused)
            step += 1
            steps_since += 1
            bad_count += bad
            first_bad = torch.where(bad & (first_bad < 0), step, first_bad)

            do_eval = step == t_cfg.max_steps or (t_cfg.eval_every > 0 and step % t_cfg.eval_every == 0)
            do_save = step == t_cfg.max_steps or (t_cfg.save_every > 0 and step % t_cfg.save_every == 0)
            do_hellaswag = hellaswag is not None and (step == t_cfg.max_steps or step % t_cfg.hellaswag_every == 0)
            if first_interval or do_eval or do_save or do_hellaswag or step % t_cfg.log_every == 0 or stop.signum:
                rt.synchronize()
                dt = (time.perf_counter() - t_last) / steps_since
                n_bad = int(bad_count.item())
                if n_bad:
                    where = int(first_bad.item())
                    if t_cfg.on_nan == "stop":
                        good = latest_valid_checkpoint(run_dir)[0]
                        raise GptspeedError(
                            f"training diverged: non-finite loss or gradient at step {where} (that step did not "
                            f"update the weights); last good checkpoint: {good.name if good else 'none'}. "
                            "Try a lower --lr, more --warmup-steps, --dtype float32, or --on-nan skip")
                    skipped_steps += n_bad
                    say(f"skipped {n_bad} step(s) with a non-finite loss or gradient (first at step {where})")
                    bad_count.zero_()
                    first_bad.fill_(-1)
                last_train = _finite(loss_sum.item())
                tps = tokens_per_step / dt
                mem_peak, mem_total = memory_stats(rt.device)
                fields = dict(train_loss=last_train, lr=lr, grad_norm=_finite(grad_norm.item()),
                              step_ms=1000 * dt, tokens_per_s=tps,
                              data_wait_ms=1000 * (loader.wait_s - wait_last) / steps_since,
                              mfu=fpt * tps / peak if peak else None,
                              mem_peak_bytes=mem_peak, mem_total_bytes=mem_total,
                              mem_frac=mem_peak / mem_total if mem_peak and mem_total else None,
                              eta_s=(t_cfg.max_steps - step) * dt,
                              epoch_eta_s=(None if stream else (1 - loader.epoch_progress()) * loader.tokens_per_epoch / tps),
                              includes_warmup=first_interval)
                if do_eval:
                    last_val = fields["val_loss"] = run_eval()
                if do_hellaswag:
                    fields.update(hellaswag(model))
                log.write(record(step, **fields))
                t_last, steps_since, first_interval = time.perf_counter(), 0, False
                wait_last = loader.wait_s
            if do_save or stop.signum:
                save()
    finally:
        stop.restore()
        loader.close()
    if stop.signum is not None:
        say(f"stopped at step {step}; checkpoint saved in {run_dir}. Resume with: gptspeed train --out {run_dir} --resume")
    else:
        say(f"done: {step} steps in {format_duration(time.time() - wall_start)}; checkpoint in {run_dir}")
    return {"step": step, "last_train_loss": last_train, "last_val_loss": last_val, "skipped_steps": skipped_steps,
            "interrupted": stop.signum, "run_dir": str(run_dir)}
