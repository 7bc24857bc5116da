"""Weighted mixtures of prepared folders: ``--data A=0.7,B=0.3`` or ``--data mix.yaml`` -- the
parsing (:func:`parse_mixture`) and the sampler (:func:`blend`, :class:`MixtureLoader`).

A mixture trains one model on several prepared folders that share one tokenizer, each source
drawn in proportion to its weight, and evaluates each source's val split apart as well as mixed
(:mod:`gptspeed.eval.during`). The folders are found, locked and checked as one folder is, by
:func:`gptspeed.data.train_data.find_mixture` (a :class:`~gptspeed.data.train_data.MixtureData`).

**Granularity: one sequence (a micro-batch row of ``seq_len + 1`` tokens).** The job's rows are
numbered across steps, ranks and micro-steps (global micro-batch ``g`` holds rows
``g*B*W ... (g+1)*B*W - 1``, rank ``r`` the ``r``-th ``B`` of them, so ranks never share a row);
row ``n`` goes to the source furthest behind its share of the first ``n + 1`` rows, ``w_d * (n + 1)
- count_d`` (the lowest index on a tie). This is the deterministic blending of Megatron-LM's
``BlendedDataset`` (its ``build_blending_indices``); torchtitan's interleaved loader (PR #3063) mixes
at the same granularity but draws each sequence's source at random. The deterministic choice keeps
every prefix of the row stream within 2 rows of each source's share (not just on average), so every
micro-batch of every rank holds each source's share within 4 rows; and the position a resume needs
is only how many rows each source gave. Inside a source the rows are those of a
:class:`~gptspeed.data.loader.TokenLoader` of one row a batch (``--sampling``, ``--seed``,
``--align-to-docs`` as for one folder), each source passing through its epochs on its own. The seed
orders a source's rows (``--sampling random``); the interleaving needs none.

Bad input is one line (:class:`~gptspeed.errors.GptspeedError`): a weight that is not a
non-negative finite number, weights summing to zero, a source given twice (or two sources of one
name), a source that is a stream or has no val split, sources prepared with different tokenizers.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptspeed.data.sources import is_stream_source
from gptspeed.errors import GptspeedError, show_value

if TYPE_CHECKING:
    import torch

    from gptspeed.data.prefetch import Prefetcher

MIXTURE_FILE_SUFFIXES = (".yaml", ".yml", ".json")
_NAME = re.compile(r"[\w.-]{1,64}")
_FILE_KEYS = {"path", "weight", "name"}


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture as given: ``name`` (its key in metrics.jsonl), ``path`` (a prepared
    folder, ``~`` expanded) and ``weight`` (a non-negative finite float, as given: not normalised)."""

    name: str
    path: str
    weight: float


def is_mixture(spec: str) -> bool:
    """Whether ``--data spec`` names a mixture: not a stream, not an existing folder (a folder
    stays one folder, whatever its name holds), and either a ``.yaml`` / ``.yml`` / ``.json`` file
    name or an inline list holding ``=`` (``A=0.7,B=0.3``)."""
    if not spec or is_stream_source(spec) or os.path.isdir(os.path.expanduser(spec)):
        return False
    return spec.lower().endswith(MIXTURE_FILE_SUFFIXES) or "=" in spec


def parse_mixture(spec: str) -> list[SourceSpec]:
    """The sources of mixture ``spec``: an inline ``PATH=WEIGHT,PATH=WEIGHT`` list (each split at
    its last ``=``; a path holding a comma needs the file form) or a mixture file, YAML or JSON::

        sources:
          - {path: web, weight: 0.7}
          - {path: code, weight: 0.3, name: code}

    whose relative paths are relative to the file's folder. A source's name is ``name`` or its
    folder's name. GptspeedError (one line) for a weight that does not parse, is negative or not
    finite, weights that sum to zero, a source that is a stream or no folder, a folder given
    twice, two sources of one name, a name that is not 1-64 letters, digits, ``_``, ``.`` or ``-``,
    or a file that is not such a list."""
    if spec.lower().endswith(MIXTURE_FILE_SUFFIXES):
        sources = _read_file(Path(os.path.expanduser(spec)))
    else:
        sources = [_inline_source(part, spec) for part in spec.split(",")]
    return _checked(sources)


def _inline_source(part: str, spec: str) -> SourceSpec:
    path, eq, weight = part.strip().rpartition("=")
    if not eq or not path.strip():
        raise GptspeedError(
            f"--data {spec!r}: {part.strip()!r} is not PATH=WEIGHT: a mixture is a comma-separated list of "
            "prepared folders with their weights (A=0.7,B=0.3), or a mixture file (mix.yaml)"
        )
    path = os.path.expanduser(path.strip())
    return SourceSpec(_default_name(path), path, _weight(weight.strip(), path))


def _default_name(path: str) -> str:
    return Path(os.path.abspath(path)).name


def _weight(value: Any, path: str) -> float:
    """``value`` as a weight: a non-negative finite number; GptspeedError naming the source otherwise."""
    try:
        w = float(value) if not isinstance(value, bool) and isinstance(value, (int, float, str)) else None
    except ValueError:
        w = None
    if w is None or not math.isfinite(w):
        raise GptspeedError(
            f"mixture weight of {path} is {show_value(value)}, not a number: give each source a weight such as 0.7"
        )
    if w < 0:
        raise GptspeedError(f"mixture weight of {path} is {show_value(value)}: weights must be 0 or more")
    return w


def _read_file(path: Path) -> list[SourceSpec]:
    from gptspeed.configio import read_config_file

    if not path.exists():
        raise GptspeedError(
            f"mixture file {path} does not exist: give --data a prepared folder, a mixture file or A=0.7,B=0.3"
        )
    doc = read_config_file(path)  # one line for a file that cannot be read or parsed, or is not a mapping
    items = doc.get("sources")
    if set(doc) != {"sources"} or not isinstance(items, list) or not items:
        raise GptspeedError(
            f"mixture file {path} must hold only 'sources': a list of "
            "{path: FOLDER, weight: W, name: NAME (optional)}"
        )
    sources = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict) or not {"path", "weight"} <= set(item) <= _FILE_KEYS:
            raise GptspeedError(
                f"mixture file {path}: source {i} must be a mapping of path and weight (and optionally name), "
                f"got {show_value(item)}"[:300]
            )
        where = os.path.expanduser(str(item["path"]))
        where = str(path.parent / where) if not os.path.isabs(where) else where
        name = item.get("name", _default_name(where))
        sources.append(SourceSpec(str(name), where, _weight(item["weight"], where)))
    return sources


def _checked(sources: list[SourceSpec]) -> list[SourceSpec]:
    if sum(s.weight for s in sources) <= 0:
        raise GptspeedError("mixture weights sum to 0: give at least one source a weight above 0")
    seen: dict[str, SourceSpec] = {}
    names: dict[str, SourceSpec] = {}
    for s in sources:
        if is_stream_source(s.path) or not os.path.isdir(s.path):
            what = "a stream" if is_stream_source(s.path) else "not a prepared folder"
            raise GptspeedError(
                f"mixture source {s.path} is {what}: a mixture's sources are folders made by `gptspeed prepare`"
            )
        real = os.path.realpath(s.path)
        if real in seen:
            raise GptspeedError(
                f"mixture source {s.path} is given twice (as {seen[real].path} too): give each folder once"
            )
        if s.name in names:
            raise GptspeedError(
                f"mixture sources {names[s.name].path} and {s.path} are both named {s.name!r}: "
                "name them in a mixture file (name: ...)"
            )
        if not _NAME.fullmatch(s.name):
            raise GptspeedError(
                f"mixture source {s.path}: its name {s.name!r} is not 1-64 letters, digits, '_', '.' or '-': "
                "give it such a name (name: ... in a mixture file)"[:300]
            )
        seen[real], names[s.name] = s, s
    return sources


# ---------------------------------------------------------------------------------- the loader
def blend(weights: list[float], counts: list[int] | tuple[int, ...], n: int) -> tuple[list[int], list[int], list[int]]:
    """The sources of the next ``n`` rows of a mixture: row ``m`` (0-based, all rows so far)
    goes to the source ``d`` with the largest ``weights[d] * (m + 1) - counts[d]`` (the lowest ``d`` on a
    tie; Megatron-LM's blending). ``weights``: normalised (sum 1); ``counts``: rows each source gave
    so far. Returns ``(source of each row, that source's row index, the counts after)``."""
    c, w, K = list(counts), weights, range(len(weights))
    first = sum(c)
    sources, rows = [], []
    for upto in range(first + 1, first + n + 1):  # rows 0 .. upto - 1 once this one is placed
        d = max(K, key=lambda k: w[k] * upto - c[k])
        sources.append(d)
        rows.append(c[d])
        c[d] += 1
    return sources, rows, c


class MixtureLoader:
    """Micro-batches ``(x, y)``, each ``(B, T)`` int64 on ``device``, of rows drawn from several
    sources in proportion to their weights (:func:`blend`; the :class:`~gptspeed.data.train_data.TrainLoader`
    protocol). ``sources``: one-row :class:`~gptspeed.data.loader.TokenLoader` s (host tensors), whose
    row ``k`` is a source's ``k``-th row over all its epochs.

    Global micro-batch ``g`` is the job's next ``B * world_size`` rows; this rank takes the
    ``rank``-th ``B`` of them, so ranks are disjoint. Every rank reads every row of a global batch, for
    the job's document counts (as :class:`TokenLoader` does aligned to documents). The state is the
    rows each source gave (all ranks) and the documents counted: a resume -- with any batch size or
    world size, since the row stream does not depend on them -- reads exactly the rows it would have.
    ``workers`` >= 1 threads make batches ahead (the same batches whatever ``workers`` is).

    Progress: ``documents`` (the job's), ``documents_by_source`` (``{name: documents}``); ``epoch`` and
    :meth:`epoch_progress` count passes over the source used up first (the smallest rows / weight),
    ``tokens_per_epoch`` the tokens the job trains on during one such pass.
    """

    def __init__(
        self,
        names: list[str],
        weights: list[float],
        sources: list[Any],
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        workers: int = 0,
        prefetch: int = 4,
    ):
        import torch

        if workers < 0:
            raise GptspeedError(f"loader workers must be >= 0, got {workers}")
        total = float(sum(weights))
        self.names, self.weights, self.sources = list(names), [w / total for w in weights], list(sources)
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.workers, self.prefetch = workers, max(1, prefetch)
        self.counts = [0] * len(names)  # rows each source gave, all ranks
        self.documents, self.source_documents = 0, [0] * len(names)
        self.wait_s = 0.0
        self._prefetcher: Prefetcher | None = None
        # the source used up first: the one with the fewest rows per unit of weight
        self._first_out = min(
            (d for d, w in enumerate(self.weights) if w > 0),
            key=lambda d: sources[d].batches_per_epoch / self.weights[d],
        )

    @property
    def documents_by_source(self) -> dict[str, int]:
        return dict(zip(self.names, self.source_documents))

    @property
    def epoch(self) -> int:
        d = self._first_out
        return self.counts[d] // self.sources[d].batches_per_epoch

    def epoch_progress(self) -> float:
        d = self._first_out
        return (self.counts[d] % self.sources[d].batches_per_epoch) / self.sources[d].batches_per_epoch

    @property
    def tokens_per_epoch(self) -> int:
        d = self._first_out
        return round(self.sources[d].batches_per_epoch / self.weights[d]) * self.T

    def _make(self, counts: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """The global micro-batch after ``counts``: this rank's rows ``(B, T + 1)`` as a host tensor
        (pinned on CUDA), the documents each source's rows hold (every rank's), the counts after."""
        import torch

        sources, rows, after = blend(self.weights, counts, self.B * self.world_size)
        docs, mine = [0] * len(self.names), []
        for j, (d, k) in enumerate(zip(sources, rows)):
            t, n = self.sources[d].batch_at(k)
            docs[d] += n
            if j // self.B == self.rank:
                mine.append(t.reshape(-1))
        t = torch.stack(mine)
        return (t.pin_memory() if self.device.type == "cuda" else t), docs, after

    def _made(self, skip: int, every: int):
        """Worker ``skip`` of ``every``: batches ``skip``, ``skip + every``, ... from the counts now."""
        counts = list(self.counts)
        for i in itertools.count():
            if i % every == skip:
                made = self._make(counts)
                counts = made[2]
                yield made
            else:
                counts = blend(self.weights, counts, self.B * self.world_size)[2]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch ``(x, y)``: ``(B, T)`` int64 tensors on ``device``."""
        from gptspeed.data.loader import rows_to_xy
        from gptspeed.data.prefetch import Prefetcher

        t0 = time.perf_counter()
        if self.workers == 0:
            t, docs, after = self._make(self.counts)
        else:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(
                    [self._made(k, self.workers) for k in range(self.workers)], self.prefetch, "gptspeed-mixture"
                )
            t, docs, after = self._prefetcher.get()
        self.counts = after
        self.documents += sum(docs)
        self.source_documents = [a + b for a, b in zip(self.source_documents, docs)]
        xy = rows_to_xy(t, self.device)
        self.wait_s += time.perf_counter() - t0
        return xy

    def mark(self) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """Where the loader is (rows per source, documents, documents per source), for :meth:`rewind`."""
        return tuple(self.counts), self.documents, tuple(self.source_documents)

    def rewind(self, mark: tuple[tuple[int, ...], int, tuple[int, ...]]) -> None:
        """Go back to ``mark``: the batches consumed since are read again."""
        self.close()
        self.counts, self.documents, self.source_documents = list(mark[0]), mark[1], list(mark[2])

    def close(self) -> None:
        """Stop the background threads (prefetched batches are dropped; the state is unchanged)."""
        if self._prefetcher is not None:
            self._prefetcher.close(timeout=5)
        self._prefetcher = None
        for s in self.sources:
            s.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _kind(self) -> dict[str, Any]:
        """What a saved position must match: the sources, weights, shards and row shape."""
        first = self.sources[0]
        return {
            "mixture": self.names,
            "weights": self.weights,
            "shards": [[p.name for p in s.shards] for s in self.sources],
            "seq_len": self.T,
            "sampling": first.sampling,
            "seed": first.seed if first.sampling == "random" else None,
            "align_to_docs": first.align_to_docs,
        }

    def state_dict(self) -> dict[str, Any]:
        """What has been consumed (plain lists, ints, floats and strings): rows per source, documents."""
        return {
            **self._kind(),
            "rows": list(self.counts),
            "documents": self.documents,
            "documents_by_source": list(self.source_documents),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch consumed when ``state`` was taken (any batch size
        or world size: the rows are numbered for the whole job). GptspeedError (one line) when it was
        taken over other sources, weights, shards, sequence length, sampling, seed or --align-to-docs."""
        kind = self._kind()
        differ = [k for k, v in kind.items() if state.get(k) != v]
        if differ:
            raise GptspeedError(
                f"the checkpoint's data position is that of another mixture (its {', '.join(differ)} differ): "
                "resume with the --data it was saved with"
            )
        self.close()
        self.counts = [int(c) for c in state["rows"]]
        self.documents = int(state["documents"])
        self.source_documents = [int(c) for c in state["documents_by_source"]]
