"""The evaluations a run makes while it trains: the val loss over ``--eval-tokens`` and, with
``--hellaswag-every``, HellaSwag -- each under the run's ``--sdpa-backend``, on every rank (FSDP2
forwards are collectives)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class RunEvaluator:
    """Built once by the trainer, after its step: ``stepper`` is the run's
    :class:`gptspeed.step.TrainStep`, ``data`` its :class:`gptspeed.data.train_data.TrainData`. The
    HellaSwag examples are loaded and tokenized here, so a missing file fails before the first step."""

    def __init__(self, cfg, rt, data, stepper):
        from gptspeed.eval.hellaswag import hellaswag_hook
        from gptspeed.run_tokenizer import training_tokenizer

        self.cfg, self.rt, self.data, self.stepper = cfg, rt, data, stepper
        if cfg.train.eval_bpb and rt.parallel == "fsdp":
            from gptspeed.errors import GptspeedError

            raise GptspeedError(
                "--eval-bpb is not computed under --parallel fsdp yet: leave it out, or run `gptspeed eval` on a checkpoint"
            )
        needed = cfg.train.eval_bpb or cfg.train.hellaswag_every  # what encodes or decodes text
        self.tokenizer = training_tokenizer(cfg.model, data) if needed else None  # None: GPT-2's
        self._hellaswag = hellaswag_hook(cfg, rt, self.tokenizer)  # None unless --hellaswag-every
        self.val_by_source: dict[str, float] = {}  # a mixture's last val loss per source, by "val_loss/NAME"

    @property
    def hellaswag_on(self) -> bool:
        return self._hellaswag is not None

    def val_loss(self, stop: Callable[[], bool] | None = None) -> float | None:
        """Val loss (nats/token) over ``--eval-tokens``; None without a val split (a stream) or when
        ``stop`` interrupted it (:func:`gptspeed.eval.val_loss.evaluate`). For a mixture: the mean of
        its sources' (each over ``--eval-tokens`` of its own val split) under its weights, each kept
        in :attr:`val_by_source`."""
        if not self.data.has_val:
            return None
        from gptspeed.eval.val_loss import evaluate

        loss, self.val_by_source = self._per_source(
            lambda shards: self._over_val(evaluate, self.stepper.train_model, stop, shards)[0], "val_loss"
        )
        return loss

    def bpb(self, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """``{"val_bpb": bits per byte}`` (a mixture's: the weighted mean, and ``"val_bpb/NAME"`` each
        source's) over ``--eval-tokens`` with ``--eval-bpb``
        (:func:`gptspeed.eval.bpb.evaluate_bpb`, on the eager model: one row at a time); ``{}``
        without it, without a val split, or when ``stop`` interrupted it."""
        if not (self.cfg.train.eval_bpb and self.data.has_val):
            return {}
        from gptspeed.eval.bpb import evaluate_bpb
        from gptspeed.parallelize import unwrap

        model = unwrap(self.stepper.model)
        bpb_fn = functools.partial(evaluate_bpb, tokenizer=self.tokenizer)
        bpb, each = self._per_source(lambda shards: self._over_val(bpb_fn, model, stop, shards), "val_bpb")
        return {} if bpb is None else {"val_bpb": bpb, **each}

    def _per_source(self, figure: Callable[[list], float | None], key: str) -> tuple[float | None, dict[str, float]]:
        """``(figure(val shards), {})``; for a mixture (:class:`gptspeed.data.train_data.MixtureData`)
        each source's figure and their mean under the mixture's weights: ``(mean, {"KEY/NAME": figure})``.
        ``(None, {})`` when ``figure`` was interrupted (None)."""
        from gptspeed.data.train_data import MixtureData

        if not isinstance(self.data, MixtureData):
            return figure(self.data.val_shards), {}
        each = {}
        for s in self.data.sources:
            each[s.name] = figure(s.data.val_shards)
            if each[s.name] is None:
                return None, {}
        mean = sum(s.weight * each[s.name] for s in self.data.sources) / sum(s.weight for s in self.data.sources)
        return mean, {f"{key}/{name}": v for name, v in each.items()}

    def _over_val(self, fn: Callable[..., Any], model: Any, stop: Callable[[], bool] | None, shards: list) -> Any:
        """``fn`` (an evaluation of :mod:`gptspeed.eval`) of ``model`` over the first ``--eval-tokens``
        of the val ``shards``, in micro-batches of the run's shape, under the step's attention settings."""
        t, m = self.cfg.train, self.cfg.model
        with self.stepper.attention():
            return fn(
                model,
                self.rt,
                shards,
                t.batch_size,
                m.block_size,
                t.eval_tokens,
                m.valid_vocab_size,
                stop=stop,
            )

    def hellaswag(self) -> dict[str, Any]:
        """``hellaswag_acc_norm``, ``hellaswag_acc``, ``hellaswag_examples`` of the model now."""
        with self.stepper.attention():
            fields = self._hellaswag(self.stepper.model)
        if self.rt.parallel == "fsdp":
            from gptspeed.eval.val_loss import reshard

            reshard(self.stepper.model)
        return fields
