"""Documents -> GPT-2 token arrays, in parallel threads, in document order.

Used by ``gptspeed prepare`` (:mod:`gptspeed.data.prepare`) and by streaming training
(:mod:`gptspeed.data.stream`). Each document becomes ``[EOT, *encode_ordinary(text)]`` as uint16
(``<|endoftext|>`` = 50256 *before* each document, as in nanoGPT / llm.c / modded-nanogpt data
scripts). Another tokenizer (``prepare --tokenizer``, ``train --data jsonl:/hf: --tokenizer``: a
:class:`gptspeed.bpe.Tokenizer`) goes through the same threads (:func:`tokenize_stream`), each document
``[its EOT, *its ids]`` in its ``dtype`` (uint32 above 65,536 ids).

Parallelism is threads, as in tiktoken's own ``encode_ordinary_batch``: tiktoken's Rust core
releases the GIL while it splits and merges, and :meth:`tiktoken.Encoding.encode_to_numpy` hands
the ids back as one buffer instead of a Python list of ints, so the part that holds the GIL is a
few percent of the work. No process start-up, no pickling of texts or tokens.

Long documents go to the BPE in pieces of at most :data:`PIECE_CHARS` characters
(:func:`document_pieces`): tiktoken needs 30-90 bytes of memory per character of the text it
is given at once (measured: 2M characters of one repeated letter took 83 MB; a 204 KB gzip that
expands to one 200 MB document took minutes and ~10 GB), so one huge document -- a decompression
bomb, a whole book in a ``.txt`` -- would otherwise cost far more memory than its text. Each cut
falls between a non-whitespace character and a space, tab or newline: every piece of GPT-2's
pre-tokenizing regex is an optional leading space and non-whitespace characters, or whitespace
only, so no piece spans such a place and no match before it looks past it; the tokens are then
exactly those of the whole document. Only a run of more than :data:`PIECE_CHARS` characters
holding no such place (one "word" or one whitespace run that long) is cut inside, where its
tokens may differ from a whole-document encoding; the text itself is kept whole (the tokens
decode to it).

One encoding per thread: tiktoken's pre-tokenizing regex (the Rust ``regex`` crate under
``fancy-regex``) keeps a fast path for the first thread that uses a compiled pattern; any other
thread takes its scratch space from a shared pool. Measured on the 2-core CI machine (Hamlet,
174k characters, min of 15 calls): 18 ms in the pattern's first thread, 23.5 ms in another. A copy built
in each worker thread from the already-parsed merge ranks (~35 ms, once per thread) keeps every
thread on its fast path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import tiktoken

from gptspeed.tokenizer import EOT_TOKEN, new_encoding

BATCH_DOCS = 256
"""Most documents per task handed to a worker thread."""
BATCH_CHARS = 1 << 18
"""Most characters per task (a batch is closed once it reaches this): small enough that the
last task of a small corpus does not leave the other threads idle for long."""

PIECE_CHARS = 1 << 20
"""Most characters of one document handed to the BPE at once (:func:`document_pieces`): about
90 MB of tiktoken's memory at worst, per tokenizing thread."""

_LAST_CUT = re.compile(r"(?s).*\S(?=[ \t\n\r\x0b\x0c])")
"""The last place, in a window, after a non-whitespace character (as ``str.isspace`` sees it: a
subset of the regex's ``\\S``) and before an ASCII whitespace character (``\\s`` for both)."""

_local = threading.local()
_pools: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def default_workers() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity`` where it exists, else
    ``os.cpu_count()``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def thread_encoding() -> tiktoken.Encoding:
    """The calling thread's own GPT-2 encoding (built on its first call in this thread, then
    reused). Equal in every output to :func:`gptspeed.tokenizer.get_encoding`; see the module
    docstring for why each thread has its own."""
    enc = getattr(_local, "encoding", None)
    if enc is None:
        enc = _local.encoding = new_encoding()
    return enc


def document_pieces(text: str, piece_chars: int | None = None, last_cut: re.Pattern = _LAST_CUT) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``piece_chars`` characters (default
    :data:`PIECE_CHARS`) whose encodings, laid end to end, are the encoding of ``text``: each cut
    is the last place in the window between a non-whitespace character and an ASCII whitespace
    one (see the module docstring; ``last_cut``: another tokenizer's safe cut, the window's last match's
    end); a window holding none is cut at its end. ``"".join`` of the pieces is ``text``. A text no
    longer than ``piece_chars`` is one piece."""
    limit = PIECE_CHARS if piece_chars is None else piece_chars
    pos, n = 0, len(text)
    while n - pos > limit:
        m = last_cut.match(text, pos, pos + limit)
        cut = m.end() if m is not None and m.end() > pos else pos + limit
        yield text[pos:cut]
        pos = cut
    yield text[pos:]


def _encode_ordinary(text: str, piece_chars: int | None) -> list[np.ndarray]:
    """``encode_ordinary(text)`` piece by piece (:func:`document_pieces`), in parts laid end to end:
    tiktoken's uint32 ids for a text of one piece, uint16 for each piece of a longer one (2
    bytes a token held while the rest is encoded)."""
    enc = thread_encoding()
    pieces = document_pieces(text, piece_chars)
    first = enc.encode_to_numpy(next(pieces), allowed_special=set(), disallowed_special=())
    rest = [
        enc.encode_to_numpy(piece, allowed_special=set(), disallowed_special=()).astype(np.uint16) for piece in pieces
    ]
    return [first, *rest]


def encode_document(text: str, piece_chars: int | None = None) -> np.ndarray:
    """``[EOT, *encode_ordinary(text)]`` as a uint16 array of shape ``(n_tokens + 1,)``; an empty
    text (or one that encodes to nothing) gives an empty array: it is not a document.

    A literal ``"<|endoftext|>"`` inside the text is encoded as plain text, like
    ``encode_ordinary``, never as :data:`EOT_TOKEN`. Thread-safe.

    Surrogates (``"\\ud800"``: valid in JSON as an escape, and common in scraped web text, where
    a UTF-16 pair was cut in two) cannot be encoded to UTF-8, so they are not text the BPE can
    read. They are handled as tiktoken's own ``encode`` / ``encode_ordinary`` handle them -- what
    the nanoGPT, llm.c and modded-nanogpt data scripts call, so the same documents give the same
    tokens here: a valid pair is joined into its character and a lone surrogate becomes U+FFFD
    (the replacement character, as ``errors="replace"``); the rest of the document is kept. Never
    raises for a ``str``.

    A text longer than ``piece_chars`` (default :data:`PIECE_CHARS`) is encoded in pieces
    (:func:`document_pieces`), so tiktoken's memory is bounded by the piece, not the document;
    the result is the same (see the module docstring for the one exception).
    """
    if not text:
        return np.zeros(0, dtype=np.uint16)
    # allowed_special empty + disallowed_special empty == encode_ordinary (encode_to_numpy: one buffer)
    try:
        parts = _encode_ordinary(text, piece_chars)
    except UnicodeEncodeError:  # surrogates: tiktoken.Encoding.encode's own fix-up (encode_to_numpy lacks it)
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        parts = _encode_ordinary(text, piece_chars)
    n = sum(len(part) for part in parts)
    if not n:
        return np.zeros(0, dtype=np.uint16)
    doc = np.empty(n + 1, dtype=np.uint16)
    doc[0] = EOT_TOKEN
    pos = 1
    for part in parts:  # every GPT-2 id < 50257 < 2**16
        doc[pos : pos + len(part)] = part
        pos += len(part)
    return doc


def encode_documents(texts: Iterable[str]) -> list[np.ndarray]:
    """:func:`encode_document` of each text, in order."""
    return [encode_document(t) for t in texts]


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    # Kept for the life of the process: the threads keep their encodings (and their regex fast
    # paths) from one call to the next; idle threads cost nothing. Keyed by pid too: a forked
    # child inherits the executor but not its threads, and must not wait on them.
    key = (os.getpid(), workers)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix=f"gptspeed-tokenize-{workers}"
            )
        return pool


def tokenize_stream(docs: Iterable[str], workers: int = 1, tokenizer=None) -> Iterator[np.ndarray]:
    """The tokens of each document of ``docs`` (:func:`encode_document`), in document order.
    ``tokenizer``: a :class:`gptspeed.bpe.Tokenizer` other than GPT-2's (its
    :meth:`~gptspeed.bpe.Tokenizer.encode_documents` then encodes each batch, in the worker threads:
    ``[tokenizer.eot, *ids]`` arrays of ``tokenizer.dtype``); None for GPT-2's.

    ``workers`` > 1 encodes batches of documents (up to :data:`BATCH_DOCS` documents /
    :data:`BATCH_CHARS` characters) in that many threads while the caller reads the next
    documents; at most ``4 * workers`` batches, and no more batches once ``8 * workers *
    BATCH_CHARS`` characters are in flight (a batch holding a huge document is waited for before
    the next is read), so memory stays bounded whatever the corpus size. ``workers`` == 1
    encodes in the calling thread. The result does not depend on ``workers``. An exception raised
    while reading ``docs`` or encoding propagates to the caller.
    """
    encode = encode_documents if tokenizer is None else tokenizer.encode_documents
    if workers <= 1 and tokenizer is not None:
        for batch in _batches(docs):
            yield from encode(batch)
        return
    if workers <= 1:
        for text in docs:
            yield encode_document(text)
        return
    pool = _pool(workers)
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    sizes: collections.deque[int] = collections.deque()  # characters of each pending batch
    try:
        for batch in _batches(docs):
            pending.append(pool.submit(encode, batch))
            sizes.append(sum(map(len, batch)))
            while pending and (len(pending) >= 4 * workers or sum(sizes) > 8 * workers * BATCH_CHARS):
                sizes.popleft()
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        for f in pending:  # the consumer stopped early (max_tokens, an error, Ctrl-C)
            f.cancel()
        concurrent.futures.wait(pending)  # and the batches already encoding finish now, not after it returned
