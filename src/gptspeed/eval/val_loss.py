"""Validation loss: mean cross-entropy over the val split, the same on every rank.

Shapes stay static for ``torch.compile``: every full batch has the training micro-batch's shape
``(B, T)``; a partial last batch (fewer than ``B`` windows left) runs eagerly
(:func:`gptspeed.parallelize.eager`) instead of compiling a graph for its size, and under FSDP2 the
ranks that have fewer batches join the others' collectives with full-size dummy batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from gptspeed.data.loader import eval_batches_per_rank, iter_eval_batches
from gptspeed.parallelize import eager, unwrap
from gptspeed.runtime import Runtime


def reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps the root's parameters unsharded after a forward (backward would gather them
    again at once); after a no-grad forward nothing frees them, and the next training step then
    leaves the root's gradients unreduced. Reshard explicitly (``FSDPModule.reshard``); a no-op
    for other models."""
    from torch.distributed.fsdp import FSDPModule

    for m in unwrap(model).modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class ValFigures(NamedTuple):
    """What one pass over the val tokens gives (:func:`evaluate_val`): ``loss`` (mean nats per token;
    None when stopped), ``tokens`` (the targets evaluated), ``bpb`` (bits per byte,
    :mod:`gptspeed.eval.bpb`; None without a bytes table or when stopped, NaN when no target had bytes)."""

    loss: float | None
    tokens: int
    bpb: float | None = None


def evaluate(
    model: torch.nn.Module,
    rt: Runtime,
    shards: list[Path],
    batch_size: int,
    seq_len: int,
    max_tokens: int = 0,
    max_token_id: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[float | None, int]:
    """``(loss, tokens)`` of :func:`evaluate_val`: mean cross-entropy (nats/token) over the first
    ``max_tokens`` tokens of ``shards`` (0 = all); ``(None, tokens so far)`` when ``stop`` interrupted it."""
    figures = evaluate_val(model, rt, shards, batch_size, seq_len, max_tokens, max_token_id, stop)
    return figures.loss, figures.tokens


@torch.no_grad()
def evaluate_val(
    model: torch.nn.Module,
    rt: Runtime,
    shards: list[Path],
    batch_size: int,
    seq_len: int,
    max_tokens: int = 0,
    max_token_id: int | None = None,
    stop: Callable[[], bool] | None = None,
    nbytes: torch.Tensor | None = None,
) -> ValFigures:
    """The val loss -- and, given ``nbytes``, bits per byte -- over the first ``max_tokens`` tokens of
    ``shards`` (0 = all), in batches of ``batch_size`` windows of ``seq_len``: one pass, one forward
    per batch giving each target's nats (``model(x, y, reduction="none")``, ``(B, T)`` fp32, by the
    model's loss path), summed in float64 on the device; one host-device sync at the end.

    ``nbytes``: ``(vocab_size,)`` int64 on ``rt.device``, each token's UTF-8 bytes
    (:func:`gptspeed.eval.bpb.token_bytes`). Then ``bpb`` = the nats of the targets that have bytes
    over ``ln 2`` times their bytes (a target of 0 bytes, ``<|endoftext|>``, counts no nats).

    With several ranks the batches are dealt round-robin (``iter_eval_batches``) and the sums (nats,
    tokens, counted nats, bytes) all-reduced, so every rank returns the same figures. Under FSDP2
    every forward is a collective: a rank with fewer batches (it knows how many the others have
    without asking, :func:`~gptspeed.data.loader.eval_batches_per_rank`) runs dummy forwards of the
    full shape until it has run as many. ``stop`` (one process only): checked before each batch;
    when it returns True the evaluation is abandoned and ``ValFigures(None, tokens so far)``
    returned, so a Ctrl-C never waits for it.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # nats, counted nats (with bytes), bytes
    n = batches = 0
    for x, y in iter_eval_batches(
        shards,
        batch_size,
        seq_len,
        max_tokens,
        rank=rt.rank,
        world_size=rt.world_size,
        device=rt.device,
        max_token_id=max_token_id,
    ):
        if stop is not None and not rt.distributed and stop():
            model.train(was_training)
            return ValFigures(None, n)
        with rt.autocast(), eager() if x.size(0) != batch_size else contextlib.nullcontext():
            _, nats = model(x, y, reduction="none")  # (b, T) fp32
        sums += _batch_sums(nats, y, nbytes)
        n += y.numel()
        batches += 1
    if rt.distributed and rt.parallel == "fsdp":  # every forward all-gathers: join the others' last ones
        most = eval_batches_per_rank(shards, batch_size, seq_len, max_tokens, rt.world_size)
        dummy = torch.zeros((batch_size, seq_len), dtype=torch.long, device=rt.device)
        for _ in range(most - batches):
            with rt.autocast():
                model(dummy, dummy, reduction="none")
    sums = torch.cat([sums, torch.tensor([float(n)], dtype=torch.float64, device=rt.device)])  # float64: exact
    if rt.distributed:
        import torch.distributed as dist

        dist.all_reduce(sums)  # every rank's nats, counted nats, bytes and tokens, summed
    if rt.parallel == "fsdp":
        reshard(model)
    model.train(was_training)
    nats, counted, total_bytes, tokens = sums.tolist()
    bpb = None if nbytes is None else counted / (math.log(2) * total_bytes) if total_bytes else math.nan
    return ValFigures(nats / tokens if tokens else math.nan, int(tokens), bpb)


def _batch_sums(nats: torch.Tensor, y: torch.Tensor, nbytes: torch.Tensor | None) -> torch.Tensor:
    """``(3,)`` float64 on the device: a batch's nats ``(b, T)`` summed, and -- with ``nbytes`` -- the
    nats of its targets ``y`` ``(b, T)`` that have bytes and their bytes (zeros without)."""
    nats = nats.double()
    if nbytes is None:
        return torch.stack([nats.sum(), nats.new_zeros(()), nats.new_zeros(())])
    b = nbytes[y]
    return torch.stack([nats.sum(), torch.where(b > 0, nats, torch.zeros_like(nats)).sum(), b.sum().double()])
