"""The data folder keeps what it promises (gptspeed.data.folder, issue 41): a prepare never writes
under a running train nor a train reads under a prepare (a lock), a shard changed where nothing
could lock is one line after the last step is saved, prepare writes only into its own folders,
a manifest that lists one file twice is refused, and one huge document costs bounded memory."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from gptspeed.data import read_shard, write_shard
from gptspeed.data.prepare import PrepareLock, prepare
from gptspeed.data.train_data import find_train_data
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

from conftest import assert_user_error, run_main

DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog, again and again. " * (4 + i % 5)
        for i in range(60)]


def corpus(tmp_path: Path, docs=DOCS) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_bytes(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs))
    return src


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _fit(data: Path, run: Path, **over):
    from gptspeed.trainer import build_train_config, fit

    tiny = dict(n_layer=1, n_head=2, n_embd=16, block_size=32, batch_size=4, warmup_steps=1, log_every=1,
                device="cpu", dtype="float32", compile=False, eval_every=0, data=str(data), out=str(run),
                max_steps=4, save_every=100_000)
    return fit(build_train_config("pico", {**tiny, **over}), echo=False)


def _prepare_during_step(monkeypatch, at_step: int, *args: str) -> list:
    """Run ``gptspeed prepare ARGS`` (the CLI, in this process) just before the training step
    ``at_step + 1``; the result is appended to the returned list."""
    from gptspeed.trainer import Trainer

    real, seen = Trainer.train_step, []

    def step(self, *a, **kw):
        if self.step == at_step and not seen:
            seen.append(run_main("prepare", *args))
        return real(self, *a, **kw)

    monkeypatch.setattr(Trainer, "train_step", step)
    return seen


# ---------------------------------------------------------------------- one huge document
class _Recording:
    """A GPT-2 encoding that records the length of every text handed to the BPE."""

    def __init__(self, enc, lengths):
        self.enc, self.lengths = enc, lengths

    def encode_to_numpy(self, text, **kw):
        self.lengths.append(len(text))
        return self.enc.encode_to_numpy(text, **kw)


def test_a_huge_document_reaches_the_bpe_in_bounded_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    """One 200 MB document (204 KB of gzip) went to tiktoken whole: ~60 bytes of memory a
    character, minutes at 10 GB. Now at most PIECE_CHARS characters go at once (here lowered to
    4,096), cut where the tokens cannot change (after a non-space, before a space or newline):
    the same tokens as the whole document (prepare and the stream loader share the code). A run with
    no such place longer than a piece (one 1M-character "word", the bomb's kind) is cut inside;
    its tokens still decode to its text."""
    from gptspeed.data import tokenize as T

    lengths: list[int] = []
    real = T.thread_encoding
    monkeypatch.setattr(T, "thread_encoding", lambda: _Recording(real(), lengths))
    monkeypatch.setattr(T, "PIECE_CHARS", 4096)
    enc = get_encoding()
    rng = np.random.default_rng(0)
    words = ["the", "cat", "don't", "1999", "naïve", "日本語", "🙂", "--", "'re", "\n", "\n\n", "  ", "\t", "\r\n"]
    prose = " ".join(rng.choice(words, 200_000))  # ~1M characters, every kind of space and word
    bomb = "a" * 1_000_000
    src = tmp_path / "bomb.jsonl.gz"
    src.write_bytes(gzip.compress(json.dumps({"text": prose}).encode() + b"\n" + json.dumps({"text": bomb}).encode()
                                  + b"\n"))
    prepare(str(src), tmp_path / "out", shard_tokens=1 << 20, workers=2, progress=False)
    assert lengths and max(lengths) <= 4096
    stream = np.concatenate([read_shard(p) for p in sorted((tmp_path / "out").glob("*.bin"))])  # train_ < val_
    second = int(np.flatnonzero(stream == EOT_TOKEN)[1])
    assert stream[1:second].tolist() == enc.encode_ordinary(prose)
    assert enc.decode(stream[second + 1:].tolist()) == bomb
