"""Corpus -> token shards: ``gptspeed prepare SOURCE --out DIR [--tokenizer ...]`` (:mod:`.prepare_tokenizer`).

SOURCE is a named corpus (:data:`gptspeed.data.corpora.CORPORA`, files;
:data:`~gptspeed.data.corpora.HF_CORPORA`, online through ``datasets``), a ``.txt`` /
``.jsonl[.gz|.zst]`` / ``.parquet`` file, a folder of such files, a glob, or ``hf:DATASET`` (see
:mod:`gptspeed.data.sources`). Every document is tokenized with GPT-2's BPE by default (in ``workers``
threads, :mod:`gptspeed.data.tokenize`) and preceded by ``<|endoftext|>`` (50256), as in nanoGPT /
llm.c / modded-nanogpt data scripts. The stream is written as it is tokenized, in chunks of
``shard_tokens`` tokens, then cut into a train and a val split (val = the tail; with a shuffle
seed, of the documents put in a global random order first), written as shards
(:mod:`gptspeed.data.shards`); ``manifest.json`` is written last: its presence marks the folder
complete. An interrupted prepare resumes after its last finished chunk. A corpus tokenized upstream
(:data:`~gptspeed.data.corpora.SHARD_CORPORA`: the speedrun's ``fineweb10B``) is not tokenized: its
shards are checked and linked into the folder as they are (:mod:`gptspeed.data.fineweb`).

How :func:`prepare` keeps memory flat: documents are read one at a time, tokenized and appended to
staging chunks of ``shard_tokens`` tokens written as they fill, so a corpus larger than RAM fits.
When the stream ends the cut between train and val is placed (:func:`split_cut`): full chunks
before it become the train shards by a rename, the val shards are the tail, cut into
``shard_tokens`` pieces; disk peaks at the final size plus one shard. With a shuffle seed the
documents are written in a global random order instead (:func:`shuffled_order`,
:func:`write_shuffled`). A ``.prepare-progress.json`` beside the chunks records the documents
consumed per finished chunk: an interrupted prepare with the same input and settings resumes after
the last finished chunk; once every document is staged it says so, and a prepare interrupted while
writing the final shards finishes them without reading the input again (the folder's state between
two runs: :mod:`gptspeed.data.prepared_state`).

One ``prepare`` at a time per folder: it holds an exclusive ``fcntl.flock`` on ``OUT/.prepare.lock``
(:func:`gptspeed.data.folder.prepare_lock`) from before it touches the staging chunks until the manifest
is written; a second one is refused in one line naming the holder. It also holds the folder itself
exclusive (as :func:`gptspeed.data.folder.data_folder_lock`), which every ``gptspeed train`` reading the folder
holds shared for its whole run: a prepare (``--force``) is refused while a train reads the
folder, and a train while a prepare writes it. ``--out`` must be new, empty, or gptspeed's own
data folder (:func:`gptspeed.data.folder.check_prepare_target`): never ``/``, the home folder,
or a folder of other files. An OSError while writing (a full disk, a
folder made read-only) is one line naming the folder: every file is written to a temporary name
and renamed (:func:`gptspeed.fileio.write_atomic`), the staging chunks and the progress file are
hidden, and a folder holding the progress file but no manifest is refused by
:func:`gptspeed.data.find_shards`, so nothing half-written looks prepared; the same command run
again resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import gptspeed
from gptspeed.data import MANIFEST_FORMAT, MANIFEST_FORMAT_VERSION, MANIFEST_NAME
from gptspeed.data import prepare_tokenizer as ptok
from gptspeed.data.corpora import CORPORA, HF_CORPORA, SHARD_CORPORA, resolve_source
from gptspeed.data.fineweb import prepare_shard_corpus
from gptspeed.data.folder import check_prepare_target, prepare_lock
from gptspeed.data.prepared_state import (
    PROGRESS_NAME,
    STAGE_NAME,
    check_out,
    clear_prepared,
    input_sha256,
    make_out,
    remove_if_nothing_staged,
    reuse_prepared,
    staging_state,
    write_progress,
)
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.data.sources import SourceStats, iter_files, iter_hf
from gptspeed.data.tokenize import default_workers, tokenize_stream
from gptspeed.errors import GptspeedError
from gptspeed.fileio import sha256_file, write_text_atomic
from gptspeed.options import PrepareOptions
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB


class _Concat:
    """Read-only slices ``[a, b)`` across a list of shard memmaps laid end to end; ``eot`` the id
    that starts each document."""

    def __init__(self, paths: list[Path], eot: int = EOT_TOKEN):
        self.arrays, self.eot = [read_shard(p) for p in paths], eot
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.n = int(self.starts[-1])

    def slice(self, a: int, b: int) -> np.ndarray:
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        if 0 <= i < len(self.arrays) and b <= self.starts[i + 1]:  # inside one chunk: a view
            return self.arrays[i][a - self.starts[i] : b - self.starts[i]]
        parts = []
        for i, arr in enumerate(self.arrays):
            lo, hi = max(a, int(self.starts[i])), min(b, int(self.starts[i + 1]))
            if lo < hi:
                parts.append(arr[lo - self.starts[i] : hi - self.starts[i]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.arrays[0].dtype if self.arrays else np.uint16)

    def find_eot(self, lo: int, hi: int, last: bool, block: int = 1 << 22) -> int | None:
        """First (or last) EOT position in ``[lo, hi]``, scanning blocks outward; None if none."""
        lo, hi = max(lo, 0), min(hi, self.n - 1)
        if lo > hi:
            return None
        starts = range(hi + 1, lo, -block) if last else range(lo, hi + 1, block)
        for s in starts:
            a, b = (max(lo, s - block), s) if last else (s, min(hi + 1, s + block))
            hits = np.flatnonzero(self.slice(a, b) == self.eot)
            if len(hits):
                return a + int(hits[-1] if last else hits[0])
        return None


def place_cut(n: int, val_fraction: float, find_start: Callable[[int, int, bool], int | None]) -> int:
    """Index where val starts in a stream of ``n`` tokens: ``round(n * (1 - val_fraction))``,
    moved to the nearest document start (not the stream's first token) within
    ``n * val_fraction / 2``; on a tie the earlier one; unmoved if none is that near.
    ``find_start(lo, hi, last)`` gives the last (or first) document start in ``[lo, hi]``, or None."""
    cut = round(n * (1 - val_fraction))
    w = n * val_fraction / 2
    before = find_start(max(1, math.ceil(cut - w)), cut, True)
    after = find_start(max(1, cut), math.floor(cut + w), False)
    if before is not None and (after is None or cut - before <= after - cut):
        return before
    return after if after is not None else cut


def val_share(total: int, val_fraction: float, val_tokens: int | None) -> float:
    """The share of a stream of ``total`` tokens that goes to val: ``val_fraction``, or for a corpus
    with a fixed val size (:attr:`gptspeed.data.corpora.HFCorpus.val_tokens`: FineWeb-Edu's 100M,
    build-nanogpt's) ``val_tokens / total`` when that is smaller -- 100M tokens of 10B, not 1B;
    a corpus cut short (``--max-tokens``) below ``val_tokens / val_fraction`` keeps the fraction.
    :func:`place_cut` then moves the cut to the nearest document start, as for any corpus."""
    return val_fraction if val_tokens is None else min(val_fraction, val_tokens / total)


def split_cut(tokens: _Concat, val_fraction: float) -> int:
    """:func:`place_cut` for the stream in source order, whose document starts are its EOTs;
    reads only the blocks near the cut."""
    return place_cut(tokens.n, val_fraction, lambda lo, hi, last: tokens.find_eot(lo, hi, last=last))


def document_starts(tokens: _Concat, block: int = 1 << 22) -> np.ndarray:
    """Positions (int64) of every EOT in the stream, i.e. of every document's first token, in
    order; reads the stream once, ``block`` tokens at a time."""
    parts = [
        np.flatnonzero(tokens.slice(a, min(tokens.n, a + block)) == tokens.eot) + a for a in range(0, tokens.n, block)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class _ShardWriter:
    """Packs token pieces into ``{split}_NNNNNN.bin`` shards of ``shard_tokens`` tokens."""

    def __init__(self, out: Path, split: str, shard_tokens: int, buf: np.ndarray, eot: int = EOT_TOKEN):
        self.out, self.split, self.buf, self.fill, self.eot = out, split, buf[:shard_tokens], 0, eot
        self.shards: list[str] = []
        self.documents = 0

    def add(self, piece: np.ndarray) -> None:
        self.documents += int(np.count_nonzero(piece == self.eot))
        p = 0
        while p < len(piece):
            take = min(len(self.buf) - self.fill, len(piece) - p)
            self.buf[self.fill : self.fill + take] = piece[p : p + take]
            self.fill, p = self.fill + take, p + take
            if self.fill == len(self.buf):
                self.flush()

    def flush(self) -> None:
        if self.fill:
            self.shards.append(f"{self.split}_{len(self.shards):06d}.bin")
            write_shard(self.out / self.shards[-1], self.buf[: self.fill])
            self.fill = 0


def shuffled_order(tokens: _Concat, seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray, int]:
    """A global random order of the documents of ``tokens`` and where val starts in it.

    The order is ``numpy.random.default_rng(seed).permutation(n_documents)`` over *all* documents
    of the corpus (not a window), so a corpus sorted by topic, source or length gives neither a
    periodic training loss nor a val split drawn from one end of it. The cut is placed in the
    permuted stream by the rule of :func:`place_cut`. Memory: 24 bytes per document.

    Returns:
        ``(spans, order, cut)``: ``spans`` (n_documents, 2) int64 ``[start, length]`` in the
        stream; ``order`` the permutation; ``cut`` the number of train tokens.
    """
    starts = document_starts(tokens)
    if not len(starts) or starts[0] != 0:  # a stream always opens with a document's EOT
        starts = np.concatenate([[0], starts]).astype(np.int64)
    spans = np.stack([starts, np.diff(starts, append=tokens.n)], axis=1)
    order = np.random.default_rng(seed).permutation(len(starts))
    bounds = np.cumsum(spans[order, 1])[:-1]  # document starts in the permuted stream, after 0

    def find_start(lo: int, hi: int, last: bool) -> int | None:
        k = int(np.searchsorted(bounds, hi, side="right")) - 1 if last else int(np.searchsorted(bounds, lo))
        return int(bounds[k]) if 0 <= k < len(bounds) and lo <= bounds[k] <= hi else None

    return spans, order, place_cut(tokens.n, val_fraction, find_start)


def write_shuffled(
    tokens: _Concat,
    spans: np.ndarray,
    order: np.ndarray,
    cut: int,
    out: Path,
    shard_tokens: int,
    progress: bool = False,
) -> tuple[_ShardWriter, _ShardWriter]:
    """Write the documents ``spans[order]`` of ``tokens``: the first ``cut`` tokens as train
    shards, the rest as val shards. Documents are read from the memory-mapped staging chunks in
    permuted order (random reads); one shard buffer in memory.

    Returns:
        The train and val writers (their ``shards`` and ``documents``).
    """
    buf = np.empty(min(shard_tokens, tokens.n), dtype=tokens.arrays[0].dtype)
    train, val = _ShardWriter(out, "train", shard_tokens, buf, tokens.eot), None
    pos = 0
    with tqdm(total=len(order), unit="doc", desc="shuffle", disable=None if progress else True) as bar:
        for k in order:
            a, length = (int(v) for v in spans[k])
            piece = tokens.slice(a, a + length)
            if val is None and pos + length > cut:  # the cut falls in (or right before) this one
                train.add(piece[: cut - pos])
                train.flush()
                val = _ShardWriter(out, "val", shard_tokens, buf, tokens.eot)
                piece = piece[cut - pos :]
            (train if val is None else val).add(piece)
            pos += length
            bar.update(1)
    assert val is not None, "cut must be below the token count"
    val.flush()
    return train, val


def _stage(
    docs: Iterator[str],
    out: Path,
    state: dict,
    *,
    workers: int,
    shard_tokens: int,
    max_tokens: int | None,
    progress: bool,
    tokenizer=None,
) -> None:
    """Tokenize ``docs`` (after the ``state["next_doc"]`` already staged) into staging chunks
    ``.stream_NNNNNN.bin`` of ``shard_tokens`` tokens, recording each finished chunk in ``state``
    and the progress file, then the last partial chunk in ``state`` only. ``tokenizer``: a
    :class:`gptspeed.bpe.Tokenizer`, None for GPT-2's."""
    skip_docs, skip_tokens = state["next_doc"], state["doc_offset"]
    docs = itertools.islice(docs, skip_docs, None)  # already in finished chunks: read, not tokenized
    dtype = np.uint16 if tokenizer is None else tokenizer.dtype
    buf = np.empty(shard_tokens if max_tokens is None else min(shard_tokens, max_tokens), dtype=dtype)
    fill, total, n_docs = 0, state["tokens"], state["documents"]
    start_tokens = total
    t0 = time.perf_counter()
    bar = tqdm(unit="doc", desc="tokenize", initial=skip_docs, disable=None if progress else True)
    done = False
    # closing: on an error or Ctrl-C the tokenizer's threads stop here, not when the frame is collected
    with bar, contextlib.closing(tokenize_stream(docs, workers, tokenizer)) as stream:
        for doc_index, doc in enumerate(stream, start=skip_docs):
            bar.update(1)
            p = skip_tokens if doc_index == skip_docs else 0
            if len(doc) and p == 0:
                n_docs += 1
            while p < len(doc):
                take = min(len(buf) - fill, len(doc) - p)
                if max_tokens is not None:
                    take = min(take, max_tokens - total - fill)
                buf[fill : fill + take] = doc[p : p + take]
                fill, p = fill + take, p + take
                full = fill == len(buf)
                done = max_tokens is not None and total + fill >= max_tokens
                if full or done:
                    name = STAGE_NAME.format(len(state["chunks"]))
                    write_shard(out / name, buf[:fill])
                    total, chunk_len, fill = total + fill, fill, 0
                    nxt, off = (doc_index, p) if p < len(doc) else (doc_index + 1, 0)
                    state["chunks"].append({"name": name, "tokens": chunk_len})
                    state.update(next_doc=nxt, doc_offset=off, documents=n_docs, tokens=total)
                    write_progress(out, state)
                if done:
                    break
            if done:
                break
            if doc_index % 64 == 0:
                bar.set_postfix_str(
                    f"{(total + fill - start_tokens) / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False
                )
        if fill:
            name = STAGE_NAME.format(len(state["chunks"]))
            write_shard(out / name, buf[:fill])
            total += fill
            state["chunks"].append({"name": name, "tokens": fill})
            state.update(documents=n_docs, tokens=total)


MIN_SHARD_TOKENS = 256  # a shard is a file: --shard-tokens 10 wrote tens of thousands of files for a small corpus
MAX_SHARD_TOKENS = 2**31 - 1  # the shard header's token count is an int32


def _noting_text(docs: Iterator[str], seen: dict[str, bool]) -> Iterator[str]:
    """``docs`` unchanged, setting ``seen["text"]`` once a document holds something besides
    whitespace (a whitespace-only corpus is refused like an empty one)."""
    for doc in docs:
        if not seen["text"] and not doc.isspace() and doc:
            seen["text"] = True
        yield doc


@dataclass(frozen=True)
class _Input:
    """What ``prepare`` reads: a dataset streamed through ``datasets`` (``dataset`` set; no files)
    or local files (``paths``, their names in the manifest, and (sha256, bytes) of each), and the
    ``input_sha256`` that identifies it (:func:`input_sha256`; for a dataset, of its name/config/split)."""

    dataset: str | None
    hf_name: str | None
    split: str
    paths: list[Path]
    names: list[str]
    info: list[tuple[str, int]]
    sha256: str
    stamps: tuple[tuple[int, int], ...] = ()  # (size, mtime_ns) of each file, taken before it was hashed
    val_tokens: int | None = None  # a named corpus's fixed val size (HFCorpus.val_tokens)
    tokenizer: Any = None  # how it is tokenized: a gptspeed.bpe.Tokenizer, None for GPT-2's (prepare_tokenizer.py)

    def check_unchanged(self) -> None:
        """GptspeedError naming the first file whose size or modification time is not what it was
        before it was hashed: its tokens would not be the text the manifest's sha256 names (a file
        still being downloaded or written)."""
        for path, stamp in zip(self.paths, self.stamps):
            try:
                st = path.stat()
                now = (st.st_size, st.st_mtime_ns)
            except OSError:
                now = None
            if now != stamp:
                raise GptspeedError(
                    f"{path} changed while it was being prepared (a download or a writer not finished?): "
                    "nothing was marked prepared; run the same command again once it is complete"
                )


def _check_arguments(
    val_fraction: float,
    shard_tokens: int,
    workers: int,
    max_tokens: int | None,
    out: Path,
    shuffle_seed: int | None = None,
) -> int:
    """GptspeedError for a bad argument of :func:`prepare`; returns the tokenizing threads to use."""
    if not 0.0 < val_fraction < 1.0:
        raise GptspeedError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < MIN_SHARD_TOKENS:
        raise GptspeedError(
            f"--shard-tokens must be an integer of at least {MIN_SHARD_TOKENS} (one file per shard: "
            f"fewer would write a file every few tokens), got {shard_tokens!r}"
        )
    if shard_tokens > MAX_SHARD_TOKENS:
        raise GptspeedError(
            f"--shard-tokens must be at most {MAX_SHARD_TOKENS:,} (2^31-1: a shard's header "
            f"counts its tokens in an int32), got {shard_tokens:,}"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise GptspeedError(f"workers must be 0 (one per CPU) or a positive integer, got {workers!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise GptspeedError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")
    if shuffle_seed is not None:
        from gptspeed.config import check_seed

        check_seed(shuffle_seed, "--shuffle-seed")  # numpy's generators take non-negative seeds only
    check_out(out)
    return workers or default_workers()


def _resolve_input(source: str, hf_name: str | None, split: str, progress: bool) -> _Input:
    """SOURCE -> :class:`_Input` (downloading a named corpus if needed: :func:`resolve_source`)."""
    dataset, val_tokens = None, None
    if source in HF_CORPORA:
        c = HF_CORPORA[source]
        dataset, hf_name, split = c.dataset, hf_name or c.config, split if split != "train" else c.split
        val_tokens = c.val_tokens
    elif source.startswith("hf:"):
        dataset = source[3:]
        if not dataset:
            raise GptspeedError("hf: needs a dataset name, e.g. hf:HuggingFaceFW/fineweb-edu --hf-name sample-10BT")
    if dataset is not None:
        sha = hashlib.sha256(json.dumps([dataset, hf_name, split]).encode()).hexdigest()
        return _Input(dataset, hf_name, split, [], [], [], sha, val_tokens=val_tokens)
    paths, names = resolve_source(source, progress=progress)
    # a named corpus's files were just checked against its digests: no need to hash them twice
    known = CORPORA[source].files if source in CORPORA else {}
    try:
        stamps = tuple((st.st_size, st.st_mtime_ns) for st in (p.stat() for p in paths))  # before hashing
        info = [(known.get(n) or sha256_file(p), size) for p, n, (size, _) in zip(paths, names, stamps)]
    except OSError as e:
        raise GptspeedError(f"cannot read {e.filename or source}: {e.strerror or e}") from None
    return _Input(None, hf_name, split, paths, names, info, input_sha256([d for d, _ in info]), stamps)


def _stage_input(
    inp: _Input,
    out: Path,
    state: dict,
    *,
    text_field: str,
    skip_bad: bool,
    workers: int,
    shard_tokens: int,
    max_tokens: int | None,
    progress: bool,
) -> None:
    """Read and tokenize every document of ``inp`` into staging chunks (:func:`_stage`), unless
    ``state`` says that was done; marks ``state`` complete, with its bad records and whether any
    text was seen."""
    if state.get("complete"):  # interrupted while finishing: every document is already staged
        return
    stats = SourceStats()
    if inp.dataset is not None:
        docs = iter_hf(
            inp.dataset, config=inp.hf_name, split=inp.split, text_field=text_field, stats=stats, skip_bad=skip_bad
        )
    else:
        docs = iter_files(inp.paths, text_field, stats, skip_bad=skip_bad)
    seen = {"text": bool(state.get("has_text"))}
    _stage(
        _noting_text(docs, seen),
        out,
        state,
        workers=workers,
        shard_tokens=shard_tokens,
        max_tokens=max_tokens,
        progress=progress,
        tokenizer=inp.tokenizer,
    )
    state.update(complete=True, bad_records=stats.bad, has_text=seen["text"])
    write_progress(out, state)


def _write_splits(
    out: Path,
    state: dict,
    source: str,
    val_fraction: float,
    shard_tokens: int,
    shuffle_seed: int | None,
    progress: bool,
    val_tokens: int | None = None,
    eot: int = EOT_TOKEN,
) -> dict:
    """Staged chunks -> the train and val shards (:func:`split_cut`, or :func:`shuffled_order`
    with a seed); the chunks are removed or renamed. Returns the manifest's ``splits``.
    ``val_tokens``: a corpus's fixed val size (:func:`val_share`). GptspeedError (and ``out``
    cleared) for no text, or too little to give both splits a token."""
    total, n_docs = state["tokens"], state["documents"]
    chunk_paths = [out / c["name"] for c in state["chunks"]]
    if total == 0 or not state.get("has_text", True):
        clear_prepared(out)
        raise GptspeedError(f"no text in {source} (empty, or only whitespace): give files with some text")
    val_fraction = val_share(total, val_fraction, val_tokens)
    tokens = _Concat(chunk_paths, eot)
    if shuffle_seed is not None:
        spans, order, cut = shuffled_order(tokens, shuffle_seed, val_fraction)
    else:
        cut = split_cut(tokens, val_fraction)
    if not 0 < cut < total:
        del tokens
        clear_prepared(out)
        raise GptspeedError(
            f"{source} has only {total} tokens, too few to split with val_fraction={val_fraction}: "
            "add text or change --val-fraction"
        )
    if shuffle_seed is not None:
        train, val = write_shuffled(tokens, spans, order, cut, out, shard_tokens, progress)
        train_shards, val_shards, val_docs = train.shards, val.shards, val.documents
        del tokens, spans, order
        for p in chunk_paths:
            p.unlink(missing_ok=True)
    else:
        # val first (it reads chunks at and after the cut), then the partial train shard, then renames
        val_shards, val_docs = [], 0
        for i, start in enumerate(range(cut, total, shard_tokens)):
            part = tokens.slice(start, min(total, start + shard_tokens))
            val_docs += int(np.count_nonzero(part == eot))
            val_shards.append(f"val_{i:06d}.bin")
            write_shard(out / val_shards[-1], part)
        train_shards = [f"train_{i:06d}.bin" for i in range((cut + shard_tokens - 1) // shard_tokens)]
        k = cut // shard_tokens
        if cut % shard_tokens:
            write_shard(out / train_shards[k], tokens.slice(k * shard_tokens, cut))
        # chunk i holds tokens [i*S, (i+1)*S) (every chunk but the last is full): train shard i for i < k
        del tokens
        for i in range(k):
            os.replace(chunk_paths[i], out / train_shards[i])
        for p in chunk_paths[k:]:
            p.unlink(missing_ok=True)
    return {
        "train": {"tokens": cut, "documents": n_docs - val_docs, "shards": train_shards},
        "val": {"tokens": total - cut, "documents": val_docs, "shards": val_shards},
    }


def _manifest(
    source: str, inp: _Input, val_fraction: float, shard_tokens: int, splits: dict, settings: dict, state: dict
) -> dict:
    """The ``manifest.json`` of a finished prepare (fields: :func:`prepare`'s Returns)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_FORMAT_VERSION,
        "source": source,
        "tokenizer": "gpt2",
        "eot_token": EOT_TOKEN,
        "n_vocab": N_VOCAB,
        "files": [{"path": nm, "sha256": d, "bytes": b} for nm, (d, b) in zip(inp.names, inp.info)],
        "input_sha256": inp.sha256,
        "documents": state["documents"],
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "splits": splits,
        "settings": settings,
        "bad_records": state.get("bad_records", 0),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gptspeed_version": gptspeed.__version__,
        # what the bytes depend on besides the input and settings: the BPE, and the shuffle's
        # numpy.random.default_rng(seed).permutation
        "tiktoken_version": importlib.metadata.version("tiktoken"),
        "numpy_version": np.__version__,
    }
    return manifest if inp.tokenizer is None else ptok.tokenizer_manifest(manifest, inp.tokenizer)


def prepare(
    source: str,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = PrepareOptions.val_fraction,
    shard_tokens: int = PrepareOptions.shard_tokens,
    force: bool = PrepareOptions.force,
    progress: bool = True,
    workers: int = PrepareOptions.workers,
    text_field: str = PrepareOptions.text_field,
    shuffle_seed: int | None = PrepareOptions.shuffle_seed,
    skip_bad: bool = PrepareOptions.skip_bad,
    max_tokens: int | None = PrepareOptions.max_tokens,
    hf_name: str | None = PrepareOptions.hf_name,
    split: str = PrepareOptions.split,
    max_shards: int | None = PrepareOptions.max_shards,
    print_hashes: bool = PrepareOptions.print_hashes,
    tokenizer: str = PrepareOptions.tokenizer,
) -> dict:
    """Tokenize SOURCE into ``train_NNNNNN.bin`` / ``val_NNNNNN.bin`` shards and a manifest,
    streaming, in flat memory (how: the module docstring); or, for a corpus tokenized upstream
    (``fineweb10B``: :data:`~gptspeed.data.corpora.SHARD_CORPORA`), put its shards in the folder
    as they are (:func:`gptspeed.data.fineweb.prepare_shard_corpus`).

    Args:
        source: a named corpus (``tinyshakespeare``, ``shakespeare-gutenberg``, or online through
            ``datasets``: ``tinystories``, ``fineweb-edu-10B``), a ``.txt`` (one document),
            ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one per line) or ``.parquet`` (one per row)
            file, a folder of such files (recursive, sorted), a glob, or ``hf:DATASET`` (a hub id
            or a local jsonl/parquet file, streamed through ``datasets``).
        out_dir: output folder (created).
        val_fraction: share of tokens for val, in (0, 1).
        shard_tokens: most tokens per shard file (2 bytes each on disk), at least 256.
        force: overwrite a folder that already has a ``manifest.json``. Without it, a folder
            prepared from the same input (same file hashes) and settings is left as it is and its
            manifest returned with ``"reused": True``; any other prepared folder is an error.
        progress: show tqdm bars (documents, tokens/s, downloads) when stderr is a terminal.
        workers: tokenizing threads (the shards do not depend on it); 0 = one per usable CPU.
        text_field: the JSON field / parquet column / dataset feature holding the text.
        shuffle_seed: None keeps the source order; an int writes the documents in a global
            random order fixed by the seed, val then being a random share of documents too. Disk
            then peaks at twice the corpus while finishing.
        skip_bad: skip and count bad records instead of stopping at the first.
        max_tokens: stop after this many tokens (the stream is cut there), None = all.
        hf_name, split: the dataset configuration and split for ``hf:`` sources.
        max_shards: ``fineweb10B`` only: its first N train shards (default all); the val shard always.
        print_hashes: print each input file's sha256 as ``sha256  path`` lines (the format of the
            tables in :mod:`gptspeed.data.corpora`), from the manifest.
        tokenizer: ``gpt2`` (the default: GPT-2's BPE, uint16 shards), a tiktoken encoding name or
            a TOK_DIR (:func:`gptspeed.bpe.resolve_tokenizer`); a vocabulary above 65,536 ids is
            written as llm.c's uint32 shards (:mod:`gptspeed.data.shards`), and the manifest records
            the tokenizer (:mod:`gptspeed.data.prepare_tokenizer`).

    Returns:
        The manifest written to ``out_dir/manifest.json``: format, source, tokenizer, files
        (path, sha256, bytes; empty for datasets), input_sha256, documents, val_fraction,
        shard_tokens, splits (tokens, documents = EOT count, shards), settings (text_field,
        shuffle_seed, skip_bad, max_tokens, dataset, hf_name, split; val_tokens for a corpus with
        a fixed val size), bad_records, created (UTC ISO time), gptspeed_version,
        tiktoken_version, numpy_version. A corpus tokenized upstream: see :func:`~gptspeed.data.fineweb.prepare_shard_corpus`.

    Raises:
        GptspeedError: bad arguments (``shard_tokens`` above 2^31-1 included), an ``out_dir`` that
            cannot be a folder (under a file, a name too long), or must not be one (``/``, the home
            folder, a folder of files gptspeed did not write: :func:`check_prepare_target`), folder
            already prepared without force, another prepare into it under way or a train reading it
            (:func:`~gptspeed.data.folder.prepare_lock`), bad SOURCE (see
            :func:`resolve_source`), a file that cannot be read to its end (a corrupt or truncated
            ``.gz`` / ``.zst``), a non-UTF-8 file, a bad record (naming file and line) without
            ``skip_bad``, no text, too little text for both splits, an OSError while writing (a
            full disk: naming the folder; the same command resumes once there is room).
    """
    out = Path(os.path.expanduser(out_dir))  # os.path's leaves an unknown ~user as it is (Path's raises)
    args = dict(val_fraction=val_fraction, shard_tokens=shard_tokens, text_field=text_field, shuffle_seed=shuffle_seed)
    args.update(skip_bad=skip_bad, max_tokens=max_tokens, hf_name=hf_name, split=split)
    if source in SHARD_CORPORA or max_shards is not None:
        ptok.check_gpt2_only(source, tokenizer)
        manifest = prepare_shard_corpus(source, out, force=force, progress=progress, max_shards=max_shards, given=args)
    else:
        args["tokenizer"] = tokenizer
        manifest = _prepare_text(source, out, force=force, progress=progress, workers=workers, **args)
    if print_hashes:
        for f in manifest["files"]:
            print(f"{f['sha256']}  {f['path']}")
    return manifest


def _prepare_text(
    source: str,
    out: Path,
    *,
    val_fraction: float,
    shard_tokens: int,
    force: bool,
    progress: bool,
    workers: int,
    text_field: str,
    shuffle_seed: int | None,
    skip_bad: bool,
    max_tokens: int | None,
    hf_name: str | None,
    split: str,
    tokenizer: str,
) -> dict:
    """:func:`prepare` of a source it tokenizes."""
    workers = _check_arguments(val_fraction, shard_tokens, workers, max_tokens, out, shuffle_seed)
    tok = ptok.load_prepare_tokenizer(tokenizer)
    check_prepare_target(out)  # never /, the home folder, or a folder of other files
    inp = dataclasses.replace(_resolve_input(source, hf_name, split, progress), tokenizer=tok)
    settings = {
        "text_field": text_field,
        "shuffle_seed": shuffle_seed,
        "skip_bad": skip_bad,
        "max_tokens": max_tokens,
        "dataset": inp.dataset,
        "hf_name": inp.hf_name,
        "split": inp.split,
    }
    if inp.val_tokens is not None:  # only then: a folder prepared before it was a setting is still reused
        settings["val_tokens"] = inp.val_tokens
    if tok is not None:  # only then, likewise (GPT-2's folders are as they were)
        settings["tokenizer_sha256"] = tok.sha256
    if os.path.lexists(out / MANIFEST_NAME) and not force:
        return reuse_prepared(out, source, val_fraction, shard_tokens, inp.sha256, settings)
    created = make_out(out)
    lock = prepare_lock(out).acquire()
    try:
        manifest = _prepare_locked(
            source,
            inp,
            out,
            force=force,
            settings=settings,
            val_fraction=val_fraction,
            shard_tokens=shard_tokens,
            workers=workers,
            text_field=text_field,
            skip_bad=skip_bad,
            max_tokens=max_tokens,
            shuffle_seed=shuffle_seed,
            progress=progress,
        )
    except BaseException:
        if created:  # a prepare that fails leaves no new folder behind, unless it holds chunks to resume from
            remove_if_nothing_staged(out, lock)
        raise
    finally:
        lock.release()
    return manifest


def _prepare_locked(
    source: str,
    inp: _Input,
    out: Path,
    *,
    force: bool,
    settings: dict,
    val_fraction: float,
    shard_tokens: int,
    workers: int,
    text_field: str,
    skip_bad: bool,
    max_tokens: int | None,
    shuffle_seed: int | None,
    progress: bool,
) -> dict:
    """:func:`prepare`'s work in ``out``, whose :func:`~gptspeed.data.folder.prepare_lock` the caller holds: stage, split,
    write the manifest (then drop the progress file). An OSError (a full disk) becomes one line
    naming the folder; what was written stays hidden or unlisted (see the module docstring)."""
    try:
        key = hashlib.sha256(json.dumps([source, inp.sha256, shard_tokens, settings]).encode()).hexdigest()
        state = staging_state(out, key, force)
        eot = EOT_TOKEN if inp.tokenizer is None else inp.tokenizer.eot
        _stage_input(
            inp,
            out,
            state,
            text_field=text_field,
            skip_bad=skip_bad,
            workers=workers,
            shard_tokens=shard_tokens,
            max_tokens=max_tokens,
            progress=progress,
        )
        inp.check_unchanged()  # the tokens are of the text the manifest's hashes name
        splits = _write_splits(
            out, state, source, val_fraction, shard_tokens, shuffle_seed, progress, settings.get("val_tokens"), eot
        )
        manifest = _manifest(source, inp, val_fraction, shard_tokens, splits, settings, state)
        ptok.save_data_tokenizer(out, inp.tokenizer)  # before the manifest: a listed folder holds it
        write_text_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
        (out / PROGRESS_NAME).unlink(missing_ok=True)  # after the manifest: the folder never looks finished before
    except OSError as e:
        import errno

        what = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        name = f" (at {Path(e.filename).name})" if getattr(e, "filename", None) else ""
        raise GptspeedError(
            f"cannot write the data folder {out}: {what}{name}; nothing there is marked prepared: "
            "make room (or fix the folder), then run the same command again to resume"
        ) from None
    return manifest


def default_train_data(say: Callable[[str], object] = print) -> Path:
    """The data ``gptspeed train`` uses without ``--data``: tiny Shakespeare, shipped with the
    package (:data:`gptspeed.data.corpora.DEFAULT_CORPUS`), prepared once into
    ``$GPTSPEED_CACHE/prepared/tinyshakespeare`` (default ``~/.cache/gptspeed``) and reused after
    (a folder prepared from the same input is kept as it is). A first preparation is written into a
    temporary folder beside it and renamed into place, so an interrupted one leaves nothing that
    looks prepared, and two runs starting at once each get a complete folder. Says what it does in
    one line through ``say``. Returns the folder; GptspeedError if the cache cannot be written, or
    its folder exists without a manifest (it is not gptspeed's preparation: never written over)."""
    from gptspeed.data.corpora import DEFAULT_CORPUS, cache_dir

    out = cache_dir() / "prepared" / DEFAULT_CORPUS
    if (out / MANIFEST_NAME).is_file():
        say(f"no --data: training on {DEFAULT_CORPUS} (shipped with gptspeed), prepared in {out}")
        return out
    if os.path.lexists(out):  # every preparation is renamed into place whole: this is not one of them
        raise GptspeedError(
            f"the data cache {out} exists but is not a prepared folder (no {MANIFEST_NAME}): "
            "remove it, set GPTSPEED_CACHE, or give --data"
        )
    say(f"no --data: preparing {DEFAULT_CORPUS} (shipped with gptspeed) into {out} once, then training on it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise GptspeedError(
            f"cannot write the data cache {out.parent}: {e.strerror or e}; set GPTSPEED_CACHE or give --data"
        ) from None
    try:
        prepare(DEFAULT_CORPUS, tmp, force=True, progress=False)
        try:
            os.rename(tmp, out)
        except OSError as e:  # another run prepared it first: keep theirs if it is complete
            if not (out / MANIFEST_NAME).is_file():
                raise GptspeedError(
                    f"the data cache {out} exists but is not a prepared folder ({e.strerror or e}): "
                    "remove it, set GPTSPEED_CACHE, or give --data"
                ) from None
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out
