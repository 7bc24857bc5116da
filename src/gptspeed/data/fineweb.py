"""The corpora tokenized upstream (:data:`~gptspeed.data.corpora.SHARD_CORPORA`: the modded-nanogpt
speedrun's ``fineweb10B``): ``gptspeed prepare fineweb10B`` does not tokenize, it checks each shard
(header, sha256 against gptspeed's record and the Hub's, documents counted) and puts it in the folder
as it is -- hard-linked, symbolically linked or copied -- under the names every prepared folder uses,
with a manifest like any other (:func:`prepare_shard_corpus`, called by
:func:`gptspeed.data.prepare.prepare`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

import gptspeed
from gptspeed.data import MANIFEST_FORMAT, MANIFEST_FORMAT_VERSION, MANIFEST_NAME
from gptspeed.data.corpora import MIRROR_ENV, SHARD_CORPORA, ShardCorpus, ShardFile, shard_corpus_files
from gptspeed.data.folder import check_prepare_target, prepare_lock
from gptspeed.data.prepared_state import (
    PROGRESS_NAME,
    check_out,
    clear_prepared,
    fresh_state,
    input_sha256,
    make_out,
    reuse_prepared,
    write_progress,
)
from gptspeed.data.shards import HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION, TOKEN_DTYPE
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_atomic, write_text_atomic
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB

_TOKENIZING_FLAGS = {  # prepare's keyword -> (its flag, its default): none applies to shards made upstream
    "val_fraction": ("--val-fraction", 0.1),
    "shard_tokens": ("--shard-tokens", 100_000_000),
    "text_field": ("--text-field", "text"),
    "shuffle_seed": ("--shuffle-seed", None),
    "skip_bad": ("--skip-bad", False),
    "max_tokens": ("--max-tokens", None),
    "hf_name": ("--hf-name", None),
    "split": ("--split", "train"),
}


_SCAN_BYTES = 1 << 24  # read per step while a shard is hashed and its documents counted


def _check_shard_corpus_arguments(source: str, max_shards: int | None, given: dict) -> int:
    """The number of train shards to take; GptspeedError (one line) for ``--max-shards`` with a source
    that is not a :data:`~gptspeed.data.corpora.SHARD_CORPORA` corpus, out of range, or a tokenizing
    flag given (the shards are used as they were made)."""
    if source not in SHARD_CORPORA:
        raise GptspeedError(
            f"--max-shards is for the corpora tokenized upstream ({', '.join(SHARD_CORPORA)}), not {source!r}: "
            "use --max-tokens to prepare less of it"
        )
    corpus = SHARD_CORPORA[source]
    bad = [flag for key, (flag, default) in _TOKENIZING_FLAGS.items() if given.get(key, default) != default]
    if bad:
        raise GptspeedError(
            f"{source} is tokenized upstream and its shards are used as they are: {', '.join(bad)} "
            f"{'does' if len(bad) == 1 else 'do'} not apply (--max-shards N takes its first N train shards)"
        )
    n = len(corpus.train) if max_shards is None else max_shards
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(corpus.train):
        raise GptspeedError(
            f"--max-shards must be an integer from 1 to {len(corpus.train)} ({source}'s train shards), "
            f"got {max_shards!r}"
        )
    return n


def _header_problem(head: bytes, size: int) -> str | None:
    """What is wrong with a shard whose first bytes are ``head`` and whose size is ``size``, by the
    format's own checks (magic, version, a token count that matches the size); None if nothing."""
    if len(head) < HEADER_BYTES:
        return f"{size:,} bytes, shorter than the {HEADER_BYTES:,}-byte header of a token shard"
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        return f"not a token shard (it starts with magic {magic}, expected {SHARD_MAGIC})"
    if version != SHARD_VERSION:
        return f"a shard of format version {version}, expected {SHARD_VERSION}"
    expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * count
    if count < 0 or size != expected:
        return f"damaged: its header says {count:,} tokens ({expected:,} bytes) but the file has {size:,} bytes"
    return None


def _scan_upstream_shard(f: ShardFile, known: str | None, bar: tqdm) -> dict:
    """Check the shard ``f`` and measure it in one read: its header (:func:`_header_problem`), then its
    sha256 against ``known`` (recorded in gptspeed) and the Hub's (:attr:`ShardFile.hub_sha256`) where
    there is one; its ``<|endoftext|>`` tokens counted on the way. Returns ``{"sha256", "bytes",
    "tokens", "documents"}``. GptspeedError (one line naming the file and what to do) otherwise."""
    if f.origin == "mirror":
        fix = f"replace it in {MIRROR_ENV}, or remove it there to download it"
    else:
        fix = f"remove {os.path.realpath(f.path)} from the Hugging Face cache and run again to download it again"
    try:
        with open(f.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(HEADER_BYTES)
            problem = _header_problem(head, size)
            if problem:
                raise GptspeedError(f"{f.rel} ({f.path}) is {problem}: {fix}")
            h, documents, read = hashlib.sha256(head), 0, len(head)
            while chunk := fh.read(_SCAN_BYTES):
                h.update(chunk)
                documents += int(np.count_nonzero(np.frombuffer(chunk, dtype=TOKEN_DTYPE) == EOT_TOKEN))
                read += len(chunk)
                bar.update(len(chunk))
    except OSError as e:
        raise GptspeedError(f"cannot read {f.path}: {e.strerror or e}") from None
    if read != size:
        raise GptspeedError(
            f"{f.path} changed while it was read (a download not finished?): run again once it is complete"
        )
    digest = h.hexdigest()
    for expect, whose in ((known, "recorded in gptspeed"), (f.hub_sha256, "the Hub's")):
        if expect and digest != expect:
            raise GptspeedError(f"{f.rel} ({f.path}) has sha256 {digest}, expected {expect} ({whose}): {fix}")
    return {"sha256": digest, "bytes": size, "tokens": (size - HEADER_BYTES) // 2, "documents": documents}


def _local_name(file: str) -> str:
    """The name a prepared folder gives the upstream shard ``file``: its split and its number
    (``fineweb_train_000001.bin`` -> ``train_000001.bin``), as :func:`gptspeed.data.find_shards` finds it."""
    import re

    from gptspeed.data import shard_name_split

    number = re.search(r"(\d+)\.bin$", file)
    split = shard_name_split(file)
    assert number is not None and split is not None, file  # the corpus tables name them so
    return f"{split}_{int(number.group(1)):06d}.bin"


def _place_shard(src: Path, dest: Path) -> str:
    """Put the file ``src`` (its real path: a cache's link is followed) in the folder as ``dest``, through a
    temporary name so that ``dest`` is whole or absent: a hard link where the file system allows (the
    folder and the cache share the bytes: no space), else a symbolic link to it, else a copy. Returns
    ``"hardlink"``, ``"symlink"`` or ``"copy"``."""
    real = Path(os.path.realpath(src))
    for how, make in (("hardlink", os.link), ("symlink", os.symlink)):
        tmp = dest.with_name(f".{dest.name}.{os.urandom(4).hex()}.tmp")
        try:
            make(real, tmp)
        except OSError:
            continue
        try:
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return how
    import shutil

    with open(real, "rb") as f:
        write_atomic(dest, lambda out: shutil.copyfileobj(f, out, _SCAN_BYTES))
    return "copy"


def prepare_shard_corpus(
    source: str, out: Path, *, force: bool, progress: bool, max_shards: int | None, given: dict
) -> dict:
    """:func:`prepare` of a corpus tokenized upstream (:data:`~gptspeed.data.corpora.SHARD_CORPORA`):
    its val shard and first ``max_shards`` train shards (default all) are taken from the mirror or the
    Hub (:func:`~gptspeed.data.corpora.shard_corpus_files`), each checked (:func:`_scan_upstream_shard`),
    then put in ``out`` under the names :func:`_local_name` gives (:func:`_place_shard`: linked where
    possible, else copied) with a manifest like any prepared folder's; each file entry also says where the
    file came from (``origin``: mirror or hub), under which name it stands (``as``) and how
    (``placed``). ``given``: prepare's tokenizing arguments, refused unless at their defaults."""
    n = _check_shard_corpus_arguments(source, max_shards, given)
    check_out(out)
    check_prepare_target(out)  # never /, the home folder, or a folder of other files
    corpus = SHARD_CORPORA[source]
    files = shard_corpus_files(source, [*corpus.val, *corpus.train[:n]], progress=progress)
    total = sum(os.path.getsize(f.path) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="check", disable=None if progress else True) as bar:
        scans = [_scan_upstream_shard(f, corpus.sums.get(f.rel), bar) for f in files]
    settings = {"max_shards": n}
    input_sha = input_sha256([s["sha256"] for s in scans])
    shard_tokens = max(s["tokens"] for s in scans)
    if os.path.lexists(out / MANIFEST_NAME) and not force:
        return reuse_prepared(out, source, None, shard_tokens, input_sha, settings)
    created = make_out(out)
    lock = prepare_lock(out).acquire()
    try:
        manifest = _write_shard_corpus(out, corpus, files, scans, settings, input_sha, shard_tokens)
    except BaseException:
        with contextlib.suppress(OSError):
            clear_prepared(out)  # nothing half-placed stays: the folder holds gptspeed's names only, or nothing
        if created:
            lock.release()
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    finally:
        lock.release()
    if progress:
        print(_placement_line(source, out, manifest["files"]), file=sys.stderr)
    return manifest


def _placement_line(source: str, out: Path, entries: list[dict]) -> str:
    """One line saying how the shards of ``entries`` came into ``out``: linked (no space) or copied, from where."""
    import collections

    words = {"hardlink": "hard-linked", "symlink": "symbolically linked", "copy": "copied"}
    where = {"mirror": f"the mirror ({MIRROR_ENV})", "hub": "the Hugging Face cache"}
    counts = collections.Counter((e["placed"], e["origin"]) for e in entries)
    return f"{source}: {len(entries)} shards in {out}: " + ", ".join(
        f"{n} {words[placed]} from {where[origin]}" for (placed, origin), n in counts.items()
    )


def _write_shard_corpus(
    out: Path,
    corpus: ShardCorpus,
    files: list[ShardFile],
    scans: list[dict],
    settings: dict,
    input_sha: str,
    shard_tokens: int,
) -> dict:
    """:func:`prepare_shard_corpus`'s writing, under its lock: a progress file first (a folder holding it
    and no manifest is refused by ``train``), the shards, the manifest, then the progress file removed.
    An OSError (a full disk for a copy) is one line naming the folder."""
    try:
        clear_prepared(out)
        write_progress(out, fresh_state(corpus.name))
        entries, splits = [], {s: {"tokens": 0, "documents": 0, "shards": []} for s in ("train", "val")}
        for f, scan in zip(files, scans):
            name = _local_name(f.rel.rsplit("/", 1)[1])
            placed = _place_shard(f.path, out / name)
            entries.append({"path": f.rel, "sha256": scan["sha256"], "bytes": scan["bytes"], "as": name})
            entries[-1].update(origin=f.origin, placed=placed)
            split = splits[name.split("_", 1)[0]]
            split["tokens"] += scan["tokens"]
            split["documents"] += scan["documents"]
            split["shards"].append(name)
        revisions = sorted({f.revision for f in files if f.revision})
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "source": corpus.name,
            "tokenizer": "gpt2",
            "eot_token": EOT_TOKEN,
            "n_vocab": N_VOCAB,
            "files": entries,
            "input_sha256": input_sha,
            "documents": splits["train"]["documents"] + splits["val"]["documents"],
            "val_fraction": None,  # the split is upstream's: its val shard
            "shard_tokens": shard_tokens,
            "splits": splits,
            "settings": settings,
            "bad_records": 0,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gptspeed_version": gptspeed.__version__,
            "hub": {"repo": corpus.repo, "revisions": revisions},
        }
        write_text_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
        (out / PROGRESS_NAME).unlink(missing_ok=True)
    except OSError as e:
        what = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise GptspeedError(
            f"cannot write the data folder {out}: {what}; nothing there is marked prepared: "
            "make room (or fix the folder), then run the same command again"
        ) from None
    return manifest
