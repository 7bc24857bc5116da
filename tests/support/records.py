"""Documents with awkward records (empty, whitespace, lone surrogates, non-UTF-8), written as jsonl, and the token stream ``prepare`` must make of them."""

from __future__ import annotations

import json

import numpy as np

from gptspeed.data import find_shards, read_shard
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

DOCS = [f"Document number {i}. " + "Some words here, and more words. " * (3 + i % 7) for i in range(40)]


def lines_of(docs) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def expected_stream(docs):
    enc = get_encoding()
    return np.concatenate([[EOT_TOKEN, *enc.encode_ordinary(d)] for d in docs if d]).astype(np.uint16)


def all_tokens(out):
    return np.concatenate([read_shard(p) for s in ("train", "val") for p in find_shards(out, s)])
