"""The tokenizer a prepare (and later a run) uses: GPT-2's (the default), a tiktoken encoding, or a
byte-level BPE folder written by ``gptspeed tokenizer train`` (:mod:`gptspeed.bpe_train`).

``--tokenizer`` names one of three things (:func:`resolve_tokenizer`):

- ``gpt2``: GPT-2's BPE, built offline from the files shipped with the package
  (:mod:`gptspeed.tokenizer`); 50,257 ids, ``<|endoftext|>`` = 50256.
- a tiktoken encoding name (``cl100k_base``, ``o200k_base``, ...: ``tiktoken.list_encoding_names()``),
  loaded by tiktoken (which downloads its file once into its cache); its ``<|endoftext|>`` separates
  documents.
- TOK_DIR, a folder holding a Hugging Face ``tokenizer.json`` (the format of the ``tokenizers``
  library, which transformers' ``PreTrainedTokenizerFast`` loads) and, when gptspeed trained it, its
  manifest :data:`TOKENIZER_MANIFEST`. The file is read as input gptspeed did not write: at most
  :data:`MAX_TOKENIZER_JSON_BYTES`, JSON nested at most :data:`MAX_JSON_DEPTH` deep, a byte-level BPE
  model, a ``Split`` pre-tokenizer whose pattern is one of :data:`PATTERNS` (a pattern of its own could
  backtrack without bound on a hostile text), and ``<|endoftext|>`` a special token.

Each is a :class:`Tokenizer`: ``encode`` / ``decode`` (text <-> ids, exact for any UTF-8 text: a
byte-level BPE has a token for every byte), ``encode_documents`` (``[EOT, *ids]`` arrays for
``prepare``'s threads), ``n_vocab``, ``eot`` and ``sha256`` (what a prepared folder's manifest
records). A vocabulary of at most 65,536 ids is written as GPT-2's uint16 shards, a larger one as
llm.c's uint32 shards (:mod:`gptspeed.data.shards`).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from gptspeed.data.tokenize import document_pieces as cut_pieces
from gptspeed.errors import GptspeedError

EOT = "<|endoftext|>"
"""The document separator, a special token of every tokenizer here."""
PATTERNS = {
    # GPT-2's pre-tokenizing split (tiktoken's r50k_pat_str)
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    # GPT-4's (tiktoken's cl100k_base), as nanochat and most new trainers use it
    "gpt4": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""",
}
"""The split patterns ``tokenizer train --pattern`` offers, and the only ones a TOK_DIR may use."""
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MANIFEST = "gptspeed-tokenizer.json"
MAX_TOKENIZER_JSON_BYTES = 256 << 20
"""A ``tokenizer.json`` larger than this is refused (a 200k-token vocabulary takes about 10 MB)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of a ``tokenizer.json`` accepted (a real one is about 6 deep)."""
MAX_VOCAB = 2**32
"""Most ids a vocabulary may have: llm.c's uint32 shards hold ids below 2**32."""
UINT16_VOCAB = 65_536
"""Most ids GPT-2's uint16 shard format holds; a larger vocabulary is written as uint32 shards."""
PIECE_CHARS = 1 << 20
"""Most characters of a document handed to the BPE at once (as :data:`gptspeed.data.tokenize.PIECE_CHARS`)."""

_LAST_CUT = re.compile(r"(?s).*[^\W_](?= )")
"""The last place in a window after a letter or digit and before a space: a token of either pattern
of :data:`PATTERNS` never spans it (a run of letters or digits ends there, and nothing matching a
space holds a letter or digit), so the pieces encode as the whole text does."""


class Tokenizer:
    """A loaded tokenizer: ``name`` (``gpt2``, a tiktoken name, or TOK_DIR's path), ``kind``
    (``gpt2`` | ``tiktoken`` | ``hf``), ``n_vocab`` (ids 0 ... n_vocab-1), ``eot`` (the id of
    ``<|endoftext|>``) and ``sha256`` (of ``tokenizer.json``; for tiktoken's, of its merge ranks and
    specials)."""

    name: str
    kind: str
    n_vocab: int
    eot: int
    sha256: str

    @property
    def dtype(self) -> np.dtype:
        """The shards' token dtype: ``<u2`` for at most 65,536 ids, else ``<u4``."""
        return np.dtype("<u2") if self.n_vocab <= UINT16_VOCAB else np.dtype("<u4")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, a literal ``<|endoftext|>`` in it encoded as plain text."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (invalid UTF-8, a sequence cut inside a character, becomes U+FFFD)."""
        raise NotImplementedError

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        return [self.encode(p) for p in pieces]

    def encode_documents(self, texts: list[str], piece_chars: int = PIECE_CHARS) -> list[np.ndarray]:
        """``[eot, *encode(text)]`` of each text as a :attr:`dtype` array (empty for a text that
        encodes to nothing: it is not a document). Texts longer than ``piece_chars`` go in pieces
        (:func:`document_pieces`), to the same ids."""
        pieces = [list(document_pieces(t, piece_chars)) if t else [] for t in texts]
        flat = self._encode_pieces([p for ps in pieces for p in ps])
        out, k = [], 0
        for ps in pieces:
            ids = [i for part in flat[k : k + len(ps)] for i in part]
            k += len(ps)
            out.append(np.array([self.eot, *ids], dtype=self.dtype) if ids else np.zeros(0, dtype=self.dtype))
        return out

    def manifest_fields(self) -> dict:
        """What a manifest says of this tokenizer, as ``prepare --tokenizer`` writes it and
        :func:`gptspeed.run_tokenizer.manifest_tokenizer` reads it: ``tokenizer`` (its name: the
        encoding's, or the TOK_DIR, where its ``tokenizer.json`` is), ``tokenizer_kind``,
        ``tokenizer_sha256``, ``eot_token``, ``n_vocab``."""
        return {
            "tokenizer": self.name,
            "tokenizer_kind": self.kind,
            "tokenizer_sha256": self.sha256,
            "eot_token": self.eot,
            "n_vocab": self.n_vocab,
        }


def document_pieces(text: str, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``piece_chars`` characters, each cut at the last
    letter-or-digit-then-space in its window (:data:`_LAST_CUT`: the pieces' tokens are the whole
    text's), a window without one cut at its end; ``"".join`` of them is ``text``
    (:func:`gptspeed.data.tokenize.document_pieces` with this cut)."""
    return cut_pieces(text, piece_chars, _LAST_CUT)


def _no_surrogates(text: str) -> str:
    """``text`` with a valid surrogate pair joined and a lone surrogate made U+FFFD (tiktoken's fix-up)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class TiktokenTokenizer(Tokenizer):
    """GPT-2's embedded BPE (``kind`` ``gpt2``) or a named tiktoken encoding (``tiktoken``)."""

    def __init__(self, name: str, encoding, kind: str, sha256: str):
        self.name, self.kind, self.encoding, self.sha256 = name, kind, encoding, sha256
        self.n_vocab = int(encoding.n_vocab)
        try:
            self.eot = int(encoding.eot_token)
        except (KeyError, AttributeError):
            raise GptspeedError(f"tiktoken encoding {name} has no {EOT} token to separate documents") from None

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` of Hugging Face ``tokenizers`` (``kind`` ``hf``), its special tokens
    encoded as plain text when they occur in a document (``encode_special_tokens``)."""

    def __init__(self, name: str, tok, sha256: str):
        self.name, self.kind, self.tok, self.sha256 = name, "hf", tok, sha256
        self.tok.encode_special_tokens = True
        self.n_vocab = int(tok.get_vocab_size(with_added_tokens=True))
        self.eot = int(tok.token_to_id(EOT))

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        try:
            encodings = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        except Exception:  # a surrogate: not UTF-8, which Rust's strings must be
            encodings = self.tok.encode_batch_fast([_no_surrogates(p) for p in pieces], add_special_tokens=False)
        return [e.ids for e in encodings]

    def encode(self, text: str) -> list[int]:
        return self._encode_pieces([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _json_depth_ok(value, limit: int) -> bool:
    """True if ``value`` (parsed JSON) nests at most ``limit`` lists/objects deep (iterative)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _check_tokenizer_json(path: Path, spec: dict) -> None:
    """GptspeedError unless ``spec`` (``path``'s parsed JSON) is a byte-level BPE gptspeed reads."""
    bad = f"{path} is not a byte-level BPE tokenizer gptspeed reads"
    if not _json_depth_ok(spec, MAX_JSON_DEPTH):
        raise GptspeedError(f"{path} is nested more than {MAX_JSON_DEPTH} deep: not a tokenizer.json")
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise GptspeedError(f"{bad}: its model is not BPE")
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    kinds = [p.get("type") for p in parts if isinstance(p, dict)]
    splits = [p for p in parts if isinstance(p, dict) and p.get("type") == "Split"]
    pattern = splits[0].get("pattern", {}) if len(splits) == 1 else {}
    if "ByteLevel" not in kinds or not isinstance(pattern, dict) or pattern.get("Regex") not in PATTERNS.values():
        raise GptspeedError(
            f"{bad}: its pre-tokenizer must split with GPT-2's or GPT-4's pattern, then map bytes (ByteLevel), "
            "as `gptspeed tokenizer train` writes it (another pattern may backtrack without bound)"
        )
    if spec.get("normalizer") is not None:
        raise GptspeedError(f"{bad}: it normalizes text (its ids would not decode to the text they came from)")
    special = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")]
    if EOT not in [t.get("content") for t in special]:
        raise GptspeedError(f"{bad}: it has no special token {EOT} to separate documents")


def load_tokenizer_dir(folder: str | Path) -> HFTokenizer:
    """The :class:`HFTokenizer` of TOK_DIR ``folder`` (checks: the module docstring).

    Raises:
        GptspeedError: ``folder`` is not a folder or holds no ``tokenizer.json``; the file is too
            large, not UTF-8 JSON, nested too deeply, not a byte-level BPE with a known pattern and
            ``<|endoftext|>``, has more than :data:`MAX_VOCAB` ids, or ``tokenizers`` rejects it.
    """
    from gptspeed.fileio import parse_json, read_user_text

    folder = Path(folder).expanduser()
    path = folder / TOKENIZER_JSON
    if not folder.is_dir() or not path.exists():
        raise GptspeedError(
            f"{folder} is not a tokenizer folder (no {TOKENIZER_JSON}): train one with `gptspeed tokenizer train`"
        )
    text = read_user_text(path, "tokenizer file", max_bytes=MAX_TOKENIZER_JSON_BYTES)
    spec = parse_json(text, f"tokenizer file {path}")
    _check_tokenizer_json(path, spec)
    try:
        from tokenizers import Tokenizer as HFTok
    except ImportError:
        raise GptspeedError("a tokenizer folder needs the tokenizers library: pip install tokenizers") from None
    try:
        tok = HFTok.from_str(text)
    except Exception as e:
        raise GptspeedError(f"{path} is not a tokenizer the tokenizers library reads: {str(e)[:200]}") from None
    result = HFTokenizer(str(folder), tok, hashlib.sha256(text.encode()).hexdigest())
    result.json_text = text  # what a prepared folder, a run folder and an export copy
    if result.n_vocab > MAX_VOCAB:
        raise GptspeedError(f"{path} has {result.n_vocab:,} ids, more than the {MAX_VOCAB:,} a uint32 shard holds")
    return result


def _tiktoken_sha256(encoding) -> str:
    """sha256 of an encoding's pattern, special tokens and merge ranks (in rank order)."""
    h = hashlib.sha256(encoding._pat_str.encode())
    h.update(repr(sorted(encoding._special_tokens.items())).encode())
    for token, rank in sorted(encoding._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(b"%d:%d:" % (rank, len(token)) + token)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _resolve_cached(spec: str) -> Tokenizer:
    import tiktoken

    from gptspeed import tokenizer as gpt2

    if spec == "gpt2":
        sha = hashlib.sha256((gpt2.ENCODER_JSON_SHA256 + gpt2.VOCAB_BPE_SHA256).encode()).hexdigest()
        return TiktokenTokenizer("gpt2", gpt2.get_encoding(), "gpt2", sha)
    if spec in tiktoken.list_encoding_names():
        try:
            enc = tiktoken.get_encoding(spec)
        except Exception as e:
            raise GptspeedError(
                f"cannot load tiktoken encoding {spec} (it is downloaded once): {str(e)[:200]}"
            ) from None
        return TiktokenTokenizer(spec, enc, "tiktoken", _tiktoken_sha256(enc))
    if Path(spec).expanduser().exists():
        return load_tokenizer_dir(spec)
    raise GptspeedError(
        f"--tokenizer {spec!r} names nothing known: give gpt2, a tiktoken encoding "
        f"({', '.join(sorted(tiktoken.list_encoding_names()))}), or a folder written by `gptspeed tokenizer train`"
    )


def resolve_tokenizer(spec: str | Tokenizer) -> Tokenizer:
    """The :class:`Tokenizer` ``spec`` names (the module docstring); a Tokenizer is returned as it is.
    A TOK_DIR is read again at each call (it may have been retrained); the others are cached.

    Raises:
        GptspeedError: ``spec`` names nothing known, or what it names cannot be loaded (see
            :func:`load_tokenizer_dir`).
    """
    if isinstance(spec, Tokenizer):
        return spec
    if not isinstance(spec, str) or not spec:
        raise GptspeedError(f"--tokenizer must name a tokenizer, got {spec!r}")
    import tiktoken

    if spec == "gpt2" or spec in tiktoken.list_encoding_names():
        return _resolve_cached(spec)
    return _resolve_cached.__wrapped__(spec)
