"""What a training run writes and says as it goes: :class:`TrainLog`, the :class:`~gptspeed.trainer.Trainer`'s
reporter.

It opens the metrics log (rank 0: ``metrics.jsonl`` through :class:`gptspeed.metrics.RunLog`, and the
trackers ``--log-to`` names), writes config.json and prints the banner when training starts
(:mod:`gptspeed.runinfo`), writes one record per log step -- the step's one host-device sync: the loss
(averaged over ranks), the gradient norm, throughput since the last record, memory, and the evaluations
due -- and says how the run ended (done, stopped with the command that resumes it, or the
``--stop-at-val-loss`` target reached). Every duration comes from a monotonic clock.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from gptspeed.averaging import evaluated_weights
from gptspeed.metrics import RunLog, format_duration, memory_stats
from gptspeed.runinfo import banner, resume_command, run_derived, write_run_config

if TYPE_CHECKING:
    from gptspeed.signals import StopFlag


class TrainLog:
    """The reporter of ``trainer`` (every rank builds one; only rank 0 writes records, after
    :meth:`open`). ``wall_start``: when training started (``time.monotonic()``), reset by
    :meth:`start`; a record's ``time_s`` and the closing line's duration count from it."""

    def __init__(self, trainer: Any):  # a gptspeed.trainer.Trainer (which imports this module)
        self.trainer = trainer
        self.metrics: RunLog | None = None  # rank 0's metrics.jsonl and trackers, once open
        self.wall_start = time.monotonic()

    def open(self) -> None:
        """The metrics log (rank 0) and the trackers ``--log-to`` names, whose files count as this run's."""
        from gptspeed.trackers import open_trackers  # --log-to: TensorBoard, W&B

        tr = self.trainer
        before = {p.name for p in tr.run_dir.iterdir()}
        trackers = open_trackers(
            tr.cfg.train.log_to, tr.run_dir, tr.cfg.to_dict(), tr.step if tr.resume.continues else None, say=tr.say
        )
        tr.folder.written |= {p.name for p in tr.run_dir.iterdir()} - before  # their files and folders
        show_docs = tr.data.documents is None or tr.data.documents > 1
        self.metrics = RunLog(tr.run_dir / "metrics.jsonl", echo=tr.echo, show_documents=show_docs, trackers=trackers)

    def start(self) -> None:
        """Training starts: the clock, config.json (rank 0), metrics.jsonl cut back to the checkpoint,
        and the banner."""
        tr = self.trainer
        self.wall_start = time.monotonic()  # durations from a monotonic clock: a clock jump cannot make them negative
        if tr.rt.is_main:
            tr.folder.written.add("config.json")
            write_run_config(tr.run_dir, tr.cfg, tr.rt, run_derived(tr))
        if self.metrics is not None:
            tr.folder.written.add(self.metrics.path.name)
            self.metrics.truncate_after(tr.step if tr.resume.path is not None else -1)
        for line in banner(tr.cfg, tr.rt, run_derived(tr), malloc_reason=tr.malloc_reason, step=tr.step):
            tr.say(line)

    def record(self, step: int, **fields) -> None:
        """Write one metrics record (rank 0): progress counters plus ``fields``."""
        if self.metrics is None:
            return
        tr = self.trainer
        if fields.get("val_loss") is not None:  # a mixture's val loss per source (gptspeed.eval.during)
            fields = {**fields, **tr.evals.val_by_source}
        self.metrics.write(
            {
                "step": step,
                "max_steps": tr.cfg.train.max_steps,
                "tokens": tr.tokens,
                "documents": tr.loader.documents,
                **{f"documents/{k}": n for k, n in getattr(tr.loader, "documents_by_source", {}).items()},
                "epoch": tr.loader.epoch + tr.loader.epoch_progress(),
                "time_s": time.monotonic() - self.wall_start,
                "skipped_steps": tr.skipped_steps,
                **fields,
            }
        )

    def log_step(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, due: Any, stop: StopFlag
    ) -> dict[str, Any]:
        """The record of a log step: losses and norms read (the step's one sync), throughput since
        the last record, the ``--on-nan`` policy, memory, and the evaluations ``due`` says
        (a :class:`gptspeed.trainer.Due`). Returns its fields."""
        tr, rt = self.trainer, self.trainer.rt
        if rt.distributed:
            import torch.distributed as dist

            loss = loss.clone()
            dist.all_reduce(loss)  # gloo has no AVG: sum, then divide
            loss /= rt.world_size
        rt.synchronize()
        left = None
        if tr.loader.tokens_per_epoch:
            left = (1 - tr.loader.epoch_progress()) * tr.loader.tokens_per_epoch
        fields = tr.throughput.measure(tr.step, left, tr.loader.wait_s)
        tr.check_divergence()
        mem_peak, mem_total = memory_stats(rt.device)
        fields.update(
            train_loss=_finite(loss.item()),
            lr=lr,
            grad_norm=_finite(grad_norm.item()),
            mem_peak_bytes=mem_peak,
            mem_total_bytes=mem_total,
            mem_frac=mem_peak / mem_total if mem_peak and mem_total else None,
        )
        # --ema-tail-ratio: the tail average's blend, in the tail
        with evaluated_weights(tr.tail_average if due.eval or due.hellaswag else None):
            if due.eval:
                fields["val_loss"] = tr.evaluate(stop)
                fields.update(tr.evals.bpb(stop))  # {} without --eval-bpb
            if due.hellaswag:
                fields.update(tr.evals.hellaswag())
        self.record(tr.step, **fields)
        tr.throughput.restart(tr.loader.wait_s)
        return fields

    def say_end(self, summary: dict[str, Any], stopping: int | None, first_step: int) -> None:
        """How the run ended: stopped before its first step, stopped by a signal (and the command that
        resumes it), or done (the ``--stop-at-val-loss`` target if reached, steps, skipped steps, time)."""
        tr = self.trainer
        if stopping is not None and tr.step == first_step:
            tr.say("stopped before the first step: nothing to save")
        elif stopping is not None:
            tr.say(
                f"stopped at step {tr.step}; checkpoint saved in {tr.run_dir}. "
                f"Resume with: {resume_command(tr.rt, tr.run_dir)}"
            )
        else:
            if summary.get("reached_target") is not None:
                tr.say(
                    f"reached --stop-at-val-loss {tr.cfg.train.stop_at_val_loss:g}: val loss "
                    f"{summary['last_val_loss']:.4f} at step {tr.step}"
                )
            skipped = f" ({tr.skipped_steps} skipped as non-finite in all)" if tr.skipped_steps else ""
            tr.say(
                f"done: {tr.step - first_step} steps{skipped} in "
                f"{format_duration(time.monotonic() - self.wall_start)}; checkpoint in {tr.run_dir}"
            )

    def close(self) -> None:
        """Close the metrics log's trackers."""
        if self.metrics is not None:
            self.metrics.close()


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None
