"""``--align-to-docs``'s row starts, found once per data folder and kept with it.

:func:`gptspeed.data.loader.doc_aligned_rows` scans a shard's every token for document starts; over
fineweb10B's ~20 GB of shards that is tens of seconds at every start and resume. :func:`aligned_rows`
scans once and keeps the result beside the shards in ``.align-to-docs-T{seq_len}.npz`` (numpy's
uncompressed ``.npz``: every shard's row starts as int64, 8 bytes a row, ~80 MB for 10B tokens at
T = 1024), with the identity of the shards they were found in -- each shard's name, size,
modification time (ns) and :func:`~gptspeed.data.shards.shard_fingerprint` -- and a sha256 of the rows.

The file is used only when all of that matches the shards as they are now, the rows hash to the
recorded sha256 and every row lies inside its shard; anything else (a shard re-prepared, replaced or
touched, another ``seq_len``, a damaged, truncated or foreign file) is never trusted: the shards are
scanned again and the file rewritten. It is written atomically (:func:`gptspeed.fileio.write_atomic`:
a temporary ``.NAME.XXXXXXXX.tmp``, fsynced, then renamed; removed on failure), so no half-written
file ever stands under its name. A folder that cannot be written (read-only) is scanned at every
start, as without the file. Ranks of one job that start together may each scan and write it once:
the renames are atomic and the contents equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gptspeed.data.shards import shard_fingerprint
from gptspeed.fileio import write_atomic

CACHE_FORMAT = "gptspeed-doc-rows-1"


def cache_path(shards: list[Path], seq_len: int) -> Path:
    """Where the row starts of ``shards`` at ``seq_len`` are kept: beside the first shard."""
    return Path(shards[0]).parent / f".align-to-docs-T{seq_len}.npz"


def shard_identity(shards: list[Path]) -> list[list]:
    """``[name, bytes, mtime_ns, fingerprint]`` per shard (the name relative to the cache's folder;
    a shard elsewhere by its absolute path): what a kept file must have been made from."""
    folder = Path(shards[0]).parent
    out = []
    for p in map(Path, shards):
        st = os.stat(p)
        name = p.name if p.parent == folder else str(p.resolve())
        out.append([name, st.st_size, st.st_mtime_ns, shard_fingerprint(p)])
    return out


def _sha256(counts: np.ndarray, rows: np.ndarray) -> str:
    h = hashlib.sha256(counts.tobytes())
    h.update(rows.tobytes())
    return h.hexdigest()


def read_rows(path: Path, identity: list[list], seq_len: int, lengths: list[int]) -> list[np.ndarray] | None:
    """The row starts kept at ``path`` (one int64 array per shard), or None unless the file is whole
    and was made from shards of this ``identity`` at this ``seq_len``: its sha256 matches, and each
    shard's rows ascend and end inside its ``lengths`` tokens."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta, counts, rows = json.loads(str(z["meta"])), z["counts"], z["rows"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # absent, damaged or foreign
        return None
    want = {"format": CACHE_FORMAT, "seq_len": seq_len, "shards": identity}
    if not isinstance(meta, dict) or {k: meta.get(k) for k in want} != want:
        return None
    if counts.dtype != np.int64 or rows.dtype != np.int64 or counts.shape != (len(lengths),):
        return None
    if counts.min(initial=0) < 0 or int(counts.sum()) != rows.shape[0] or meta.get("sha256") != _sha256(counts, rows):
        return None
    parts = np.split(rows, np.cumsum(counts)[:-1])
    for r, n in zip(parts, lengths):
        if len(r) and (r[0] < 0 or r[-1] + seq_len + 1 > n or (len(r) > 1 and np.any(np.diff(r) <= 0))):
            return None
    return parts


def write_rows(path: Path, identity: list[list], seq_len: int, parts: list[np.ndarray]) -> bool:
    """Keep ``parts`` (int64 row starts per shard) at ``path``, atomically; False (nothing written,
    no temporary file left) where the folder cannot be written."""
    counts = np.array([len(r) for r in parts], dtype=np.int64)
    rows = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
    meta = {"format": CACHE_FORMAT, "seq_len": seq_len, "shards": identity, "sha256": _sha256(counts, rows)}
    try:
        write_atomic(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), counts=counts, rows=rows))
    except OSError:
        return False
    return True


def aligned_rows(
    shards: list[Path], lengths: list[int], seq_len: int, scan: Callable[[int], np.ndarray]
) -> list[np.ndarray]:
    """Every shard's ``--align-to-docs`` row starts (int64, ascending; ``lengths``: each shard's
    tokens): read from the folder's kept file when it is valid for these shards (:func:`read_rows`),
    else ``scan(i)`` for each shard ``i`` (:func:`gptspeed.data.loader.doc_aligned_rows` of its
    tokens) and the result kept (:func:`write_rows`). OSError from reading a shard's identity."""
    if not shards:
        return []
    identity, path = shard_identity(shards), cache_path(shards, seq_len)
    parts = read_rows(path, identity, seq_len, lengths)
    if parts is None:
        parts = [scan(i) for i in range(len(shards))]
        write_rows(path, identity, seq_len, parts)
    return parts
