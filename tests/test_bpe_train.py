"""``gptspeed tokenizer train`` / ``compare`` (gptspeed.bpe_train): a byte-level BPE trained on a few KB
of tiny Shakespeare, its folder written whole or not at all, and each bad input one line."""

from __future__ import annotations

import json
import lzma

import pytest

from gptspeed.bpe import TOKENIZER_JSON, TOKENIZER_MANIFEST, load_tokenizer_dir
from gptspeed.bpe_train import compare_tokenizers, train_tokenizer
from gptspeed.data.corpora import EMBEDDED_DIR
from gptspeed.errors import GptspeedError
from gptspeed.fileio import sha256_file

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("no_network")


def shakespeare(chars: int) -> str:
    return lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()[:chars]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(shakespeare(12_000), encoding="utf-8")
    return path


def test_train_writes_a_tokenizer_of_the_vocabulary_asked_and_a_manifest_naming_its_sources(tmp_path, corpus):
    m = train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=400, progress=False)
    tok = load_tokenizer_dir(tmp_path / "tok")
    assert m["vocab_size"] == tok.n_vocab == 400
    assert tok.eot == m["eot_token"] == 399  # <|endoftext|> the last id, as GPT-2's 50256
    assert m["pattern"]["name"] == "gpt4"
    assert m["sources"] == [{"path": str(corpus), "sha256": sha256_file(corpus), "bytes": corpus.stat().st_size}]
    assert m["tokenizer_sha256"] == sha256_file(tmp_path / "tok" / TOKENIZER_JSON) == tok.sha256
    assert json.loads((tmp_path / "tok" / TOKENIZER_MANIFEST).read_text()) == m
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "tok"]  # no temporary folder left


def test_max_chars_bounds_the_text_read(tmp_path, corpus):
    m = train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=300, max_chars=1000, progress=False)
    assert m["chars"] == 1000 and m["documents"] == 1


def test_the_gpt2_pattern_splits_as_gpt2_does(tmp_path, corpus):
    train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=300, pattern="gpt2", progress=False)
    tok = load_tokenizer_dir(tmp_path / "tok")
    pieces = tok.tok.pre_tokenizer.pre_tokenize_str("you're  here\n\n123456")
    assert [p for p, _ in pieces] == ["you", "'re", "Ġ", "Ġhere", "Ċ", "Ċ", "123456"]  # GPT-4's cuts digits by 3


def test_force_replaces_a_tokenizer_folder_but_never_other_files(tmp_path, corpus):
    train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=300, progress=False)
    with pytest.raises(GptspeedError, match="exists"):
        train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=320, progress=False)
    assert (
        train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=320, force=True, progress=False)["vocab_size"]
        == 320
    )
    assert load_tokenizer_dir(tmp_path / "tok").n_vocab == 320
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(GptspeedError, match="not a tokenizer folder"):
        train_tokenizer([str(corpus)], other, vocab_size=300, force=True, progress=False)
    assert (other / "notes.txt").read_text() == "mine"


def write_bad(tmp_path, kind):
    path = tmp_path / "bad.txt"
    if kind == "empty":
        path.write_text("")
    elif kind == "whitespace":
        path.write_text(" \n\n\t ")
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)  # not UTF-8
    elif kind == "nul":
        path.write_bytes(b"ELF\0\0\0\x01\x02" * 100)  # valid UTF-8, but binary
    return path


@pytest.mark.parametrize(
    "kind, vocab, match",
    [
        ("empty", 300, "no text in"),
        ("whitespace", 300, "no text in"),
        ("binary", 300, "not UTF-8"),
        ("nul", 300, "NUL characters"),
        ("good", 256, "--vocab-size must be from 257"),
        ("good", 2**32 + 1, "--vocab-size must be from 257"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, corpus, kind, vocab, match):
    src = corpus if kind == "good" else write_bad(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_main(
        "tokenizer", "train", str(src), "--vocab-size", str(vocab), "--out", str(tmp_path / "tok"), "--no-progress"
    )
    assert_user_error(r, match)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_compare_prints_bytes_per_token_of_gpt2_and_each_tokenizer_per_file(tmp_path, corpus):
    train_tokenizer([str(corpus)], tmp_path / "tok", vocab_size=400, progress=False)
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(shakespeare(20_000)[-4000:], encoding="utf-8")
    rows = compare_tokenizers([str(tmp_path / "tok")], [str(corpus), str(held_out)])
    tok = load_tokenizer_dir(tmp_path / "tok")
    text = corpus.read_text(encoding="utf-8")
    first = rows[0]["results"]
    assert first[str(tmp_path / "tok")]["tokens"] == len(tok.encode(text))
    assert first[str(tmp_path / "tok")]["bytes_per_token"] == pytest.approx(len(text.encode()) / len(tok.encode(text)))
    assert 3 < first["gpt2"]["bytes_per_token"] < 5  # GPT-2's ~4 bytes a token on English
    r = run_main("tokenizer", "compare", str(tmp_path / "tok"), "--text", str(corpus), str(held_out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["file", "bytes", "gpt2", "tok"] and len(lines) == 3
    assert f"{first['gpt2']['bytes_per_token']:.3f}" in lines[1]


def test_train_reads_what_prepare_reads_a_folder_of_text_and_jsonl_bad_records_skipped(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text(shakespeare(4000), encoding="utf-8")
    lines = [json.dumps({"text": shakespeare(8000)[4000 + i * 1000 : 5000 + i * 1000]}) for i in range(4)]
    (folder / "b.jsonl").write_text("\n".join([lines[0], "{broken", *lines[1:]]) + "\n", encoding="utf-8")
    with pytest.raises(GptspeedError, match="b.jsonl"):
        train_tokenizer([str(folder)], tmp_path / "tok", vocab_size=300, progress=False)
    assert not (tmp_path / "tok").exists()
    m = train_tokenizer([str(folder)], tmp_path / "tok", vocab_size=300, skip_bad=True, progress=False)
    assert [s["path"] for s in m["sources"]] == ["a.txt", "b.jsonl"]
    assert (m["documents"], m["bad_records"], m["chars"]) == (5, 1, 8000)
