"""The training loop: a :class:`Trainer` that builds a run's parts once and steps them.

``Trainer.__init__`` locks the run folder, resolves the final configuration and the checkpoint to
continue (:func:`gptspeed.resume.resolve_run`: nothing rewrites the configuration afterwards), then
builds the data loader, the step (model, parallel/compiled wrapper, optimizer, GradScaler), the
checkpointer (every piece of state registered by name) and the metrics log. :meth:`Trainer.train`
loads the checkpoint, then per step sets the learning rate, runs :meth:`Trainer.train_step` (the
:class:`~gptspeed.step.TrainStep`) and, when due, logs, evaluates and saves. Compare torchtitan's
``Trainer.train`` / ``train_step`` and litgpt's ``fit``. The policies live beside it: resume and
global batch in :mod:`gptspeed.resume`, ``--on-nan`` in :mod:`gptspeed.divergence`, signals in
:mod:`gptspeed.signals`; what it writes and says (metrics records, config.json, the banner, the
closing line) in :mod:`gptspeed.trainlog`.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptspeed.averaging import build_tail_average, register_tail_average
from gptspeed.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    RNGState,
    RunFolder,
    check_free_space,
    checkpoint_path,
    estimate_checkpoint_bytes,
    latest_valid_checkpoint,
    step_of,
)
from gptspeed.config import RunConfig, world_from_env
from gptspeed.configure import build_train_config  # noqa: F401 -- re-exported beside fit
from gptspeed.cpu import keep_freed_memory
from gptspeed.data.shards import ShardError
from gptspeed.data.train_data import TrainData, train_data_for
from gptspeed.distributed import init_distributed, lost_peer_error, peer_lost, shutdown_distributed
from gptspeed.divergence import DivergencePolicy
from gptspeed.errors import GptspeedError
from gptspeed.eval.during import RunEvaluator
from gptspeed.metrics import (
    FirstPace,
    Throughput,
    eval_pace,
    first_step_pace,
    peak_flops,
)
from gptspeed.parallelize import eager
from gptspeed.resume import resolve_run
from gptspeed.run_tokenizer import RUN_TOKENIZER_FILE, check_data_tokenizer, save_run_tokenizer
from gptspeed.runinfo import resume_command
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.schedules import attn_window_at, grad_accum_at, seq_len_at, set_lr, tokens_between
from gptspeed.signals import StopFlag, agree_on_stop
from gptspeed.step import StepAbandoned, TrainStep, build_model, is_out_of_memory
from gptspeed.trainlog import TrainLog

__all__ = ["Trainer", "TrainState", "fit", "build_train_config", "resume_command"]


@dataclasses.dataclass
class Due:
    """What a step is due for, by the configured intervals."""

    log: bool
    eval: bool
    save: bool
    hellaswag: bool


def due_at(step: int, first_interval: bool, cfg: RunConfig, save: bool, hellaswag: bool) -> Due:
    """What ``step`` is due for: evaluation every ``--eval-every`` steps and at the last, HellaSwag
    likewise (when on), ``save`` as the checkpointer says, and a log record at all of them, every
    ``--log-every`` steps and at the first step after a (re)start."""
    t = cfg.train
    last = step == t.max_steps
    d = Due(
        log=False,
        eval=last or (t.eval_every > 0 and step % t.eval_every == 0),
        save=save,
        hellaswag=hellaswag and (last or step % t.hellaswag_every == 0),
    )
    d.log = first_interval or d.eval or d.save or d.hellaswag or step % t.log_every == 0
    return d


@dataclasses.dataclass
class TrainState:
    """The trainer's own counters, a checkpoint part (``trainer``): optimizer steps done, steps
    skipped as non-finite, tokens trained on (a resume with another global batch goes on
    counting from there), and ``reached`` -- ``[step, val loss]`` of the evaluation that reached
    ``--stop-at-val-loss`` (a resume with that target, or a higher one, trains no further)."""

    step: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    tokens_per_step: int = 0
    reached: list | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "skipped_steps": self.skipped_steps, "tokens": self.tokens, "reached": self.reached}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        self.tokens = int(state.get("tokens", self.step * self.tokens_per_step))  # older checkpoints: one batch size
        self.reached = state.get("reached")


def make_loader(data: TrainData, cfg: RunConfig, rt: Runtime):
    """The run's training loader over ``data``: this rank's micro-batches of the run's shape, its
    sampling, seed and workers (``--loader-workers`` -1: one thread on CUDA, none elsewhere)."""
    t = cfg.train
    return data.loader(
        t.batch_size,
        cfg.model.block_size,
        rank=rt.rank,
        world_size=rt.world_size,
        device=rt.device,
        max_token_id=cfg.model.valid_vocab_size,
        sampling=t.sampling,
        seed=cfg.runtime.seed,
        workers=t.loader_workers if t.loader_workers >= 0 else int(rt.device_type == "cuda"),
        align_to_docs=t.align_to_docs,
    )


class Trainer:
    """One training run. Build it with a configuration validated where it was built
    (:func:`gptspeed.configure.build_train_config`) and a resolved runtime (every rank under
    torchrun), then call :meth:`train`.

    Raises GptspeedError while building for anything the user can fix: bad data, a folder
    another process is writing or gptspeed did not write, a checkpoint that would not continue the
    same run. The run folder is locked first; a folder this run created is removed again if
    building fails.
    """

    def __init__(self, cfg: RunConfig, rt: Runtime, *, echo: bool = True):
        self.rt = rt
        self.echo = echo and rt.is_main
        self.say: Callable[..., None] = print if self.echo else (lambda *a, **k: None)
        t = cfg.train
        self.run_dir = Path(t.out)
        self.state = TrainState()
        self.data: TrainData = train_data_for(t)
        self.loader = self.log = self.stop = None  # self.stop: the stop signals' flag, while training
        self.pace = FirstPace(self.say, 0, None, 0.0)  # the first step's: set when training starts
        self.folder = RunFolder(self.run_dir, rt.is_main)
        self.folder.open()  # the lock first: no other writer reads or writes the folder from here on
        self.barrier()
        try:
            check_data_tokenizer(cfg.model, self.data)  # the model's vocabulary and <|endoftext|> are the data's
            self.cfg, self.resume = resolve_run(cfg, rt, self.data.identity, say=self.say)  # final from here on
            if rt.is_main and save_run_tokenizer(self.run_dir, self.cfg.model, self.data):
                self.folder.written.add(RUN_TOKENIZER_FILE)
            self._build()
        except BaseException:
            self.close()
            self.folder.abandon()  # a folder this run created is removed again
            raise

    # ------------------------------------------------------------------------------ building
    def _build(self) -> None:
        """Every part, in order: the data loader, the step (every rule checked before the device is
        touched), the checkpointer with every part registered, the counters, the metrics log."""
        cfg, rt, t = self.cfg, self.rt, self.cfg.train
        self.state.tokens_per_step = (
            t.batch_size * cfg.model.block_size * cfg.grad_accum_steps(rt.world_size) * rt.world_size
        )
        self.loader = make_loader(self.data, cfg, rt)
        self.data.check_val(cfg.model.block_size)
        keep = cfg.runtime.keep_freed_memory
        self.malloc_reason = (
            keep_freed_memory()[1]
            if (rt.device_type == "cpu" if keep is None else keep)
            else "the system malloc as it is (off)"
        )
        self._build_step()
        self.evals = RunEvaluator(cfg, rt, self.data, self.stepper)  # loads HellaSwag's examples now, if asked for
        check_free_space(self.run_dir, estimate_checkpoint_bytes(self.model))
        self.checkpointer = Checkpointer(
            self.run_dir,
            sharded=rt.parallel == "fsdp",
            is_main=rt.is_main,
            barrier=self.barrier,
            keep=t.keep_checkpoints,
            every=t.save_every,
            last_step=t.max_steps,
            meta={
                "config": cfg.to_dict(),
                "data": self.data.identity,
                "world_size": rt.world_size,
                "run_id": self.resume.run_id,
            },
        )
        self._register_state()
        if self.resume.path is not None:
            self.checkpointer.load(self.resume.path)
        self.divergence = DivergencePolicy(t.on_nan, rt.device)
        self.flops_per_token = self.model.flops_per_token(cfg.model.block_size)
        self.peak, self.peak_source = peak_flops(rt.device, rt.dtype, cfg.runtime.peak_tflops)  # one device
        self.throughput = Throughput(
            self.tokens_per_step,
            self.flops_per_token,
            self.peak,
            rt.world_size,
            t.max_steps,
            tokens_between=lambda first, last: tokens_between(first, last, cfg, rt.world_size),
        )
        self.log = TrainLog(self)
        if rt.is_main:
            self.log.open()

    def _build_step(self) -> None:
        """The model (seeded; ``--init-from`` weights on a new run) and its :class:`TrainStep`."""
        cfg = self.cfg
        model = build_model(cfg, self.rt)
        if cfg.model.softmax == "data":  # the same ids on resume (the data are checked unchanged)
            model.set_softmax_ids(self.data.token_ids())
        if cfg.train.init_from and self.resume.path is None:
            from gptspeed.hf.load import load_hf_weights

            self.say(f"initialised from {load_hf_weights(model, cfg.train.init_from)}")
        self.stepper = TrainStep(cfg, self.rt, model=model)
        self.tail_average = build_tail_average(model, cfg)  # --ema-tail-ratio (gptspeed.averaging), else None

    # the step's parts, for the checkpointer, evaluation and the log
    model = property(lambda self: self.stepper.model)
    train_model = property(lambda self: self.stepper.train_model)
    optimizer = property(lambda self: self.stepper.optimizer)
    scaler = property(lambda self: self.stepper.scaler)
    skips_on_device = property(lambda self: self.stepper.skips_on_device)
    accum = property(lambda self: self.stepper.accum)
    # the counters
    step = property(lambda self: self.state.step)
    tokens = property(lambda self: self.state.tokens)
    skipped_steps = property(lambda self: self.state.skipped_steps)
    tokens_per_step = property(lambda self: self.state.tokens_per_step)

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
        c.register("trainer", self.state)
        register_tail_average(c, self.tail_average, step_of(self.resume.path) if self.resume.continues else None)

    # ----------------------------------------------------------------------------- stepping
    def barrier(self) -> None:
        if self.rt.distributed:
            import torch.distributed as dist

            dist.barrier()

    def train_step(
        self, accum: int | None = None, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """One optimizer step over the loader's next ``accum`` micro-batches (default: the run's), trained as
        sequences of ``seq_len`` tokens (default ``--seq-len``) (:class:`gptspeed.step.TrainStep`): device tensors
        ``(loss, grad_norm, bad)``. A shard gone bad under the run (:class:`~gptspeed.data.shards.ShardError`) is a
        GptspeedError naming it, after saving the steps since the last checkpoint when it can (:func:`save_before_data_error`);
        out of memory is one line; a step a stop signal leaves (``self.stop.mid_step``) is rewound, and None returned."""
        at = self.loader.mark()  # a few ints: where a failed step rewinds to
        try:
            with out_of_memory_as_one_line(self, f"step {self.step + 1}'s forward and backward"):
                next_batch = self.pace.wrap(self.loader.next_batch) if self.pace.units > 2 else self.loader.next_batch
                return self.stepper(next_batch, self.stop.mid_step if self.stop else None, accum=accum, seq_len=seq_len)
        except StepAbandoned as e:
            return save_after_leaving_a_step(self, e, at)
        except ShardError as e:
            raise GptspeedError(f"{e}. {save_before_data_error(self, at)}") from None

    def check_divergence(self) -> None:
        """The ``--on-nan`` policy at a log step (:class:`gptspeed.divergence.DivergencePolicy`)."""

        def good() -> str:
            return (latest_valid_checkpoint(self.run_dir)[0] or Path("none")).name

        self.state.skipped_steps += self.divergence.check(self.state.skipped_steps, self.step, good, self.say)

    def evaluate(self, stop: Callable[[], bool] | None = None) -> float | None:
        """The val loss now (:meth:`gptspeed.eval.during.RunEvaluator.val_loss`); out of memory is one line.
        None when ``stop`` interrupted it -- also when it raised once a stop signal had arrived in one
        process (its first compile's C++ compiler killed by the same signal): the step before it is
        finished, and the loop saves it at the next step's start (:func:`save_after_leaving_a_step`)."""
        where = f"the val loss after step {self.step}"
        with out_of_memory_as_one_line(self, where):
            try:
                return self.evals.val_loss(stop)
            except Exception as e:
                if is_out_of_memory(e) or self.stop is None or self.stop.mid_step is None or not self.stop():
                    raise
                self.say(f"{where} was left: it raised {failure_name(e)} as the stop arrived")
                return None

    # --------------------------------------------------------------------------------- run
    def train(self) -> dict[str, Any]:
        """Train to ``--max-steps`` (or until SIGINT / SIGTERM). Returns a summary: ``step``,
        ``last_train_loss``, ``last_val_loss``, ``skipped_steps``, ``interrupted`` (the signal
        number that stopped it, or None), ``run_dir``. GptspeedError when training diverges with
        ``--on-nan stop`` (or most steps were skipped with ``skip``)."""
        summary = {
            "step": self.step,
            "last_train_loss": None,
            "last_val_loss": None,
            "skipped_steps": self.skipped_steps,
            "interrupted": None,
            "run_dir": str(self.run_dir),
        }
        if (done := self._done_already(summary)) is not None:
            self.say(done)
            self.close()
            return summary
        self.stop = stop = StopFlag(self.say, ranks=self.rt.distributed)
        first_step, stopping = self.step, None
        try:
            stopping = self._start(stop, summary)
            if stopping is None:
                stopping = self._loop(stop, summary)
        except BaseException as e:
            self._failed(e, first_step)
            raise
        finally:
            if stop.signum is None:  # stopped by a signal: repeats keep being ignored until the process exits
                stop.restore()
            self.close()
        return self._finish(summary, stopping, first_step)

    def _done_already(self, summary: dict[str, Any]) -> str | None:
        """Why a resumed run has nothing to do, or None: it is at ``--max-steps``, or an evaluation of it
        reached its ``--stop-at-val-loss`` (then ``summary["reached_target"]`` is that step; a lower target goes on)."""
        t, reached = self.cfg.train, self.state.reached
        if self.step >= t.max_steps:
            return f"{self.run_dir} is already at step {self.step} of {t.max_steps}: nothing to do (raise --max-steps to go on)"
        if t.stop_at_val_loss is not None and reached and reached[1] <= t.stop_at_val_loss:
            summary["reached_target"] = reached[0]
            return (
                f"{self.run_dir} reached --stop-at-val-loss {t.stop_at_val_loss:g} at step {reached[0]} (val loss "
                f"{reached[1]:.4f}): nothing to do (a lower --stop-at-val-loss goes on)"
            )
        return None

    def _start(self, stop: StopFlag, summary: dict[str, Any]) -> int | None:
        """config.json, metrics.jsonl cut back to the checkpoint, the banner, and a new run's step-0
        val loss. Returns the signal that stopped it, or None."""
        t = self.cfg.train
        self.log.start()
        stopping = None
        if not self.resume.continues and self.data.has_val:
            # eagerly when the run compiles: training's graphs are compiled first, so the first step
            # is not kept waiting by a cold compile of the no-grad graph (built at the first later eval)
            how = " (eagerly: the compiled graphs are built for training first)" if self.rt.compile else ""
            self.say(f"step 0: evaluating the val loss on {t.eval_tokens or 'all'} val tokens{how} ...", flush=True)
            pace = eval_pace(self.say, self.cfg, -(-t.eval_tokens // (t.batch_size * self.cfg.model.block_size)))
            with eager() if self.rt.compile else contextlib.nullcontext():
                summary["last_val_loss"] = self.evaluate(pace.wrap(stop) if t.eval_tokens else stop)
            if stop():
                stopping = agree_on_stop(stop, self.rt)
            else:
                self.log.record(0, val_loss=summary["last_val_loss"], **self.evals.bpb())  # bpb: {} without --eval-bpb
        self.throughput.restart(self.loader.wait_s)
        self.pace = first_step_pace(self.say, self.cfg, self.step, self.accum, self.rt.device.type == "cpu")
        return stopping

    def _loop(self, stop: StopFlag, summary: dict[str, Any]) -> int | None:
        """Steps until ``--max-steps``, a signal, or ``--stop-at-val-loss`` reached (then
        ``summary["reached_target"]`` is the step); returns the signal that stopped it, or None."""
        stopping, first_interval = None, True
        target = self.cfg.train.stop_at_val_loss
        while self.step < self.cfg.train.max_steps and stopping is None and summary.get("reached_target") is None:
            lr = set_lr(self.optimizer, self.cfg, self.step)
            self.model.set_attn_window(attn_window_at(self.step, self.cfg))  # --attn-window's warm-up
            accum = grad_accum_at(self.step, self.cfg, self.rt.world_size)  # --batch-warmup-steps
            seq_len = seq_len_at(self.step, self.cfg)  # --seq-len-warmup-steps
            if (done := self.train_step(accum, seq_len)) is None:  # a signal left the step
                return stop.signum
            loss, grad_norm, bad = done
            self.state.step += 1
            if self.tail_average is not None:
                self.tail_average.update(self.step)  # on the device, no sync
            self.state.tokens += (tokens := self.tokens_per_step // self.accum * accum)  # --batch-warmup-steps
            full = seq_len == self.cfg.model.block_size  # MFU counts a shorter step's own (smaller) attention term
            self.throughput.step_done(tokens, self.flops_per_token if full else self.model.flops_per_token(seq_len))
            self.divergence.note(bad, self.step)
            due = due_at(self.step, first_interval, self.cfg, self.checkpointer.due(self.step), self.evals.hellaswag_on)
            if not self.rt.distributed:
                stopping = stop.signum
            if due.log or stopping:  # ranks agree on stopping at log steps only (no per-step collective)
                stopping = agree_on_stop(stop, self.rt)
                fields = self.log.log_step(loss, grad_norm, lr, due, stop)
                first_interval = False
                summary["last_train_loss"] = fields["train_loss"]
                if due.eval:
                    summary["last_val_loss"] = fields["val_loss"]
                    if target is not None and fields["val_loss"] is not None and fields["val_loss"] <= target:
                        summary["reached_target"] = self.step
                        self.state.reached = [self.step, fields["val_loss"]]  # saved: a resume stops here too
            self.checkpointer.save_if_due(self.step, stopping=stopping is not None or "reached_target" in summary)
        return stopping

    def _failed(self, e: BaseException, first_step: int) -> None:
        """A run that failed: a new run that never stepped leaves nothing behind; a lost peer under
        torchrun is one line (raised from here), not the collective's traceback."""
        if not self.resume.continues and self.step == first_step:
            self.folder.abandon()
        if self.rt.distributed and peer_lost(e):
            raise lost_peer_error(self.rt, self.step, e) from None

    def _finish(self, summary: dict[str, Any], stopping: int | None, first_step: int) -> dict[str, Any]:
        summary.update(step=self.step, skipped_steps=self.skipped_steps, interrupted=stopping)
        self.log.say_end(summary, stopping, first_step)
        if stopping is not None and self.step == first_step:
            self.folder.abandon()
        return summary

    def close(self) -> None:
        """Stop the loader's threads, close the metrics log's trackers and release the run folder."""
        if self.loader is not None:
            self.loader.close()
        if self.log is not None:
            self.log.close()  # the trackers
        self.folder.close()
        self.data.close()  # the data folder's shared lock (gptspeed.data.folder): a prepare may write it again


def save_before_data_error(trainer: Trainer, at: Any) -> str:
    """The data-error rescue: save the checkpoint of ``trainer``'s last finished step after its
    loader failed mid-step (its position rewound to the step's start with ``at``; the weights and
    optimizer are untouched until the last micro-batch is in). One process only: with several, the others wait in a
    collective. Returns what was done, for the error line."""
    if trainer.step == 0:
        return "No step was done"
    if trainer.rt.distributed:
        return "The steps since the last checkpoint are lost"
    if checkpoint_path(trainer.run_dir, trainer.step).exists():
        return f"The checkpoint of step {trainer.step} is intact"
    trainer.loader.rewind(at)
    try:
        trainer.checkpointer.save(trainer.step)
    except GptspeedError as e:
        return f"Saving step {trainer.step} failed too: {e}"
    return (
        f"Trained {trainer.step:,} steps ({trainer.tokens:,} tokens); the checkpoint of step {trainer.step} was saved: "
        f"fix the {'data' if trainer.data.is_stream else 'shard'}, then --resume"
    )


def save_after_leaving_a_step(trainer: Trainer, left: StepAbandoned, at: Any) -> None:
    """A stop signal left a step unfinished (:class:`~gptspeed.step.StepAbandoned`: nothing was
    stepped): rewind the data position to ``at`` (the step's start: a resume reads its batches
    again), say so, and save the last finished step unless it is saved already (a resumed run that
    did no step) or there is none (step 0)."""
    trainer.loader.rewind(at)
    if left.failed is not None:  # the signal also stopped work the process does not control (a compiler)
        trainer.say(
            f"step {trainer.step + 1} was left in its micro-batch {left.done + 1} of {left.accum}, which raised "
            f"{failure_name(left.failed)} as the stop arrived: a resume redoes it from the same batches"
        )
    elif left.done:
        trainer.say(
            f"step {trainer.step + 1} was left after {left.done} of its {left.accum} micro-batches: "
            "a resume redoes it from the same batches"
        )
    if trainer.step > 0 and not checkpoint_path(trainer.run_dir, trainer.step).exists():
        trainer.checkpointer.save(trainer.step)


def failure_name(e: BaseException) -> str:
    """``e`` in a few words, for a line: its class, and the class it wraps when it is inductor's wrapper
    (``InductorError: CppCompileError``), never the compiler's command line and output."""
    name = type(e).__name__
    inner = getattr(e, "inner_exception", None) or e.__cause__
    return f"{name} ({type(inner).__name__})" if inner is not None and type(inner) is not type(e) else name


@contextlib.contextmanager
def out_of_memory_as_one_line(trainer: Trainer, where: str):
    """Context manager: running out of memory inside (:func:`gptspeed.step.is_out_of_memory`)
    becomes :func:`out_of_memory_error`'s one line; anything else passes through."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        raise out_of_memory_error(trainer, where) from None


def out_of_memory_error(trainer: Trainer, where: str) -> GptspeedError:
    """The one line for running out of memory in ``where`` (a step's forward and backward, an
    evaluation): the micro-batch that did not fit, what to change, and the newest checkpoint, which
    is intact (nothing is saved: the memory is gone, and the step may have been half done)."""
    cfg, rt = trainer.cfg, trainer.rt
    t, T = cfg.train, cfg.model.block_size
    total = t.total_batch_tokens or t.batch_size * T * rt.world_size
    ckpt = latest_valid_checkpoint(trainer.run_dir)[0]
    intact = (
        f"the checkpoint of step {step_of(ckpt)} is intact" if ckpt is not None else "no checkpoint was written yet"
    )
    if ckpt is not None and trainer.step > step_of(ckpt):
        intact += f" (steps {step_of(ckpt) + 1}-{trainer.step} were not saved)"
    smaller = max(1, t.batch_size // 2)
    ac = "" if cfg.runtime.activation_checkpointing == "full" else ", or --activation-checkpointing full"
    auto = "--batch-size auto (the largest that fits, found by a probe) or " if rt.device.type == "cuda" else ""
    return GptspeedError(
        f"out of memory on {rt.device.type} in {where}, at a micro-batch of --batch-size {t.batch_size} x --seq-len {T} = "
        f"{t.batch_size * T:,} tokens: use {auto}a smaller --batch-size (e.g. {smaller}) with the same --total-batch-tokens "
        f"{total} (more micro-steps a step, the same run){ac}, then --resume; {intact}"
    )


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
        raise GptspeedError(
            f"ranks were launched with different configurations (ranks {odd} differ from rank 0): "
            "give every node the same flags and config file"
        )


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
    rt = resolve_runtime(
        cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.parallel, planned_steps=t.max_steps
    )
    try:
        init_distributed(rt, cfg.runtime.dist_timeout_s)
        check_same_config(cfg, rt)
        return Trainer(cfg, rt, echo=echo).train()
    finally:
        shutdown_distributed()
