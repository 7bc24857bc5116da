"""The token shard file formats of llm.c (and modded-nanogpt).

A shard is a 1024-byte header of 256 little-endian int32 — ``[0]`` magic, ``[1]`` version, ``[2]``
token count, the rest 0 — followed by exactly ``count`` token ids. Two formats, as llm.c's
``dev/data/data_common.py`` writes them:

- GPT-2's: magic 20240520, version 1, ids as little-endian uint16 (a vocabulary of at most 65,536
  ids: GPT-2's 50,257 fit). llm.c's C trainer and modded-nanogpt read it.
- llm.c's uint32 format (its "llama-3" one): magic 20240801, version 7, ids as little-endian uint32
  (any vocabulary up to 2**32 ids: Llama 3's 128,256, cl100k's, a tokenizer of one's own).

:func:`write_shard` writes the uint32 format for a ``uint32`` array and GPT-2's otherwise; the
readers take either, by the header. Files written by llm.c's scripts and modded-nanogpt's
``data/cached_fineweb*.py`` read here unchanged, and ours read there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_atomic

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
TOKEN_DTYPE = np.dtype("<u2")
"""GPT-2's format's token dtype: little-endian uint16, 2 bytes per token."""
WIDE_MAGIC = 20240801
WIDE_VERSION = 7
WIDE_DTYPE = np.dtype("<u4")
"""llm.c's uint32 format's token dtype: little-endian uint32, 4 bytes per token."""
FORMATS = {SHARD_VERSION: (SHARD_MAGIC, TOKEN_DTYPE), WIDE_VERSION: (WIDE_MAGIC, WIDE_DTYPE)}
"""version -> (magic, token dtype) of each format read and written here."""

_REPREPARE = "prepare the data again with `gptspeed prepare SOURCE --out DIR --force`"


class ShardError(GptspeedError):
    """A shard file is missing, truncated, or not in the format above; the message names it.
    The trainer saves the last finished step before such an error ends the run; its subclass
    :class:`gptspeed.data.stream.StreamError` (a document stream that failed or ended) gets the same."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` as one shard at ``path``, atomically.

    The bytes go to a hidden temp file ``.NAME.*.tmp`` in the same folder (never matched by a
    ``*.bin`` glob), are flushed and fsynced, then ``os.replace``-d onto ``path``: a crash leaves
    either the old file or the complete new one, never a partial shard. The temp file is removed
    if anything fails.

    Args:
        path: destination file; its folder must exist.
        tokens: 1-D (or any shape, flattened) integer array. A ``uint32`` array is written in
            llm.c's uint32 format (values in [0, 2**32)), any other in GPT-2's uint16 format
            (values in [0, 65535]).

    Raises:
        ValueError: ``tokens`` is not an integer array or has values outside its format's range
            (a caller bug, not a user error).
    """
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"shard tokens must be integers, got dtype {tokens.dtype}")
    version = WIDE_VERSION if tokens.dtype == np.uint32 else SHARD_VERSION
    magic, dtype = FORMATS[version]
    top = np.iinfo(dtype).max
    if tokens.size and (tokens.min() < 0 or tokens.max() > top):
        raise ValueError(f"shard tokens must be in [0, {top}], got min {tokens.min()} max {tokens.max()}")
    if tokens.size > np.iinfo(np.int32).max:
        raise ValueError(f"a shard holds at most 2**31-1 tokens, got {tokens.size}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, tokens.size
    data = tokens.reshape(-1).astype(dtype, copy=False)

    write_atomic(path, lambda f: (f.write(header.tobytes()), f.write(data.tobytes())))


def read_header(path: str | os.PathLike) -> tuple[int, int]:
    """Validate the shard at ``path`` and return ``(version, token_count)``.

    Reads only the 1024-byte header and the file size; checks magic and version (one of
    :data:`FORMATS`), and that the file is exactly ``1024 + itemsize * token_count`` bytes
    (itemsize 2 for version 1, 4 for version 7).

    Raises:
        ShardError: missing file, file shorter than the header, wrong magic (not an llm.c /
            gptspeed shard), unsupported version, or a size that disagrees with the token count
            (truncated, or extra bytes).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(f"shard {path} does not exist: {_REPREPARE}") from None
    except IsADirectoryError:
        raise ShardError(f"shard {path} is a directory, not a shard file") from None
    if size < HEADER_BYTES or len(raw) < HEADER_BYTES:
        raise ShardError(
            f"shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header: "
            f"it is truncated or not a shard; {_REPREPARE}"
        )
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = (int(x) for x in header[:3])
    if magic not in (SHARD_MAGIC, WIDE_MAGIC):
        raise ShardError(
            f"shard {path} starts with magic {magic}, expected {SHARD_MAGIC} (uint16) or {WIDE_MAGIC} (uint32): "
            "it is not an llm.c/gptspeed token shard"
        )
    if FORMATS.get(version, (None,))[0] != magic:
        raise ShardError(
            f"shard {path} has magic {magic} and format version {version}, but this gptspeed reads only versions "
            f"{SHARD_VERSION} (magic {SHARD_MAGIC}) and {WIDE_VERSION} (magic {WIDE_MAGIC}): {_REPREPARE}"
        )
    if count < 0:
        raise ShardError(f"shard {path} has a negative token count {count}: {_REPREPARE}")
    expected = HEADER_BYTES + FORMATS[version][1].itemsize * count
    if size < expected:
        raise ShardError(
            f"shard {path} is truncated: its header says {count} tokens ({expected} bytes) but "
            f"the file has {size} bytes; {_REPREPARE}"
        )
    if size > expected:
        raise ShardError(
            f"shard {path} has {size - expected} bytes after its {count} tokens ({expected} "
            f"bytes expected): it is corrupt; {_REPREPARE}"
        )
    return version, count


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """The tokens of the shard at ``path``, validated by :func:`read_header`.

    Returns:
        A read-only ``np.memmap`` of dtype ``<u2`` (version 1) or ``<u4`` (version 7) and shape
        ``(token_count,)`` (no copy: pages load on access). An empty shard gives a read-only empty
        ndarray (mmap cannot map 0 bytes).

    Raises:
        ShardError: as :func:`read_header`.
    """
    version, count = read_header(path)
    dtype = FORMATS[version][1]
    if count == 0:
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


FINGERPRINT_BYTES = 1 << 16  # bytes read at each of a shard's start, middle and end


def shard_fingerprint(path: str | os.PathLike, f: BinaryIO | None = None) -> str:
    """A cheap identity of a shard's tokens: sha256 of its size and of 64 KiB read at its start,
    middle and end (16 hex digits). Re-preparing with other settings or overwriting the tokens in
    place changes it (a resume then refuses the data, naming it); an edit confined to bytes it does
    not read would not -- hashing every shard at every start would cost minutes on a large corpus.
    ``f``: the shard already open (binary), read without moving its position; else ``path`` is opened."""
    import hashlib

    if f is None:
        with open(path, "rb") as f:
            return shard_fingerprint(path, f)
    h = hashlib.sha256()
    size = os.fstat(f.fileno()).st_size
    h.update(str(size).encode())
    for offset in (0, max(0, size // 2 - FINGERPRINT_BYTES // 2), max(0, size - FINGERPRINT_BYTES)):
        h.update(os.pread(f.fileno(), FINGERPRINT_BYTES, offset))
    return h.hexdigest()[:16]


class MappedShard:
    """A shard's tokens memory-mapped for reading while training, safe against the file shrinking.

    A memory-mapped file that is truncated while mapped turns a read of its lost pages into SIGBUS:
    the process dies (exit 135) with no message and no checkpoint. So the file stays open here, and
    :meth:`window` compares its current size (one ``fstat``, about a microsecond) with the tokens
    asked for before touching them. (A truncation in the microseconds between the check and the
    copy can still fault; the check turns the usual case -- a shard re-prepared or cut while a run
    reads it -- into an error naming the shard.)

    Raises:
        ShardError: as :func:`read_header` when opened; from :meth:`window`, when the file no longer
            holds the tokens asked for.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tokens = read_shard(self.path)
        self._file = open(self.path, "rb")  # noqa: SIM115 -- held for fstat, closed by close()

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (clipped to the shard): a read-only ``<u2`` (or ``<u4``) view, no copy."""
        stop = min(stop, len(self.tokens))
        need = HEADER_BYTES + self.tokens.dtype.itemsize * stop
        size = os.fstat(self._file.fileno()).st_size
        if size < need:
            raise ShardError(
                f"shard {self.path} shrank to {size:,} bytes while being read (its tokens up to {stop:,} need "
                f"{need:,}): it was truncated or re-prepared under the running job; restore it, or {_REPREPARE}"
            )
        return self.tokens[start:stop]

    def close(self) -> None:
        self._file.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
