"""Training straight from a ``.jsonl`` file or a Hugging Face dataset, without token shards.

For users without disk for pre-tokenized shards: documents are read as a stream, tokenized in
worker threads (:func:`gptspeed.data.tokenize.tokenize_stream`) with GPT-2's BPE or the
:class:`gptspeed.bpe.Tokenizer` given (``gptspeed train --tokenizer``: a tiktoken encoding, a
``tokenizer train`` folder; ids of a vocabulary over 65,536 kept as uint32), each preceded by that
tokenizer's ``<|endoftext|>``, and packed into consecutive windows of ``B*T*world_size`` (+1) tokens, exactly
as :class:`gptspeed.data.loader.TokenLoader` cuts shards: :class:`StreamWindows`, a PyTorch
``IterableDataset``. :class:`StreamLoader` (what ``gptspeed train --data jsonl:/hf:`` uses) runs it
in a background thread that keeps batches ready.

Resume limits (honest): the state is the number of documents fully consumed and the token offset
into the next one (an offset in that tokenizer's tokens: the state names the tokenizer, and a loader
of another refuses it), so a resume is exact for a source that yields the same documents in the same
order (a local file; a hub dataset whose revision did not change) — but it re-reads (without
tokenizing) every document consumed so far, which takes time proportional to the position. There
are no epochs: when the stream ends, :meth:`StreamLoader.next_batch` raises :class:`StreamError`.

A stream that fails or ends is a :class:`StreamError`, a :class:`gptspeed.data.shards.ShardError`:
the trainer handles it as it handles a bad shard, saving the last finished step before the run
ends with the one line (``Trainer.train_step``). Its causes: the stream ran out before
``--max-steps``; the file is missing, unreadable, corrupt or truncated (a cut ``.gz`` / ``.zst``);
a bad record (streaming training has no ``--skip-bad``: the line names the file and line); or any
other exception the source raised (a dataset's reader, the network), named by its type.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from gptspeed.data.loader import host_tensor, to_xy
from gptspeed.data.prefetch import Prefetcher
from gptspeed.data.shards import ShardError
from gptspeed.data.sources import SourceStats, iter_file, iter_hf
from gptspeed.data.tokenize import tokenize_stream
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN


class StreamError(ShardError):
    """The document stream failed (unreadable, corrupt or truncated input, a bad record, an
    exception of its source) or ended; the message, one line, names the stream. A
    :class:`~gptspeed.data.shards.ShardError`, so the trainer saves the last finished step."""


BAD_RECORD_HINT = (
    "streaming training stops at a bad record: fix or remove it, or prepare shards with `gptspeed prepare --skip-bad`"
)


def iter_stream_documents(
    data: str, text_field: str = "text", split: str = "train", hf_name: str | None = None
) -> Iterator[str]:
    """Documents of ``jsonl:PATH`` (also .jsonl.gz/.zst/.parquet/.txt) or ``hf:NAME``.
    GptspeedError naming the file and line for a bad record (no records are skipped)."""
    if data.startswith("jsonl:"):
        path = Path(data[len("jsonl:") :]).expanduser()
        if not path.is_file():
            raise GptspeedError(f"{path} does not exist: give --data jsonl:PATH of a file")
        return iter_file(path, text_field, SourceStats(hint=BAD_RECORD_HINT))
    if data.startswith("hf:"):
        return iter_hf(
            data[3:], config=hf_name, split=split, text_field=text_field, stats=SourceStats(hint=BAD_RECORD_HINT)
        )
    raise GptspeedError(f"--data {data!r} is not a stream (jsonl:PATH or hf:NAME)")


class _StreamEnd(Exception):
    """Raised by :meth:`StreamLoader._batches` after its last window; :meth:`StreamLoader.next_batch`
    turns it into the StreamError line, counting the batches it consumed (the producer thread runs
    ahead of them)."""


class StreamWindows(torch.utils.data.IterableDataset):
    """Consecutive windows of ``global_tokens + 1`` tokens packed from a document stream, as a
    PyTorch ``IterableDataset`` (the tokens a global batch and its shifted targets need).

    Each item is ``(window, documents, doc_index, doc_offset)``: ``window`` an array of shape
    ``(global_tokens + 1,)`` (its last token is the next window's first), uint16 for GPT-2's BPE, else
    ``tokenizer.dtype`` (uint32 for a vocabulary over 65,536 ids), ``documents`` the documents started
    in its first ``global_tokens`` tokens, and ``(doc_index, doc_offset)`` the position of the next
    window's first token (the resume position). Documents are tokenized in ``workers`` threads
    (:func:`gptspeed.data.tokenize.tokenize_stream`; ``tokenizer``: a :class:`gptspeed.bpe.Tokenizer`,
    None for GPT-2's), each preceded by that tokenizer's ``<|endoftext|>``, and packed with no padding,
    exactly as shards would be. The stream starts at document ``doc_index``, token ``doc_offset``;
    documents before it are read, not tokenized.

    It is one ordered stream: iterate it directly or through ``DataLoader(dataset,
    batch_size=None, num_workers=0 or 1)``; more DataLoader workers would each read the whole
    stream, so they raise GptspeedError.
    """

    def __init__(
        self,
        data: str,
        global_tokens: int,
        *,
        text_field: str = "text",
        split: str = "train",
        hf_name: str | None = None,
        workers: int = 1,
        doc_index: int = 0,
        doc_offset: int = 0,
        tokenizer=None,
    ):
        super().__init__()
        self.data, self.global_tokens, self.workers = data, global_tokens, workers
        self.text_field, self.split, self.hf_name = text_field, split, hf_name
        self.doc_index, self.doc_offset = doc_index, doc_offset
        self.tokenizer = tokenizer
        self.eot = EOT_TOKEN if tokenizer is None else tokenizer.eot

    def __iter__(self) -> Iterator[tuple[np.ndarray, int, int, int]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise GptspeedError(
                "StreamWindows is one ordered stream: use it with DataLoader(num_workers=0 or 1); "
                "it tokenizes in its own threads (workers=N)"
            )
        G = self.global_tokens
        docs = itertools.islice(
            iter_stream_documents(self.data, self.text_field, self.split, self.hf_name), self.doc_index, None
        )
        # tokens not yet emitted: pieces joined once per window, not once per document
        pending: list[np.ndarray] = []
        n_pending = 0
        # positions: (doc index, offset) of each buffered token's document, kept as run-lengths
        runs: list[list[int]] = []  # [doc_index, first offset in buf's doc, count]
        first = True
        for i, doc in enumerate(tokenize_stream(docs, self.workers, self.tokenizer), start=self.doc_index):
            if first:
                doc = doc[self.doc_offset :] if len(doc) else doc
                off0, first = self.doc_offset, False
            else:
                off0 = 0
            if not len(doc):
                continue
            pending.append(doc)
            n_pending += len(doc)
            runs.append([i, off0, len(doc)])
            if n_pending < G + 1:
                continue
            buf = np.concatenate(pending)
            while len(buf) >= G + 1:
                window = buf[: G + 1]
                docs_in = int(np.count_nonzero(window[:G] == self.eot))
                buf = buf[G:]
                left = G  # drop G tokens from the runs
                while left:
                    r = runs[0]
                    take = min(left, r[2])
                    r[1] += take
                    r[2] -= take
                    left -= take
                    if r[2] == 0:
                        runs.pop(0)
                nxt = (runs[0][0], runs[0][1]) if runs else (i + 1, 0)
                yield window, docs_in, nxt[0], nxt[1]
            pending, n_pending = [buf], len(buf)


class StreamLoader:
    """Micro-batches ``(x, y)``, each ``(B, T)`` int64 on ``device``, from a document stream.

    Args:
        data: ``jsonl:PATH`` or ``hf:NAME`` (see :func:`iter_stream_documents`).
        batch_size, seq_len: B and T.
        rank, world_size: this rank reads the ``rank``-th ``B*T`` slice of each global window.
        device: where batches go (non-blocking copies from pinned memory on CUDA).
        workers: tokenizing threads (the batches do not depend on it).
        prefetch: batches kept ready by the background thread.
        tokenizer: a :class:`gptspeed.bpe.Tokenizer` to encode the documents with (None: GPT-2's BPE).

    Attributes: ``documents`` (documents started in consumed windows), ``wait_s`` (seconds
    :meth:`next_batch` waited). State: :meth:`state_dict` (consumed position only).
    """

    def __init__(
        self,
        data: str,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        text_field: str = "text",
        split: str = "train",
        hf_name: str | None = None,
        workers: int = 1,
        prefetch: int = 8,
        tokenizer=None,
    ):
        self.data, self.text_field, self.split, self.hf_name = data, text_field, split, hf_name
        self.tokenizer = tokenizer
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.workers, self.prefetch = workers, prefetch
        self.global_tokens = batch_size * seq_len * world_size
        self.doc_index, self.doc_offset = 0, 0  # first token of the next window
        self.documents, self.batches, self.epoch, self.wait_s = 0, 0, 0, 0.0
        self.tokens_per_epoch = None  # a stream has no known length (and no epochs)
        self._prefetcher: Prefetcher | None = None

    def _batches(self) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """This rank's batches from the consumed position on: ``(host tensor, documents started in
        the window, next document index, token offset in it)``. After the last one :class:`_StreamEnd`;
        StreamError (one line, naming the stream) for anything the stream raised on the way."""
        windows = StreamWindows(
            self.data,
            self.global_tokens,
            text_field=self.text_field,
            split=self.split,
            hf_name=self.hf_name,
            workers=self.workers,
            doc_index=self.doc_index,
            doc_offset=self.doc_offset,
            tokenizer=self.tokenizer,
        )
        start = self.rank * self.B * self.T
        try:
            for window, docs_in, di, do in windows:
                yield host_tensor(window[start : start + self.B * self.T + 1], self.device), docs_in, di, do
        except GptspeedError as e:  # already one line naming the file (and line)
            raise StreamError(f"the stream {self.data} failed: {e}") from None
        except Exception as e:  # a dataset's reader, the network, ...: named, still one line
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise StreamError(f"the stream {self.data} failed: {type(e).__name__}: {first}") from None
        raise _StreamEnd()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch ``(x, y)``, ``(B, T)`` int64 on ``device``.

        Raises:
            StreamError: the stream has ended (saying how many batches and tokens it gave), or it
                failed (a bad record, a corrupt or truncated file, its source raised)."""
        t0 = time.perf_counter()
        if self._prefetcher is None:
            self._prefetcher = Prefetcher([self._batches()], self.prefetch, "gptspeed-stream")
        try:
            t, docs_in, self.doc_index, self.doc_offset = self._prefetcher.get()
        except _StreamEnd:
            self._prefetcher = None  # get() closed it
            tokens = self.batches * self.global_tokens
            raise StreamError(
                f"the stream {self.data} ended after {self.batches:,} batches of {self.B}x{self.T} "
                f"tokens ({tokens:,} tokens in all; streams have no epochs): lower --max-steps or "
                "give more data"
            ) from None
        except Exception:
            self._prefetcher = None  # get() closed it: the next call starts again from the consumed position
            raise
        self.documents += docs_in
        self.batches += 1
        xy = to_xy(t, self.B, self.T, self.device)
        self.wait_s += time.perf_counter() - t0
        return xy

    def close(self) -> None:
        """Stop the background thread (prefetched batches are dropped; the state is unchanged)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._prefetcher = None

    def mark(self) -> tuple[int, int, int, int]:
        """Where the stream is: ``(doc_index, doc_offset, documents, batches)``, for :meth:`rewind`."""
        return self.doc_index, self.doc_offset, self.documents, self.batches

    def rewind(self, mark: tuple[int, int, int, int]) -> None:
        """Go back to ``mark`` (from :meth:`mark`): the batches consumed since are read again."""
        self.close()
        self.doc_index, self.doc_offset, self.documents, self.batches = mark

    def epoch_progress(self) -> float:
        """Always 0.0: a stream has no known length."""
        return 0.0

    def _tokenizer_sha256(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.sha256

    def state_dict(self) -> dict:
        """Consumed position: documents fully consumed and the token offset into the next one; with a
        ``tokenizer``, its sha256 (``tokenizer_sha256``: the offset counts its tokens)."""
        tokenizer = {} if self.tokenizer is None else {"tokenizer_sha256": self._tokenizer_sha256()}
        return {
            "stream": self.data,
            "doc_index": self.doc_index,
            "doc_offset": self.doc_offset,
            "documents": self.documents,
            "batches": self.batches,
            "global_tokens": self.global_tokens,
            **tokenizer,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the last consumed batch (re-reads the consumed documents, see module doc).

        Raises GptspeedError if the state is from another stream, batch shape or tokenizer."""
        if state.get("stream") != self.data or state.get("global_tokens") != self.global_tokens:
            raise GptspeedError("the checkpoint's data position does not fit this stream or batch shape")
        if state.get("tokenizer_sha256") != self._tokenizer_sha256():
            raise GptspeedError(
                "the checkpoint's data position counts the tokens of another tokenizer than this stream's: "
                "resume with the run's --tokenizer"
            )
        self.close()
        self.doc_index, self.doc_offset = state["doc_index"], state["doc_offset"]
        self.documents, self.batches = state["documents"], state["batches"]
