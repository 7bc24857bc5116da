"""``gptspeed bench race`` with arms of their own ``--data``: a race of tokenizers (the same text prepared with
each, ``gptspeed prepare TEXT --out DIR --tokenizer TOK``), raced by bits per byte (``--target-bpb``).

An arm may give ``--data DIR`` only where the race can compare it (:func:`check_race_data`): with
``--target-bpb`` (bits per byte compare across tokenizers), or when every arm's data has the same tokenizer
(then a val loss per token compares too). Every arm's val split must be the same *text*: each folder's val
shards are decoded with its own tokenizer and the text's sha256 compared (:func:`val_text_sha256`). As
``--eval-tokens`` counts tokens, which are different text with each tokenizer, arms of different tokenizers
each evaluate their whole val split (``--eval-tokens 0``: the same text, but for each shard's last partial
window, fewer than ``block_size + 1`` tokens, which no evaluation reads) -- :func:`arm_eval_tokens`. The run
of benchmarks/runs/2026-11-29-race-tokenizer-nano-cpu did this by hand.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from gptspeed.errors import GptspeedError


def data_tokenizer_identity(data: str) -> str:
    """The tokenizer identity of ``data`` (:func:`gptspeed.run_tokenizer.data_tokenizer`): ``gpt2``, a
    tiktoken encoding's name, or ``sha256:...`` of a ``tokenizer.json``."""
    from gptspeed.run_tokenizer import data_tokenizer

    return data_tokenizer(data).identity


VAL_TEXT_CHUNK = 1 << 20
"""Tokens read at a time by :func:`val_text_sha256` (a decoded piece ends at a document's start)."""


def val_text_sha256(data: str, chunk: int = VAL_TEXT_CHUNK) -> str:
    """The sha256 (hex) of ``data``'s val split decoded to text: its val shards' ids, in order, decoded
    with the data's own tokenizer (GPT-2's for a GPT-2 folder) and encoded as UTF-8. Read ``chunk``
    tokens at a time and decoded in pieces that end where a document starts (its ``<|endoftext|>``),
    so no character is cut and memory holds about one chunk (or one document, if longer), not the
    split. GptspeedError when ``data`` has no val split or its tokenizer cannot be loaded."""
    from gptspeed.bpe import resolve_tokenizer
    from gptspeed.data.train_data import find_train_data
    from gptspeed.run_tokenizer import training_tokenizer

    train_data = find_train_data(data)
    try:
        if not train_data.has_val:
            raise GptspeedError(f"--data {data} has no val split: give a folder from `gptspeed prepare`")
        tok = training_tokenizer(SimpleNamespace(tokenizer=train_data.tokenizer.identity), train_data)
        tok = tok if tok is not None else resolve_tokenizer("gpt2")
        digest = hashlib.sha256()
        for piece in _document_pieces(train_data.val_shards, tok.eot, chunk):
            digest.update(tok.decode(piece.tolist()).encode("utf-8", "surrogatepass"))
    finally:
        train_data.close()
    return digest.hexdigest()


def _document_pieces(shards: list, eot: int, chunk: int):
    """The ids of ``shards``, in order, as int64 arrays that each end just before an ``eot`` (the last one
    where the shards end): read ``chunk`` ids at a time, a document cut by a read carried into the next."""
    import numpy as np

    from gptspeed.data.shards import read_shard

    carry = np.zeros(0, dtype=np.int64)
    for path in shards:
        ids = read_shard(path)
        for a in range(0, len(ids), chunk):
            piece = np.concatenate([carry, np.asarray(ids[a : a + chunk], dtype=np.int64)])
            starts = np.flatnonzero(piece == eot)
            cut = int(starts[-1]) if len(starts) else 0
            if cut:
                yield piece[:cut]
            carry = piece[cut:]
    if len(carry):
        yield carry


def check_race_data(
    names: list[str], datas: list[str], target_bpb: float | None, target_val_loss: float | None
) -> None:
    """Whether arms ``names`` training on ``datas`` (each arm's ``--data``, in order) can be raced: one
    data for all always; else every tokenizer the same or ``target_bpb`` given, and every data's val
    split the same text (:func:`val_text_sha256`). GptspeedError (one line) otherwise: a val-loss target
    with different tokenizers, or naming the arms whose val text differs from the first arm's."""
    if len(set(datas)) == 1:
        return
    tokenizers = [data_tokenizer_identity(d) for d in datas]
    if target_bpb is None and len(set(tokenizers)) > 1:
        target = f"--target-val-loss {target_val_loss:g}" if target_val_loss is not None else "a val-loss target"
        raise GptspeedError(
            f"bench race: the arms' --data have different tokenizers ({', '.join(sorted(set(tokenizers)))}) and "
            f"{target} is a loss per token, which does not compare across tokenizers: give --target-bpb BPB"
        )
    shas = [val_text_sha256(d) for d in datas]
    differ = [f"{n} ({d})" for n, d, s in zip(names, datas, shas) if s != shas[0]]
    if differ:
        raise GptspeedError(
            f"bench race: the val text of arm(s) {', '.join(differ)} differs from arm {names[0]}'s ({datas[0]}): "
            "a race compares arms on the same val text; prepare each folder from the same text"
        )


def arm_eval_tokens(datas: list[str], eval_tokens: int, given: bool) -> list[int]:
    """Each arm's ``--eval-tokens``: ``eval_tokens`` for every arm when their data share one tokenizer
    (the same val text is then the same tokens); else 0 for every arm -- each evaluates its whole val
    split, the same text (:func:`check_race_data`) -- and ``given`` (the race was given a nonzero
    ``--eval-tokens``) is refused in one line, as its count of tokens would be different text in each."""
    if len({data_tokenizer_identity(d) for d in datas}) == 1:
        return [eval_tokens] * len(datas)
    if given and eval_tokens:
        raise GptspeedError(
            f"bench race: --eval-tokens {eval_tokens} counts tokens, which are different text with each arm's "
            "tokenizer; arms of different tokenizers each evaluate their whole val split (the same text): drop "
            "--eval-tokens or give 0"
        )
    return [0] * len(datas)
