"""Bits per byte on the val split: a model's quality independent of its tokenizer, as nanochat
reports a base model's (its training log and ``base_loss`` evaluation; Karpathy, nanochat, 2025).

Each val target token counts the UTF-8 bytes of its text, as nanochat counts them: the token
decoded alone (``decode([id])``, bytes that are not valid UTF-8 on their own becoming U+FFFD, three
bytes) and encoded again; the special ``<|endoftext|>`` and the padding ids count 0 bytes, and a
target of 0 bytes counts no nats either. Over the evaluated tokens::

    bits per byte = sum of nats / (ln 2 * sum of bytes)

A run's val loss is nats per *token*; bits per byte divides the same prediction cost by the text
it covers, so runs with different tokenizers (or none yet: a byte model) compare. Both come from one
pass over the val tokens (:func:`gptspeed.eval.val_loss.evaluate_val`): each batch's forward gives
every target's nats, summed once for the loss and once, over the targets with bytes, for this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from gptspeed.eval.val_loss import evaluate_val
from gptspeed.parallelize import unwrap
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


def bytes_table(model: torch.nn.Module, device: torch.device, tokenizer=None) -> torch.Tensor:
    """:func:`token_bytes` for ``model``'s vocabulary (``config.vocab_size``, under any compile or
    data-parallel wrapper), on ``device``: the ``nbytes`` of :func:`gptspeed.eval.val_loss.evaluate_val`."""
    return token_bytes(unwrap(model).config.vocab_size, tokenizer).to(device)


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
    """Bits per byte over the first ``max_tokens`` tokens of the val ``shards`` (0 = all): the
    ``bpb`` of :func:`gptspeed.eval.val_loss.evaluate_val` (``batch_size`` windows of ``seq_len`` a
    forward, summed over the ranks; under FSDP2 too), which gives the val loss in the same pass.
    Returns None when ``stop`` interrupted it, NaN when no token had bytes. ``tokenizer``: the one the
    tokens are of (:func:`token_bytes`; None: GPT-2's).
    """
    nbytes = bytes_table(model, rt.device, tokenizer)
    return evaluate_val(model, rt, shards, batch_size, seq_len, max_tokens, max_token_id, stop, nbytes).bpb
