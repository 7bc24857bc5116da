"""Tail weight averaging (``--ema-tail-ratio``): an exponential moving average of the weights over the last
part of training, read out as a blend of the weights and the average.

The method is modded-nanogpt's tail EMA readout (track 3, record #45, PR #325, "Tail-EMA readout reaches
3.28 in 2720 steps"; kept in record #46): from a start step on, after each optimizer step, the average moves
``1/horizon`` of the way to the weights (``avg += (w - avg) / horizon``; the first is a copy); the model
evaluated is ``(1 - blend) * w + blend * avg`` (their horizon 150 steps, started 720 steps before the end,
about five horizons, blend 0.6), every parameter but an untied token embedding (their ``nonembed`` scope).
Under a decaying learning rate the last weights orbit a minimum; the average smooths that orbit, and the
blend trades the average's lag against the weights' noise (Polyak averaging, Polyak & Juditsky 1992).

gptspeed's settings: the tail is the last ``round(--ema-tail-ratio * --max-steps)`` steps (the average starts
as a copy of the weights after step ``max_steps - tail``); ``--ema-horizon`` (default a fifth of the tail,
modded-nanogpt's "start at least five horizons before the end": the starting weights then weigh
``exp(-5)``, under 1%, at the end); ``--ema-blend`` (default 0.6). The raw weights are what trains, what
the optimizer steps and what a resume continues; the average is one more checkpoint part
(``tail_average``). Every evaluation from the tail's start on -- the val loss the training log reports,
its bits per byte and HellaSwag, and so the last one -- is of the blend, and so are ``gptspeed eval``,
``sample``, ``export-hf`` and :mod:`gptspeed.api` reading a checkpoint that holds an average
(:func:`readout_state`). Before the tail, and with the setting off, nothing changes: no tensor, no step.

Costs: one fp32 copy of the averaged parameters on the model's device from the tail's start (4 bytes a
parameter; a GPT-2 124M: ~0.5 GB), the same again in every checkpoint of the tail; per step in the tail one
``torch._foreach_lerp_`` over them (a read of the weights and a read-write of the average: memory-bound,
a few percent of a small model's step on a CPU, far less on a GPU), no host-device sync and no
collective (under FSDP2 each rank averages its own shards); per evaluation in the tail a copy of the
weights is kept aside and put back (one more copy of the weights for its duration, bit-exact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gptspeed.config import RunConfig, TrainConfig

#: The checkpoint part holding the average, by parameter name (fp32; none before the tail).
PART = "tail_average"
#: The token embedding, left out when it is not also the head (modded-nanogpt's ``nonembed`` scope).
TOKEN_EMBEDDING = "transformer.wte.weight"


def tail_steps(t: TrainConfig) -> int:
    """Steps averaged: ``round(ema_tail_ratio * max_steps)`` (0: off)."""
    return round(t.ema_tail_ratio * t.max_steps)


def horizon(t: TrainConfig) -> float:
    """The average's time constant in steps: ``--ema-horizon``, default a fifth of the tail (at least 1)."""
    return t.ema_horizon if t.ema_horizon is not None else max(1.0, tail_steps(t) / 5)


def averaged_names(model: torch.nn.Module, tie_embeddings: bool) -> list[str]:
    """The names of ``model``'s parameters that are averaged: all (each tied tensor once) but the token
    embedding when it is untied from the head."""
    return [n for n, _ in model.named_parameters() if tie_embeddings or n != TOKEN_EMBEDDING]


class TailAverage:
    """The average of a run's weights over its tail, a checkpoint part (``state_dict`` / ``load_state_dict``:
    ``{parameter name: fp32 tensor}``, empty before the tail).

    ``model``: the plain module whose parameters train (:attr:`gptspeed.step.TrainStep.model`; under FSDP2
    their DTensor shards). ``cfg``: the run's, with ``--ema-tail-ratio`` on. Call :meth:`update` after every
    optimizer step with the steps done; evaluate inside :meth:`applied`."""

    def __init__(self, model: torch.nn.Module, cfg: RunConfig):
        t = cfg.train
        self.start = t.max_steps - tail_steps(t)  # the average is first the weights after this step
        self.weight = 1.0 / horizon(t)
        self.blend = t.ema_blend
        params = dict(model.named_parameters())
        self.names = averaged_names(model, cfg.model.tie_embeddings)
        self.params = [params[n] for n in self.names]
        self.avg: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (steps done, counted from 1): none before the tail; at its start
        the average becomes an fp32 copy of the weights; after it, ``avg += (w - avg) / horizon`` (one
        ``_foreach_lerp_``, on the device, no sync)."""
        if step < self.start:
            self.avg = None  # none before the tail (a resume with a higher --max-steps moves the tail later)
            return
        if step == self.start or self.avg is None:
            self.avg = [p.detach().float().clone() for p in self.params]
        else:
            torch._foreach_lerp_(local(self.avg), [p.float() for p in local(self.params)], self.weight)

    def expect(self, step: int) -> None:
        """Before loading a checkpoint of step ``step``: hold an average to load into when that step is in the
        tail (a sharded checkpoint is read into the tensors a part already has)."""
        if step >= self.start and self.avg is None:
            self.avg = [torch.zeros_like(p.detach(), dtype=torch.float32) for p in self.params]

    def state_dict(self) -> dict[str, Any]:
        return {} if self.avg is None else dict(zip(self.names, self.avg))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the average exactly (KeyError for a missing parameter: :func:`~gptspeed.checkpoint.load_part`
        makes it one line); an empty state is a checkpoint from before the tail."""
        if not state:
            self.avg = None
            return
        if set(state) != set(self.names):
            raise KeyError(f"Missing key(s) in state_dict: {sorted(set(self.names) ^ set(state))[:3]}")
        self.expect(self.start)
        for a, n in zip(self.avg, self.names):
            if state[n] is not a:
                a.copy_(state[n])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, the model's weights are the blend ``(1 - blend) * w + blend * avg`` (once the tail has
        started; before, unchanged); after it, exactly the weights before it (a kept copy is put back)."""
        if self.avg is None:
            yield
            return
        with torch.no_grad():
            kept = [p.clone() for p in local(self.params)]
            blend_into(local(self.params), local(self.avg), self.blend)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(local(self.params), kept)


def local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor detached, and under FSDP2 its DTensor's local shard (the same storage: an in-place change is
    the DTensor's), so the foreach kernels run on plain tensors, each rank on its own shards."""
    return [t.to_local() if hasattr(t, "to_local") else t.detach() for t in tensors]


def blend_into(weights: list[torch.Tensor], avg: list[torch.Tensor], blend: float) -> None:
    """``w = w + blend * (avg - w)`` in place for each pair (the average cast to each weight's dtype)."""
    torch._foreach_lerp_(weights, [a.to(w.dtype) for w, a in zip(weights, avg)], blend)


def build_tail_average(model: torch.nn.Module, cfg: RunConfig) -> TailAverage | None:
    """A :class:`TailAverage` of ``model`` when ``--ema-tail-ratio`` is on, else None."""
    return TailAverage(model, cfg) if cfg.train.ema_tail_ratio else None


def register_tail_average(checkpointer: Any, avg: TailAverage | None, resume_step: int | None) -> None:
    """Register ``avg`` (None: off, nothing to do) with the run's
    :class:`~gptspeed.checkpoint.Checkpointer` as part :data:`PART`, sharded like the model; a sharded
    checkpoint of ``resume_step`` (None: a new run) is read into the tensors the part holds, so they are made
    first (:meth:`TailAverage.expect`)."""
    if avg is None:
        return
    checkpointer.register(PART, avg, sharded=True)
    if checkpointer.sharded and resume_step is not None:
        avg.expect(resume_step)


def evaluated_weights(avg: TailAverage | None) -> contextlib.AbstractContextManager:
    """Context manager: the weights an evaluation sees -- ``avg``'s blend once its tail has started
    (:meth:`TailAverage.applied`), else (and with ``avg`` None, off) the weights as they are."""
    return avg.applied() if avg is not None else contextlib.nullcontext()


def readout_state(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The model weights a checkpoint is read out as: ``ckpt["model"]`` with each averaged tensor blended,
    in place, to ``(1 - blend) * w + blend * avg`` when the checkpoint holds a tail average (its run's
    ``--ema-blend``); else ``ckpt["model"]`` unchanged. ``ckpt``: a checkpoint as loaded (its tensors this
    caller's own; tied tensors stay one tensor). ``ckpt["readout"]`` says which: ``"tail average"`` or
    ``"weights"``."""
    model, avg = ckpt["model"], ckpt.get(PART) or {}
    ckpt["readout"] = "tail average" if avg else "weights"
    if avg:
        names = list(avg)
        blend = float(ckpt["config"]["train"]["ema_blend"])
        with torch.no_grad():
            blend_into([model[n] for n in names], [avg[n] for n in names], blend)
    return model
