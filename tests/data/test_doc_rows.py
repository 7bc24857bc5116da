"""``gptspeed.data.doc_rows``: ``--align-to-docs``'s row starts found once per data folder and kept beside its
shards, trusted only while they match the shards and hash whole."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import gptspeed.data.loader as loader_mod
from gptspeed.data import doc_rows
from gptspeed.data.loader import TokenLoader
from gptspeed.data.loader import doc_aligned_rows as scan_rows
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.tokenizer import EOT_TOKEN

B, T = 2, 8


def documents(seed: int, n: int = 40) -> np.ndarray:
    """``n`` documents of 2 .. 3T tokens, each after an ``<|endoftext|>``."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[EOT_TOKEN], rng.integers(0, 50000, k)]) for k in rng.integers(2, 3 * T, n)]
    return np.concatenate(docs).astype(np.uint16)


@pytest.fixture
def folder(tmp_path):
    for i in range(3):
        write_shard(tmp_path / f"train_{i:06d}.bin", documents(i))
    return tmp_path


@pytest.fixture
def scans(monkeypatch):
    """The shards :func:`doc_aligned_rows` scanned (by token count), counted through the loader."""
    seen, real = [], loader_mod.doc_aligned_rows

    def counted(tokens, seq_len, *eot):
        seen.append(len(tokens))
        return real(tokens, seq_len, *eot)

    monkeypatch.setattr(loader_mod, "doc_aligned_rows", counted)
    return seen


def rows_of(folder, seq_len=T) -> list[list[int]]:
    shards = sorted(folder.glob("train_*.bin"))
    return [r.tolist() for r in TokenLoader(shards, B, seq_len, align_to_docs=True)._rows]


def scanned_by_hand(folder, seq_len=T) -> list[list[int]]:
    """Each shard's rows from the scan itself (the real one, imported before any test counts it)."""
    return [scan_rows(read_shard(p), seq_len).tolist() for p in sorted(folder.glob("train_*.bin"))]


def test_the_second_start_reads_the_kept_rows_instead_of_scanning(folder, scans):
    """The first loader scans each of the 3 shards once and keeps the rows beside them; a second (a restart, a
    resume) scans none and gets the same rows; another seq_len is another file, scanned once."""
    first = rows_of(folder)
    assert len(scans) == 3 and (folder / f".align-to-docs-T{T}.npz").is_file()
    assert rows_of(folder) == first and len(scans) == 3
    assert first == scanned_by_hand(folder)
    rows_of(folder, 4)
    assert len(scans) == 6 and rows_of(folder, 4) == scanned_by_hand(folder, 4) and len(scans) == 6


@pytest.mark.parametrize("change", ["re-prepared", "touched", "one-more-shard"])
def test_changed_shards_are_scanned_again_and_the_kept_rows_rewritten(folder, scans, change):
    """A shard re-prepared with other documents, one whose bytes are the same but whose modification time moved
    (rewritten in place), or a shard added: the kept rows are stale, so every shard is scanned again -- the rows
    are the new shards' -- and the file rewritten, which the next start reads."""
    rows_of(folder)
    path = folder / "train_000001.bin"
    if change == "re-prepared":
        write_shard(path, documents(7))
    elif change == "touched":
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    else:
        write_shard(folder / "train_000003.bin", documents(9))
    shards = len(list(folder.glob("train_*.bin")))
    got = rows_of(folder)
    assert len(scans) == 3 + shards
    assert got == scanned_by_hand(folder)
    assert rows_of(folder) == got and len(scans) == 3 + shards


def tampered(path, **arrays):
    """The kept file rewritten with some of its arrays replaced (its recorded identity and sha256 kept)."""
    with np.load(path) as z:
        kept = {k: z[k] for k in z.files}
    with open(path, "wb") as f:
        np.savez(f, **{**kept, **arrays})


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "empty", "rows-edited", "rows-out-of-the-shard", "sha-and-rows-edited", "other-format"],
)
def test_a_damaged_kept_file_is_never_trusted_but_scanned_again_and_rewritten(folder, scans, damage):
    """Whatever is wrong with the kept file -- not a zip, cut in half, empty, a row start changed (its sha256 no
    longer matches), rows past their shard's end with a matching sha256, another format -- the loader scans the
    shards again, gets the right rows, and leaves a good file that the next start reads."""
    want = rows_of(folder)
    path = folder / f".align-to-docs-T{T}.npz"
    data = path.read_bytes()
    with np.load(path) as z:
        rows, counts, meta = z["rows"].copy(), z["counts"], str(z["meta"])
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all" * 10)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "rows-edited":
        rows[3] += 1
        tampered(path, rows=rows)
    elif damage in ("rows-out-of-the-shard", "sha-and-rows-edited"):  # the sha256 recomputed: the rows checked
        if damage == "rows-out-of-the-shard":
            rows[-1] += 10_000
        else:
            rows[1] = rows[0]  # not ascending
        m = json.loads(meta)
        m["sha256"] = doc_rows._sha256(counts, rows)
        tampered(path, rows=rows, meta=np.array(json.dumps(m)))
    else:
        tampered(path, meta=np.array(meta.replace(doc_rows.CACHE_FORMAT, "gptspeed-doc-rows-0")))
    assert rows_of(folder) == want and len(scans) == 6
    assert rows_of(folder) == want and len(scans) == 6


def test_a_write_that_fails_leaves_nothing_that_looks_kept(folder, scans, monkeypatch):
    """A write that fails halfway (a full disk, a read-only folder) leaves no file under the kept name and no
    temporary file behind; the loader still gets its rows (scanned), and the next start scans and keeps them."""
    real = np.savez

    def half(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(doc_rows.np, "savez", half)
    want = rows_of(folder)
    assert len(scans) == 3 and sorted(p.name for p in folder.iterdir()) == [f"train_{i:06d}.bin" for i in range(3)]
    monkeypatch.setattr(doc_rows.np, "savez", real)
    assert rows_of(folder) == want and len(scans) == 6
    assert rows_of(folder) == want and len(scans) == 6
