"""Documents of known text for the corpus tests, written as jsonl, and the tokens and shard bytes ``prepare`` must make of them."""

from __future__ import annotations

import json

import numpy as np

from gptspeed.data import find_shards, read_shard
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

DOCS = [f"Document number {i}. " + "Some words here, and more words. " * (3 + i % 7) for i in range(40)]


def encode(text):
    return get_encoding().encode_ordinary(text)


def expected_stream(docs):
    return np.concatenate([[EOT_TOKEN, *encode(d)] for d in docs if d]).astype(np.uint16)


def all_tokens(out):
    return np.concatenate([np.concatenate([read_shard(p) for p in find_shards(out, s)]) for s in ("train", "val")])


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")
    return path


def documents(tokens):
    """The documents of a token stream: the pieces starting at each EOT."""
    starts = np.flatnonzero(tokens == EOT_TOKEN)
    return [tuple(d) for d in np.split(tokens, starts[1:])]
