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
        needed = cfg.train.eval_bpb or cfg.train.hellaswag_every  # what encodes or decodes text
        self.tokenizer = training_tokenizer(cfg.model, data) if needed else None  # None: GPT-2's
        self._hellaswag = hellaswag_hook(cfg, rt, self.tokenizer)  # None unless --hellaswag-every
        self.val_by_source: dict[str, float] = {}  # a mixture's last val loss per source, by "val_loss/NAME"
        self._bpb: dict[str, float] = {}  # the last evaluation's "val_bpb" (and "val_bpb/NAME"), --eval-bpb
        self._nbytes = None  # with --eval-bpb: each token's bytes (gptspeed.eval.bpb.token_bytes), on the device
        if cfg.train.eval_bpb:
            from gptspeed.eval.bpb import bytes_table

            self._nbytes = bytes_table(stepper.model, rt.device, self.tokenizer)

    @property
    def hellaswag_on(self) -> bool:
        return self._hellaswag is not None

    def val_loss(self, stop: Callable[[], bool] | None = None) -> float | None:
        """Val loss (nats/token) over ``--eval-tokens``; None without a val split (a stream) or when
        ``stop`` interrupted it (:func:`gptspeed.eval.val_loss.evaluate_val`). For a mixture: the mean of
        its sources' (each over ``--eval-tokens`` of its own val split) under its weights, each kept
        in :attr:`val_by_source`. With ``--eval-bpb`` the same pass gives bits per byte, kept for :meth:`bpb`."""
        self._bpb = {}
        if not self.data.has_val:
            return None
        from gptspeed.eval.val_loss import evaluate_val

        evaluate = functools.partial(evaluate_val, nbytes=self._nbytes)
        figures = self._per_source(lambda shards: self._over_val(evaluate, self.stepper.train_model, stop, shards))
        self.val_by_source = {k: v for k, v in figures.items() if k.startswith("val_loss/")}
        self._bpb = {k: v for k, v in figures.items() if k.startswith("val_bpb")}
        return figures.get("val_loss")

    def bpb(self, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """``{"val_bpb": bits per byte}`` (a mixture's: the weighted mean, and ``"val_bpb/NAME"`` each
        source's) over ``--eval-tokens`` with ``--eval-bpb``, measured by the last :meth:`val_loss`'s
        pass (``stop`` was heeded there); ``{}`` without it, without a val split, or when that pass was
        interrupted."""
        return self._bpb

    def _per_source(self, figures: Callable[[list], Any]) -> dict[str, float]:
        """``{"val_loss": ..., "val_bpb": ...}`` of ``figures(val shards)`` (a
        :class:`~gptspeed.eval.val_loss.ValFigures`; no ``val_bpb`` where it has none); for a mixture
        (:class:`gptspeed.data.train_data.MixtureData`) each source's, as ``"KEY/NAME"``, and their mean
        under the mixture's weights. ``{}`` when ``figures`` was interrupted (its loss None)."""
        from gptspeed.data.train_data import MixtureData

        def of(shards: list) -> dict[str, float] | None:
            f = figures(shards)
            return None if f.loss is None else {"val_loss": f.loss, **({} if f.bpb is None else {"val_bpb": f.bpb})}

        if not isinstance(self.data, MixtureData):
            return of(self.data.val_shards) or {}
        sources, each = self.data.sources, {}
        for s in sources:
            each[s.name] = of(s.data.val_shards)
            if each[s.name] is None:
                return {}
        weight, out = sum(s.weight for s in sources), {}
        for key in each[sources[0].name]:
            out[key] = sum(s.weight * each[s.name][key] for s in sources) / weight
            out.update({f"{key}/{s.name}": each[s.name][key] for s in sources})
        return out

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
