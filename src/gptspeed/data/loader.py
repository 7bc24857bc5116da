"""The training loader: token windows from memory-mapped shards, prefetched, resumable exactly.

Each optimizer micro-step takes a window of ``B*T*world_size`` consecutive tokens from one shard
(in shard order, or in a seeded random order per epoch); rank ``r`` gets the ``r``-th slice of
``B*T`` (+1 token for the shifted targets), so ranks see disjoint data. A shard's tail shorter
than a full global micro-batch is skipped; after the last window the loader starts the next
epoch. With ``align_to_docs`` each row starts at a document start instead (:func:`doc_aligned_rows`).
Background threads prepare batches ahead; the state (:meth:`TokenLoader.state_dict`) counts
consumed batches only, so a resumed run reads exactly the batches it would have read.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from gptspeed.data.doc_rows import aligned_rows
from gptspeed.data.prefetch import Prefetcher
from gptspeed.data.shards import MappedShard, ShardError, read_header, shard_fingerprint
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN

SAMPLING = ("sequential", "random")


def check_token_ids(buf: np.ndarray, max_token_id: int | None, path: Path, offset: int | np.ndarray) -> None:
    """GptspeedError naming the shard and the first bad token if ``buf`` holds an id >= ``max_token_id``
    (it would index past the embedding: a crash deep inside torch on CPU, a device-side assert on
    CUDA). ``buf``: 1-D tokens starting at token ``offset`` of the shard, or 2-D rows ``(B, T+1)``
    with ``offset`` the shard offset of each row's first token (``--align-to-docs``: rows need not
    be adjacent)."""
    if max_token_id is not None and buf.size and int(buf.max()) >= max_token_id:
        where = np.unravel_index(int(np.argmax(buf >= max_token_id)), buf.shape)
        at = offset + where[0] if buf.ndim == 1 else int(offset[where[0]]) + where[1]
        raise GptspeedError(
            f"{path}: token id {int(buf[where])} at token {int(at):,} is not below the vocabulary size "
            f"{max_token_id}: the shard was not made with the GPT-2 tokenizer, or is corrupted"
        )


def doc_aligned_rows(tokens: np.ndarray, seq_len: int, eot: int = EOT_TOKEN) -> np.ndarray:
    """Where the rows of ``seq_len + 1`` tokens (inputs and shifted targets) of a shard holding
    ``tokens`` start when batches are aligned to document starts (``--align-to-docs``): int64 token
    offsets, ascending. The first row starts at the shard's first ``<|endoftext|>`` (id ``eot``: a document
    start: gptspeed's shards put one before each document). After a row ``[p, p + T]``, with ``e = p
    + T`` and ``d`` the first document start at or after ``e`` (the shard's end if none): the next row
    starts at ``d`` when the gap ``d - e`` is shorter than a row -- the tail of a document that began
    inside the row is skipped, so every such row begins with its document -- else at ``e``: a
    document longer than a row goes on in whole rows, nothing of it skipped. Rows that would run past
    the shard's end are left out. The modded-nanogpt speedrun's batches aligned to BOS tokens, for
    fixed-shape rows: no row begins inside a document it has not read from its start."""
    starts = np.flatnonzero(tokens == eot)
    n, rows = len(tokens), []
    pos = int(starts[0]) if len(starts) else n
    while pos + seq_len + 1 <= n:
        rows.append(pos)
        end = pos + seq_len
        k = int(np.searchsorted(starts, end))
        nxt = int(starts[k]) if k < len(starts) else n
        pos = nxt if nxt - end < seq_len else end
    return np.asarray(rows, dtype=np.int64)


def host_tensor(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """Token ids -> an int64 host tensor, in pinned memory when ``device`` is CUDA (so the copy to
    the device can be non-blocking; PyTorch's caching host allocator keeps the pinned block alive
    until the copy is done)."""
    t = torch.from_numpy(buf.astype(np.int64, copy=False))
    return t.pin_memory() if device.type == "cuda" else t


def to_xy(t: torch.Tensor, rows: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host tensor of ``rows * seq_len + 1`` consecutive tokens -> inputs ``x`` and targets ``y``
    (``x`` shifted by one), each ``(rows, seq_len)`` int64 on ``device`` (non-blocking copy)."""
    if device.type != "cpu":
        t = t.to(device, non_blocking=True)
    return t[:-1].view(rows, seq_len), t[1:].view(rows, seq_len)


def rows_to_xy(t: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host tensor of rows ``(B, T + 1)`` -> inputs ``x`` and targets ``y``, each ``(B, T)`` int64 on
    ``device`` (non-blocking copy; made contiguous on the device)."""
    if device.type != "cpu":
        t = t.to(device, non_blocking=True)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def to_device(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 host array -> device tensor (:func:`host_tensor`, then a non-blocking copy)."""
    t = host_tensor(buf, device)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


class TokenLoader:
    """Micro-batches ``(x, y)``, each ``(B, T)`` int64 on ``device``, ``y`` = ``x`` shifted by one.

    The train split is cut into windows of ``B*T*world_size`` consecutive tokens (+1 for the
    targets; a shard's tail shorter than a window is skipped); rank ``r`` gets the ``r``-th
    ``B*T`` slice of each window. ``sampling="sequential"`` reads the windows in shard order;
    ``"random"`` reads each epoch's windows in a permutation drawn from ``(seed, epoch)``. After
    the last window of an epoch the next epoch starts.

    With ``workers >= 1`` that many background threads prepare the next batches ahead (up to
    ``prefetch`` each) into pinned host memory on CUDA; the copy to the device is non-blocking.
    The batches are the same whatever ``workers`` is. The state (:meth:`state_dict`) counts what
    was *consumed* by :meth:`next_batch`, never what was prefetched, so a resume is exact.

    ``align_to_docs``: each row starts where :func:`doc_aligned_rows` says (a document start, or a
    long document's next row), each shard's rows found by one scan of its tokens the first time a
    loader of this ``seq_len`` is built on the folder, and kept in memory (8 bytes a row: ~80 MB for
    10B tokens at T = 1024) and beside the shards (:func:`gptspeed.data.doc_rows.aligned_rows`:
    checked against the shards, so a later start or resume reads them instead of scanning); a
    micro-step takes ``B * world_size`` consecutive rows, rank ``r`` the ``r``-th ``B``.

    Raises GptspeedError if the shards hold fewer tokens than one global micro-batch needs, and
    when a batch holds a token id >= ``max_token_id`` (checked per batch: a max over B*T ids).
    Raises :class:`~gptspeed.data.shards.ShardError` (the trainer saves its last finished step
    first) when a shard, opened at its first batch, is not the one the loader was built on: another
    token count than its header said then, or -- with ``expect``, ``(tokens, fingerprint)`` per
    shard (:func:`gptspeed.data.shards.shard_fingerprint`) -- other tokens (re-prepared or
    replaced under the run).
    Attributes: ``documents`` counts the ``<|endoftext|>`` tokens (id ``eot``, the data's: document starts) in every
    rank's windows so far, i.e. documents seen by the whole job; ``epoch`` completed passes;
    ``wait_s`` seconds :meth:`next_batch` spent waiting for (or, without workers, making) batches.
    """

    def __init__(
        self,
        shards: list[Path],
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        max_token_id: int | None = None,
        sampling: str = "sequential",
        seed: int = 0,
        workers: int = 0,
        prefetch: int = 4,
        expect: list[tuple[int, str]] | None = None,
        align_to_docs: bool = False,
        eot: int = EOT_TOKEN,
    ):
        if sampling not in SAMPLING:
            raise GptspeedError(f"sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
        if workers < 0:
            raise GptspeedError(f"loader workers must be >= 0, got {workers}")
        self.shards = [Path(p) for p in shards]
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.max_token_id = max_token_id
        self.sampling, self.seed = sampling, seed
        self.workers, self.prefetch = workers, max(1, prefetch)
        self.global_tokens = batch_size * seq_len * world_size  # tokens per micro-step, all ranks
        self.lengths = [read_header(p)[1] for p in self.shards]
        self.expect = expect
        self.align_to_docs, self.eot = align_to_docs, eot
        self._maps: dict[int, MappedShard] = {}
        self._lock = threading.Lock()
        if align_to_docs:  # every shard's aligned rows' starts, found once per data folder and kept there
            self._rows = aligned_rows(self.shards, self.lengths, seq_len, self._scan_rows)
            self.batches_per_shard = [len(r) // (batch_size * world_size) for r in self._rows]
        else:
            self.batches_per_shard = [max(0, (n - 1) // self.global_tokens) for n in self.lengths]
        self.batches_per_epoch = sum(self.batches_per_shard)
        self.tokens_per_epoch = self.batches_per_epoch * self.global_tokens
        if self.tokens_per_epoch == 0 and align_to_docs:
            raise GptspeedError(
                f"--align-to-docs: the train split has fewer rows starting at a document start than one "
                f"micro-batch needs (batch_size {batch_size} x world size {world_size} rows of seq_len {seq_len} + 1 "
                "tokens): lower --batch-size / --seq-len, prepare more text, or train without --align-to-docs"
            )
        if self.tokens_per_epoch == 0:
            need = self.global_tokens + 1
            raise GptspeedError(
                f"train split has {max(self.lengths, default=0):,} tokens, fewer than one micro-batch needs "
                f"(batch_size {batch_size} x seq_len {seq_len} x world size {world_size} + 1 = {need:,}): "
                "lower --batch-size / --seq-len or prepare more text"
            )
        self._first_window = np.cumsum([0] + self.batches_per_shard)  # window index of each shard's first
        self._perms: dict[int, np.ndarray] = {}
        self.batches = 0  # micro-batches consumed, all epochs
        self.documents, self.wait_s = 0, 0.0
        self._prefetcher: Prefetcher | None = None

    def _scan_rows(self, s: int) -> np.ndarray:
        """Shard ``s``'s aligned rows' starts, from one scan of its tokens (:func:`doc_aligned_rows`)."""
        return doc_aligned_rows(self._shard(s).window(0, self.lengths[s]), self.T, self.eot)

    # -------------------------------------------------------------- where a batch comes from
    @property
    def epoch(self) -> int:
        return self.batches // self.batches_per_epoch

    def _window(self, g: int) -> tuple[int, int]:
        """(shard index, token offset) of global micro-batch ``g`` (0-based, all epochs); aligned to
        documents, the offset of its first row."""
        s, i = self._window_index(g)
        if self.align_to_docs:
            return s, int(self._rows[s][i * self.B * self.world_size])
        return s, i * self.global_tokens

    def _window_index(self, g: int) -> tuple[int, int]:
        """(shard index, micro-batch index within the shard) of global micro-batch ``g``."""
        epoch, i = divmod(g, self.batches_per_epoch)
        if self.sampling == "random":
            with self._lock:
                perm = self._perms.get(epoch)
                if perm is None:
                    perm = np.random.default_rng([self.seed, epoch]).permutation(self.batches_per_epoch)
                    self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
                    self._perms[epoch] = perm
            i = int(perm[i])
        s = int(np.searchsorted(self._first_window, i, side="right")) - 1
        return s, i - int(self._first_window[s])

    def _shard(self, s: int) -> MappedShard:
        shard = self._maps.get(s)
        if shard is None:
            with self._lock:
                shard = self._maps.get(s)
                if shard is None:
                    shard = self._maps[s] = self._open(s)
        return shard

    def _open(self, s: int) -> MappedShard:
        """Shard ``s`` mapped, checked to be the file the loader was built on (see the class docstring)."""
        shard = MappedShard(self.shards[s])
        changed = None
        if len(shard) != self.lengths[s]:
            changed = f"it held {self.lengths[s]:,} tokens when the run started and holds {len(shard):,} now"
        elif self.expect is not None and shard_fingerprint(shard.path, shard._file) != self.expect[s][1]:
            changed = "its tokens are not those it held when the run started"
        if changed is not None:
            shard.close()
            raise ShardError(
                f"shard {shard.path} changed under the running job ({changed}): it was re-prepared or "
                "replaced; put the run's data back to --resume, or start a new run on the new data"
            )
        return shard

    def _make(self, g: int) -> tuple[torch.Tensor, int]:
        """Host tensor of batch ``g`` (``B*T+1`` int64, or ``(B, T+1)`` rows aligned to documents; pinned
        on CUDA) and its document count. ShardError naming the shard if its file shrank under the run
        (:class:`MappedShard`)."""
        if self.align_to_docs:
            return self._make_aligned(g)
        s, pos = self._window(g)
        window = self._shard(s).window(pos, pos + self.global_tokens + 1)
        docs = int(np.count_nonzero(window[: self.global_tokens] == self.eot))
        start = self.rank * self.B * self.T
        buf = window[start : start + self.B * self.T + 1]
        check_token_ids(buf, self.max_token_id, self.shards[s], pos + start)
        return host_tensor(buf, self.device), docs

    def _make_aligned(self, g: int) -> tuple[torch.Tensor, int]:
        s, i = self._window_index(g)
        shard, B, T = self._shard(s), self.B, self.T
        starts = self._rows[s][i * B * self.world_size : (i + 1) * B * self.world_size]
        rows = [shard.window(p, p + T + 1) for p in starts]  # every rank's, for the job's document count
        docs = sum(int(np.count_nonzero(r[:T] == self.eot)) for r in rows)
        mine = slice(self.rank * B, (self.rank + 1) * B)
        buf = np.stack(rows[mine])
        check_token_ids(buf, self.max_token_id, self.shards[s], starts[mine])
        return host_tensor(buf, self.device), docs

    def batch_at(self, g: int) -> tuple[torch.Tensor, int]:
        """Micro-batch ``g`` (0-based, all epochs) as a host tensor and its document count, as
        :meth:`next_batch` would make it, without consuming it: for a caller that orders batches
        itself (:class:`gptspeed.data.mixture.MixtureLoader`, whose one-row batches are its rows)."""
        return self._make(g)

    # -------------------------------------------------------------- background threads
    def _start(self) -> None:
        """Thread ``k`` makes batches ``first + k``, ``first + k + workers``, ... (round-robin)."""
        first = self.batches
        sources = [map(self._make, itertools.count(first + k, self.workers)) for k in range(self.workers)]
        self._prefetcher = Prefetcher(sources, self.prefetch, "gptspeed-loader")

    def close(self) -> None:
        """Stop the background threads (prefetched batches are dropped; the state is unchanged)."""
        if self._prefetcher is not None:
            self._prefetcher.close(timeout=5)
        self._prefetcher = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch ``(x, y)``: ``(B, T)`` int64 tensors on ``device``."""
        t0 = time.perf_counter()
        if self.workers == 0:
            t, docs = self._make(self.batches)
        else:
            if self._prefetcher is None:
                self._start()
            t, docs = self._prefetcher.get()
        self.batches += 1
        self.documents += docs
        xy = rows_to_xy(t, self.device) if t.dim() == 2 else to_xy(t, self.B, self.T, self.device)
        self.wait_s += time.perf_counter() - t0
        return xy

    def mark(self) -> tuple[int, int]:
        """Where the loader is: ``(batches consumed, documents seen)``, for :meth:`rewind`."""
        return self.batches, self.documents

    def rewind(self, mark: tuple[int, int]) -> None:
        """Go back to ``mark`` (from :meth:`mark`): the batches consumed since are read again."""
        self.close()
        self.batches, self.documents = mark

    def epoch_progress(self) -> float:
        """Fraction of the current epoch consumed, in [0, 1)."""
        return (self.batches % self.batches_per_epoch) / self.batches_per_epoch

    def state_dict(self) -> dict:
        """What has been consumed: plain ints and strings (fits in a checkpoint)."""
        s, pos = self._window(self.batches)
        return {
            "batches": self.batches,
            "shard_index": s,
            "position": pos,
            "epoch": self.epoch,
            "documents": self.documents,
            "shards": [p.name for p in self.shards],
            "global_tokens": self.global_tokens,
            "world_size": self.world_size,
            "sampling": self.sampling,
            "seed": self.seed,
            "align_to_docs": self.align_to_docs,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the last batch consumed when ``state`` was taken.

        A position saved with another world size (same B and T, sequential sampling) is re-sharded
        when it falls on a global micro-batch boundary of this world size: the token stream from
        there on is the same (rank r of W reads what micro-step r of a W-times longer accumulation
        reads), up to the end of the current shard, whose skipped tail depends on the world size.

        Raises GptspeedError if the state was taken with other shards, batch shape, sampling or
        seed, or with another world size at a position that cannot be re-sharded (naming both).
        """
        saved_world = state.get("world_size", state["global_tokens"] // (self.B * self.T) or 1)
        same = (
            state["shards"] == [p.name for p in self.shards]
            and state["global_tokens"] == self.B * self.T * saved_world
            and state.get("sampling", "sequential") == self.sampling
            and (self.sampling == "sequential" or state.get("seed") == self.seed)
            and state.get("align_to_docs", False) == self.align_to_docs
        )
        if saved_world != self.world_size and same:
            s, pos = state["shard_index"], state["position"]
            if (
                self.align_to_docs
                or self.sampling != "sequential"
                or pos % self.global_tokens
                or pos // self.global_tokens >= self.batches_per_shard[s]
            ):
                raise GptspeedError(
                    f"the checkpoint's data position was saved with world size {saved_world} and does not fall on a "
                    f"batch boundary for world size {self.world_size}: resume with {saved_world} process(es)"
                )
            state = {k: v for k, v in state.items() if k != "batches"}  # re-derived from (epoch, shard, position)
        if not same:
            raise GptspeedError(
                "the checkpoint's data position does not fit this data folder or batch shape "
                "(different shards, batch size, sequence length, world size, sampling, seed or --align-to-docs)"
            )
        self.close()
        if "batches" in state:
            self.batches = int(state["batches"])
        else:  # a state from before the batch counter: (epoch, shard, position), sequential
            s, pos = state["shard_index"], state["position"]
            self.batches = (
                state["epoch"] * self.batches_per_epoch + int(self._first_window[s]) + pos // self.global_tokens
            )
        self.documents = state["documents"]


def eval_schedule(
    lengths: list[int], batch_size: int, seq_len: int, max_tokens: int = 0
) -> Iterator[tuple[int, int, int]]:
    """The evaluation batches of shards holding ``lengths`` tokens, all ranks together, in order:
    ``(shard index, first window, rows)`` -- consecutive windows of ``seq_len`` (+1) tokens,
    ``batch_size`` at a time (the last batch of a shard may be smaller), until ``max_tokens``
    predicted tokens (0 = the whole split)."""
    budget = max_tokens if max_tokens > 0 else float("inf")
    for s, n in enumerate(lengths):
        n_windows = (n - 1) // seq_len
        for first in range(0, max(0, n_windows), batch_size):
            if budget <= 0:
                return
            rows = min(batch_size, n_windows - first, max(1, int(min(budget, 1 << 62)) // seq_len))
            budget -= rows * seq_len
            yield s, first, rows


def eval_batches_per_rank(
    shards: list[Path], batch_size: int, seq_len: int, max_tokens: int = 0, world_size: int = 1
) -> int:
    """The most evaluation batches any rank gets from :func:`iter_eval_batches` (batches are dealt
    round-robin), known to every rank without communicating."""
    total = sum(1 for _ in eval_schedule([read_header(p)[1] for p in shards], batch_size, seq_len, max_tokens))
    return -(-total // world_size)


def iter_eval_batches(
    shards: list[Path],
    batch_size: int,
    seq_len: int,
    max_tokens: int = 0,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    max_token_id: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic evaluation batches (:func:`eval_schedule`), dealt round-robin to ranks: this
    rank's ``(x, y)``, each ``(rows, seq_len)`` int64 on ``device``.

    Raises GptspeedError if the split holds fewer than ``seq_len + 1`` tokens.
    """
    device = torch.device(device)
    lengths = [read_header(p)[1] for p in shards]
    if all(n < seq_len + 1 for n in lengths):
        raise GptspeedError(
            f"val split has {max(lengths, default=0):,} tokens, fewer than one sequence (seq_len {seq_len} + 1): "
            "prepare more text, raise --val-fraction or lower --seq-len"
        )
    maps: dict[int, MappedShard] = {}
    for batch_no, (s, first, rows) in enumerate(eval_schedule(lengths, batch_size, seq_len, max_tokens)):
        if batch_no % world_size != rank:
            continue
        if s not in maps:
            maps = {s: MappedShard(shards[s])}  # memory-mapped; one shard open at a time
        buf = maps[s].window(first * seq_len, (first + rows) * seq_len + 1)
        check_token_ids(buf, max_token_id, shards[s], first * seq_len)
        yield to_xy(host_tensor(buf, device), rows, seq_len, device)
