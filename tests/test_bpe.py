"""gptspeed.bpe: a tokenizer trained here round-trips text exactly, encodes long documents in pieces to
the same ids, and a folder that is not a tokenizer (or a hostile tokenizer.json) is one line."""

from __future__ import annotations

import json
import lzma
import os

import pytest

from gptspeed.bpe import (
    EOT,
    MAX_JSON_DEPTH,
    MAX_TOKENIZER_JSON_BYTES,
    TOKENIZER_JSON,
    document_pieces,
    load_tokenizer_dir,
    resolve_tokenizer,
)
from gptspeed.bpe_train import train_tokenizer
from gptspeed.data.corpora import EMBEDDED_DIR
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN
from gptspeed.tokenizer import encode as gpt2_encode

pytestmark = pytest.mark.usefixtures("no_network")

TEXT = lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()[:12_000]


@pytest.fixture(scope="module", params=["gpt2", "gpt4"])
def tok_dir(request, tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "corpus.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path_factory.mktemp("tok") / request.param
    train_tokenizer([str(src)], out, vocab_size=450, pattern=request.param, progress=False)
    return out


ODD = [
    "",
    "Hello, world!\n\n  It's 12345 o'clock.\t\r\n",
    "été – 日本語 😀 naïve\u0301 \x00 \x7f",
    f"a literal {EOT} is text, not a separator",
    "   \n\n\n    ",
]


@pytest.mark.parametrize("text", [TEXT[:3000], *ODD])
def test_text_to_ids_to_text_is_exact(tok_dir, text):
    tok = load_tokenizer_dir(tok_dir)
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text
    assert (tok.eot in ids) is False  # a literal <|endoftext|> never becomes the separator


def test_a_trained_tokenizer_compresses_its_text_better_than_bytes(tok_dir):
    tok = load_tokenizer_dir(tok_dir)
    assert len(tok.encode(TEXT)) < 0.75 * len(TEXT.encode())


def test_documents_start_with_the_separator_and_long_ones_encode_in_pieces_to_the_same_ids(tok_dir):
    tok = load_tokenizer_dir(tok_dir)
    whole = [tok.eot, *tok.encode(TEXT)]
    assert len(list(document_pieces(TEXT, 257))) > 40  # 12,000 characters cut in ~50 pieces
    assert "".join(document_pieces(TEXT, 257)) == TEXT
    docs = tok.encode_documents([TEXT, "", "   "], piece_chars=257)
    assert docs[0].tolist() == whole and docs[0].dtype == tok.dtype == "<u2"
    assert len(docs[1]) == 0 and docs[2].tolist() == [tok.eot, *tok.encode("   ")]


def test_gpt2_resolves_to_the_shipped_bpe():
    tok = resolve_tokenizer("gpt2")
    assert (tok.n_vocab, tok.eot, tok.kind) == (50257, EOT_TOKEN, "gpt2")
    assert tok.encode("Hello world") == gpt2_encode("Hello world")
    assert tok.encode_documents(["Hi"])[0].tolist() == [EOT_TOKEN, *gpt2_encode("Hi")]


def rewrite(tok_dir, tmp_path, change):
    """A copy of ``tok_dir`` whose tokenizer.json ``change(spec)`` edited."""
    out = tmp_path / "edited"
    out.mkdir()
    spec = json.loads((tok_dir / TOKENIZER_JSON).read_text())
    change(spec)
    (out / TOKENIZER_JSON).write_text(json.dumps(spec))
    return out


def nest(spec):
    deep: object = 0
    for _ in range(MAX_JSON_DEPTH + 5):
        deep = [deep]
    spec["extra"] = deep


def other_pattern(spec):
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"(a+)+$"  # backtracks exponentially


def no_eot(spec):
    spec["added_tokens"] = []


def not_bpe(spec):
    spec["model"]["type"] = "WordPiece"


def normalizer(spec):
    spec["normalizer"] = {"type": "Lowercase"}


@pytest.mark.parametrize(
    "change, match",
    [
        (nest, "nested more than"),
        (other_pattern, "GPT-2's or GPT-4's pattern"),
        (no_eot, "no special token <|endoftext|>"),
        (not_bpe, "model is not BPE"),
        (normalizer, "normalizes text"),
    ],
    ids=["deeply-nested", "unknown-pattern", "no-eot", "not-bpe", "normalizer"],
)
def test_a_hostile_tokenizer_json_is_refused_in_one_line(tok_dir, tmp_path, change, match):
    folder = rewrite(tok_dir, tmp_path, change)
    with pytest.raises(GptspeedError, match=match) as e:
        resolve_tokenizer(str(folder))
    assert "\n" not in str(e.value)


def test_a_folder_that_is_not_a_tokenizer_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptspeedError, match="not a tokenizer folder"):
        resolve_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / TOKENIZER_JSON).write_text("{not json")
    with pytest.raises(GptspeedError, match="not valid JSON"):
        resolve_tokenizer(str(tmp_path / "garbage"))
    (tmp_path / "huge").mkdir()
    with open(tmp_path / "huge" / TOKENIZER_JSON, "wb") as f:  # sparse: no disk used
        f.truncate(MAX_TOKENIZER_JSON_BYTES + 1)
    with pytest.raises(GptspeedError, match="more than the"):
        resolve_tokenizer(str(tmp_path / "huge"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(GptspeedError, match="not a tokenizer folder"):
        resolve_tokenizer(str(tmp_path / "fifo"))


def test_a_tokenizer_naming_nothing_known_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(GptspeedError, match="names nothing known: give gpt2, a tiktoken encoding .*cl100k_base"):
        resolve_tokenizer(str(tmp_path / "nowhere"))
