"""``gptspeed prepare --tokenizer``: what a tokenizer other than GPT-2's changes in a prepared folder.

GPT-2's BPE (``--tokenizer gpt2``, the default) leaves everything as it always was: uint16 shards,
the manifest's ``"tokenizer": "gpt2"``, ``eot_token`` 50256, ``n_vocab`` 50257, and no other field
(a folder prepared before ``--tokenizer`` existed is reused as it is). Any other
(:func:`gptspeed.bpe.resolve_tokenizer`) writes its ids in the shard format its vocabulary fits
(:mod:`gptspeed.data.shards`: GPT-2's uint16 one up to 65,536 ids, llm.c's uint32 one above), puts
its ``<|endoftext|>`` id before each document, and is recorded in the manifest
(:func:`tokenizer_manifest`) and in its settings (``tokenizer_sha256``: a prepare with another
tokenizer into the same folder is refused without ``--force``, and never resumes the other's chunks).
"""

from __future__ import annotations

from gptspeed.bpe import Tokenizer, resolve_tokenizer
from gptspeed.data.shards import FORMATS, SHARD_VERSION, WIDE_VERSION
from gptspeed.errors import GptspeedError


def load_prepare_tokenizer(spec: str) -> Tokenizer | None:
    """None for ``gpt2`` (prepare's own GPT-2 path, unchanged), else the :class:`Tokenizer` ``spec``
    names. GptspeedError: as :func:`gptspeed.bpe.resolve_tokenizer`."""
    if spec == "gpt2":
        return None
    return resolve_tokenizer(spec)


def check_gpt2_only(source: str, spec: str) -> None:
    """GptspeedError unless ``spec`` is ``gpt2`` for a corpus tokenized upstream (``fineweb10B``:
    its shards are GPT-2's ids, linked as they are)."""
    if spec != "gpt2":
        raise GptspeedError(
            f"{source} comes tokenized with GPT-2's BPE (its shards are linked as they are): "
            f"--tokenizer {spec} cannot apply; prepare its text instead, or drop --tokenizer"
        )


def save_data_tokenizer(out, tok: Tokenizer | None) -> None:
    """Copy an HF tokenizer's ``tokenizer.json`` into the prepared folder ``out`` (atomically), so the
    folder carries what a run on it needs (:mod:`gptspeed.run_tokenizer`); nothing for GPT-2's or a
    tiktoken encoding (its name is the tokenizer). OSError as the write raises it."""
    text = getattr(tok, "json_text", None)
    if text is not None:
        from pathlib import Path

        from gptspeed.fileio import write_text_atomic

        write_text_atomic(Path(out) / "tokenizer.json", text)


def tokenizer_manifest(manifest: dict, tok: Tokenizer) -> dict:
    """``manifest`` with the fields of ``tok``: ``tokenizer`` (its name: a tiktoken encoding, or the
    TOK_DIR as given), ``tokenizer_kind`` (``tiktoken`` | ``hf``), ``tokenizer_sha256``
    (:attr:`Tokenizer.sha256`), ``eot_token``, ``n_vocab``, and ``shard_format`` (``magic``,
    ``version``, ``token_bytes`` of its shards)."""
    version = SHARD_VERSION if tok.dtype.itemsize == 2 else WIDE_VERSION
    magic, dtype = FORMATS[version]
    return {
        **manifest,
        **tok.manifest_fields(),
        "shard_format": {"magic": magic, "version": version, "token_bytes": dtype.itemsize},
    }
