"""``gptspeed.data.prepare``: corpus -> GPT-2 token shards: ``gptspeed prepare SOURCE --out DIR``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gptspeed.data import find_shards, load_manifest, read_shard
from gptspeed.data.corpora import CORPORA
from gptspeed.data.prepare import prepare
from gptspeed.data.prepared_state import PROGRESS_NAME
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, encode

from support.cli import assert_user_error, run_main
from support.documents import DOCS, all_tokens, expected_stream, shard_bytes, write_jsonl
from support.paths import SHAKESPEARE_TOKENS
from support.paths import SHARED_DATA as SHARED
from support.records import DOCS as DOCS_RECORDS
from support.records import lines_of

pytestmark = pytest.mark.usefixtures("no_network", "no_requests")


def shard_bytes_records(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


needs_shared = pytest.mark.skipif(not (SHARED / "SHA256SUMS").is_file(), reason="shared/data not beside the checkout")


def all_tokens_three(out, split):
    return np.concatenate([read_shard(p) for p in find_shards(out, split)])


def write_docs(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return folder


DOCS_THREE = ["The first document. " * 40, "The second one, rather shorter. " * 5, "A third. " * 12]


def test_workers_give_identical_shards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 20)
    one = prepare(str(path), tmp_path / "w1", shard_tokens=3000, progress=False, workers=1)
    two = prepare(str(path), tmp_path / "w2", shard_tokens=3000, progress=False, workers=2)
    assert len(one["splits"]["train"]["shards"]) > 2
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")
    assert one["splits"] == two["splits"]


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_resume_skips_finished_chunks(tmp_path, monkeypatch, shuffle_seed):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    ref = prepare(str(path), tmp_path / "ref", shard_tokens=2000, progress=False, shuffle_seed=shuffle_seed)
    import gptspeed.data.prepare as P

    real, calls = P.write_shard, []

    def crash_on_third(p, tokens):
        calls.append(p.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(p, tokens)

    monkeypatch.setattr(P, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(path), tmp_path / "out", shard_tokens=2000, progress=False, shuffle_seed=shuffle_seed)
    state = json.loads((tmp_path / "out" / PROGRESS_NAME).read_text())
    assert len(state["chunks"]) == 2 and not (tmp_path / "out" / "manifest.json").exists()
    encoded = []
    import gptspeed.data.tokenize as T

    real_encode = T.encode_document
    monkeypatch.setattr(P, "write_shard", real)
    monkeypatch.setattr(T, "encode_document", lambda text: encoded.append(text) or real_encode(text))
    m = prepare(str(path), tmp_path / "out", shard_tokens=2000, progress=False, shuffle_seed=shuffle_seed)
    assert len(encoded) < len(DOCS) * 10 - 5  # the documents of finished chunks were not tokenized again
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    assert m["splits"] == ref["splits"] and m["documents"] == ref["documents"]
    assert not (tmp_path / "out" / PROGRESS_NAME).exists()


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_interrupted_while_finishing_resumes_without_reading_again(tmp_path, monkeypatch, shuffle_seed):
    import gptspeed.data.prepare as P

    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    kw = dict(shard_tokens=2000, progress=False, shuffle_seed=shuffle_seed)
    ref = prepare(str(path), tmp_path / "ref", **kw)
    real = P.write_shard

    def crash_at_val(p, tokens):
        if p.name.startswith("val_"):
            raise KeyboardInterrupt
        real(p, tokens)

    monkeypatch.setattr(P, "write_shard", crash_at_val)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(path), tmp_path / "out", **kw)
    assert json.loads((tmp_path / "out" / PROGRESS_NAME).read_text())["complete"]
    monkeypatch.setattr(P, "write_shard", real)
    monkeypatch.setattr(P, "iter_files", lambda *a, **k: pytest.fail("the input was read again"))
    m = prepare(str(path), tmp_path / "out", **kw)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    assert m["splits"] == ref["splits"] and m["documents"] == ref["documents"]
    assert not list((tmp_path / "out").glob(".*"))  # no staging chunk, progress or temp file left


def test_bad_records_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:5]]
    lines[2] = '{"text": "broken'
    lines.insert(4, json.dumps({"body": "no text field"}))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(GptspeedError, match=r"d\.jsonl:3: not valid JSON.*--skip-bad"):
        prepare(str(path), tmp_path / "o1", progress=False)
    lines[2] = json.dumps({"text": DOCS[2]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(GptspeedError, match=r"d\.jsonl:5: no string field 'text'"):
        prepare(str(path), tmp_path / "o2", progress=False)
    lines[2] = "not json"
    path.write_text("\n".join(lines) + "\n")
    m = prepare(str(path), tmp_path / "o3", skip_bad=True, progress=False)
    assert m["bad_records"] == 2 and m["documents"] == 4
    np.testing.assert_array_equal(all_tokens(tmp_path / "o3"), expected_stream([DOCS[0], DOCS[1], DOCS[3], DOCS[4]]))


def test_parquet_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[:3]}), tmp_path / "d.parquet")
    with pytest.raises(GptspeedError, match=r"d\.parquet: no column 'text'.*--text-field"):
        prepare(str(tmp_path / "d.parquet"), tmp_path / "o", progress=False)


def test_memory_stays_flat_as_the_corpus_grows(tmp_path):
    """Peak Python + numpy memory (tracemalloc) of a whole prepare for a 1 MB and a 10 MB corpus:
    streaming keeps the difference far below the 9 MB of extra text (let alone its tokens). With
    a shuffle seed, so that the staging stream and the shuffled write are both measured."""
    import tracemalloc

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    line = " ".join(words[i % len(words)] for i in range(180))  # ~1 KB per document
    prepare(str(write_jsonl(tmp_path / "w.jsonl", [line] * 10)), tmp_path / "warm", workers=2, progress=False)
    peaks = []
    for n_docs in (1_000, 10_000):
        path = write_jsonl(tmp_path / f"d{n_docs}.jsonl", (f"{i} {line}" for i in range(n_docs)))
        tracemalloc.start()
        try:
            m = prepare(
                str(path), tmp_path / f"o{n_docs}", shard_tokens=200_000, workers=2, progress=False, shuffle_seed=5
            )
            peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)  # MiB
        finally:
            tracemalloc.stop()
        assert m["documents"] == n_docs
    assert peaks[1] - peaks[0] < 6, f"peak memory grew from {peaks[0]:.1f} to {peaks[1]:.1f} MiB"


# ------------------------------------------------------------------- 6, 7, 8, 9: prepare's output
def test_shard_tokens_above_int32_is_refused_before_any_work(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS[:3]))
    proc = run_main("prepare", str(src), "--out", str(tmp_path / "out"), "--shard-tokens", "3000000000")
    assert_user_error(proc, "--shard-tokens must be at most 2,147,483,647")
    assert not (tmp_path / "out").exists()
    m = prepare(str(src), tmp_path / "ok", shard_tokens=2**31 - 1, progress=False)  # the largest is fine
    assert m["shard_tokens"] == 2**31 - 1


def test_an_out_folder_that_cannot_be_is_one_line(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS[:3]))
    (tmp_path / "somefile.txt").write_text("mine")
    assert_user_error(
        run_main("prepare", str(src), "--out", str(tmp_path / "somefile.txt" / "sub")), "a part of its path is a file"
    )
    assert_user_error(run_main("prepare", str(src), "--out", str(tmp_path / ("x" * 300))), "too long")
    assert_user_error(run_main("prepare", str(src), "--out", str(tmp_path / ("x" * 300) / "sub")), "too long")
    assert (tmp_path / "somefile.txt").read_text() == "mine"


@pytest.mark.parametrize("fail_at", ["chunk", "train-shard"])
def test_a_full_disk_while_writing_shards_is_one_line_and_nothing_looks_prepared(tmp_path, monkeypatch, fail_at):
    """ENOSPC from a shard write was a raw OSError traceback. Now one line names the folder; the
    temporary file is gone, no manifest is written, find_shards refuses the folder (its val shard
    may already be there), and the same command resumes to the same shards once there is room."""
    import gptspeed.data.shards as shards_mod
    from gptspeed import fileio

    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS * 3))
    kw = dict(shard_tokens=1000, progress=False)
    ref = prepare(str(src), tmp_path / "ref", **kw)
    out = tmp_path / "out"

    def full_disk(path, write, before_rename=None):
        target = Path(path).name
        hit = target == ".stream_000002.bin" if fail_at == "chunk" else target.startswith("train_")
        if not hit:
            return fileio.write_atomic(path, write, before_rename)

        def half(f):
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return fileio.write_atomic(path, half, before_rename)

    monkeypatch.setattr(shards_mod, "write_atomic", full_disk)
    proc = run_main("prepare", str(src), "--out", str(out), "--shard-tokens", "1000")
    assert_user_error(proc, f"cannot write the data folder {out}: the disk is full", "run the same command again")
    assert not (out / "manifest.json").exists() and not list(out.glob(".*.tmp"))
    if fail_at == "train-shard":
        assert (out / "val_000000.bin").is_file()  # written before the failure: must not look usable
    with pytest.raises(GptspeedError, match="unfinished `gptspeed prepare`"):
        find_shards(out, "train")
    monkeypatch.setattr(shards_mod, "write_atomic", fileio.write_atomic)
    m = prepare(str(src), out, **kw)
    assert m["splits"] == ref["splits"] and shard_bytes_records(out) == shard_bytes_records(tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


@needs_shared
def test_tinyshakespeare(tmp_path):
    out = tmp_path / "tiny"
    m = prepare("tinyshakespeare", out, progress=False)
    train, val = all_tokens_three(out, "train"), all_tokens_three(out, "val")
    assert len(train) + len(val) == SHAKESPEARE_TOKENS + 1
    assert train[0] == EOT_TOKEN and np.count_nonzero(train == EOT_TOKEN) == 1
    assert len(val) == SHAKESPEARE_TOKENS + 1 - round((SHAKESPEARE_TOKENS + 1) * 0.9)  # one document: no move
    assert m == load_manifest(out) == json.loads((out / "manifest.json").read_text())
    assert m["format"] == "gptspeed-shards" and m["format_version"] == 1
    assert (m["tokenizer"], m["eot_token"], m["n_vocab"]) == ("gpt2", 50256, 50257)
    assert m["source"] == "tinyshakespeare" and m["documents"] == 1
    sha = CORPORA["tinyshakespeare"].files["tinyshakespeare/input.txt"]
    assert m["files"] == [{"path": "tinyshakespeare/input.txt", "sha256": sha, "bytes": 1115394}]
    assert m["input_sha256"] == hashlib.sha256((sha + "\n").encode()).hexdigest()
    assert m["splits"]["train"] == {"tokens": len(train), "documents": 1, "shards": ["train_000000.bin"]}
    assert m["splits"]["val"] == {"tokens": len(val), "documents": 0, "shards": ["val_000000.bin"]}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_000000.bin", "val_000000.bin"]


def test_directory_splits_at_document_start(tmp_path):
    src = write_docs(tmp_path / "src" / "sub", DOCS_THREE).parent  # recursive
    (tmp_path / "src" / "notes.md").write_text("not a .txt: ignored")
    m = prepare(str(src), tmp_path / "out", val_fraction=0.3, progress=False)
    train, val = all_tokens_three(tmp_path / "out", "train"), all_tokens_three(tmp_path / "out", "val")
    expected = np.concatenate([[EOT_TOKEN, *encode(d)] for d in DOCS_THREE])
    np.testing.assert_array_equal(np.concatenate([train, val]), expected)
    assert m["documents"] == np.count_nonzero(expected == EOT_TOKEN) == 3
    assert val[0] == EOT_TOKEN  # the cut moved to a document start
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 3
    assert [f["path"] for f in m["files"]] == ["sub/doc0.txt", "sub/doc1.txt", "sub/doc2.txt"]


def test_glob_and_single_file(tmp_path):
    src = write_docs(tmp_path / "src", DOCS_THREE)
    m = prepare(str(src / "doc[02].txt"), tmp_path / "g", val_fraction=0.2, progress=False)
    assert m["documents"] == 2 and len(m["files"]) == 2
    m = prepare(str(src / "doc0.txt"), tmp_path / "f", progress=False)
    assert m["documents"] == 1
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == len(encode(DOCS_THREE[0])) + 1


@needs_shared
def test_small_shards_concatenate_to_one(tmp_path):
    one = prepare("tinyshakespeare", tmp_path / "one", progress=False)
    many = prepare("tinyshakespeare", tmp_path / "many", shard_tokens=100_000, progress=False)
    assert many["splits"]["train"]["shards"] == [f"train_{i:06d}.bin" for i in range(4)]
    assert many["splits"]["train"]["tokens"] == one["splits"]["train"]["tokens"]
    for split in ("train", "val"):
        shards = find_shards(tmp_path / "many", split)
        assert all(len(read_shard(p)) <= 100_000 for p in shards)
        np.testing.assert_array_equal(
            all_tokens_three(tmp_path / "many", split), all_tokens_three(tmp_path / "one", split)
        )


def test_already_prepared_and_force(tmp_path):
    docs = [d * 6 for d in DOCS_THREE]  # ~1,400 tokens: several shards of 256
    src = write_docs(tmp_path / "src", docs)
    out = tmp_path / "out"
    prepare(str(src), out, shard_tokens=256, progress=False)
    n_old = len(list(out.glob("*.bin")))
    again = prepare(str(src), out, shard_tokens=256, progress=False)  # same input and settings: kept
    assert again["reused"] and len(list(out.glob("*.bin"))) == n_old
    with pytest.raises(GptspeedError, match="already prepared from other input or settings; pass --force"):
        prepare(str(src), out, progress=False)  # other shard size
    (src / "doc1.txt").write_text(docs[1] + " more")
    with pytest.raises(GptspeedError, match="already prepared from other input"):
        prepare(str(src), out, shard_tokens=256, progress=False)  # same settings, other text
    prepare(str(src), out, force=True, progress=False)  # one shard per split now
    assert n_old > 2 and sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"shard_tokens": 0}, "shard.tokens"),
        ({"shard_tokens": 255}, "at least 256"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    src = write_docs(tmp_path / "src", DOCS_THREE)
    with pytest.raises(GptspeedError, match=match):
        prepare(str(src), tmp_path / "out", progress=False, **kwargs)


def test_bad_sources(tmp_path):
    empty = write_docs(tmp_path / "empty", ["", ""])
    with pytest.raises(GptspeedError, match="no text in"):
        prepare(str(empty), tmp_path / "o1", progress=False)
    with pytest.raises(GptspeedError, match="does not exist"):
        prepare(str(tmp_path / "nope"), tmp_path / "o2", progress=False)
    (tmp_path / "no-txt").mkdir()
    with pytest.raises(GptspeedError, match="no \\*.txt files"):
        prepare(str(tmp_path / "no-txt"), tmp_path / "o3", progress=False)
    with pytest.raises(GptspeedError, match="matches no files"):
        prepare(str(tmp_path / "*.nothing"), tmp_path / "o4", progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(GptspeedError, match="latin1.txt is not UTF-8"):
        prepare(str(tmp_path / "latin1.txt"), tmp_path / "o5", progress=False)
    (tmp_path / "tiny.txt").write_text("hi")  # 2 tokens: one split would be empty
    with pytest.raises(GptspeedError, match="too few"):
        prepare(str(tmp_path / "tiny.txt"), tmp_path / "o6", progress=False)
    assert not (tmp_path / "o6" / "manifest.json").exists()


@needs_shared
def test_mirror_with_wrong_sha256(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    (mirror / "tinyshakespeare").mkdir(parents=True)
    bad = mirror / "tinyshakespeare" / "input.txt"
    shutil.copy(SHARED / "tinyshakespeare" / "input.txt", bad)
    with bad.open("a") as f:
        f.write("extra line\n")
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(mirror))
    with pytest.raises(GptspeedError, match="input.txt has sha256 [0-9a-f]{64}, expected 86c4e6"):
        prepare("tinyshakespeare", tmp_path / "out", progress=False)


# ------------------------------------------------------------------ FineWeb-Edu: a fixed-size val split


def test_a_corpus_with_a_fixed_val_size_keeps_it_whatever_its_size(tmp_path, monkeypatch):
    """FineWeb-Edu's val split is 100M tokens (build-nanogpt's), not a tenth of 10B: a corpus with ``val_tokens``
    puts that many in val (at the nearest document start), and one too small for it keeps the fraction."""
    import datasets  # noqa: F401  (the test extra installs it; HF corpora are read through it)

    from gptspeed.data.corpora import HF_CORPORA, HFCorpus

    assert HF_CORPORA["fineweb-edu-10B"].val_tokens == 100_000_000
    assert HF_CORPORA["tinystories"].val_tokens is None
    doc = "The same words in every document, so that each one has the same length. " * 3
    length = len(encode(doc)) + 1  # its <|endoftext|> too
    for n_docs, val_docs in ((400, 20), (1000, 20), (100, 10)):  # 20 documents' worth, or a tenth when less
        path = write_jsonl(tmp_path / f"{n_docs}.jsonl", [doc] * n_docs)
        monkeypatch.setitem(HF_CORPORA, "edu", HFCorpus("edu", str(path), None, val_tokens=20 * length))
        m = prepare("edu", tmp_path / f"out{n_docs}", progress=False)
        assert m["splits"]["val"]["tokens"] == val_docs * length and m["splits"]["val"]["documents"] == val_docs
        assert m["splits"]["train"]["tokens"] == (n_docs - val_docs) * length
        assert m["settings"]["val_tokens"] == 20 * length
    # a corpus without one keeps the fraction, and its settings are as before
    m = prepare(str(path), tmp_path / "plain", progress=False)
    assert m["splits"]["val"]["tokens"] == 10 * length and "val_tokens" not in m["settings"]
