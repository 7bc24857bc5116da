"""The training loop: build the run, step, evaluate, log, checkpoint, stop cleanly.

Hot-loop rules: the loss, gradient norm and non-finite flags stay on the device and are read
(one host-device sync) only at log steps; the wall clock is read only after synchronising the
device and is stopped while evaluating; batches come from pinned memory with non-blocking copies
(see data/loader.py). What is promised about interruptions, crashes and divergence, and which
test proves it, is in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gptspeed.checkpoint import (SHARDED_META, check_free_space, checkpoint_path, estimate_checkpoint_bytes,
                                 latest_valid_checkpoint, list_checkpoints, load_checkpoint,
                                 prune_checkpoints, save_checkpoint, seal_path, seal_sharded)
from gptspeed.config import RunConfig, preset, run_defining_diff
from gptspeed.data import find_shards, load_manifest
from gptspeed.data.loader import TokenLoader, iter_eval_batches
from gptspeed.data.shards import read_header
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.metrics import RunLog, environment, format_duration, memory_stats, peak_flops
from gptspeed.model import GPT
from gptspeed.optim import build_optimizer, lr_at
from gptspeed.runtime import (Runtime, grad_sync_control, init_distributed, parallelize, resolve_runtime,
                               shutdown_distributed)


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
               fused: bool, sync=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over ``accum`` micro-batches from ``next_batch() -> (x, y)``.

    Returns device tensors ``(loss, grad_norm, bad)``: the mean loss over the micro-batches (fp32),
    the global gradient norm before clipping, and a bool that is True when the loss or the
    gradient was not finite -- then the weights and optimizer state are left as they were. With a
    fused optimizer that skip happens on the device (AdamW's ``found_inf`` argument, the mechanism
    GradScaler uses), so the step has no host-device sync; the non-fused path reads ``bad``
    (one sync) -- so does Muon (``--optimizer muon``: :class:`gptspeed.optim.MuonWithAdamW` is
    built with ``fused=False`` because ``torch.optim.Muon`` takes no ``found_inf``), which then
    skips both its optimizers. With float16 the GradScaler skips steps whose scaled gradients
    overflow, as usual.

    Data parallel (``sync`` from :func:`gptspeed.runtime.grad_sync_control`): each micro-step runs
    inside ``sync(last)``, so gradients are reduced across ranks only on the last one; the
    returned loss is this rank's (average it over ranks when logging); ``grad_norm`` is the global
    norm, the same on every rank (under FSDP2 the DTensor norm is made whole with
    ``full_tensor()``); ``bad`` is OR-ed over ranks (one scalar all-reduce, no host sync) so every
    rank skips the same steps.
    """
    loss_sum = torch.zeros((), device=rt.device)
    for i in range(accum):
        x, y = next_batch()
        with (sync(i == accum - 1) if sync is not None else contextlib.nullcontext()):
            with rt.autocast():
                _, loss = model(x, y)
            loss = loss / accum
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    if sync is not None:
        import torch.distributed as dist

        loss_bad = (~torch.isfinite(loss_sum)).to(torch.float32)
        dist.all_reduce(loss_bad, op=dist.ReduceOp.MAX)
        loss_ok = loss_bad == 0
    else:
        loss_ok = torch.isfinite(loss_sum)
    if scaler.is_enabled():
        bad = ~loss_ok  # overflowing fp16 gradients are the scaler's business
        scaler.step(optimizer)
        scaler.update()
    else:
        bad = ~(loss_ok & torch.isfinite(grad_norm))
        if fused:
            optimizer.found_inf = bad.float()
            optimizer.step()
        elif not bad.item():
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, bad


def parallel_options(cfg: RunConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`gptspeed.runtime.parallelize` a run's configuration asks for."""
    r = cfg.runtime
    return dict(compile_mode=r.compile_mode, compile_tuning=r.compile_tuning,
                activation_checkpointing=r.activation_checkpointing, fp8=r.fp8)


def auto_batch_size(cfg: RunConfig, rt: Runtime, say=print) -> int:
    """``--batch-size auto``: the micro-batch :func:`gptspeed.batchsize.resolve_auto_batch` finds
    for this configuration on ``rt.device`` (each probe builds the model afresh and takes two full
    training steps on random tokens). The probe runs eagerly even when the run compiles: one
    compile per probed size would cost minutes, and the compiled step (fused kernels) needs no more
    memory than the eager one, so the eager fit is a safe lower bound. GptspeedError off CUDA."""
    import dataclasses
    from gptspeed.batchsize import resolve_auto_batch

    T = cfg.model.block_size
    sequences = cfg.train.total_batch_tokens // T if cfg.train.total_batch_tokens else None

    def make_step(b: int):
        model = GPT(cfg.model)
        train_model = parallelize(model, dataclasses.replace(rt, compile=False), **parallel_options(cfg))
        optimizer, fused = build_optimizer(model, cfg.optim, rt.device_type)
        scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.use_grad_scaler)
        x = torch.randint(0, cfg.model.valid_vocab_size, (b, T + 1), device=rt.device)
        params = list(model.parameters())

        def step():
            return train_step(train_model, optimizer, scaler, rt, lambda: (x[:, :-1], x[:, 1:]), 1,
                              cfg.optim.grad_clip, params, fused)
        return step

    settings = {"model": cfg.model.__dict__, "dtype": rt.dtype, "compile": rt.compile, "optimizer": cfg.optim.optimizer,
                **parallel_options(cfg)}
    return resolve_auto_batch(rt.device, settings, sequences, make_step, say=say)


@torch.no_grad()
def evaluate(model: torch.nn.Module, rt: Runtime, shards: list[Path], batch_size: int, seq_len: int,
             max_tokens: int = 0, max_token_id: int | None = None) -> tuple[float, int]:
    """Mean cross-entropy (nats/token) over the first ``max_tokens`` tokens of ``shards`` (0 = all).
    Returns ``(loss, tokens)``; one host-device sync at the end.

    With several ranks the batches are dealt round-robin (``iter_eval_batches``) and ``(sum,
    count)`` all-reduced, so every rank returns the same figure. Under FSDP2 every forward is a
    collective: ranks with fewer batches run dummy forwards until all have run as many."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
    n = 0
    batches = 0
    for x, y in iter_eval_batches(shards, batch_size, seq_len, max_tokens, rank=rt.rank,
                                  world_size=rt.world_size, device=rt.device, max_token_id=max_token_id):
        with rt.autocast():
            _, loss = model(x, y)
        total += loss.double() * y.numel()
        n += y.numel()
        batches += 1
    if rt.distributed:
        import torch.distributed as dist

        if rt.parallel == "fsdp":
            most = torch.tensor([batches], device=rt.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            dummy = torch.zeros((1, seq_len), dtype=torch.long, device=rt.device)
            for _ in range(int(most.item()) - batches):
                with rt.autocast():
                    model(dummy, dummy)
        both = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=rt.device)])
        dist.all_reduce(both)
        total, n = both[0], int(both[1].item())
    _reshard(model)
    model.train(was_training)
    return (total / n).item(), n


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps the root's parameters unsharded after a forward (backward would gather them
    again at once); after a no-grad forward nothing frees them, and the next training step then
    leaves the root's gradients unreduced. Reshard explicitly (FSDPModule.reshard)."""
    inner = getattr(model, "_orig_mod", model)
    if hasattr(inner, "reshard") and hasattr(inner, "set_requires_gradient_sync"):
        for m in inner.modules():
            if hasattr(m, "reshard") and hasattr(m, "set_requires_gradient_sync"):
                m.reshard()


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

    Under torchrun (WORLD_SIZE > 1) every rank runs this: configuration errors (a global batch
    the world size does not divide, ...) are raised before any collective, so every rank reports
    them and none hangs; then the ranks join the process group and compare a hash of their
    configurations. Only rank 0 prints and writes config.json, metrics.jsonl and ``.pt``
    checkpoints; under FSDP2 all ranks write their shards of a ``.dcp`` checkpoint.
    """
    t_cfg = cfg.train
    if not t_cfg.data:
        raise GptspeedError("--data is required: a folder made by `gptspeed prepare`")
    if not t_cfg.out:
        raise GptspeedError("--out is required: the run folder for checkpoints and metrics")
    rt = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.parallel)
    cfg.validate(rt.world_size)
    echo = echo and rt.is_main
    say = print if echo else (lambda *a, **k: None)
    try:
        init_distributed(rt, cfg.runtime.dist_timeout_s)
        _check_same_config(cfg, rt)
        return _fit(cfg, rt, say, echo)
    finally:
        shutdown_distributed()


def _config_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_same_config(cfg: RunConfig, rt: Runtime) -> None:
    """GptspeedError on every rank when the ranks were launched with different configurations
    (one ``all_gather_object`` of a config hash)."""
    if not rt.distributed:
        return
    import torch.distributed as dist

    hashes: list[Any] = [None] * rt.world_size
    dist.all_gather_object(hashes, _config_hash(cfg))
    if len(set(hashes)) > 1:
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise GptspeedError(f"ranks were launched with different configurations (ranks {odd} differ from rank 0): "
                            "give every node the same flags and config file")


def _barrier(rt: Runtime) -> None:
    if rt.distributed:
        import torch.distributed as dist

        dist.barrier()


def _fit(cfg: RunConfig, rt: Runtime, say, echo: bool) -> dict[str, Any]:
    t_cfg = cfg.train
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
            ck_world = ckpt.get("world_size", 1)
            if "optimizer" in ckpt or ckpt.get("sharded"):
                if ck_world != rt.world_size:  # the loader re-shards its position or refuses (naming both sizes)
                    say(f"resuming {path.name} (world size {ck_world}) with world size {rt.world_size}")
                if rt.parallel == "fsdp" and not ckpt.get("sharded"):
                    raise GptspeedError(f"cannot resume the single-file checkpoint {path.name} with --parallel fsdp: "
                                        "resume it with --parallel ddp (or one process), or start a new --out")
                if rt.parallel != "fsdp" and ckpt.get("sharded"):
                    raise GptspeedError(f"{path.name} is a sharded (FSDP) checkpoint: resume with --parallel fsdp, or "
                                        f"make a single file with `gptspeed consolidate --run {run_dir} --out NEW_RUN`")
            changed = run_defining_diff(RunConfig.from_dict(ckpt["config"], f"checkpoint {path}"), cfg)
            if "optimizer" not in ckpt and not ckpt.get("sharded"):  # weights only (gptspeed import-hf): only the model must match
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

    if t_cfg.batch_size == 0:  # --batch-size auto
        t_cfg.batch_size = auto_batch_size(cfg, rt, say)
    B, T, W = t_cfg.batch_size, cfg.model.block_size, rt.world_size
    accum = cfg.grad_accum_steps(W)
    tokens_per_step = B * T * accum * W  # all ranks
    max_id = cfg.model.valid_vocab_size
    loader_workers = t_cfg.loader_workers if t_cfg.loader_workers >= 0 else int(rt.device.type == "cuda")
    if stream:
        if W > 1:
            raise GptspeedError("streaming training (--data jsonl:/hf:) runs in one process: prepare shards for torchrun")
        loader = StreamLoader(t_cfg.data, B, T, device=rt.device, workers=max(1, loader_workers))
    else:
        loader = TokenLoader(train_shards, B, T, rank=rt.rank, world_size=W, device=rt.device, max_token_id=max_id,
                             sampling=t_cfg.sampling, seed=cfg.runtime.seed, workers=loader_workers)
        _check_val_size(val_shards, T)
    from gptspeed.eval.hellaswag import hellaswag_hook

    hellaswag = hellaswag_hook(cfg, rt)  # None unless --hellaswag-every; loads its data now

    torch.manual_seed(cfg.runtime.seed)
    model = GPT(cfg.model)
    if rt.is_main:
        _prepare_run_dir(run_dir)
    _barrier(rt)
    check_free_space(run_dir, estimate_checkpoint_bytes(model))
    if ckpt is not None and not ckpt.get("sharded"):
        model.load_state_dict(ckpt["model"])  # before wrapping: DDP / FSDP2 take the loaded weights
    elif ckpt is None and t_cfg.init_from:
        from gptspeed.hf import load_hf_weights

        say(f"initialised from {load_hf_weights(model, t_cfg.init_from)}")
    train_model = parallelize(model, rt, **parallel_options(cfg))
    sync = grad_sync_control(train_model)
    optimizer, fused = build_optimizer(model, cfg.optim, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.use_grad_scaler)
    step = skipped_steps = 0
    if ckpt is not None:
        if ckpt.get("sharded"):
            _load_sharded(path, model, optimizer)
        elif "optimizer" in ckpt:  # absent from weights-only checkpoints (gptspeed import-hf)
            optimizer.load_state_dict(ckpt["optimizer"])
        if "optimizer" in ckpt or ckpt.get("sharded"):
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
    if step >= t_cfg.max_steps:
        say(f"{run_dir} is already at step {step} of {t_cfg.max_steps}: nothing to do (raise --max-steps to go on)")
        return {"step": step, "last_train_loss": None, "last_val_loss": None, "skipped_steps": skipped_steps,
                "interrupted": None, "run_dir": str(run_dir)}

    fpt = model.flops_per_token(T)
    peak, peak_source = peak_flops(rt.device, rt.dtype, cfg.runtime.peak_tflops)  # one device
    env = environment(rt.device)
    config_json = {**cfg.to_dict(), "derived": {
        "grad_accum_steps": accum, "tokens_per_step": tokens_per_step, "params": model.num_params(False),
        "params_non_embedding": model.num_params(), "flops_per_token": fpt, "fused_adamw": fused,
        "dtype": rt.dtype, "compile": rt.compile, "device": str(rt.device),
        "world_size": W, "parallel": rt.parallel,
        "peak_flops": peak, "peak_flops_source": peak_source, "train_tokens_per_epoch": getattr(loader, "tokens_per_epoch", None),
        "data": data_id}, "environment": env}
    if rt.is_main:
        write_text_atomic(run_dir / "config.json", json.dumps(config_json, indent=2) + "\n")
        log = RunLog(run_dir / "metrics.jsonl", echo=echo)
        log.truncate_after(step if ckpt is not None else -1)
        write_record = log.write
    else:
        write_record = lambda rec: None  # noqa: E731 -- only rank 0 writes metrics

    say(f"gptspeed: {model.num_params(False) / 1e6:.2f}M parameters | {env['device']} ({rt.device}) | {rt.dtype} | "
        f"compile {cfg.runtime.compile_mode + ' ' + cfg.runtime.compile_tuning if rt.compile else 'off'} | "
        f"{cfg.optim.optimizer}{' (fused AdamW)' if fused else ''} | {'fp8 | ' if cfg.runtime.fp8 else ''}"
        f"activation checkpointing {cfg.runtime.activation_checkpointing} | "
        f"B={B} T={T} x {accum} micro-steps" + (f" x {W} ranks ({rt.parallel})" if W > 1 else "")
        + f" = {tokens_per_step:,} tokens/step")
    if ckpt is not None:
        say(f"resumed from step {step}")
    if peak is None:
        say(f"MFU: not reported ({peak_source})")

    def record(step_: int, **fields) -> dict[str, Any]:
        return {"step": step_, "max_steps": t_cfg.max_steps, "tokens": step_ * tokens_per_step,
                "documents": loader.documents, "epoch": loader.epoch + loader.epoch_progress(),
                "time_s": time.time() - wall_start, "skipped_steps": skipped_steps, **fields}

    def save() -> None:
        meta = {
            "step": step, "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "loader": loader.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(rt.device) if rt.device_type == "cuda" else None},
            "config": cfg.to_dict(), "data": data_id, "skipped_steps": skipped_steps, "world_size": W,
        }
        if rt.parallel == "fsdp":
            _save_sharded(run_dir, rt, model, optimizer, meta, t_cfg.keep_checkpoints)
            return
        if rt.is_main:  # DDP: every rank holds the same weights; rank 0 writes the unwrapped module's
            save_checkpoint(run_dir, {**meta, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                            keep=t_cfg.keep_checkpoints)
        _barrier(rt)

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
            write_record(record(0, val_loss=last_val))
        max_lr, min_lr = cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio
        t_last, steps_since, first_interval = time.perf_counter(), 0, True
        wait_last = loader.wait_s
        params = list(model.parameters())
        bad_count = torch.zeros((), dtype=torch.int64, device=rt.device)  # non-finite steps since last read
        first_bad = torch.full((), -1, dtype=torch.int64, device=rt.device)
        stopping: int | None = None  # the signal that stops the run (agreed by all ranks)
        while step < t_cfg.max_steps and stopping is None:
            lr = lr_at(step, max_lr=max_lr, min_lr=min_lr, warmup_steps=cfg.optim.warmup_steps,
                       max_steps=t_cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
            loss_sum, grad_norm, bad = train_step(train_model, optimizer, scaler, rt, loader.next_batch, accum,
                                                  cfg.optim.grad_clip, params, fused, sync)
            step += 1
            steps_since += 1
            bad_count += bad
            first_bad = torch.where(bad & (first_bad < 0), step, first_bad)

            do_eval = step == t_cfg.max_steps or (t_cfg.eval_every > 0 and step % t_cfg.eval_every == 0)
            do_save = step == t_cfg.max_steps or (t_cfg.save_every > 0 and step % t_cfg.save_every == 0)
            do_hellaswag = hellaswag is not None and (step == t_cfg.max_steps or step % t_cfg.hellaswag_every == 0)
            if not rt.distributed:
                stopping = stop.signum
            # ranks agree on stopping at log steps only (a collective per step would cost a sync)
            if first_interval or do_eval or do_save or do_hellaswag or step % t_cfg.log_every == 0 or stopping:
                if rt.distributed:
                    import torch.distributed as dist

                    loss_sum = loss_sum.clone()
                    dist.all_reduce(loss_sum)  # gloo has no AVG: sum, then divide
                    loss_sum /= W
                    sig = torch.tensor([stop.signum or 0], device=rt.device)
                    dist.all_reduce(sig, op=dist.ReduceOp.MAX)
                    stopping = int(sig.item()) or None
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
                tps = tokens_per_step / dt  # all ranks together
                mem_peak, mem_total = memory_stats(rt.device)
                fields = dict(train_loss=last_train, lr=lr, grad_norm=_finite(grad_norm.item()),
                              step_ms=1000 * dt, tokens_per_s=tps, tokens_per_s_per_device=tps / W,
                              data_wait_ms=1000 * (loader.wait_s - wait_last) / steps_since,
                              mfu=fpt * tps / (peak * W) if peak else None,  # over the sum of device peaks
                              mem_peak_bytes=mem_peak, mem_total_bytes=mem_total,
                              mem_frac=mem_peak / mem_total if mem_peak and mem_total else None,
                              eta_s=(t_cfg.max_steps - step) * dt,
                              epoch_eta_s=(None if stream else (1 - loader.epoch_progress()) * loader.tokens_per_epoch / tps),
                              includes_warmup=first_interval)
                if do_eval:
                    last_val = fields["val_loss"] = run_eval()
                if do_hellaswag:
                    fields.update(hellaswag(model))  # every rank: FSDP2 forwards are collectives
                    _reshard(model)
                write_record(record(step, **fields))
                t_last, steps_since, first_interval = time.perf_counter(), 0, False
                wait_last = loader.wait_s
            if do_save or stopping:
                save()
    finally:
        stop.restore()
        loader.close()
    if stopping is not None:
        say(f"stopped at step {step}; checkpoint saved in {run_dir}. Resume with: gptspeed train --out {run_dir} --resume")
    else:
        say(f"done: {step} steps in {format_duration(time.time() - wall_start)}; checkpoint in {run_dir}")
    return {"step": step, "last_train_loss": last_train, "last_val_loss": last_val, "skipped_steps": skipped_steps,
            "interrupted": stopping, "run_dir": str(run_dir)}


def _save_sharded(run_dir: Path, rt: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  meta: dict[str, Any], keep: int) -> Path:
    """FSDP2: every rank writes its shards of model and optimizer state with
    ``torch.distributed.checkpoint.save`` into ``ckpt_{step:08d}.dcp/``; rank 0 adds ``meta.pt``
    (step, loader, RNG, config...) and, after a barrier, the seal listing every file's sha256, so a
    crash at any point leaves no sealed, incomplete checkpoint. Sources:
    https://pytorch.org/docs/stable/distributed.checkpoint.html"""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gptspeed.checkpoint import FORMAT, FORMAT_VERSION

    folder = checkpoint_path(run_dir, meta["step"], sharded=True)
    if rt.is_main:
        seal_path(folder).unlink(missing_ok=True)  # an old seal must never vouch for new files
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    _barrier(rt)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
        if rt.is_main:
            torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, "sharded": True, **meta},
                       folder / SHARDED_META)
    except OSError as e:
        raise GptspeedError(f"could not write checkpoint {folder}: {e.strerror or e}") from e
    _barrier(rt)
    if rt.is_main:
        seal_sharded(folder, meta["step"])
        prune_checkpoints(run_dir, keep)
    _barrier(rt)
    return folder


def _load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a ``.dcp`` checkpoint into an FSDP2-sharded model and its optimizer (DCP re-shards
    to the current world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
