"""The training loop: a :class:`Trainer` that builds a run's parts once and steps them.

``Trainer.__init__`` builds the data loader, the model and its parallel/compiled wrapper, the
optimizer, the GradScaler, the checkpointer (every piece of state registered by name) and the
metrics log; :meth:`Trainer.train` resumes, then per step sets the learning rate, runs
:meth:`Trainer.train_step` (= :meth:`~Trainer.forward_backward` per micro-batch, then
:meth:`~Trainer.optimizer_step`) and, when due, logs, evaluates and saves. Compare torchtitan's
``Trainer.train`` / ``train_step`` / ``forward_backward_step`` and litgpt's ``fit``.

Hot-loop rules: the loss, gradient norm and non-finite flags stay on the device and are read (one
host-device sync) only at log steps; the wall clock is read only after synchronising the device
and is stopped while evaluating; batches come from pinned memory with non-blocking copies (see
data/loader.py). What is promised about interruptions, crashes and divergence, and which test
proves it, is in docs/reliability.md; who calls whom is in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gptspeed.checkpoint import (Checkpointer, ModelState, OptimizerState, RNGState, RunFolder, check_free_space,
                                 checkpoint_path, estimate_checkpoint_bytes, latest_valid_checkpoint,
                                 list_checkpoints, refuse_checkpoints)
from gptspeed.config import AUTO_BATCH_SIZE, RunConfig, run_defining_diff, world_from_env
from gptspeed.configure import build_train_config  # noqa: F401 -- re-exported beside fit
from gptspeed.cpu import keep_freed_memory
from gptspeed.data.shards import ShardError
from gptspeed.data.train_data import TrainData, find_train_data
from gptspeed.distributed import init_distributed, peer_lost, shutdown_distributed
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.metrics import RunLog, Throughput, environment, format_duration, memory_stats, peak_flops
from gptspeed.optim import lr_at
from gptspeed.parallelize import eager
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.step import TrainStep, auto_batch_size, build_model


MAX_SKIPPED_SHARE = 0.5  # --on-nan skip: a run with at least this share of its steps skipped has diverged


class StopFlag:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) set ``signum``; the loop
    finishes its step, saves and exits 128+signum. The notice is printed once: later signals (a
    scheduler repeating SIGTERM while the checkpoint is written) only wait for the save -- printing
    from a handler that interrupted another print would raise "reentrant call" and kill the
    process before its resume line; SIGTERM and SIGHUP are then ignored (``SIG_IGN``, which also
    outlives the interpreter's shutdown) and the handlers are left so when the run ends. A second SIGINT raises KeyboardInterrupt at once (checkpoints
    are written atomically, so nothing is corrupted). Calling the flag says whether a signal arrived."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self, say=print):
        self.signum: int | None = None
        self.say = say
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # already stopping: the save goes on
        self.signum = signum
        for repeat in self.SIGNALS:  # repeats of SIGTERM / SIGHUP are ignored by the OS from here to the exit
            if repeat != signal.SIGINT:
                signal.signal(repeat, signal.SIG_IGN)
        with contextlib.suppress(RuntimeError):  # "reentrant call": the signal interrupted a print
            self.say(f"\n{signal.Signals(signum).name} received: finishing this step and saving a checkpoint "
                     "(Ctrl-C again to quit now)", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class Due:
    """What a step is due for, by the configured intervals."""

    log: bool
    eval: bool
    save: bool
    hellaswag: bool


class Trainer:
    """One training run. Build it with a validated configuration and a resolved runtime (every
    rank under torchrun), then call :meth:`train`.

    Raises GptspeedError while building for anything the user can fix: bad data, a folder
    another process is writing, a checkpoint that would not continue the same run. The run
    folder is locked first; a folder this run created is removed again if building fails.
    """

    def __init__(self, cfg: RunConfig, rt: Runtime, *, echo: bool = True):
        self.cfg = cfg = copy.deepcopy(cfg)  # --batch-size auto is resolved in our copy only
        self.rt = rt
        self.echo = echo and rt.is_main
        self.say: Callable[..., None] = print if self.echo else (lambda *a, **k: None)
        t = cfg.train
        self.run_dir = Path(t.out)
        self.step = self.skipped_steps = self.tokens = 0
        self.resume_world: int | None = None  # the world size of the checkpoint resumed
        self.data: TrainData = find_train_data(t.data, text_field=t.text_field, hf_name=t.hf_name, split=t.split)
        self.loader = None
        self.folder = RunFolder(self.run_dir, rt.is_main)
        self.folder.open()  # the lock first: no other writer reads or writes the folder from here on
        self.barrier()
        try:
            self._setup(cfg, rt)
        except BaseException:
            self.close()
            self.folder.abandon()  # a folder this run created is removed again
            raise

    def _setup(self, cfg: RunConfig, rt: Runtime) -> None:
        t = cfg.train
        self.checkpointer = Checkpointer(
            self.run_dir, sharded=rt.parallel == "fsdp", is_main=rt.is_main, barrier=self.barrier,
            keep=t.keep_checkpoints, every=t.save_every, last_step=t.max_steps,
            meta={"config": cfg.to_dict(), "data": self.data.identity, "world_size": rt.world_size})
        self.resume_from, self.resume_kind = self._resume_point()  # refuses a changed run before writing
        if self.run_id is None:  # a new run (or one of an earlier gptspeed): its identity from now on
            import uuid

            self.run_id = uuid.uuid4().hex
        self.checkpointer.meta["run_id"] = self.run_id
        self._keep_global_batch(cfg, rt)
        if t.batch_size == AUTO_BATCH_SIZE:
            t.batch_size = auto_batch_size(cfg, rt, self.say)
            cfg.validate(rt.world_size)  # what needs B (the FP8 shape rule) is checked now
            self.checkpointer.meta["config"] = cfg.to_dict()
        self.tokens_per_step = t.batch_size * cfg.model.block_size * cfg.grad_accum_steps(rt.world_size) * rt.world_size
        workers = t.loader_workers if t.loader_workers >= 0 else int(rt.device_type == "cuda")
        self.loader = self.data.loader(t.batch_size, cfg.model.block_size, rank=rt.rank, world_size=rt.world_size,
                                       device=rt.device, max_token_id=cfg.model.valid_vocab_size,
                                       sampling=t.sampling, seed=cfg.runtime.seed, workers=workers)
        self.data.check_val(cfg.model.block_size)
        keep = cfg.runtime.keep_freed_memory
        if keep is None:
            keep = rt.device_type == "cpu"
        self.malloc_reason = keep_freed_memory()[1] if keep else "the system malloc as it is (off)"
        from gptspeed.eval.hellaswag import hellaswag_hook

        self.hellaswag = hellaswag_hook(cfg, rt)  # None unless --hellaswag-every; loads its data now
        self._build_step(cfg, rt)  # every rule of the step is checked here, before the device is touched
        check_free_space(self.run_dir, estimate_checkpoint_bytes(self.model))
        self._register_state()
        if self.resume_from is not None:
            self.checkpointer.load(self.resume_from)
        self._init_counters()
        self.flops_per_token = self.model.flops_per_token(cfg.model.block_size)
        self.peak, self.peak_source = peak_flops(rt.device, rt.dtype, cfg.runtime.peak_tflops)  # one device
        self.throughput = Throughput(self.tokens_per_step, self.flops_per_token, self.peak, rt.world_size,
                                     t.max_steps)
        self.log = None
        if rt.is_main:
            show_docs = self.data.documents is None or self.data.documents > 1
            from gptspeed.trackers import open_trackers  # --log-to: TensorBoard, W&B (rank 0 only)

            before = {p.name for p in self.run_dir.iterdir()}
            trackers = open_trackers(t.log_to, self.run_dir, cfg.to_dict(),
                                     self.step if self.resume_kind == "full" else None, say=self.say)
            self.folder.written |= {p.name for p in self.run_dir.iterdir()} - before  # their files and folders
            self.log = RunLog(self.run_dir / "metrics.jsonl", echo=self.echo, show_documents=show_docs,
                              trackers=trackers)

    def _keep_global_batch(self, cfg: RunConfig, rt: Runtime) -> None:
        """Record the global batch a run starts with (``--total-batch-tokens`` left unset: B x T x
        the world size), so that a resume with another number of processes keeps it by adjusting
        the gradient accumulation -- or is refused in one line when it cannot. Checkpoints written
        before this was recorded keep the global batch of the world size they were written with."""
        t = cfg.train
        if t.total_batch_tokens is None and t.batch_size != AUTO_BATCH_SIZE:
            t.total_batch_tokens = t.batch_size * cfg.model.block_size * (self.resume_world or rt.world_size)
            self.checkpointer.meta["config"] = cfg.to_dict()
        if t.batch_size == AUTO_BATCH_SIZE:
            return
        try:
            cfg.grad_accum_steps(rt.world_size)
        except GptspeedError:
            if self.resume_from is None:
                raise
            per = t.batch_size * cfg.model.block_size * rt.world_size
            raise GptspeedError(
                f"cannot resume {self.resume_from.name} with {rt.world_size} process(es): its global batch of "
                f"{t.total_batch_tokens:,} tokens is not a multiple of --batch-size x --seq-len x processes = {per:,}; "
                f"resume with {self.resume_world or 1} process(es), or with --force-resume and a --batch-size or "
                "--total-batch-tokens that fits (the run then changes)") from None

    # ------------------------------------------------------------------------------ building
    def _init_counters(self) -> None:
        """Non-finite steps since the last read, and the first of them, kept on the device."""
        self.bad_count = torch.zeros((), dtype=torch.int64, device=self.rt.device)
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=self.rt.device)

    def _build_step(self, cfg: RunConfig, rt: Runtime) -> None:
        """The model (seeded; ``--init-from`` weights on a new run) and its :class:`TrainStep`."""
        model = build_model(cfg, rt)
        if cfg.model.softmax == "data":  # the same ids on resume (the data are checked unchanged)
            model.set_softmax_ids(self.data.token_ids())
        if cfg.train.init_from and self.resume_from is None:
            from gptspeed.hf import load_hf_weights

            self.say(f"initialised from {load_hf_weights(model, cfg.train.init_from)}")
        self.stepper = TrainStep(cfg, rt, model=model)

    # the step's parts, for the checkpointer, evaluation and the log
    model = property(lambda self: self.stepper.model)
    train_model = property(lambda self: self.stepper.train_model)
    optimizer = property(lambda self: self.stepper.optimizer)
    scaler = property(lambda self: self.stepper.scaler)
    skips_on_device = property(lambda self: self.stepper.skips_on_device)
    accum = property(lambda self: self.stepper.accum)

    def _register_state(self) -> None:
        """Every piece of state a resume needs, by name (adding one is one line)."""
        sharded = self.rt.parallel == "fsdp"
        c = self.checkpointer
        c.register("model", ModelState(self.model, sharded), sharded=True)
        c.register("optimizer", OptimizerState(self.model, self.optimizer, sharded), sharded=True)
        if self.scaler.is_enabled():
            c.register("scaler", self.scaler)
        c.register("loader", self.loader)
        c.register("rng", RNGState(self.rt.device))
        c.register("trainer", self)

    def _resume_point(self) -> tuple[Path | None, str | None]:
        """With ``--resume``: the newest valid checkpoint and its kind (``full``, or ``weights``
        for an imported model), after checking it continues this run. Without: refuse a folder
        that already holds checkpoints."""
        t = self.cfg.train
        self.run_id: str | None = None  # the resumed checkpoint's run (None: a new run)
        if not t.resume:
            refuse_checkpoints(self.run_dir, "pass --resume to continue it, or choose another --out")
            return None, None
        path = self.checkpointer.resume_point(self.say)
        if path is None:
            found = [p.name for p in list_checkpoints(self.run_dir)]
            metrics = self.run_dir / "metrics.jsonl"
            if found and metrics.is_file():
                found.append(metrics.name)
            # never write over checkpoints that cannot be verified; a run killed before its first
            # save (a metrics.jsonl, no checkpoint) is started again, as resuming it means
            if found:
                raise GptspeedError(f"--resume: {self.run_dir} holds {', '.join(found[:4])}{' ...' if len(found) > 4 else ''} "
                                    "but no checkpoint that can be verified (each is unsealed or damaged): refusing to "
                                    "write over them; move them away, or choose another --out")
            self.say(f"--resume: no checkpoint in {self.run_dir}, starting a new run")
            return None, None
        changes = lambda d: run_defining_diff(RunConfig.from_dict(d, f"checkpoint {path}"), self.cfg)  # noqa: E731
        seal = self.checkpointer.check_resume(path, changes, force=t.force_resume, say=self.say)
        self.resume_world = int(seal.get("world_size", 1))
        if seal.get("kind", "full") == "full" and isinstance(seal.get("run_id"), str):
            self.run_id = seal["run_id"]
        return path, seal.get("kind", "full")

    # ----------------------------------------------------------------------- trainer state
    def state_dict(self) -> dict[str, int]:
        """The trainer's own counters: optimizer steps done, steps skipped as non-finite, and tokens
        trained on (a resume with another global batch goes on counting from there)."""
        return {"step": self.step, "skipped_steps": self.skipped_steps, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        self.tokens = int(state.get("tokens", self.step * self.tokens_per_step))  # older checkpoints: one batch size

    # ----------------------------------------------------------------------------- stepping
    def barrier(self) -> None:
        if self.rt.distributed:
            import torch.distributed as dist

            dist.barrier()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over the loader's next micro-batches (:class:`gptspeed.step.TrainStep`).
        Returns device tensors ``(loss, grad_norm, bad)``. A shard that went bad under the run
        (:class:`gptspeed.data.shards.ShardError`) raises GptspeedError naming it, after saving the
        steps done since the last checkpoint when it can (:meth:`save_before_data_error`)."""
        at = self.loader.mark()  # a few ints: where a failed step rewinds to
        try:
            return self.stepper(self.loader.next_batch)
        except ShardError as e:
            raise GptspeedError(f"{e}. {self.save_before_data_error(at)}") from None

    def save_before_data_error(self, at: Any) -> str:
        """Save the checkpoint of the last finished step after the loader failed mid-step (its
        position rewound to the step's start with ``at``; the weights and optimizer are untouched
        until the last micro-batch is in). One process only: with several, the others wait in a
        collective. Returns what was done, for the error line."""
        if self.step == 0:
            return "No step was done"
        if self.rt.distributed:
            return "The steps since the last checkpoint are lost"
        if checkpoint_path(self.run_dir, self.step).exists():
            return f"The checkpoint of step {self.step} is intact"
        self.loader.rewind(at)
        try:
            self.checkpointer.save(self.step)
        except GptspeedError as e:
            return f"Saving step {self.step} failed too: {e}"
        return (f"Trained {self.step:,} steps ({self.tokens:,} tokens); the checkpoint of step {self.step} was saved: "
                f"fix the {'data' if self.data.is_stream else 'shard'}, then --resume")

    def set_lr(self) -> float:
        """The learning rate of this step (warm-up then cosine, :func:`gptspeed.optim.lr_at`) into
        every param group, times the group's ``lr_mult``."""
        o = self.cfg.optim
        lr = lr_at(self.step, max_lr=o.lr, min_lr=o.lr * o.min_lr_ratio, warmup_steps=self.cfg.warmup_steps(),
                   max_steps=self.cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    # ------------------------------------------------------------------------- the policies
    def note_non_finite(self, bad: torch.Tensor) -> None:
        """Count a skipped step on the device (no sync) and remember the first one."""
        self.bad_count += bad
        self.first_bad = torch.where(bad & (self.first_bad < 0), self.step, self.first_bad)

    def handle_non_finite(self) -> None:
        """The ``--on-nan`` policy, applied at log steps (one read of the device counters):
        ``stop`` raises GptspeedError naming the first bad step and the last good checkpoint;
        ``skip`` counts the skipped steps and goes on -- while they are isolated: once at least
        :data:`MAX_SKIPPED_SHARE` of the run's steps (and 3 or more) were skipped, the run is not
        training any more, and it stops as ``stop`` does."""
        n_bad = int(self.bad_count.item())
        if not n_bad:
            return
        where = int(self.first_bad.item())
        skipped = self.skipped_steps + n_bad
        if self.cfg.train.on_nan == "stop" or (skipped >= 3 and skipped >= MAX_SKIPPED_SHARE * self.step):
            good = latest_valid_checkpoint(self.run_dir)[0]
            what = (f"non-finite loss or gradient at step {where} (that step did not update the weights)"
                    if self.cfg.train.on_nan == "stop" else
                    f"{skipped} of the {self.step} steps so far had a non-finite loss or gradient and were skipped "
                    f"(--on-nan skip goes on past isolated ones only)")
            raise GptspeedError(
                f"training diverged: {what}; last good checkpoint: {good.name if good else 'none'}. "
                f"Try a lower --lr, more --warmup-steps, --dtype float32{', or --on-nan skip' if self.cfg.train.on_nan == 'stop' else ''}")
        self.skipped_steps += n_bad
        self.say(f"skipped {n_bad} step(s) with a non-finite loss or gradient (first at step {where})")
        self.bad_count.zero_()
        self.first_bad.fill_(-1)

    def due(self, step: int, first_interval: bool) -> Due:
        t = self.cfg.train
        last = step == t.max_steps
        d = Due(log=False, eval=last or (t.eval_every > 0 and step % t.eval_every == 0),
                save=self.checkpointer.due(step),
                hellaswag=self.hellaswag is not None and (last or step % t.hellaswag_every == 0))
        d.log = first_interval or d.eval or d.save or d.hellaswag or step % t.log_every == 0
        return d

    def agree_on_stop(self, stop: StopFlag) -> int | None:
        """The signal that stops the run, agreed by all ranks (one all-reduce; at log steps only)."""
        if not self.rt.distributed:
            return stop.signum
        import torch.distributed as dist

        sig = torch.tensor([stop.signum or 0], device=self.rt.device)
        dist.all_reduce(sig, op=dist.ReduceOp.MAX)
        return int(sig.item()) or None

    # ------------------------------------------------------------------- evaluating, logging
    def evaluate(self, stop: Callable[[], bool] | None = None) -> float | None:
        """Val loss over ``--eval-tokens`` (None without a val split, as for a stream, or when
        ``stop`` interrupted it)."""
        if not self.data.has_val:
            return None
        from gptspeed.eval.val_loss import evaluate

        t = self.cfg.train
        with self.stepper.attention():
            return evaluate(self.train_model, self.rt, self.data.val_shards, t.batch_size, self.cfg.model.block_size,
                            t.eval_tokens, self.cfg.model.valid_vocab_size, stop=stop)[0]

    def record(self, step: int, **fields) -> None:
        """Write one metrics record (rank 0): progress counters plus ``fields``."""
        if self.log is None:
            return
        self.log.write({"step": step, "max_steps": self.cfg.train.max_steps, "tokens": self.tokens,
                        "documents": self.loader.documents, "epoch": self.loader.epoch + self.loader.epoch_progress(),
                        "time_s": time.monotonic() - self.wall_start, "skipped_steps": self.skipped_steps, **fields})

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, due: Due,
                 stop: StopFlag) -> dict[str, Any]:
        """The record of a log step: losses and norms read (the step's one sync), throughput since
        the last record, memory, and the evaluations due. Returns its fields."""
        if self.rt.distributed:
            import torch.distributed as dist

            loss = loss.clone()
            dist.all_reduce(loss)  # gloo has no AVG: sum, then divide
            loss /= self.rt.world_size
        self.rt.synchronize()
        left = None
        if self.loader.tokens_per_epoch:
            left = (1 - self.loader.epoch_progress()) * self.loader.tokens_per_epoch
        fields = self.throughput.measure(self.step, left, self.loader.wait_s)
        self.handle_non_finite()
        mem_peak, mem_total = memory_stats(self.rt.device)
        fields.update(train_loss=_finite(loss.item()), lr=lr, grad_norm=_finite(grad_norm.item()),
                      mem_peak_bytes=mem_peak, mem_total_bytes=mem_total,
                      mem_frac=mem_peak / mem_total if mem_peak and mem_total else None)
        if due.eval:
            fields["val_loss"] = self.evaluate(stop)
        if due.hellaswag:
            with self.stepper.attention():
                fields.update(self.hellaswag(self.model))  # every rank: FSDP2 forwards are collectives
            if self.rt.parallel == "fsdp":
                from gptspeed.eval.val_loss import reshard

                reshard(self.model)
        self.record(self.step, **fields)
        self.throughput.restart(self.loader.wait_s)
        return fields

    # --------------------------------------------------------------------------------- run
    def _write_config(self) -> None:
        if not self.rt.is_main:
            return
        cfg, rt = self.cfg, self.rt
        derived = {"grad_accum_steps": self.accum, "tokens_per_step": self.tokens_per_step,
                   "params": self.model.num_params(False), "params_non_embedding": self.model.num_params(),
                   "flops_per_token": self.flops_per_token, "fused_adamw": self.skips_on_device, "dtype": rt.dtype,
                   "compile": rt.compile, "device": str(rt.device), "world_size": rt.world_size,
                   "parallel": rt.parallel, "warmup_steps": cfg.warmup_steps(), "peak_flops": self.peak,
                   "peak_flops_source": self.peak_source, "train_tokens_per_epoch": self.loader.tokens_per_epoch,
                   "data": self.data.identity, "run_id": self.run_id}
        doc = {**cfg.to_dict(), "derived": derived, "environment": environment(rt.device)}
        self.folder.written.add("config.json")
        write_text_atomic(self.run_dir / "config.json", json.dumps(doc, indent=2) + "\n")

    def _announce(self) -> None:
        cfg, rt, t = self.cfg, self.rt, self.cfg.train
        B, T, W = t.batch_size, cfg.model.block_size, rt.world_size
        r = cfg.runtime
        self.say(f"gptspeed: {self.model.num_params(False) / 1e6:.2f}M parameters | {environment(rt.device)['device']} "
                 f"({rt.device}) | {rt.dtype} | compile {r.compile_mode + ' ' + r.compile_tuning if rt.compile else 'off'}"
                 f" | {cfg.optim.optimizer}{' (fused AdamW)' if self.skips_on_device else ''} | "
                 f"{'fp8 | ' if r.fp8 else ''}"
                 f"{f'sdpa {r.sdpa_backend} | ' if r.sdpa_backend != 'auto' else ''}activation checkpointing {r.activation_checkpointing} | "
                 f"B={B} T={T} x {self.accum} micro-steps" + (f" x {W} ranks ({rt.parallel})" if W > 1 else "")
                 + f" = {self.tokens_per_step:,} tokens/step")
        why_compile = rt.compile_reason or ("on" if rt.compile else "off")
        self.say(f"why: dtype {rt.dtype_reason or rt.dtype} | compile {why_compile} | malloc: {self.malloc_reason}")
        warmup = cfg.warmup_steps()
        if warmup >= t.max_steps:
            self.say(f"warning: warm-up is {warmup} steps but the run has {t.max_steps}: the learning rate never "
                     f"reaches --lr {cfg.optim.lr:g}; lower --warmup-steps or give --warmup-ratio (e.g. 0.05)")
        if self.step:
            self.say(f"resumed from step {self.step}")
        if self.peak is None:
            self.say(f"MFU: not reported ({self.peak_source})")

    def train(self) -> dict[str, Any]:
        """Train to ``--max-steps`` (or until SIGINT / SIGTERM). Returns a summary: ``step``,
        ``last_train_loss``, ``last_val_loss``, ``skipped_steps``, ``interrupted`` (the signal
        number that stopped it, or None), ``run_dir``. GptspeedError when training diverges with
        ``--on-nan stop``."""
        t = self.cfg.train
        summary = {"step": self.step, "last_train_loss": None, "last_val_loss": None,
                   "skipped_steps": self.skipped_steps, "interrupted": None, "run_dir": str(self.run_dir)}
        if self.step >= t.max_steps:
            self.say(f"{self.run_dir} is already at step {self.step} of {t.max_steps}: nothing to do "
                     "(raise --max-steps to go on)")
            self.close()
            return summary
        self.wall_start = time.monotonic()  # durations from a monotonic clock: a clock jump cannot make them negative
        stop = StopFlag(self.say)
        stopping: int | None = None
        first_step = self.step
        new_run = self.resume_kind != "full"
        try:
            self._write_config()
            if self.log is not None:
                self.folder.written.add(self.log.path.name)
                self.log.truncate_after(self.step if self.resume_from is not None else -1)
            self._announce()
            if new_run and self.data.has_val:
                # eagerly when the run compiles: training's graphs are compiled first, so the first step
                # is not kept waiting by a cold compile of the no-grad graph (built at the first later eval)
                how = " (eagerly: the compiled graphs are built for training first)" if self.rt.compile else ""
                self.say(f"step 0: evaluating the val loss on {t.eval_tokens or 'all'} val tokens{how} ...", flush=True)
                with eager() if self.rt.compile else contextlib.nullcontext():
                    summary["last_val_loss"] = self.evaluate(stop)
                if stop():
                    stopping = self.agree_on_stop(stop)
                else:
                    self.record(0, val_loss=summary["last_val_loss"])
            self.throughput.restart(self.loader.wait_s)
            first_interval = True
            while self.step < t.max_steps and stopping is None:
                lr = self.set_lr()
                loss, grad_norm, bad = self.train_step()
                self.step += 1
                self.tokens += self.tokens_per_step
                self.throughput.step_done()
                self.note_non_finite(bad)
                due = self.due(self.step, first_interval)
                if not self.rt.distributed:
                    stopping = stop.signum
                if due.log or stopping:  # ranks agree on stopping at log steps only (no per-step collective)
                    stopping = self.agree_on_stop(stop)
                    fields = self.log_step(loss, grad_norm, lr, due, stop)
                    first_interval = False
                    summary["last_train_loss"] = fields["train_loss"]
                    if due.eval:
                        summary["last_val_loss"] = fields["val_loss"]
                self.checkpointer.save_if_due(self.step, stopping=stopping is not None)
        except BaseException as e:
            if new_run and self.step == first_step:
                self.folder.abandon()  # a new run that never stepped leaves nothing behind
            if self.rt.distributed and peer_lost(e):
                raise GptspeedError(
                    f"rank {self.rt.rank} of {self.rt.world_size}: lost contact with another rank after step {self.step} "
                    f"({str(e).splitlines()[0][:160]}): a process of the job died or was killed. The newest sealed "
                    "checkpoint is intact; torchrun --max-restarts restarts the group, which resumes from it") from None
            raise
        finally:
            if stop.signum is None:  # stopped by a signal: repeats keep being ignored until the process exits
                stop.restore()
            self.close()
        summary.update(step=self.step, skipped_steps=self.skipped_steps, interrupted=stopping)
        if stopping is not None and self.step == first_step:
            self.say("stopped before the first step: nothing to save")
            self.folder.abandon()
        elif stopping is not None:
            self.say(f"stopped at step {self.step}; checkpoint saved in {self.run_dir}. "
                     f"Resume with: {resume_command(self.rt, self.run_dir)}")
        else:
            skipped = f" ({self.skipped_steps} skipped as non-finite in all)" if self.skipped_steps else ""
            self.say(f"done: {self.step - first_step} steps{skipped} in {format_duration(time.monotonic() - self.wall_start)}; "
                     f"checkpoint in {self.run_dir}")
        return summary

    def close(self) -> None:
        """Stop the loader's threads, close the metrics log's trackers and release the run folder."""
        if self.loader is not None:
            self.loader.close()
        if getattr(self, "log", None) is not None:
            self.log.close()
        self.folder.close()


def resume_command(rt: Runtime, run_dir: Path) -> str:
    """The command that resumes ``run_dir`` as it ran: under torchrun, with its launcher and process
    counts (``LOCAL_WORLD_SIZE`` processes per node; the rendezvous flags of a multi-node job are
    the user's own, so they are left as ``...``)."""
    if not rt.distributed:
        return f"gptspeed train --out {run_dir} --resume"
    import os

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    nodes = max(1, rt.world_size // per_node)
    launch = (f"torchrun --standalone --nproc_per_node {per_node}" if nodes == 1 else
              f"torchrun --nnodes {nodes} --nproc_per_node {per_node} ...")
    return f"{launch} -m gptspeed train --out {run_dir} --resume"


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def config_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_same_config(cfg: RunConfig, rt: Runtime) -> None:
    """GptspeedError on every rank when the ranks were launched with different configurations
    (one ``all_gather_object`` of a config hash)."""
    if not rt.distributed:
        return
    import torch.distributed as dist

    hashes: list[Any] = [None] * rt.world_size
    dist.all_gather_object(hashes, config_hash(cfg))
    if len(set(hashes)) > 1:
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise GptspeedError(f"ranks were launched with different configurations (ranks {odd} differ from rank 0): "
                            "give every node the same flags and config file")


def fit(cfg: RunConfig, echo: bool = True) -> dict[str, Any]:
    """Train as configured (what ``gptspeed train`` runs; ``cfg`` as built, and validated, by
    :func:`gptspeed.configure.build_train_config`): join the process group under torchrun, build a
    :class:`Trainer` and :meth:`~Trainer.train`. Returns its summary.

    Raises GptspeedError for anything the user can fix -- before the run folder is touched
    wherever it can be checked beforehand -- and when training diverges with ``on_nan=stop``.

    Under torchrun (WORLD_SIZE > 1) every rank runs this: configuration errors (a global batch
    the world size does not divide, ...) were raised where the configuration was built, on every
    rank, before any collective, so every rank reports
    them and none hangs; then the ranks join the process group and compare a hash of their
    configurations. Only rank 0 prints and writes config.json, metrics.jsonl and ``.pt``
    checkpoints; under FSDP2 all ranks write their shards of a ``.dcp`` checkpoint.
    """
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    if not t.out:
        raise GptspeedError("--out is required: the run folder for checkpoints and metrics")
    if not t.data:  # the corpus shipped with gptspeed; the checkpoint records the folder, so --resume finds it
        from gptspeed.data.prepare import default_train_data

        t.data = str(default_train_data(say=print if echo and world_from_env()[0] == 0 else lambda m: None))
    rt = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.parallel,
                         planned_steps=t.max_steps)
    try:
        init_distributed(rt, cfg.runtime.dist_timeout_s)
        check_same_config(cfg, rt)
        return Trainer(cfg, rt, echo=echo).train()
    finally:
        shutdown_distributed()
