"""Documents from files and datasets, streamed one at a time (never the whole corpus in memory).

Formats, chosen by file name: ``.txt`` (the whole file is one document, UTF-8), ``.jsonl`` /
``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object per line, the document in ``text_field``) and
``.parquet`` (the column ``text_field``, one document per row). Hugging Face datasets are read
in streaming mode through the optional ``datasets`` library (:func:`iter_hf`).

Bad records (a malformed JSON line, one nested too deeply for the parser, an oversize line, a
missing or non-string text field, a null parquet value, a non-UTF-8 line: whatever a single record
can be) raise :class:`GptspeedError` naming the file and line (or row), or with ``skip_bad`` are
skipped and counted in :class:`SourceStats`. Surrogates in a JSON string (``"\\ud800"``) are not
bad records: the tokenizer replaces a lone one with U+FFFD, as tiktoken does
(:func:`gptspeed.data.tokenize.encode_document`).

A file that cannot be read to its end is not a bad record but an error naming the file, with or
without ``skip_bad``: a corrupt or truncated ``.gz`` / ``.zst`` (a zstd frame cut short is
detected, which python-zstandard's ``stream_reader`` does not do: :class:`ZstdFrames`). One cut
cannot be seen, in either format: a file cut exactly between two complete gzip members or zstd
frames is itself a valid, shorter file (as for ``gzip -t`` and ``zstd -t``).
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gptspeed.errors import GptspeedError

STREAM_PREFIXES = ("jsonl:", "hf:")  # --data jsonl:PATH / hf:NAME: a document stream, tokenized while training


def is_stream_source(data: str) -> bool:
    """True for the ``--data`` specs that stream documents (``jsonl:PATH``, ``hf:NAME``) rather than
    name a prepared folder."""
    return data.startswith(STREAM_PREFIXES)


SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
"""File name endings a folder or glob source picks up."""

MAX_RECORD_BYTES = 1 << 28
"""The longest JSON line read as one record (256 MiB): a longer line (a binary file named
``.jsonl``, a file with no newlines) is a bad record, never read whole into memory."""

SKIP_BAD_HINT = "or pass --skip-bad to skip and count such records"


@dataclass
class SourceStats:
    """Counters filled while documents are read: ``bad`` records skipped (with ``skip_bad``).
    ``hint`` ends the message of a bad record met without ``skip_bad`` (what the user can do)."""

    bad: int = 0
    hint: str = SKIP_BAD_HINT


def file_format(path: Path) -> str | None:
    """``"txt"``, ``"jsonl"``, ``"jsonl.gz"``, ``"jsonl.zst"``, ``"parquet"``, or None if unknown."""
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _bad(stats: SourceStats, skip_bad: bool, message: str) -> None:
    if not skip_bad:
        raise GptspeedError(f"{message} ({stats.hint})")
    stats.bad += 1


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file, frame after frame (a file may hold several, as
    ``zstd`` writes when inputs are concatenated and ``pzstd`` always does), as a raw stream to
    wrap in ``io.BufferedReader``.

    python-zstandard's ``ZstdDecompressor.stream_reader`` (and ``read_to_iter``) end quietly when
    the input ends inside a frame: a truncated file reads as a shorter one, with no error. Here
    each frame is decompressed by its own ``decompressobj``, whose ``eof`` says whether the frame
    was complete; input that ends while a frame is open raises EOFError (like ``gzip`` for a
    truncated member). A file cut exactly between two frames is a valid zstd file and reads
    without error: nothing in the format tells such a cut from the end.

    Input goes in :data:`IN_CHUNK` pieces, so one call's output stays bounded even for a
    hostile file (zstd's largest expansion is a 4-byte RLE block for 128 KiB).

    Raises:
        EOFError: the input ends inside a frame.
        zstandard.ZstdError: the input is not zstd data, or is corrupt.
    """

    IN_CHUNK = 1 << 12

    def __init__(self, raw: io.BufferedIOBase, dctx):
        super().__init__()
        self._raw, self._dctx = raw, dctx
        self._frame = None  # the decompressobj of the open frame; None between frames
        self._input = b""  # compressed bytes read but not yet given to a frame
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._out):
            if not self._input:
                self._input = self._raw.read(self.IN_CHUNK)
                if not self._input:
                    if self._frame is not None:
                        raise EOFError("it ends inside a zstd frame")
                    return 0
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            chunk, self._input = self._input[: self.IN_CHUNK], self._input[self.IN_CHUNK :]
            self._out, self._pos = self._frame.decompress(chunk), 0
            if self._frame.eof:  # the frame is complete: what follows it starts the next one
                self._input = self._frame.unused_data + self._input
                self._frame = None
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def _open_lines(path: Path, fmt: str) -> io.BufferedIOBase:
    if fmt == "jsonl.gz":
        return gzip.open(path, "rb")
    if fmt == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise GptspeedError(
                f"{path}: reading .zst needs the zstandard package: pip install 'gptspeed[data]'"
            ) from None
        return io.BufferedReader(ZstdFrames(open(path, "rb"), zstandard.ZstdDecompressor()), 1 << 16)
    return open(path, "rb")


def _lines(f: io.BufferedIOBase) -> Iterator[bytes | None]:
    """The lines of ``f`` (with their newline), each read with a bound: a line longer than
    :data:`MAX_RECORD_BYTES` is read past in pieces and given as None."""
    while raw := f.readline(MAX_RECORD_BYTES + 1):
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield raw


def _record_text(raw: bytes, text_field: str) -> str:
    """The ``text_field`` string of one JSON line; ValueError saying what is wrong with it
    (whatever the line holds: the caller turns it into a bad record)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError("nested too deeply to be read as JSON") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"not readable as JSON ({e})") from None
    text = obj.get(text_field) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"no string field {text_field!r} (choose the field with --text-field)")
    return text


def _unreadable(path: Path, e: BaseException) -> GptspeedError:
    """The one line for a file that cannot be read to its end (missing, unreadable, corrupt or
    truncated compressed data): it names the file; no ``--skip-bad`` can skip it."""
    if isinstance(e, FileNotFoundError):
        return GptspeedError(f"{path} does not exist")
    if isinstance(e, EOFError):
        return GptspeedError(f"{path} is truncated ({e}): copy or download it again")
    detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
    return GptspeedError(f"cannot read {path} ({detail}): the file is corrupt or truncated")


def _is_decode_error(e: BaseException) -> bool:
    """An error of a decompressor reading corrupt data (zlib's for .gz, zstandard's for .zst)."""
    return isinstance(e, (OSError, EOFError, zlib.error)) or type(e).__module__.startswith("zstandard")


def iter_jsonl(
    path: Path, text_field: str, stats: SourceStats, skip_bad: bool = False, fmt: str = "jsonl"
) -> Iterator[str]:
    """The ``text_field`` strings of a JSON-lines file (optionally gzip/zstd), in line order.

    Blank lines are ignored. A line that is not UTF-8 JSON (or is nested too deeply to parse, or
    is longer than :data:`MAX_RECORD_BYTES`), not an object, or lacks a string ``text_field`` is a
    bad record: GptspeedError ``FILE:LINE: ...`` (unless ``skip_bad``: skipped, counted in
    ``stats``).

    Raises:
        GptspeedError: a bad record (without ``skip_bad``); the file missing, unreadable, or its
            compressed data corrupt or truncated (:class:`ZstdFrames`; gzip's own check), naming it.
    """
    try:
        f = _open_lines(path, fmt)
    except OSError as e:
        raise _unreadable(path, e) from None
    with f:
        lines = _lines(f)
        lineno = 0
        while True:
            try:
                raw = next(lines, b"")
            except Exception as e:
                if _is_decode_error(e):
                    raise _unreadable(path, e) from None
                raise
            if raw == b"":
                return
            lineno += 1
            if raw is None:
                _bad(
                    stats,
                    skip_bad,
                    f"{path}:{lineno}: a line longer than {MAX_RECORD_BYTES:,} bytes (is it a JSON-lines file?)",
                )
                continue
            if not raw.strip():
                continue
            try:
                text = _record_text(raw, text_field)
            except ValueError as e:
                _bad(stats, skip_bad, f"{path}:{lineno}: {e}")
                continue
            yield text


def iter_parquet(path: Path, text_field: str, stats: SourceStats, skip_bad: bool = False) -> Iterator[str]:
    """The ``text_field`` column of a parquet file, row by row, read in record batches.

    Raises GptspeedError naming the file when the column is missing, and ``FILE: row N`` for a
    null or non-string value (unless ``skip_bad``).
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise GptspeedError(f"{path}: reading parquet needs pyarrow: pip install 'gptspeed[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise GptspeedError(f"cannot read {path} as parquet ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise GptspeedError(
            f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
            "choose it with --text-field"
        )
    row = 0
    batches = pf.iter_batches(columns=[text_field], batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # pyarrow's errors for a corrupt or truncated file
            raise GptspeedError(
                f"cannot read {path} as parquet after row {row:,} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}): the file is corrupt or truncated"
            ) from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                _bad(stats, skip_bad, f"{path}: row {row}: {text_field!r} is not a string")
                continue
            yield text


def read_txt(path: Path) -> str:
    """A UTF-8 text file, exactly (no newline translation, BOM dropped); GptspeedError if it cannot
    be read or is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GptspeedError(f"{path} is not UTF-8 (byte {e.start}: {e.reason}): convert it to UTF-8 first") from None
    return text.removeprefix("\ufeff")


def iter_file(path: Path, text_field: str, stats: SourceStats, skip_bad: bool = False) -> Iterator[str]:
    """The documents of one file, by its format (:func:`file_format`; unknown endings read as text)."""
    fmt = file_format(path) or "txt"
    if fmt == "txt":
        yield read_txt(path)
    elif fmt == "parquet":
        yield from iter_parquet(path, text_field, stats, skip_bad)
    else:
        yield from iter_jsonl(path, text_field, stats, skip_bad, fmt)


def iter_files(paths: list[Path], text_field: str, stats: SourceStats, *, skip_bad: bool = False) -> Iterator[str]:
    """Documents of ``paths``, file after file, each file's in order."""
    for p in paths:
        yield from iter_file(p, text_field, stats, skip_bad)


def iter_hf(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    stats: SourceStats | None = None,
    skip_bad: bool = False,
) -> Iterator[str]:
    """Documents of a Hugging Face dataset in streaming mode (``datasets.load_dataset(...,
    streaming=True)``): nothing is downloaded ahead, records arrive as they are read.

    ``name`` is a hub id (``HuggingFaceFW/fineweb-edu``) or a local ``.jsonl``/``.json``/
    ``.parquet`` file or glob (read with the ``json`` / ``parquet`` builders). ``config`` is the
    dataset's configuration (``--hf-name``, e.g. ``sample-10BT``).

    Raises:
        GptspeedError: ``datasets`` is not installed, the dataset cannot be opened, or a record
            lacks a string ``text_field`` (unless ``skip_bad``; then counted in ``stats``).
    """
    try:
        import datasets
    except ImportError:
        raise GptspeedError("hf: sources need the datasets library: pip install 'gptspeed[data]'") from None
    stats = stats if stats is not None else SourceStats()
    local = name.rsplit(".", 1)[-1].lower() if "." in Path(name).name else ""
    try:
        if local in ("jsonl", "json", "parquet"):
            builder = "parquet" if local == "parquet" else "json"
            ds = datasets.load_dataset(builder, data_files=name, split=split, streaming=True)
        else:
            ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        raise GptspeedError(
            f"cannot open dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None

    def records() -> Iterator[str]:
        it, i = iter(ds), 0
        while True:
            try:
                rec = next(it, StopIteration)
            except Exception as e:  # the dataset's own reader failed (network, a corrupt file)
                first = str(e).splitlines()[0] if str(e) else ""
                raise GptspeedError(
                    f"cannot read dataset {name!r} after record {i:,}: {type(e).__name__}: {first[:300]}"
                ) from None
            if rec is StopIteration:
                return
            i += 1
            text = rec.get(text_field) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                _bad(stats, skip_bad, f"{name}: record {i}: no string field {text_field!r}")
                continue
            yield text

    return records()
