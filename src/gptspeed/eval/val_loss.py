"""Validation loss: mean cross-entropy over the val split, the same on every rank.

Shapes stay static for ``torch.compile``: every full batch has the training micro-batch's shape
``(B, T)``; a partial last batch (fewer than ``B`` windows left) runs eagerly
(:func:`gptspeed.parallelize.eager`) instead of compiling a graph for its size, and under FSDP2 the
ranks that have fewer batches join the others' collectives with full-size dummy batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

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


@torch.no_grad()
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
    """Mean cross-entropy (nats/token) over the first ``max_tokens`` tokens of ``shards`` (0 =
    all), in batches of ``batch_size`` windows of ``seq_len``. Returns ``(loss, tokens)``; one
    host-device sync at the end.

    With several ranks the batches are dealt round-robin (``iter_eval_batches``) and ``(sum,
    count)`` all-reduced, so every rank returns the same figure. Under FSDP2 every forward is a
    collective: a rank with fewer batches (it knows how many the others have without asking,
    :func:`~gptspeed.data.loader.eval_batches_per_rank`) runs dummy forwards of the full shape
    until it has run as many. ``stop`` (one process only): checked before each batch; when it returns True the
    evaluation is abandoned and ``(None, tokens so far)`` returned, so a Ctrl-C never waits for it.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
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
            return None, n
        with rt.autocast(), eager() if x.size(0) != batch_size else contextlib.nullcontext():
            _, loss = model(x, y)
        total += loss.double() * y.numel()
        n += y.numel()
        batches += 1
    if rt.distributed:
        import torch.distributed as dist

        if rt.parallel == "fsdp":  # every forward all-gathers: join the others' last ones
            most = eval_batches_per_rank(shards, batch_size, seq_len, max_tokens, rt.world_size)
            dummy = torch.zeros((batch_size, seq_len), dtype=torch.long, device=rt.device)
            for _ in range(most - batches):
                with rt.autocast():
                    model(dummy, dummy)
        both = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=rt.device)])
        dist.all_reduce(both)
        total, n = both[0], int(both[1].item())
    if rt.parallel == "fsdp":
        reshard(model)
    model.train(was_training)
    return (total / n).item(), n
