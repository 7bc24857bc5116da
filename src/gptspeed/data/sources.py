"""Documents from files and datasets, streamed one at a time (never the whole corpus in memory).

Formats, chosen by file name: ``.txt`` (the whole file is one document, UTF-8), ``.jsonl`` /
``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object per line, the document in ``text_field``) and
``.parquet`` (the column ``text_field``, one document per row). Hugging Face datasets are read
in streaming mode through the optional ``datasets`` library (:func:`iter_hf`).

Bad records (a malformed JSON line, a missing or non-string text field, a null parquet value,
a non-UTF-8 line) raise :class:`GptspeedError` naming the file and line (or row), or with
``skip_bad`` are skipped and counted in :class:`SourceStats`.
"""

from __future__ import annotations

import gzip
import io
import json
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

@dataclass
class SourceStats:
    """Counters filled while documents are read: ``bad`` records skipped (with ``skip_bad``)."""

    bad: int = 0


def file_format(path: Path) -> str | None:
    """``"txt"``, ``"jsonl"``, ``"jsonl.gz"``, ``"jsonl.zst"``, ``"parquet"``, or None if unknown."""
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _bad(stats: SourceStats, skip_bad: bool, message: str) -> None:
    if not skip_bad:
        raise GptspeedError(message + " (or pass --skip-bad to skip and count such records)")
    stats.bad += 1


def _open_lines(path: Path, fmt: str) -> io.BufferedIOBase:
    if fmt == "jsonl.gz":
        return gzip.open(path, "rb")
    if fmt == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise GptspeedError(
                f"{path}: reading .zst needs the zstandard package: pip install 'gptspeed[data]'") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def iter_jsonl(path: Path, text_field: str, stats: SourceStats, skip_bad: bool = False,
               fmt: str = "jsonl") -> Iterator[str]:
    """The ``text_field`` strings of a JSON-lines file (optionally gzip/zstd), in line order.

    Blank lines are ignored. Raises GptspeedError ``FILE:LINE: ...`` for a line that is not
    UTF-8 JSON, not an object, or lacks a string ``text_field`` (unless ``skip_bad``), and for a
    corrupt compressed stream.
    """
    try:
        with _open_lines(path, fmt) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    _bad(stats, skip_bad, f"{path}:{lineno}: not UTF-8 (byte {e.start}: {e.reason})")
                    continue
                except json.JSONDecodeError as e:
                    _bad(stats, skip_bad, f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})")
                    continue
                text = obj.get(text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    _bad(stats, skip_bad, f"{path}:{lineno}: no string field {text_field!r} "
                                          "(choose the field with --text-field)")
                    continue
                yield text
    except (OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise GptspeedError(f"{path} does not exist") from None
        raise GptspeedError(f"cannot read {path} ({e}): the file is corrupt or truncated") from None
    except Exception as e:  # zstandard.ZstdError and friends
        if type(e).__module__.startswith("zstandard"):
            raise GptspeedError(f"cannot read {path} ({e}): the file is corrupt or truncated") from None
        raise


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
        raise GptspeedError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                            "choose it with --text-field")
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                _bad(stats, skip_bad, f"{path}: row {row}: {text_field!r} is not a string")
                continue
            yield text


def read_txt(path: Path) -> str:
    """A UTF-8 text file, exactly (no newline translation, BOM dropped); GptspeedError if not UTF-8."""
    data = path.read_bytes()
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


def iter_hf(name: str, *, config: str | None = None, split: str = "train", text_field: str = "text",
            stats: SourceStats | None = None, skip_bad: bool = False) -> Iterator[str]:
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
        raise GptspeedError(f"cannot open dataset {name!r} (config {config!r}, split {split!r}): "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

    def records() -> Iterator[str]:
        for i, rec in enumerate(ds):
            text = rec.get(text_field) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                _bad(stats, skip_bad, f"{name}: record {i + 1}: no string field {text_field!r}")
                continue
            yield text

    return records()
