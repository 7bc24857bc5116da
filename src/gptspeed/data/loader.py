"""The training loader: consecutive token windows from memory-mapped shards, resumable exactly.

Each optimizer micro-step takes ``B*T*world_size`` consecutive tokens from the current shard;
rank ``r`` gets the ``r``-th slice of ``B*T`` (+1 token for the shifted targets), so ranks see
disjoint data. A shard's tail shorter than a full global micro-batch is skipped; after the last
shard the loader wraps to the first and counts an epoch. Its whole state is four integers
(:meth:`TokenLoader.state_dict`), so a resumed run reads exactly the batches it would have read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from gptspeed.data.shards import read_header, read_shard
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN


def check_token_ids(buf: np.ndarray, max_token_id: int | None, path: Path, offset: int) -> None:
    """GptspeedError naming the shard if ``buf`` holds an id >= ``max_token_id`` (it would index
    past the embedding: a crash deep inside torch on CPU, a device-side assert on CUDA)."""
    if max_token_id is not None and buf.size and int(buf.max()) >= max_token_id:
        bad = int(np.argmax(buf >= max_token_id))
        raise GptspeedError(
            f"{path}: token id {int(buf[bad])} at token {offset + bad:,} is not below the vocabulary size "
            f"{max_token_id}: the shard was not made with the GPT-2 tokenizer, or is corrupted"
        )


def to_device(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 host array -> device tensor; on CUDA through pinned memory with a non-blocking copy
    (PyTorch's caching host allocator keeps the pinned block alive until the copy is done)."""
    t = torch.from_numpy(buf)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class TokenLoader:
    """Micro-batches ``(x, y)``, each ``(B, T)`` int64 on ``device``, ``y`` = ``x`` shifted by one.

    Raises GptspeedError if the shards hold fewer tokens than one global micro-batch needs, and
    when a batch holds a token id >= ``max_token_id`` (checked per batch: a max over B*T ids).
    Attributes: ``documents`` counts the ``<|endoftext|>`` tokens (document starts) in every
    rank's windows so far, i.e. documents seen by the whole job; ``epoch`` completed passes.
    """

    def __init__(self, shards: list[Path], batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, device: torch.device | str = "cpu", max_token_id: int | None = None):
        self.shards = [Path(p) for p in shards]
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.max_token_id = max_token_id
        self.global_tokens = batch_size * seq_len * world_size  # tokens per micro-step, all ranks
        self.lengths = [read_header(p)[1] for p in self.shards]
        self.batches_per_shard = [max(0, (n - 1) // self.global_tokens) for n in self.lengths]
        self.tokens_per_epoch = sum(self.batches_per_shard) * self.global_tokens
        if self.tokens_per_epoch == 0:
            need = self.global_tokens + 1
            raise GptspeedError(
                f"train split has {max(self.lengths, default=0):,} tokens, fewer than one micro-batch needs "
                f"(batch_size {batch_size} x seq_len {seq_len} x world size {world_size} + 1 = {need:,}): "
                "lower --batch-size / --seq-len or prepare more text"
            )
        self.shard_index = 0
        self.position = 0  # token offset of the next global micro-batch in the current shard
        self.epoch = 0
        self.documents = 0
        self._tokens: np.ndarray | None = None
        self._skip_empty_shards()

    def _skip_empty_shards(self) -> None:
        while self.batches_per_shard[self.shard_index] == 0:
            self._next_shard()

    def _next_shard(self) -> None:
        self.shard_index += 1
        self.position = 0
        self._tokens = None
        if self.shard_index == len(self.shards):
            self.shard_index = 0
            self.epoch += 1

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = read_shard(self.shards[self.shard_index])
        tokens = self._tokens
        pos = self.position
        self.documents += int(np.count_nonzero(tokens[pos : pos + self.global_tokens] == EOT_TOKEN))
        start = pos + self.rank * self.B * self.T
        buf = tokens[start : start + self.B * self.T + 1].astype(np.int64)
        check_token_ids(buf, self.max_token_id, self.shards[self.shard_index], start)
        self.position += self.global_tokens
        if (self.position // self.global_tokens) >= self.batches_per_shard[self.shard_index]:
            self._next_shard()
            self._skip_empty_shards()
        t = to_device(buf, self.device)
        return t[:-1].view(self.B, self.T), t[1:].view(self.B, self.T)

    def epoch_progress(self) -> float:
        """Fraction of the current epoch consumed, in [0, 1)."""
        done = sum(self.batches_per_shard[: self.shard_index]) * self.global_tokens + self.position
        return done / self.tokens_per_epoch

    def state_dict(self) -> dict:
        return {"shard_index": self.shard_index, "position": self.position, "epoch": self.epoch,
                "documents": self.documents, "shards": [p.name for p in self.shards],
                "global_tokens": self.global_tokens, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; GptspeedError if it was saved for other shards or batch shape.

        A position saved with another world size (same B and T) is re-sharded when it falls on a
        global micro-batch boundary of this world size: the token stream from there on is the
        same (rank r of W reads what micro-step r of a W-times longer accumulation reads), up to
        the end of the current shard, whose skipped tail depends on the world size. Otherwise
        GptspeedError naming both world sizes."""
        saved_world = state.get("world_size", state["global_tokens"] // (self.B * self.T) or 1)
        if saved_world != self.world_size:
            if (state["shards"] != [p.name for p in self.shards] or state["global_tokens"] != self.B * self.T * saved_world
                    or state["position"] % self.global_tokens
                    or state["position"] // self.global_tokens >= self.batches_per_shard[state["shard_index"]]):
                raise GptspeedError(
                    f"the checkpoint's data position was saved with world size {saved_world} and does not fall on a "
                    f"batch boundary for world size {self.world_size}: resume with {saved_world} process(es)")
            state = {**state, "global_tokens": self.global_tokens}
        if state["shards"] != [p.name for p in self.shards] or state["global_tokens"] != self.global_tokens:
            raise GptspeedError(
                "the checkpoint's data position does not fit this data folder or batch shape "
                "(different shards, batch size, sequence length or world size)"
            )
        self.shard_index, self.position = state["shard_index"], state["position"]
        self.epoch, self.documents = state["epoch"], state["documents"]
        self._tokens = None


def iter_eval_batches(shards: list[Path], batch_size: int, seq_len: int, max_tokens: int = 0, *,
                      rank: int = 0, world_size: int = 1,
                      device: torch.device | str = "cpu",
                      max_token_id: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic evaluation batches: consecutive windows of ``T`` (+1) tokens over the shards,
    grouped ``batch_size`` at a time (the last batch may be smaller), batches dealt round-robin to
    ranks. Stops after ``max_tokens`` predicted tokens in all (0 = the whole split).

    Raises GptspeedError if the split holds fewer than ``seq_len + 1`` tokens.
    """
    device = torch.device(device)
    lengths = [read_header(p)[1] for p in shards]
    if all(n < seq_len + 1 for n in lengths):
        raise GptspeedError(
            f"val split has {max(lengths, default=0):,} tokens, fewer than one sequence (seq_len {seq_len} + 1): "
            "prepare more text, raise --val-fraction or lower --seq-len"
        )
    budget = max_tokens if max_tokens > 0 else float("inf")
    batch_no = 0
    for path, n in zip(shards, lengths):
        n_windows = (n - 1) // seq_len
        if n_windows == 0:
            continue
        tokens = read_shard(path)
        for first in range(0, n_windows, batch_size):
            if budget <= 0:
                return
            rows = min(batch_size, n_windows - first, max(1, int(min(budget, 1 << 62)) // seq_len))
            budget -= rows * seq_len
            mine = batch_no % world_size == rank
            batch_no += 1
            if not mine:
                continue
            buf = tokens[first * seq_len : (first + rows) * seq_len + 1].astype(np.int64)
            check_token_ids(buf, max_token_id, path, first * seq_len)
            t = to_device(buf, device)
            yield t[:-1].view(rows, seq_len), t[1:].view(rows, seq_len)
