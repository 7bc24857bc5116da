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

from gptspeed.data import find_shards, load_manifest, read_shard, write_shard
from gptspeed.data.corpora import CORPORA
from gptspeed.data.prepare import PROGRESS_NAME, prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, encode

from support.cli import assert_user_error, run_main
from support.documents import DOCS, all_tokens, expected_stream, shard_bytes, write_jsonl
from support.paths import SHARED_DATA as SHARED
from support.records import DOCS as DOCS_RECORDS
from support.records import lines_of

pytestmark = pytest.mark.usefixtures("no_network", "no_requests")


@pytest.fixture
def no_requests(monkeypatch):
    """no_network for requests (what pooch downloads the named corpora through): any request fails."""
    import requests

    def refuse(*args, **kwargs):
        raise OSError("the network must not be used in tests")

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", refuse)


def shard_bytes_records(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


needs_shared = pytest.mark.skipif(not (SHARED / "SHA256SUMS").is_file(), reason="shared/data not beside the checkout")


TINY_TOKENS = 338_025


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


def test_prepare_progress_files_that_cannot_be_read_are_started_over_or_refused(tmp_path):
    """The progress file was read with a bare json.loads: not UTF-8 (UnicodeDecodeError), a list,
    or chunk names reaching outside the folder (renamed into train shards, or deleted)."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS))
    ref = prepare(str(src), tmp_path / "ref", shard_tokens=1000, progress=False)
    victim = tmp_path / "victim.bin"
    write_shard(victim, np.arange(5))
    out = tmp_path / "out"
    out.mkdir()
    for junk in (
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        b'{"chunks": 3}',
        json.dumps(
            {
                "key": "k",
                "chunks": [{"name": "../victim.bin", "tokens": 5}],
                "next_doc": 0,
                "doc_offset": 0,
                "documents": 0,
                "tokens": 5,
            }
        ).encode(),
    ):
        (out / PROGRESS_NAME).write_bytes(junk)
        m = prepare(str(src), out, shard_tokens=1000, progress=False)
        assert m["splits"] == ref["splits"] and shard_bytes_records(out) == shard_bytes_records(tmp_path / "ref")
        assert victim.is_file() and not (out / PROGRESS_NAME).exists()
        (out / "manifest.json").unlink()
    (out / PROGRESS_NAME).mkdir()
    assert_user_error(
        run_main("prepare", str(src), "--out", str(out), "--shard-tokens", "1000"),
        ".prepare-progress.json is not a file",
    )


# ------------------------------------------------------------------- 6, 7, 8, 9: prepare's output
def test_shard_tokens_above_int32_is_refused_before_any_work(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS[:3]))
    proc = run_main("prepare", str(src), "--out", str(tmp_path / "out"), "--shard-tokens", "3000000000")
    assert_user_error(proc, "--shard-tokens must be at most 2,147,483,647")
    assert not (tmp_path / "out").exists()
    m = prepare(str(src), tmp_path / "ok", shard_tokens=2**31 - 1, progress=False)  # the largest is fine
    assert m["shard_tokens"] == 2**31 - 1


def test_a_second_prepare_into_the_same_folder_is_refused_naming_the_first(tmp_path):
    """Two prepares into one folder deleted each other's staging chunks and left orphans."""
    from gptspeed.data.prepare import PrepareLock

    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS))
    out = tmp_path / "out"
    out.mkdir()
    staged = out / ".stream_000000.bin"
    write_shard(staged, np.arange(7))  # the first prepare's chunk, not yet in its progress file
    lock = PrepareLock(out).acquire()
    try:
        proc = run_main("prepare", str(src), "--out", str(out))
        assert_user_error(proc, f"{out} is being prepared by pid {os.getpid()}", "another `gptspeed prepare`")
        with pytest.raises(GptspeedError, match="being prepared by"):
            prepare(str(src), out, force=True, progress=False)
        assert staged.is_file() and sorted(p.name for p in out.iterdir()) == [".prepare.lock", staged.name]
    finally:
        lock.release()
    staged.unlink()
    prepare(str(src), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_000000.bin", "val_000000.bin"]


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
    assert len(train) + len(val) == TINY_TOKENS + 1
    assert train[0] == EOT_TOKEN and np.count_nonzero(train == EOT_TOKEN) == 1
    assert len(val) == TINY_TOKENS + 1 - round((TINY_TOKENS + 1) * 0.9)  # one document: no move
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


# ------------------------------------------------------------------ fineweb10B: the speedrun's shards, tokenized upstream

FINEWEB = {"fineweb_val_000000.bin": 1500, "fineweb_train_000001.bin": 2100, "fineweb_train_000002.bin": 1700}


def fake_fineweb_tokens(n: int, seed: int) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, EOT_TOKEN, n)
    tokens[::100] = EOT_TOKEN  # a document every 100 tokens
    return tokens


@pytest.fixture
def fineweb_mirror(tmp_path, monkeypatch):
    """A mirror holding a small fake fineweb10B (its val shard and two train shards, written with gptspeed's own
    write_shard), and a Hub that must not be asked."""
    folder = tmp_path / "mirror" / "fineweb10B"
    folder.mkdir(parents=True)
    for seed, (name, n) in enumerate(FINEWEB.items()):
        write_shard(folder / name, fake_fineweb_tokens(n, seed))
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("the mirror holds the files: the Hub must not be asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    return folder


def test_prepare_fineweb10B_max_shards_1_from_the_mirror_gives_a_folder_train_reads(tmp_path, fineweb_mirror):
    from gptspeed.data.train_data import find_train_data

    out = tmp_path / "fw"
    proc = run_main("prepare", "fineweb10B", "--out", str(out), "--max-shards", "1", "--print-hashes", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    val, train = (fineweb_mirror / n for n in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"))
    sums = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (val, train)]
    assert proc.stdout.splitlines()[:2] == [
        f"{sums[0]}  fineweb10B/fineweb_val_000000.bin",
        f"{sums[1]}  fineweb10B/fineweb_train_000001.bin",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_000001.bin", "val_000000.bin"]
    assert (out / "val_000000.bin").read_bytes() == val.read_bytes()
    assert (out / "train_000001.bin").read_bytes() == train.read_bytes()
    m = load_manifest(out)
    assert m["source"] == "fineweb10B" and m["format"] == "gptspeed-shards" and m["settings"] == {"max_shards": 1}
    assert m["splits"] == {
        "train": {"tokens": 2100, "documents": 21, "shards": ["train_000001.bin"]},
        "val": {"tokens": 1500, "documents": 15, "shards": ["val_000000.bin"]},
    }
    assert [(f["path"], f["sha256"], f["bytes"], f["as"], f["origin"]) for f in m["files"]] == [
        ("fineweb10B/fineweb_val_000000.bin", sums[0], 1024 + 3000, "val_000000.bin", "mirror"),
        ("fineweb10B/fineweb_train_000001.bin", sums[1], 1024 + 4200, "train_000001.bin", "mirror"),
    ]
    assert m["input_sha256"] == hashlib.sha256("".join(s + "\n" for s in sums).encode()).hexdigest()
    # linked, not copied, where the file system allows (here: one file system, so a hard link)
    assert {f["placed"] for f in m["files"]} == {"hardlink"} and os.stat(out / "val_000000.bin").st_nlink == 2
    # what `gptspeed train --data` opens: the folder checked against its manifest, and its batches
    data = find_train_data(str(out))
    try:
        assert data.train_shards == [out / "train_000001.bin"] and data.val_shards == [out / "val_000000.bin"]
        assert data.documents == 21 and data.identity["settings"] == {"max_shards": 1}
        x, y = data.loader(4, 64).next_batch()
        want = read_shard(train)[: 4 * 64 + 1].astype(np.int64)
        assert x.flatten().tolist() == want[:-1].tolist() and y.flatten().tolist() == want[1:].tolist()
    finally:
        data.close()
    # the same command again: the folder is kept; other settings need --force
    assert prepare("fineweb10B", out, max_shards=1, progress=False)["reused"] is True
    with pytest.raises(GptspeedError, match="already prepared from other input or settings; pass --force"):
        prepare("fineweb10B", out, max_shards=2, progress=False)
    m = prepare("fineweb10B", out, max_shards=2, force=True, progress=False)
    assert m["splits"]["train"]["shards"] == ["train_000001.bin", "train_000002.bin"]
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "train_000001.bin",
        "train_000002.bin",
        "val_000000.bin",
    ]


@pytest.mark.parametrize("damage", ["magic", "version", "truncated", "extra bytes", "shorter than a header"])
def test_a_damaged_fineweb10B_shard_is_refused_in_one_line_naming_it(tmp_path, fineweb_mirror, damage):
    path = fineweb_mirror / "fineweb_train_000001.bin"
    raw = bytearray(path.read_bytes())
    if damage in ("magic", "version"):
        raw[0 if damage == "magic" else 4 : 4 if damage == "magic" else 8] = np.array([7], "<i4").tobytes()
    elif damage == "truncated":
        raw = raw[:-2]
    elif damage == "extra bytes":
        raw += b"\0\0"
    else:
        raw = raw[:100]
    path.write_bytes(bytes(raw))
    out = tmp_path / "fw"
    proc = run_main("prepare", "fineweb10B", "--out", str(out), "--max-shards", "1")
    want = {
        "magic": "is not a token shard (it starts with magic 7, expected 20240520)",
        "version": "is a shard of format version 7, expected 1",
        "truncated": "is damaged: its header says 2,100 tokens (5,224 bytes) but the file has 5,222 bytes",
        "extra bytes": "is damaged: its header says 2,100 tokens (5,224 bytes) but the file has 5,226 bytes",
        "shorter than a header": "is 100 bytes, shorter than the 1,024-byte header of a token shard",
    }[damage]
    assert_user_error(
        proc, f"fineweb10B/fineweb_train_000001.bin ({path}) {want}", "replace it in GPTSPEED_DATA_MIRROR"
    )
    assert not out.exists()


def test_a_fineweb10B_shard_whose_sha256_differs_from_the_recorded_one_is_refused(
    tmp_path, fineweb_mirror, monkeypatch
):
    import dataclasses

    from gptspeed.data.corpora import SHARD_CORPORA

    rel = "fineweb10B/fineweb_val_000000.bin"
    corpus = dataclasses.replace(SHARD_CORPORA["fineweb10B"], sums={rel: "0" * 64})
    monkeypatch.setitem(SHARD_CORPORA, "fineweb10B", corpus)
    actual = hashlib.sha256((fineweb_mirror / "fineweb_val_000000.bin").read_bytes()).hexdigest()
    with pytest.raises(GptspeedError) as e:
        prepare("fineweb10B", tmp_path / "fw", max_shards=1, progress=False)
    assert str(e.value).startswith(
        f"{rel} ({fineweb_mirror / 'fineweb_val_000000.bin'}) has sha256 {actual}, expected {'0' * 64} "
        "(recorded in gptspeed): replace it in GPTSPEED_DATA_MIRROR"
    )
    assert not (tmp_path / "fw").exists()


def test_a_hub_file_whose_sha256_is_not_the_hubs_is_refused_naming_the_cached_blob(tmp_path, monkeypatch):
    """From the Hub, a large file's blob in huggingface_hub's cache is named by its sha256 (the Hub's): a file
    whose bytes do not give it (damaged on disk after its download) is refused, naming the blob to remove."""
    import huggingface_hub

    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    cache = tmp_path / "hub"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / "c0ffee").mkdir(parents=True)

    def download(repo_id, filename, **kwargs):
        good = tmp_path / "good.bin"
        write_shard(good, fake_fineweb_tokens(FINEWEB[filename], 0))
        blob = cache / "blobs" / hashlib.sha256(good.read_bytes()).hexdigest()
        raw = bytearray(good.read_bytes())
        raw[-1] ^= 1 if filename == "fineweb_train_000001.bin" else 0  # one bit flipped in the train shard
        blob.write_bytes(bytes(raw))
        link = cache / "snapshots" / "c0ffee" / filename
        link.symlink_to(blob)
        return str(link)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(GptspeedError) as e:
        prepare("fineweb10B", tmp_path / "fw", max_shards=1, progress=False)
    assert "\n" not in str(e.value) and str(e.value).startswith("fineweb10B/fineweb_train_000001.bin (")
    assert "(the Hub's): remove " in str(e.value) and str(cache / "blobs") in str(e.value)
    assert not (tmp_path / "fw").exists()


def test_prepare_fineweb10B_from_the_hub_records_where_its_files_came_from(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    cache = tmp_path / "hub"

    def download(repo_id, filename, **kwargs):
        tmp = tmp_path / "tmp.bin"
        write_shard(tmp, fake_fineweb_tokens(FINEWEB[filename], len(filename)))
        blob = cache / "blobs" / hashlib.sha256(tmp.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(blob)
        link = cache / "snapshots" / "c0ffee" / filename
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
        return str(link)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    m = prepare("fineweb10B", tmp_path / "fw", max_shards=1, progress=False)
    assert [(f["origin"], f["placed"]) for f in m["files"]] == [("hub", "hardlink")] * 2
    assert m["hub"] == {"repo": "kjj0/fineweb10B-gpt2", "revisions": ["c0ffee"]}
    assert not (tmp_path / "fw" / "val_000000.bin").is_symlink()  # linked to the blob itself, not to the cache's link


def test_fineweb10B_refuses_the_flags_of_tokenizing_and_max_shards_is_its_own(tmp_path, fineweb_mirror):
    with pytest.raises(
        GptspeedError, match=r"fineweb10B is tokenized upstream .*: --shuffle-seed, --max-tokens do not"
    ):
        prepare("fineweb10B", tmp_path / "a", shuffle_seed=1, max_tokens=10, progress=False)
    with pytest.raises(GptspeedError, match=r"--max-shards must be an integer from 1 to 103 \(fineweb10B's"):
        prepare("fineweb10B", tmp_path / "a", max_shards=104, progress=False)
    with pytest.raises(GptspeedError, match=r"--max-shards is for the corpora tokenized upstream \(fineweb10B\)"):
        prepare("tinyshakespeare", tmp_path / "a", max_shards=1, progress=False)
    assert not (tmp_path / "a").exists()


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


def test_a_full_disk_while_placing_fineweb10B_shards_is_one_line_and_nothing_looks_prepared(
    tmp_path, fineweb_mirror, monkeypatch
):
    import gptspeed.data.prepare as prepare_mod

    real, calls = prepare_mod._place_shard, []

    def place(src, dest):
        calls.append(dest.name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(dest))
        return real(src, dest)

    monkeypatch.setattr(prepare_mod, "_place_shard", place)
    out = tmp_path / "fw"
    with pytest.raises(GptspeedError) as e:
        prepare("fineweb10B", out, max_shards=1, progress=False)
    assert str(e.value) == (
        f"cannot write the data folder {out}: the disk is full; nothing there is marked prepared: "
        "make room (or fix the folder), then run the same command again"
    )
    assert not out.exists()  # made by this prepare: removed with what it had placed
    out.mkdir()
    calls.clear()
    with pytest.raises(GptspeedError, match="the disk is full"):
        prepare("fineweb10B", out, max_shards=1, progress=False)
    assert list(out.iterdir()) == []  # a folder that was there stays, emptied of what was placed
    monkeypatch.setattr(prepare_mod, "_place_shard", real)
    assert prepare("fineweb10B", out, max_shards=1, progress=False)["splits"]["val"]["tokens"] == 1500
