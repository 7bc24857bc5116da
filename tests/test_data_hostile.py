"""The data side under hostile or careless input (issue 28): records a tokenizer or parser chokes
on, compressed files cut short, shard names and manifest paths that point elsewhere, unreadable
manifests and progress files, out-of-range shard sizes, two prepares into one folder, output
folders that cannot be, a full disk, and streams that fail or end under a training run."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_main

from gptspeed.data import find_shards, load_manifest, read_shard, write_shard
from gptspeed.data.prepare import PROGRESS_NAME, prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

DOCS = [f"Document number {i}. " + "Some words here, and more words. " * (3 + i % 7) for i in range(40)]


def lines_of(docs) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def expected_stream(docs):
    enc = get_encoding()
    return np.concatenate([[EOT_TOKEN, *enc.encode_ordinary(d)] for d in docs if d]).astype(np.uint16)


def all_tokens(out):
    return np.concatenate([read_shard(p) for s in ("train", "val") for p in find_shards(out, s)])


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


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


def test_whatever_a_single_json_line_holds_is_a_bad_record(tmp_path, monkeypatch):
    """A line nested 100k deep raised RecursionError (a traceback); an integer of 5,000 digits raises
    ValueError (not JSONDecodeError) in Python >= 3.11; a line longer than any record is read whole.
    Each is now a bad record naming file and line: skipped and counted with skip_bad."""
    import gptspeed.data.sources as S

    monkeypatch.setattr(S, "MAX_RECORD_BYTES", 200_000)
    good = [json.dumps({"text": d}).encode() for d in DOCS[:4]]
    bad = {
        b"[" * 100_000: "nested too deeply",
        b'{"n": ' + b"7" * 5000 + b', "text": "x"}': "not readable as JSON",
        b'{"text": "' + b"y" * 300_000 + b'"}': "longer than 200,000 bytes",
    }
    for k, (line, what) in enumerate(bad.items()):
        path = tmp_path / f"d{k}.jsonl"
        path.write_bytes(b"\n".join([good[0], good[1], line, good[2], good[3]]) + b"\n")
        with pytest.raises(GptspeedError, match=rf"d{k}\.jsonl:3: .*{what}.*--skip-bad"):
            prepare(str(path), tmp_path / f"o{k}", progress=False)
        m = prepare(str(path), tmp_path / f"s{k}", skip_bad=True, progress=False)
        assert m["bad_records"] == 1 and m["documents"] == 4
        np.testing.assert_array_equal(all_tokens(tmp_path / f"s{k}"), expected_stream(DOCS[:4]))


# --------------------------------------------------------------------- 2. cut compressed files
def test_a_truncated_zst_or_gz_is_an_error_naming_the_file(tmp_path):
    """python-zstandard's stream_reader ends quietly inside a frame: a cut file read as a shorter
    one ("prepared 3,000 documents" of 5,000, exit 0). Now a cut inside a frame (a single-frame
    file cut anywhere, a multi-frame file cut in its second frame, a file of only the magic) is an
    error naming the file, --skip-bad or not. A cut exactly between two frames is a valid, shorter
    zstd file: it reads without error (documented as undetectable)."""
    zstd = pytest.importorskip("zstandard")
    data = lines_of(DOCS * 5)
    half = data.rindex(b"\n", 0, len(data) // 2) + 1  # frames end at a line's end, as in pzstd's output
    c = zstd.ZstdCompressor()
    whole_frame = c.compress(data)
    first, second = c.compress(data[:half]), c.compress(data[half:])
    assert first[:4] == b"\x28\xb5\x2f\xfd"
    cuts = {
        "single": whole_frame[: len(whole_frame) // 2],
        "last-byte": whole_frame[:-1],
        "second-frame": first + second[: len(second) // 3],
        "magic-only": whole_frame[:4],
    }
    gz = gzip.compress(data)
    for name, blob in [*cuts.items(), ("gz", gz[: len(gz) // 2])]:
        path = tmp_path / f"{name}.jsonl.{'gz' if name == 'gz' else 'zst'}"
        path.write_bytes(blob)
        for skip_bad in (False, True):
            with pytest.raises(GptspeedError, match=rf"{path.name} is truncated"):
                prepare(str(path), tmp_path / f"o-{name}", progress=False, skip_bad=skip_bad)
            assert not (tmp_path / f"o-{name}").exists()
    whole = tmp_path / "whole.jsonl.zst"
    whole.write_bytes(first + second)
    assert prepare(str(whole), tmp_path / "w", progress=False)["documents"] == len(DOCS) * 5
    at_boundary = tmp_path / "boundary.jsonl.zst"
    at_boundary.write_bytes(first)  # a valid zstd file: nothing says more was meant to follow
    assert prepare(str(at_boundary), tmp_path / "b", progress=False)["documents"] == data[:half].count(b"\n")


# --------------------------------------------------------------- 3, 4, 5: finding the shards
def test_shards_without_a_manifest_are_found_by_their_exact_split_word(tmp_path):
    """``*val*.bin`` took retrieval_/interval_/eval_ files for val shards."""
    names = [
        "val_000000.bin",
        "fineweb_val_000000.bin",
        "tiny_shakespeare_val.bin",
        "train_000000.bin",
        "fineweb_train_000001.bin",
        "retrieval_train_000000.bin",
        "interval_000000.bin",
        "eval_000000.bin",
        "medieval.bin",
    ]
    for name in names:
        write_shard(tmp_path / name, np.arange(3))
    assert [p.name for p in find_shards(tmp_path, "val")] == [
        "fineweb_val_000000.bin",
        "tiny_shakespeare_val.bin",
        "val_000000.bin",
    ]
    assert [p.name for p in find_shards(tmp_path, "train")] == [
        "fineweb_train_000001.bin",
        "retrieval_train_000000.bin",
        "train_000000.bin",
    ]
    only = tmp_path / "only"
    only.mkdir()
    write_shard(only / "retrieval_000000.bin", np.arange(3))
    with pytest.raises(GptspeedError, match="no val shards"):
        find_shards(only, "val")


@pytest.mark.parametrize("shard", ["ABS", "../other/train_000000.bin", "sub/train_000000.bin", "..", ""])
def test_manifest_shard_paths_stay_inside_the_folder(tmp_path, shakespeare_data, shard):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(shakespeare_data, other)
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    (data / "sub").mkdir()
    shutil.copy(other / "train_000000.bin", data / "sub")
    m = json.loads((data / "manifest.json").read_text())
    name = str(other / "train_000000.bin") if shard == "ABS" else shard
    m["splits"]["train"]["shards"] = [name]
    (data / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GptspeedError, match="not a file name inside"):
        find_shards(data, "train")
    proc = run_main(
        "train",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--preset",
        "pico",
        "--device",
        "cpu",
    )
    assert_user_error(proc, "not a file name inside")


def test_a_manifest_that_is_not_utf8_or_is_a_folder_is_one_line(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS))
    out = tmp_path / "out"
    prepare(str(src), out, progress=False)
    manifest = out / "manifest.json"
    manifest.write_bytes(b'{"format": "gptspeed-shards", "x": "\xff\xfe"}')
    with pytest.raises(GptspeedError, match="manifest .*manifest.json is not UTF-8 text"):
        load_manifest(out)
    assert_user_error(run_main("prepare", str(src), "--out", str(out)), "manifest.json is not UTF-8", "--force")
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(GptspeedError, match="manifest.json is a folder"):
        find_shards(out, "train")
    assert_user_error(run_main("prepare", str(src), "--out", str(out)), "manifest.json is a folder")
    manifest.rmdir()
    manifest.write_text("[" * 100_000)
    with pytest.raises(GptspeedError, match="nested too deeply"):
        load_manifest(out)


def test_prepare_progress_files_that_cannot_be_read_are_started_over_or_refused(tmp_path):
    """The progress file was read with a bare json.loads: not UTF-8 (UnicodeDecodeError), a list,
    or chunk names reaching outside the folder (renamed into train shards, or deleted)."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS))
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
        assert m["splits"] == ref["splits"] and shard_bytes(out) == shard_bytes(tmp_path / "ref")
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
    src.write_bytes(lines_of(DOCS[:3]))
    proc = run_main("prepare", str(src), "--out", str(tmp_path / "out"), "--shard-tokens", "3000000000")
    assert_user_error(proc, "--shard-tokens must be at most 2,147,483,647")
    assert not (tmp_path / "out").exists()
    m = prepare(str(src), tmp_path / "ok", shard_tokens=2**31 - 1, progress=False)  # the largest is fine
    assert m["shard_tokens"] == 2**31 - 1


def test_a_second_prepare_into_the_same_folder_is_refused_naming_the_first(tmp_path):
    """Two prepares into one folder deleted each other's staging chunks and left orphans."""
    from gptspeed.data.prepare import PrepareLock

    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS))
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
    src.write_bytes(lines_of(DOCS[:3]))
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
    src.write_bytes(lines_of(DOCS * 3))
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
    assert m["splits"] == ref["splits"] and shard_bytes(out) == shard_bytes(tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


# ----------------------------------------------------------------------------- 10. streams
def test_a_stream_ends_with_its_true_batch_count(tmp_path):
    """The line said "ended after 3 batches" after 10+ were trained: it read the consumed count in
    the producer thread, which runs ahead. Now it is the batches the consumer got, and tokens."""
    from gptspeed.data.shards import ShardError
    from gptspeed.data.stream import StreamLoader

    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS))
    n = (len(expected_stream(DOCS)) - 1) // 32
    loader = StreamLoader(f"jsonl:{path}", 2, 16, workers=1, prefetch=n + 1)
    loader.next_batch()
    loader._prefetcher._threads[0].join(timeout=60)  # the producer reached the end, one batch consumed
    for _ in range(n - 1):
        loader.next_batch()
    with pytest.raises(ShardError, match=rf"ended after {n:,} batches of 2x16 tokens \({n * 32:,} tokens in all"):
        loader.next_batch()
    loader.close()


def test_a_failing_source_is_a_stream_error_naming_it(tmp_path, monkeypatch):
    """Any exception of the source (here a RuntimeError after some documents), a bad record, or a
    truncated file is a StreamError (a ShardError, which the trainer saves before) in one line."""
    import gptspeed.data.stream as stream_mod
    from gptspeed.data.stream import StreamError, StreamLoader

    def flaky(*a, **k):
        yield from DOCS[:10]
        raise RuntimeError("connection reset\nsecond line")

    monkeypatch.setattr(stream_mod, "iter_stream_documents", flaky)
    loader = StreamLoader("hf:some/dataset", 2, 16)
    with pytest.raises(StreamError, match=r"^the stream hf:some/dataset failed: RuntimeError: connection reset$"):
        for _ in range(1000):
            loader.next_batch()
    monkeypatch.undo()
    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS[:5]) + b"{broken\n")
    loader = StreamLoader(f"jsonl:{path}", 2, 16)
    with pytest.raises(StreamError, match=r"d\.jsonl:6: not valid JSON.*streaming training stops at a bad record"):
        for _ in range(1000):
            loader.next_batch()


def _stream_run(path: Path, run: Path, **over):
    from gptspeed.trainer import build_train_config, fit

    tiny = dict(
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=32,
        batch_size=4,
        warmup_steps=1,
        lr=3e-3,
        log_every=1,
        device="cpu",
        data=f"jsonl:{path}",
        eval_every=0,
        out=str(run),
        max_steps=10_000,
        save_every=100_000,
        compile=False,
    )
    return fit(build_train_config("pico", {**tiny, **over}), echo=False)


def test_a_stream_that_fails_or_ends_saves_the_last_finished_step(tmp_path):
    """A truncated .gz under a streaming run saved nothing (a bad shard saved the last step). Now
    the run ends with one line naming the file and how many steps and tokens were trained, and
    the checkpoint of the last finished step, which resumes once the file is whole."""
    from gptspeed.checkpoint import check_checkpoint, list_checkpoints

    rng = np.random.default_rng(0)  # text that compresses little: half the .gz holds half the documents
    docs = [" ".join(f"w{int(x)}" for x in rng.integers(0, 5000, 40)) for _ in range(12)]
    data = lines_of(docs)
    whole = gzip.compress(data)
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    run = tmp_path / "run"
    with pytest.raises(GptspeedError) as e:
        _stream_run(path, run)
    msg = str(e.value)
    (ck,) = list_checkpoints(run)
    step = int(ck.stem.split("_")[1])
    assert "\n" not in msg and "d.jsonl.gz is truncated" in msg, msg
    assert step >= 2 and f"Trained {step:,} steps (" in msg and f"checkpoint of step {step} was saved" in msg, msg
    assert check_checkpoint(ck) is None
    path.write_bytes(whole)
    summary = _stream_run(path, run, resume=True, max_steps=step + 2)
    assert summary["step"] == step + 2
    # the stream runs out before --max-steps: the same, with the batch count
    short = tmp_path / "short.jsonl"
    short.write_bytes(data[: data.rindex(b"\n", 0, len(data) // 4) + 1])
    run2 = tmp_path / "run2"
    with pytest.raises(
        GptspeedError,
        match=r"short\.jsonl ended after [0-9,]+ batches of 4x32 tokens.*"
        r"Trained [0-9,]+ steps \([0-9,]+ tokens\); the checkpoint of step",
    ):
        _stream_run(short, run2)
    assert len(list_checkpoints(run2)) == 1
