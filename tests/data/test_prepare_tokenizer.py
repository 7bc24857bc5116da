"""``gptspeed prepare --tokenizer`` (gptspeed.data.prepare_tokenizer): GPT-2's folders byte for byte as
before; a trained tokenizer's ids in GPT-2's uint16 shards, a vocabulary above 65,536 in llm.c's
uint32 ones; the tokenizer recorded in the manifest; a bad --tokenizer one line, nothing written."""

from __future__ import annotations

import hashlib
import json
import lzma

import numpy as np
import pytest

from gptspeed.bpe import Tokenizer, load_tokenizer_dir
from gptspeed.bpe_train import train_tokenizer
from gptspeed.data import find_shards, read_header, read_shard
from gptspeed.data.corpora import EMBEDDED_DIR
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("no_network")

TEXT = lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()[:60_000]
DOCS = [p for p in TEXT.split("\n\n") if p.strip()]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return path


# sha256[:16] of each shard, and of the manifest less its paths, time and versions, as the code before
# --tokenizer wrote them (commit 02c43fb) for DOCS, shard_tokens 4096
TODAY = {
    None: (
        {
            "train_000000.bin": "07246a86572f2410",
            "train_000001.bin": "46fcc522a15b36b0",
            "train_000002.bin": "2ae7e533a94e873e",
            "train_000003.bin": "1947fdbb6acfc0af",
            "val_000000.bin": "1622d5915907e8b6",
        },
        "12e5c4d7fc71e941",
    ),
    7: (
        {
            "train_000000.bin": "1499caca98657605",
            "train_000001.bin": "64533836a8391dc8",
            "train_000002.bin": "8f05f5c71e09b15b",
            "train_000003.bin": "65ed129727c69712",
            "val_000000.bin": "37d0ee8d1d779801",
        },
        "8e2d212bd4f331b9",
    ),
}
TODAY_KEYS = [
    "bad_records", "created", "documents", "eot_token", "files", "format", "format_version", "gptspeed_version",
    "input_sha256", "n_vocab", "numpy_version", "settings", "shard_tokens", "source", "splits", "tiktoken_version",
    "tokenizer", "val_fraction",
]  # fmt: skip


@pytest.mark.parametrize("seed", [None, 7])
def test_a_default_prepare_writes_the_shards_and_manifest_it_wrote_before(tmp_path, jsonl, seed):
    out = tmp_path / "out"
    m = prepare(str(jsonl), out, progress=False, shard_tokens=4096, shuffle_seed=seed, workers=2)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(out.glob("*.bin"))}
    assert sorted(m) == TODAY_KEYS
    for k in ("created", "gptspeed_version", "tiktoken_version", "numpy_version", "files", "source"):
        m.pop(k)
    assert (files, hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]) == TODAY[seed]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "corpus.txt"
    src.write_text(TEXT[:12_000], encoding="utf-8")
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer([str(src)], out, vocab_size=400, progress=False)
    return out


def stream(out):
    return np.concatenate([read_shard(p) for s in ("train", "val") for p in find_shards(out, s)])


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_with_a_trained_tokenizer_writes_its_ids_and_records_it(tmp_path, jsonl, tok_dir, workers):
    out = tmp_path / "out"
    m = prepare(str(jsonl), out, progress=False, shard_tokens=1024, tokenizer=str(tok_dir), workers=workers)
    tok = load_tokenizer_dir(tok_dir)
    expected = [i for d in DOCS for i in [tok.eot, *tok.encode(d)]]
    assert stream(out).tolist() == expected
    assert all(read_header(p)[0] == 1 for p in out.glob("*.bin"))  # 400 ids: GPT-2's uint16 format
    assert (m["tokenizer"], m["tokenizer_kind"], m["n_vocab"], m["eot_token"]) == (str(tok_dir), "hf", 400, 399)
    assert m["tokenizer_sha256"] == m["settings"]["tokenizer_sha256"] == tok.sha256
    assert m["shard_format"] == {"magic": 20240520, "version": 1, "token_bytes": 2}
    assert m["documents"] == len(DOCS) == m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]
    assert tok.decode(stream(out)[1 : 1 + len(tok.encode(DOCS[0]))]) == DOCS[0]


class WideBytes(Tokenizer):
    """A vocabulary of 70,257 ids: each UTF-8 byte b is 70,000 + b (above uint16), <|endoftext|> 70,256."""

    name, kind, n_vocab, eot, sha256 = "wide-bytes", "test", 70_257, 70_256, "0" * 64

    def encode(self, text):
        return [70_000 + b for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 70_000 for i in ids).decode()


@pytest.mark.parametrize("seed", [None, 3])
def test_a_vocabulary_above_65536_writes_llm_c_uint32_shards(tmp_path, jsonl, seed):
    out = tmp_path / "out"
    m = prepare(str(jsonl), out, progress=False, shard_tokens=8192, tokenizer=WideBytes(), shuffle_seed=seed)
    assert all(read_header(p)[0] == 7 for p in out.glob("*.bin")) and len(list(out.glob("*.bin"))) > 3
    assert m["shard_format"] == {"magic": 20240801, "version": 7, "token_bytes": 4}
    tokens = stream(out)
    assert tokens.dtype == np.dtype("<u4") and tokens.max() == 70_256
    docs = np.split(tokens, np.flatnonzero(tokens == 70_256)[1:])  # documents, each starting with its separator
    assert len(docs) == m["documents"] == len(DOCS)
    texts = [WideBytes().decode(d[1:]) for d in docs]
    assert (texts if seed is None else sorted(texts)) == (DOCS if seed is None else sorted(DOCS))


def test_a_folder_prepared_with_another_tokenizer_is_refused_without_force(tmp_path, jsonl, tok_dir):
    prepare(str(jsonl), tmp_path / "out", progress=False, shard_tokens=4096)
    with pytest.raises(GptspeedError, match="already prepared from other input or settings"):
        prepare(str(jsonl), tmp_path / "out", progress=False, shard_tokens=4096, tokenizer=str(tok_dir))
    m = prepare(str(jsonl), tmp_path / "out", progress=False, shard_tokens=4096, tokenizer=str(tok_dir), force=True)
    assert m["n_vocab"] == 400


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nowhere", "names nothing known: give gpt2"),
        ("notatok", "is not a tokenizer folder (no tokenizer.json)"),
    ],
)
def test_a_bad_tokenizer_is_one_line_and_writes_nothing(tmp_path, jsonl, spec, match, monkeypatch):
    (tmp_path / "notatok").mkdir()
    monkeypatch.chdir(tmp_path)
    assert_user_error(run_main("prepare", str(jsonl), "--out", "out", "--tokenizer", spec), match)
    assert not (tmp_path / "out").exists()


def test_a_corpus_tokenized_upstream_refuses_another_tokenizer(tmp_path, tok_dir):
    with pytest.raises(GptspeedError, match="comes tokenized with GPT-2's BPE"):
        prepare("fineweb10B", tmp_path / "out", progress=False, tokenizer=str(tok_dir))
    assert not (tmp_path / "out").exists()
