"""GPT-2 byte-level BPE through tiktoken, built offline from OpenAI's original files.

tiktoken's own ``gpt2`` encoding downloads ``encoder.json`` and ``vocab.bpe`` from OpenAI's blob
store on first use. gptspeed ships those two files inside the package instead, xz-compressed
(:data:`BPE_DIR`, 433 KB for 1.5 MB, as the embedded tiny Shakespeare is), and builds the very
same encoding from them after checking the sha256 of what they decompress to (the hashes tiktoken
itself checks), so tokenizing never needs a network nor another package. The construction is
tiktoken's own (``tiktoken.load.data_gym_to_mergeable_bpe_ranks``, as
``tiktoken_ext.openai_public.gpt2`` calls it).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import lzma
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public

from gptspeed.config import GPT2_VOCAB_SIZE
from gptspeed.errors import GptspeedError

EOT_TOKEN = 50256
"""Id of ``<|endoftext|>``, the document separator (and the last id of the vocabulary)."""
N_VOCAB = GPT2_VOCAB_SIZE
"""Number of token ids of GPT-2's tokenizer (0 ... 50256)."""
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
BPE_DIR = Path(__file__).resolve().parent / "gpt2_bpe"
"""Package data: OpenAI's ``encoder.json`` and ``vocab.bpe``, each xz-compressed (``NAME.xz``)."""

_ENDOFTEXT = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def tokenizer_bytes() -> tuple[bytes, bytes]:
    """The contents of ``(encoder.json, vocab.bpe)``: the package's copies, decompressed and checked
    against :data:`ENCODER_JSON_SHA256` / :data:`VOCAB_BPE_SHA256` (once per process).

    Raises:
        GptspeedError: a file is missing, cannot be decompressed, or decompresses to other bytes
            (a broken install); the one-line message names the file.
    """
    out = []
    for name, expected in (("encoder.json", ENCODER_JSON_SHA256), ("vocab.bpe", VOCAB_BPE_SHA256)):
        path = BPE_DIR / f"{name}.xz"
        try:
            data = lzma.decompress(path.read_bytes())
        except (OSError, lzma.LZMAError) as e:
            raise GptspeedError(
                f"GPT-2 tokenizer file {path} cannot be read ({e}): the install is broken, reinstall gptspeed"
            ) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise GptspeedError(
                f"GPT-2 tokenizer file {path} decompresses to sha256 {actual}, expected {expected}: "
                "the install is broken, reinstall gptspeed"
            )
        out.append(data)
    return out[0], out[1]


@functools.lru_cache(maxsize=1)
def tokenizer_files() -> tuple[Path, Path]:
    """Paths of ``(encoder.json, vocab.bpe)``: :func:`tokenizer_bytes` written into a temporary
    folder of this process, removed when it exits. For code that wants files (an export copying
    them); reading the bytes needs no file.

    Raises:
        GptspeedError: as :func:`tokenizer_bytes`.
    """
    encoder_json, vocab_bpe = tokenizer_bytes()
    folder = Path(tempfile.mkdtemp(prefix="gptspeed-gpt2-bpe-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    paths = (folder / "encoder.json", folder / "vocab.bpe")
    paths[0].write_bytes(encoder_json)
    paths[1].write_bytes(vocab_bpe)
    return paths


@functools.lru_cache(maxsize=1)
def _mergeable_ranks() -> dict[bytes, int]:
    encoder_json, vocab_bpe = tokenizer_bytes()
    # tiktoken's builder reads paths: the checked bytes go into a temporary folder for the second
    # it takes. TIKTOKEN_CACHE_DIR="" keeps read_file_cached from copying them into its own cache;
    # the hashes are passed too, so tiktoken re-checks what it actually reads.
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        with tempfile.TemporaryDirectory(prefix="gptspeed-gpt2-bpe-") as tmp:
            (Path(tmp) / "encoder.json").write_bytes(encoder_json)
            (Path(tmp) / "vocab.bpe").write_bytes(vocab_bpe)
            return tiktoken.load.data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=str(Path(tmp) / "vocab.bpe"),
                encoder_json_file=str(Path(tmp) / "encoder.json"),
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
        GptspeedError: the tokenizer files are missing or corrupt (see :func:`tokenizer_bytes`).
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
        GptspeedError: the tokenizer files are missing or corrupt (see :func:`tokenizer_bytes`).
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
