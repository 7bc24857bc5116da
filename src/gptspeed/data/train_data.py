"""What the trainer trains on: one loader protocol for token shards and document streams.

:class:`TrainLoader` is the interface both :class:`gptspeed.data.loader.TokenLoader` (memory-mapped
shards) and :class:`gptspeed.data.stream.StreamLoader` (``jsonl:PATH`` / ``hf:NAME``, tokenized
while training) implement; :func:`find_train_data` resolves ``--data`` once (shards, val split,
identity) and :meth:`TrainData.loader` builds the right loader, so the trainer never asks which
kind it has.

A prepared folder is read under a shared lock (:func:`gptspeed.data.folder.data_folder_lock`),
taken before its shards are listed and kept by the :class:`TrainData` -- the trainer's, for its
whole run -- so ``gptspeed prepare`` cannot write the folder while it is read; and the folder is
checked to be what its manifest says (no shard listed twice, none both train and val, no two
names for one file, each split's token count the manifest's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gptspeed.data.sources import is_stream_source
from gptspeed.errors import GptspeedError


class TrainLoader(Protocol):
    """Micro-batches for training, resumable exactly.

    ``next_batch()`` returns ``(x, y)``, each ``(B, T)`` int64 on the device, ``y`` = ``x`` shifted
    by one. ``state_dict()`` / ``load_state_dict()`` hold what was *consumed* (never what was
    prefetched); ``mark()`` / ``rewind(mark)`` the same position in a few ints, taken every step
    (a step whose data failed is rewound before saving). ``close()`` stops background threads. Progress: ``documents`` (document starts
    seen by the whole job), ``epoch`` (completed passes), ``epoch_progress()`` (fraction of the
    current pass, 0.0 for a stream), ``tokens_per_epoch`` (None for a stream), ``wait_s`` (seconds
    ``next_batch`` spent waiting for or making batches).
    """

    documents: int
    epoch: int
    tokens_per_epoch: int | None
    wait_s: float

    def next_batch(self) -> tuple[Any, Any]: ...

    def epoch_progress(self) -> float: ...

    def mark(self) -> Any: ...

    def rewind(self, mark: Any) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class TrainData:
    """``--data`` resolved: ``spec`` as given, ``train_shards`` / ``val_shards`` (empty for a
    stream, which has no val split), ``identity`` (what a resume must find unchanged: the
    manifest's input hash and settings and each train shard's name, token count and
    :func:`~gptspeed.data.shards.shard_fingerprint`, or the stream, its options and its tokenizer) and
    ``documents`` (documents in the train split when the manifest says, else None). ``lock``:
    the folder's shared lock (:func:`~gptspeed.data.folder.data_folder_lock`; None for a stream; holding
    nothing where the folder cannot be locked), held while this object lives or until :meth:`close`.
    A stream's ``manifest`` is None for GPT-2's BPE, else the fields a manifest has of its
    ``--tokenizer`` (:meth:`~gptspeed.bpe.Tokenizer.manifest_fields`: where its ``tokenizer.json`` is, its
    sha256), and ``stream_tokenizer`` that :class:`~gptspeed.bpe.Tokenizer`, which the loader encodes with."""

    spec: str
    train_shards: list[Path] = field(default_factory=list)
    val_shards: list[Path] = field(default_factory=list)
    documents: int | None = None
    stream_options: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    lock: Any = field(default=None, repr=False, compare=False)
    stream_tokenizer: Any = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        """Release the data folder (a ``prepare`` may write it again)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """Computed when first asked (by the trainer's checkpointer): reading every train shard's
        fingerprint is work the early data check of :func:`gptspeed.api.train` does not need."""
        if self.is_stream:  # the tokenizer only when not GPT-2's: a GPT-2 stream's checkpoints resume as before
            tokenizer = {"tokenizer": self.tokenizer.identity} if self.manifest else {}
            return {"stream": self.spec, **(self.stream_options or {}), **tokenizer}
        from gptspeed.data.shards import read_header, shard_fingerprint

        shards = [[p.name, read_header(p)[1], shard_fingerprint(p)] for p in self.train_shards]
        m = self.manifest
        if m and m.get("input_sha256"):
            return {
                "input_sha256": m["input_sha256"],
                "val_fraction": m.get("val_fraction"),
                "settings": m.get("settings"),
                "shards": shards,
            }
        return {"shards": shards}

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The :class:`~gptspeed.run_tokenizer.DataTokenizer` these tokens were made with: the
        manifest's (:func:`~gptspeed.run_tokenizer.manifest_tokenizer`; a stream's ``--tokenizer``; GPT-2's for
        a stream without one, or a folder prepared before manifests named their tokenizer). GptspeedError
        when the manifest names it in a form prepare does not write."""
        from gptspeed.run_tokenizer import manifest_tokenizer

        return manifest_tokenizer(self.manifest, self.spec)

    @property
    def tokenizer_folder(self) -> TrainData:
        """The data whose ``spec`` and ``manifest`` lead to its tokenizer's ``tokenizer.json``
        (:func:`~gptspeed.run_tokenizer.data_tokenizer_json`, sha256-checked): this one -- a prepared
        folder holds a copy, a stream's manifest names its TOK_DIR -- or a mixture's first source
        (:class:`MixtureData`)."""
        return self

    @property
    def eot(self) -> int:
        """The id of ``<|endoftext|>`` in these tokens (:attr:`tokenizer`'s: GPT-2's 50256 for a
        stream without ``--tokenizer``, or a folder whose manifest does not name a tokenizer)."""
        return self.tokenizer.eot

    @property
    def is_stream(self) -> bool:
        return self.stream_options is not None

    @property
    def has_val(self) -> bool:
        """Whether there is a val split to evaluate on (prepared shards have one; a stream has none)."""
        return bool(self.val_shards)

    def loader(
        self,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: Any = "cpu",
        max_token_id: int | None = None,
        sampling: str = "sequential",
        seed: int = 0,
        workers: int = 0,
        align_to_docs: bool = False,
    ) -> TrainLoader:
        """The loader for this data: a :class:`~gptspeed.data.loader.TokenLoader` over the train
        shards, or a :class:`~gptspeed.data.stream.StreamLoader` (one process only; GptspeedError
        under torchrun). ``workers``: background threads (a stream always tokenizes in at least one).
        ``align_to_docs``: rows start at document starts (a prepared folder only; GptspeedError for a stream)."""
        if self.is_stream:
            from gptspeed.data.stream import StreamLoader

            if world_size > 1:
                raise GptspeedError(
                    "streaming training (--data jsonl:/hf:) runs in one process: prepare shards for torchrun"
                )
            if align_to_docs:
                raise GptspeedError(
                    "--align-to-docs aligns a prepared folder's rows to its documents; a stream (--data jsonl:/hf:) "
                    "packs documents as they come: prepare it (gptspeed prepare), or train without --align-to-docs"
                )
            return StreamLoader(
                self.spec,
                batch_size,
                seq_len,
                device=device,
                workers=max(1, workers),
                tokenizer=self.stream_tokenizer,
                **self.stream_options,
            )
        from gptspeed.data.loader import TokenLoader

        expect = [(n, fp) for _, n, fp in self.identity["shards"]]  # each shard is checked when first opened
        return TokenLoader(
            self.train_shards,
            batch_size,
            seq_len,
            rank=rank,
            world_size=world_size,
            device=device,
            max_token_id=max_token_id,
            sampling=sampling,
            seed=seed,
            workers=workers,
            expect=expect,
            align_to_docs=align_to_docs,
            eot=self.eot,
        )

    def token_ids(self, max_tokens: int = 2_000_000_000) -> Any:
        """The sorted token ids that occur in the train and val shards (``numpy`` int64), for
        ``--softmax data``: one counting pass over the memory-mapped shards (``numpy.bincount``).
        GptspeedError for a stream (its tokens are not known ahead) or more than ``max_tokens``
        tokens (a corpus that large uses most of the vocabulary anyway: use --softmax full)."""
        import numpy as np

        from gptspeed.data.shards import read_header, read_shard

        if self.is_stream:
            raise GptspeedError(
                "--softmax data needs a prepared folder (its tokens are counted before training), "
                "not a stream: run `gptspeed prepare`, or use --softmax full"
            )
        shards = self.train_shards + self.val_shards
        total = sum(read_header(p)[1] for p in shards)
        if total > max_tokens:
            raise GptspeedError(
                f"--softmax data counts every token before training; {total:,} is too many "
                f"(at most {max_tokens:,}): use --softmax full"
            )
        counts = np.zeros(1 << 16, dtype=np.int64)
        for p in shards:
            tokens = read_shard(p)
            found = np.bincount(tokens, minlength=len(counts))  # longer than counts: a uint32 shard's larger ids
            counts = np.pad(counts, (0, len(found) - len(counts))) + found
        return np.flatnonzero(counts).astype(np.int64)

    def check_val(self, seq_len: int) -> None:
        """GptspeedError when the val split holds less than one sequence (nothing for a stream)."""
        from gptspeed.data.shards import read_header

        longest = max((read_header(p)[1] for p in self.val_shards), default=None)
        if longest is not None and longest < seq_len + 1:
            raise GptspeedError(
                f"val split has {longest:,} tokens, fewer than one sequence (seq_len {seq_len} + 1): "
                "prepare more text, raise --val-fraction or lower --seq-len"
            )


def check_consistent(data_dir: Path, train: list[Path], val: list[Path], manifest: dict[str, Any] | None) -> None:
    """GptspeedError (one line) unless the shards are what a prepared folder promises: no file
    listed twice, none in both splits, no two names for one file (a link), and -- where the
    manifest gives a split's token count -- the shards' headers adding up to it."""
    import os

    from gptspeed.data.shards import read_header

    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for split, paths in (("train", train), ("val", val)):
        for p in paths:
            try:
                st = os.stat(p)
            except OSError:
                continue  # gone meanwhile: reading it names it
            other = seen.get((st.st_dev, st.st_ino))
            if other is not None:
                what = (
                    f"lists the shard {p.name} twice in its {split} split"
                    if other == (split, p.name)
                    else f"lists {p.name} as both a train and a val shard"
                    if other[1] == p.name
                    else f"has {other[0]} shard {other[1]} and {split} shard {p.name} as the same file (a link)"
                )
                raise GptspeedError(
                    f"data folder {data_dir} {what}: the model would train or validate on the same "
                    "tokens twice; prepare the folder again with --force"
                )
            seen[(st.st_dev, st.st_ino)] = (split, p.name)
    if not manifest:
        return
    for split, paths in (("train", train), ("val", val)):
        said = ((manifest.get("splits") or {}).get(split) or {}).get("tokens")
        if type(said) is not int:
            continue
        held = sum(read_header(p)[1] for p in paths)
        if held != said:
            raise GptspeedError(
                f"the {split} shards of {data_dir} hold {held:,} tokens but its manifest says {said:,}: "
                "shards were changed or replaced after `gptspeed prepare`; prepare the folder again "
                "with --force"
            )


def find_train_data(
    data: str,
    *,
    text_field: str = "text",
    hf_name: str | None = None,
    split: str = "train",
    tokenizer: str = "gpt2",
) -> TrainData:
    """Resolve ``--data``: ``jsonl:PATH`` / ``hf:NAME`` (a stream, with its ``text_field``,
    ``hf_name``, ``split`` and ``tokenizer``, :func:`~gptspeed.run_tokenizer.load_data_tokenizer`), a
    mixture (``A=0.7,B=0.3`` or ``mix.yaml``: a :class:`~gptspeed.data.mixture.MixtureData`,
    :func:`~gptspeed.data.mixture.find_mixture`) or a prepared folder: locked shared
    (:func:`~gptspeed.data.folder.data_folder_lock`, kept by the result), then its train and val shards
    listed, checked to exist and to be what the manifest says (:func:`check_consistent`). A
    ``tokenizer`` other than ``gpt2`` with prepared data must be the data's own
    (:func:`~gptspeed.run_tokenizer.check_given_tokenizer`).
    GptspeedError (one line, saying what the path is) when there is nothing to train on, the
    folder is inconsistent, a ``gptspeed prepare`` is writing it, or the tokenizer is not loadable or
    not the data's."""
    if is_stream_source(data):
        from gptspeed.run_tokenizer import load_data_tokenizer

        options = {"text_field": text_field, "hf_name": hf_name, "split": split}
        tok = load_data_tokenizer(tokenizer)
        manifest = tok.manifest_fields() if tok is not None else None
        return TrainData(data, stream_options=options, manifest=manifest, stream_tokenizer=tok)
    found = _find_prepared(data)
    if tokenizer != "gpt2":
        from gptspeed.run_tokenizer import check_given_tokenizer

        try:
            check_given_tokenizer(tokenizer, found.tokenizer, data)
        except BaseException:
            found.close()
            raise
    return found


def train_data_for(train: Any) -> TrainData:
    """:func:`find_train_data` of the settings of ``train`` (a :class:`~gptspeed.config.TrainConfig`)
    that say what the data is: ``data``, ``text_field``, ``hf_name``, ``split``, ``data_tokenizer``."""
    t = train
    return find_train_data(
        t.data, text_field=t.text_field, hf_name=t.hf_name, split=t.split, tokenizer=t.data_tokenizer
    )


def _find_prepared(data: str) -> TrainData:
    """A mixture (:func:`find_mixture`) or a prepared folder (:func:`find_train_data`), found, locked and checked."""
    from gptspeed.data import find_shards, load_manifest
    from gptspeed.data.folder import data_folder_lock
    from gptspeed.data.mixture import is_mixture

    if is_mixture(data):  # A=0.7,B=0.3 or mix.yaml: several prepared folders (gptspeed.data.mixture)
        return find_mixture(data)
    lock = data_folder_lock(data).acquire() if Path(data).is_dir() else None
    try:
        train = find_shards(data, "train")
        val = find_shards(data, "val")
        manifest = load_manifest(data)
        check_consistent(Path(data), train, val, manifest)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    documents = None
    if manifest:
        documents = (manifest.get("splits", {}).get("train", {}) or {}).get("documents")
    return TrainData(data, train, val, documents, manifest=manifest, lock=lock)


# ------------------------------------------------------------- mixtures (gptspeed.data.mixture)
@dataclass(frozen=True)
class Source:
    """A mixture's source, found: its :class:`~gptspeed.data.mixture.SourceSpec` fields and its :class:`TrainData`."""

    name: str
    weight: float
    data: TrainData


@dataclass
class MixtureData(TrainData):
    """``--data`` naming a mixture, resolved: a :class:`TrainData` (what the trainer asks of its
    data) whose ``sources`` are each a prepared folder, locked and checked as one is
    (:func:`find_mixture`). ``train_shards`` / ``val_shards`` are every source's, in order (what
    ``--softmax data`` counts); the val loss is taken per source (:mod:`gptspeed.eval.during`);
    ``manifest`` is the first source's (the sources share its tokenizer); ``documents`` the sum of
    the sources' train documents where each manifest says."""

    sources: list[Source] = field(default_factory=list)

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """Each source's name, weight and :attr:`TrainData.identity`: a resume finds them unchanged."""
        return {"mixture": [{"name": s.name, "weight": s.weight, **s.data.identity} for s in self.sources]}

    @property
    def tokenizer_folder(self) -> TrainData:
        """The first source's folder: the sources share its tokenizer (:func:`find_mixture` refuses others)."""
        return self.sources[0].data

    def close(self) -> None:
        for s in self.sources:
            s.data.close()

    def check_val(self, seq_len: int) -> None:
        """GptspeedError, naming the source, when a source's val split holds less than one sequence."""
        for s in self.sources:
            _as_source(s.name, s.data.check_val, seq_len)

    def loader(  # type: ignore[override]
        self,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: Any = "cpu",
        workers: int = 0,
        **row_options: Any,
    ) -> Any:
        """A :class:`~gptspeed.data.mixture.MixtureLoader` over one-row
        :class:`~gptspeed.data.loader.TokenLoader` s of the sources (``row_options``:
        ``max_token_id``, ``sampling``, ``seed``, ``align_to_docs``, as :meth:`TrainData.loader`
        takes them); ``workers`` background threads make its batches."""
        from gptspeed.data.mixture import MixtureLoader

        rows = [_as_source(s.name, s.data.loader, 1, seq_len, **row_options) for s in self.sources]
        weights = [s.weight for s in self.sources]
        names = [s.name for s in self.sources]
        return MixtureLoader(
            names, weights, rows, batch_size, seq_len, rank=rank, world_size=world_size, device=device, workers=workers
        )


def _as_source(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its GptspeedError's line prefixed with the mixture source it is about."""
    try:
        return fn(*args, **kwargs)
    except GptspeedError as e:
        raise GptspeedError(f"mixture source {name}: {e}") from None


def find_mixture(spec: str) -> MixtureData:
    """Resolve mixture ``spec`` (:func:`gptspeed.data.mixture.parse_mixture`): each source a prepared
    folder found as :func:`find_train_data` finds one (locked shared, checked, with a val split: it
    refuses a folder without), all of one tokenizer (:attr:`TrainData.tokenizer`: one identity,
    vocabulary and ``<|endoftext|>`` id).
    GptspeedError (one line, naming the source, or both sources for different tokenizers)
    otherwise; the folders locked so far are released."""
    from gptspeed.data.mixture import parse_mixture

    sources: list[Source] = []
    try:
        for s in parse_mixture(spec):
            data = _as_source(s.name, find_train_data, s.path)
            sources.append(Source(s.name, s.weight, data))
            first = sources[0]
            mine, theirs = first.data.tokenizer, data.tokenizer
            if (mine.identity, mine.n_vocab, mine.eot) != (theirs.identity, theirs.n_vocab, theirs.eot):
                raise GptspeedError(
                    f"mixture sources {first.name} and {s.name} have different tokenizers ({first.name}: "
                    f"{mine.said}; {s.name}: {theirs.said}): prepare them with one --tokenizer"
                )
    except BaseException:
        for s in sources:
            s.data.close()
        raise
    docs = [s.data.documents for s in sources]
    return MixtureData(
        spec,
        [p for s in sources for p in s.data.train_shards],
        [p for s in sources for p in s.data.val_shards],
        None if None in docs else sum(docs),
        manifest=sources[0].data.manifest,
        sources=sources,
    )
