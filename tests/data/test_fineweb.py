"""``gptspeed.data.fineweb``: the corpora tokenized upstream (the speedrun's ``fineweb10B``): each shard checked
and put in the folder as it is, with a manifest like any prepared folder's."""

from __future__ import annotations

import errno
import hashlib
import os

import numpy as np
import pytest

from gptspeed.data import load_manifest, read_shard, write_shard
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("no_network", "no_requests")


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


def test_a_full_disk_while_placing_fineweb10B_shards_is_one_line_and_nothing_looks_prepared(
    tmp_path, fineweb_mirror, monkeypatch
):
    import gptspeed.data.fineweb as fineweb

    real, calls = fineweb._place_shard, []

    def place(src, dest):
        calls.append(dest.name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(dest))
        return real(src, dest)

    monkeypatch.setattr(fineweb, "_place_shard", place)
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
    monkeypatch.setattr(fineweb, "_place_shard", real)
    assert prepare("fineweb10B", out, max_shards=1, progress=False)["splits"]["val"]["tokens"] == 1500
