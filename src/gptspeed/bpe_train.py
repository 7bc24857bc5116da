"""``gptspeed tokenizer train SOURCE... --vocab-size N --out TOK_DIR`` and ``gptspeed tokenizer compare``.

Training is Hugging Face ``tokenizers``' ``BpeTrainer`` (Rust, parallel; the library nanochat's
reference tokenizer path and most trainers use or compare against; it writes ``tokenizer.json``,
which transformers loads as it is). The tokenizer is a byte-level BPE as GPT-2's (Radford et al.
2019, section 2.2): the text is split by GPT-2's or GPT-4's pattern (:data:`gptspeed.bpe.PATTERNS`),
each piece's UTF-8 bytes mapped to 256 base tokens, and merges learned up to the vocabulary size;
``<|endoftext|>`` is added after the merges as a special token (the last id, as in GPT-2), the
separator ``prepare`` puts before each document. No normalizer: ids decode to exactly the text.

The documents come from the sources ``prepare`` reads (:func:`gptspeed.data.corpora.resolve_source`:
named corpora, files, folders, globs; ``.txt`` / ``.jsonl[.gz|.zst]`` / ``.parquet``), read one at a
time, until ``max_chars`` characters (the last document cut there). ``TOK_DIR`` is written whole or
not at all: ``tokenizer.json`` and the manifest (:data:`gptspeed.bpe.TOKENIZER_MANIFEST`: vocabulary
size, pattern, each source file's sha256, characters read) go into a temporary folder beside it,
renamed into place once complete.

``compare`` prints bytes per token (UTF-8 bytes of a text over its token count; higher compresses
better) of each tokenizer and GPT-2's on each text file, as nanochat's tokenizer report does.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from gptspeed.bpe import EOT, MAX_VOCAB, PATTERNS, TOKENIZER_JSON, TOKENIZER_MANIFEST, resolve_tokenizer
from gptspeed.errors import GptspeedError
from gptspeed.options import TokenizerTrainOptions

MIN_VOCAB = 256 + 1
"""The 256 byte tokens and ``<|endoftext|>``: a smaller vocabulary cannot encode every text."""
MANIFEST_FORMAT = "gptspeed-tokenizer"


def _sources(sources: list[str], progress: bool) -> list[tuple[Path, str, str, int]]:
    """``(path, name, sha256, bytes)`` of every file of ``sources`` (:func:`resolve_source`), in order."""
    from gptspeed.data.corpora import resolve_source
    from gptspeed.fileio import sha256_file

    if not sources:
        raise GptspeedError("tokenizer train needs at least one SOURCE")
    files = []
    for source in sources:
        paths, names = resolve_source(source, progress=progress)
        try:
            files += [(p, n, sha256_file(p), p.stat().st_size) for p, n in zip(paths, names)]
        except OSError as e:
            raise GptspeedError(f"cannot read {e.filename or source}: {e.strerror or e}") from None
    return files


def _documents(files, text_field: str, skip_bad: bool, max_chars: int, read: dict) -> Iterator[str]:
    """The documents of ``files``, up to ``max_chars`` characters in all (the last one cut); counts
    ``read["chars"]`` and ``read["documents"]``, the bad records skipped in ``read["stats"]``. GptspeedError for a file holding NUL characters
    (binary, not text)."""
    from gptspeed.data.sources import SourceStats, iter_file

    stats = read.setdefault("stats", SourceStats())
    for path, *_ in files:
        for doc in iter_file(path, text_field, stats, skip_bad):
            if "\0" in doc:
                raise GptspeedError(f"{path} holds NUL characters: it is binary, not text; leave it out")
            doc = doc[: max_chars - read["chars"]]
            if doc:
                read["chars"] += len(doc)
                read["documents"] += 1
                if not doc.isspace():
                    read["text"] = True
                yield doc
            if read["chars"] >= max_chars:
                return


def _check_train_arguments(vocab_size: int, pattern: str, max_chars: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise GptspeedError(
            f"--vocab-size must be from {MIN_VOCAB} (the 256 bytes and {EOT}) to {MAX_VOCAB:,} (the most a "
            f"uint32 shard holds), got {vocab_size!r}"
        )
    if pattern not in PATTERNS:
        raise GptspeedError(f"--pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise GptspeedError(f"--max-chars must be a positive integer, got {max_chars!r}")


def _new_tokenizer(pattern: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERNS[pattern]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _check_out(out: Path, force: bool) -> None:
    if os.path.lexists(out):
        if not force:
            raise GptspeedError(f"{out} exists: choose another --out, or pass --force to replace a tokenizer folder")
        if not (out / TOKENIZER_MANIFEST).is_file():
            raise GptspeedError(
                f"{out} is not a tokenizer folder gptspeed wrote (no {TOKENIZER_MANIFEST}): it is never replaced"
            )


def train_tokenizer(
    sources: list[str],
    out: str | os.PathLike,
    *,
    vocab_size: int = TokenizerTrainOptions.vocab_size,
    pattern: str = TokenizerTrainOptions.pattern,
    max_chars: int = TokenizerTrainOptions.max_chars,
    text_field: str = TokenizerTrainOptions.text_field,
    skip_bad: bool = TokenizerTrainOptions.skip_bad,
    force: bool = TokenizerTrainOptions.force,
    progress: bool = True,
) -> dict:
    """Train a byte-level BPE of ``vocab_size`` ids on ``sources`` and write it to ``out`` (how: the
    module docstring).

    Returns:
        The manifest written beside ``tokenizer.json``: format, vocab_size (the ids it has: fewer
        than asked when the text holds fewer distinct pairs), vocab_size_asked, pattern (name and
        regex), eot_token, sources (path, sha256, bytes), max_chars, chars, documents, bad_records,
        tokenizer_sha256, tokenizers_version, gptspeed_version, created.

    Raises:
        GptspeedError: a vocabulary outside [257, 2**32], an unknown pattern, ``max_chars`` < 1, a
            SOURCE naming nothing, an unreadable, non-UTF-8 or binary (NUL-holding) file, a bad record
            (without ``skip_bad``), no text at all, ``out`` existing (without ``force``, or not a
            tokenizer folder), an OSError writing it (nothing is left half-written).
    """
    import importlib.metadata

    import gptspeed

    _check_train_arguments(vocab_size, pattern, max_chars)
    out = Path(out).expanduser()
    _check_out(out, force)
    files = _sources(list(sources), progress)
    from tokenizers import trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = _new_tokenizer(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, initial_alphabet=ByteLevel.alphabet(), show_progress=progress
    )
    read = {"chars": 0, "documents": 0, "text": False}
    docs = _documents(files, text_field, skip_bad, max_chars, read)
    with tqdm(docs, unit="doc", desc="read", disable=None if progress else True) as bar:
        tok.train_from_iterator(bar, trainer)
    if not read["text"]:
        raise GptspeedError(f"no text in {' '.join(sources)} (empty, or only whitespace): give files with some text")
    tok.add_special_tokens([EOT])
    text = tok.to_str()
    import hashlib

    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": 1,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "vocab_size_asked": vocab_size,
        "pattern": {"name": pattern, "regex": PATTERNS[pattern]},
        "eot_token": tok.token_to_id(EOT),
        "sources": [{"path": n, "sha256": d, "bytes": b} for _, n, d, b in files],
        "max_chars": max_chars,
        "chars": read["chars"],
        "documents": read["documents"],
        "bad_records": read["stats"].bad if "stats" in read else 0,
        "tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokenizers_version": importlib.metadata.version("tokenizers"),
        "gptspeed_version": gptspeed.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _write_folder(out, {TOKENIZER_JSON: text, TOKENIZER_MANIFEST: json.dumps(manifest, indent=2) + "\n"})
    return manifest


def _write_folder(out: Path, files: dict[str, str]) -> None:
    """``files`` (name -> text) as the folder ``out``: written into a hidden temporary folder beside
    it, then renamed into place (an old ``out`` moved aside first and removed after)."""
    from gptspeed.fileio import fsync_dir, write_text_atomic

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the tokenizer folder is an ordinary one
    except OSError as e:
        raise GptspeedError(f"cannot write the tokenizer folder {out}: {e.strerror or e}") from None
    old = None
    try:
        for name, text in files.items():
            write_text_atomic(tmp / name, text)
        if os.path.lexists(out):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        raise GptspeedError(
            f"cannot write the tokenizer folder {out}: {e.strerror or e}; nothing was written"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def compare_tokenizers(tokenizers: list[str], text: list[str]) -> list[dict]:
    """Bytes per token of GPT-2's tokenizer and each of ``tokenizers`` (TOK_DIRs or tiktoken names,
    :func:`gptspeed.bpe.resolve_tokenizer`) on each file of ``text`` (UTF-8 text, read whole).

    Returns:
        One row per file: ``{"file", "bytes", "results": {tokenizer: {"tokens", "bytes_per_token"}}}``.

    Raises:
        GptspeedError: no text file, a file that cannot be read or is not UTF-8, a tokenizer that
            cannot be loaded.
    """
    from gptspeed.data.sources import read_txt

    if not text:
        raise GptspeedError("tokenizer compare needs --text FILE (one or more)")
    toks = {name: resolve_tokenizer(name) for name in ["gpt2", *[t for t in tokenizers if t != "gpt2"]]}
    rows = []
    for file in text:
        content = read_txt(Path(file).expanduser())
        n_bytes = len(content.encode("utf-8", "surrogatepass"))
        results = {}
        for name, tok in toks.items():
            n = len(tok.encode(content))
            results[name] = {"tokens": n, "bytes_per_token": n_bytes / n if n else 0.0}
        rows.append({"file": file, "bytes": n_bytes, "results": results})
    return rows


def format_comparison(rows: list[dict]) -> str:
    """A table of :func:`compare_tokenizers`' rows: a line per file, a column per tokenizer (bytes per
    token, and the change against GPT-2's in percent)."""
    names = list(rows[0]["results"]) if rows else []
    head = ["file", "bytes"] + [Path(n).name or n for n in names]
    lines = [head]
    for r in rows:
        base = r["results"]["gpt2"]["bytes_per_token"]
        cells = [r["file"], f"{r['bytes']:,}"]
        for n in names:
            bpt = r["results"][n]["bytes_per_token"]
            cells.append(f"{bpt:.3f}" if n == "gpt2" else f"{bpt:.3f} ({(bpt / base - 1) * 100 if base else 0:+.1f}%)")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
