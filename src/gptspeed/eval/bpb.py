"""Bits per byte on the val split: a model's quality independent of its tokenizer, as nanochat
reports a base model's (its training log and ``base_loss`` evaluation; Karpathy, nanochat, 2025).

Each val target token counts the UTF-8 bytes of its text, as nanochat counts them: the token
decoded alone (``decode([id])``, bytes that are not valid UTF-8 on their own becoming U+FFFD, three
bytes) and encoded again; the special ``<|endoftext|>`` and the padding ids count 0 bytes, and a
target of 0 bytes counts no nats either. Over the evaluated tokens::

    bits per byte = sum of nats / (ln 2 * sum of bytes)

A run's val loss is nats per *token*; bits per byte divides the same prediction cost by the text
it covers, so runs with different tokenizers (or none yet: a byte model) compare.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from gptspeed.data.loader import iter_eval_batches
from gptspeed.parallelize import eager
from gptspeed.runtime import Runtime


@functools.lru_cache(maxsize=4)
def token_bytes(vocab_size: int, tokenizer=None) -> torch.Tensor:
    """``(vocab_size,)`` int64: the UTF-8 bytes of each token's text (nanochat's count: the token
    decoded alone, then encoded); 0 for ``<|endoftext|>`` and for the ids past the tokenizer's (the
    padding rows). ``tokenizer``: a :class:`gptspeed.bpe.Tokenizer` (the run's,
    :mod:`gptspeed.run_tokenizer`), None for GPT-2's 50,257 ids."""
    from gptspeed.tokenizer import EOT_TOKEN, get_encoding

    enc = get_encoding() if tokenizer is None else tokenizer
    eot = EOT_TOKEN if tokenizer is None else tokenizer.eot
    valid = min(vocab_size, enc.n_vocab)
    counts = [len(enc.decode([i]).encode("utf-8")) if i != eot else 0 for i in range(valid)]
    return torch.tensor(counts + [0] * (vocab_size - valid), dtype=torch.long)


def nats_and_bytes(
    logits: torch.Tensor, targets: torch.Tensor, nbytes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy (nats, fp64) of the targets that have bytes, and their bytes
    (int64): ``logits`` ``(N, V)``, ``targets`` ``(N,)`` int64, ``nbytes`` :func:`token_bytes`."""
    b = nbytes[targets]
    nats = F.cross_entropy(logits.float(), targets, reduction="none")
    counted = b > 0
    return torch.where(counted, nats, torch.zeros_like(nats)).double().sum(), b.sum()


@torch.no_grad()
def evaluate_bpb(
    model: torch.nn.Module,
    rt: Runtime,
    shards: list[Path],
    batch_size: int,
    seq_len: int,
    max_tokens: int = 0,
    max_token_id: int | None = None,
    stop: Callable[[], bool] | None = None,
    tokenizer=None,
) -> float | None:
    """Bits per byte over the first ``max_tokens`` tokens of the val ``shards`` (0 = all), the
    windows of :func:`gptspeed.eval.val_loss.evaluate` (``batch_size`` windows of ``seq_len``),
    each window's logits ``(T, V)`` computed a row at a time (no ``(B, T, V)`` tensor). One process
    (with several ranks each counts its share, summed by an all-reduce; under FSDP2 the caller
    evaluates on one model). Returns None when ``stop`` interrupted it, NaN when no token had bytes.
    ``tokenizer``: the one the tokens are of (:func:`token_bytes`; None: GPT-2's).
    """
    was_training = model.training
    model.eval()
    nbytes = token_bytes(model.config.vocab_size, tokenizer).to(rt.device)
    nats = torch.zeros((), dtype=torch.float64, device=rt.device)
    count = torch.zeros((), dtype=torch.long, device=rt.device)
    batches = iter_eval_batches(
        shards,
        batch_size,
        seq_len,
        max_tokens,
        rank=rt.rank,
        world_size=rt.world_size,
        device=rt.device,
        max_token_id=max_token_id,
    )
    for x, y in batches:
        if stop is not None and not rt.distributed and stop():
            model.train(was_training)
            return None
        for row in range(x.size(0)):
            with rt.autocast(), eager():  # a (1, T) forward: never a compiled graph of its own
                logits, _ = model(x[row : row + 1])
            n, b = nats_and_bytes(logits[0], y[row], nbytes)
            nats += n
            count += b
    if rt.distributed:
        import torch.distributed as dist

        both = torch.stack([nats, count.double()])
        dist.all_reduce(both)
        nats, count = both[0], both[1]
    model.train(was_training)
    total = float(count.item())
    return nats.item() / (math.log(2) * total) if total else math.nan
