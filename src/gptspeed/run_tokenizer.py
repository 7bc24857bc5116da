"""The tokenizer a run takes from its data, and keeps.

A prepared folder's manifest names the tokenizer its shards were made with
(:mod:`gptspeed.data.prepare_tokenizer`: ``tokenizer``, ``tokenizer_kind``, ``tokenizer_sha256``,
``eot_token``, ``n_vocab``; none of them, or ``"tokenizer": "gpt2"``, is GPT-2's BPE). A new run on it
(:func:`fit_model_to_data`, from :func:`gptspeed.configure.build_train_config`) takes:

- ``valid_vocab_size`` = the manifest's ``n_vocab``, and ``vocab_size`` that padded up to a multiple of
  64 (:func:`padded_vocab`, as 50304 is for 50257), unless the user set ``vocab_size`` (refused when
  smaller than ``n_vocab``);
- ``eot_token``, the ``<|endoftext|>`` id that starts each document (the document mask, sampling's
  padding);
- ``tokenizer``, its identity: ``gpt2``, a tiktoken encoding's name, or ``sha256:HEX`` of a
  ``tokenizer.json``, which the run copies into its folder (:func:`save_run_tokenizer`, atomically:
  the folder is self-contained). A GPT-2 run is unchanged: it stores nothing more.

A stream (``--data jsonl:PATH`` / ``hf:NAME``) has no manifest: its tokenizer is the one its ``--tokenizer``
names (the ``data_tokenizer`` setting, :func:`load_data_tokenizer`; ``gpt2`` by default), and the run takes
the same from it as from a manifest that said so (:meth:`~gptspeed.bpe.Tokenizer.manifest_fields`: a TOK_DIR's ``tokenizer.json``
is found there, sha256-checked, when the run copies it). With prepared data ``--tokenizer`` can only name
the data's own (:func:`check_given_tokenizer`).

An ``export-hf`` of such a run ships the tokenizer (:func:`export_tokenizer`: its ``tokenizer.json``,
or a tiktoken encoding converted to one, :func:`tiktoken_tokenizer_json`) and names it in config.json
(``gptspeed_tokenizer``); ``import-hf``, ``--init-from`` and ``sample``/``eval --init-from`` take it
back (:func:`source_tokenizer`, :func:`eval_tokenizer`, :mod:`gptspeed.hf.reload`).

A run whose identity is not its data's is refused in one line naming both: ``--resume`` on other
data (or a stream with another ``--tokenizer``), ``--init-from`` a model of another tokenizer, a
configuration changed after it was made (:func:`check_data_tokenizer`). :func:`run_tokenizer` gives any
command the run's :class:`~gptspeed.bpe.Tokenizer` (``encode``, ``decode``, ``eot``, ``n_vocab``).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptspeed.errors import GptspeedError

GPT2 = "gpt2"
SHA_PREFIX = "sha256:"
RUN_TOKENIZER_FILE = "tokenizer.json"
"""The run folder's (and a prepared folder's) copy of an HF tokenizer's ``tokenizer.json``."""
VOCAB_MULTIPLE = 64
"""``vocab_size`` is ``n_vocab`` rounded up to a multiple of this (tensor cores; build-nanogpt's 50304)."""


@dataclass(frozen=True)
class DataTokenizer:
    """What a manifest says of its tokenizer: ``identity`` (``GPTConfig.tokenizer``), ``n_vocab``,
    ``eot`` (the ``<|endoftext|>`` id), ``name`` (as prepare was given it: ``gpt2``, a tiktoken
    encoding, a TOK_DIR), ``kind`` (``gpt2`` | ``tiktoken`` | ``hf``)."""

    identity: str
    n_vocab: int
    eot: int
    name: str = GPT2
    kind: str = GPT2

    @property
    def said(self) -> str:
        """For an error line: ``GPT-2's BPE (gpt2), <|endoftext|> 50256, 50,257 ids``; a trained one
        by the name prepare was given and the start of its sha256."""
        sha = self.identity[len(SHA_PREFIX) :][:12]
        who = f"{self.name} (sha256 {sha})" if self.kind == "hf" else describe(self.identity)
        return f"{who}, <|endoftext|> {self.eot}, {self.n_vocab:,} ids"


GPT2_DATA = DataTokenizer(GPT2, 50257, 50256)


def padded_vocab(n_vocab: int) -> int:
    """``n_vocab`` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (50257 -> 50304, 4096 -> 4096)."""
    return -(-n_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def describe(identity: str) -> str:
    """A tokenizer identity for an error line: ``GPT-2's BPE``, ``tiktoken cl100k_base``, or
    ``the tokenizer.json of sha256 0123456789ab``."""
    if identity == GPT2:
        return "GPT-2's BPE (gpt2)"
    if identity.startswith(SHA_PREFIX):
        return f"the tokenizer.json of sha256 {identity[len(SHA_PREFIX) :][:12]}"
    return f"tiktoken {identity}"


def manifest_tokenizer(manifest: dict[str, Any] | None, where: str = "the data") -> DataTokenizer:
    """The :class:`DataTokenizer` of a prepared folder's ``manifest`` (None, or no
    ``tokenizer_kind``: GPT-2's). GptspeedError when its fields are not what prepare writes."""
    kind = (manifest or {}).get("tokenizer_kind")
    if kind is None:
        return GPT2_DATA
    m = manifest
    n, eot, name, sha = m.get("n_vocab"), m.get("eot_token"), m.get("tokenizer"), m.get("tokenizer_sha256")
    ok = type(n) is int and n >= 1 and type(eot) is int and 0 <= eot < n and isinstance(name, str)
    ok = ok and isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) is not None
    if kind not in ("tiktoken", "hf") or not ok:
        raise GptspeedError(
            f"the manifest of {where} names its tokenizer in a form gptspeed does not write "
            "(tokenizer_kind, n_vocab, eot_token, tokenizer_sha256): prepare the folder again with --force"
        )
    identity = name if kind == "tiktoken" else SHA_PREFIX + sha
    return DataTokenizer(identity, n, eot, name, kind)


def load_data_tokenizer(spec: str):
    """The :class:`~gptspeed.bpe.Tokenizer` that ``--tokenizer`` ``spec`` (the ``data_tokenizer`` setting)
    names: a tiktoken encoding or a TOK_DIR (:func:`gptspeed.bpe.resolve_tokenizer`); None for ``gpt2``
    (a stream's own GPT-2 path, :func:`gptspeed.data.tokenize.encode_document`). GptspeedError (one
    line): ``spec`` names nothing known, a TOK_DIR without a valid ``tokenizer.json``, an encoding
    tiktoken cannot load."""
    if spec == GPT2:
        return None
    from gptspeed.bpe import resolve_tokenizer

    tok = resolve_tokenizer(spec)
    return None if tok.kind == GPT2 else tok


def data_tokenizer(data: str | None, tokenizer: str | None = None) -> DataTokenizer:
    """The tokenizer of ``--data``: a prepared folder's (:func:`manifest_tokenizer`), a mixture's first
    source's (:mod:`gptspeed.data.mixture`: its sources share one); for a stream, the one ``tokenizer``
    names (``--tokenizer``, :func:`load_data_tokenizer`; GPT-2's when None); GPT-2's for no ``--data``
    (tiny Shakespeare) or a path that is not a folder (the data check names it). ``tokenizer`` given
    with data that is not a stream must name the data's own (:func:`check_given_tokenizer`).
    GptspeedError: as those two and :func:`manifest_tokenizer`."""
    from gptspeed.data.mixture import is_mixture, parse_mixture
    from gptspeed.data.sources import is_stream_source

    if data and is_stream_source(data):
        tok = load_data_tokenizer(tokenizer or GPT2)
        return manifest_tokenizer(tok.manifest_fields() if tok is not None else None, data)
    folder = parse_mixture(data)[0].path if data and is_mixture(data) else data  # the sources share one
    found = GPT2_DATA
    if folder and Path(folder).expanduser().is_dir():
        from gptspeed.data import load_manifest

        found = manifest_tokenizer(load_manifest(Path(folder).expanduser()), str(folder))
    if tokenizer is not None:
        check_given_tokenizer(tokenizer, found, data)
    return found


def _identity_of(spec: str) -> str:
    """The identity (``GPTConfig.tokenizer``) of the tokenizer ``spec`` names: a tiktoken encoding's name
    is it (nothing loaded); a TOK_DIR's is ``sha256:`` of its ``tokenizer.json``."""
    import tiktoken

    if spec == GPT2 or spec in tiktoken.list_encoding_names():
        return spec
    tok = load_data_tokenizer(spec)
    return SHA_PREFIX + tok.sha256 if tok.kind == "hf" else tok.name


def check_given_tokenizer(spec: str, tok: DataTokenizer, data: str | None) -> None:
    """GptspeedError (one line naming both) when ``--tokenizer`` ``spec``, given with ``data`` that is
    not a stream (a prepared folder, a mixture, tiny Shakespeare), is not ``tok``, the one the data was
    prepared with: a prepared folder keeps its tokenizer. (The same one is then refused as a setting that
    does nothing, :func:`gptspeed.config.check_companions`.)"""
    mine = _identity_of(spec)
    if mine != tok.identity:
        raise GptspeedError(
            f"--tokenizer {spec} is {describe(mine)}, but --data {data or '(tiny Shakespeare)'} was prepared with "
            f"{tok.said}: a prepared folder keeps the tokenizer it was prepared with; drop --tokenizer, or prepare "
            f"the text again with --tokenizer {spec} (or stream it: --data jsonl:PATH --tokenizer {spec})"
        )


def _mismatch(what: str, theirs: str, data: str | None, tok: DataTokenizer) -> GptspeedError:
    from gptspeed.data.sources import is_stream_source

    stream = bool(data) and is_stream_source(data)
    fix = "stream it with that --tokenizer" if stream else "use data prepared with the same tokenizer"
    return GptspeedError(
        f"{what} takes {describe(theirs)}, but --data {data or '(tiny Shakespeare)'} is tokenized with "
        f"{describe(tok.identity)}: {fix}{'' if stream else ' (gptspeed prepare --tokenizer)'}, or start a new run"
    )


def fit_model_to_data(cfg, given: set[str], resumed: bool):
    """``cfg`` (a :class:`~gptspeed.config.RunConfig`, changed in place and returned) fitted to its
    data's tokenizer (the module docstring; a stream's is its ``--tokenizer``, the ``data_tokenizer``
    setting): a new run takes ``valid_vocab_size``, ``eot_token``, ``tokenizer`` and (unless in
    ``given``) a padded ``vocab_size`` from it; a ``resumed`` run, or one ``--init-from`` a model, must
    already have it.

    Raises:
        GptspeedError: the data's manifest is unreadable; a stream's ``--tokenizer`` names nothing
            loadable, or one given with prepared data is not the data's (:func:`check_given_tokenizer`);
            ``vocab_size`` given smaller than the data's ``n_vocab``; a resumed run's or the
            ``--init-from`` model's tokenizer is not the data's.
    """
    from gptspeed.data.sources import is_stream_source

    m, data = cfg.model, cfg.train.data
    given_tok = "data_tokenizer" in given or (bool(data) and is_stream_source(data))
    tok = data_tokenizer(data, cfg.train.data_tokenizer if given_tok else None)  # a stream's --tokenizer
    if resumed:
        if m.tokenizer != tok.identity:
            raise _mismatch(f"--resume: the run {cfg.train.out}", m.tokenizer, data, tok)
        return cfg
    if cfg.train.init_from:
        source = source_tokenizer(cfg.train.init_from)
        if source != tok.identity:
            raise _mismatch(f"--init-from {cfg.train.init_from}", source, data, tok)
    _check_derived(m, given, data, tok)
    if tok is GPT2_DATA and m.tokenizer == GPT2:
        return cfg  # GPT-2's run, as it always was
    if "vocab_size" in given and m.vocab_size < tok.n_vocab:
        raise GptspeedError(
            f"--vocab-size {m.vocab_size} is smaller than the {tok.n_vocab:,} ids of the data's tokenizer "
            f"({describe(tok.identity)}): use {tok.n_vocab} or more, or leave it out ({padded_vocab(tok.n_vocab)})"
        )
    if "vocab_size" not in given:
        m.vocab_size = padded_vocab(tok.n_vocab)
    m.valid_vocab_size, m.eot_token, m.tokenizer = tok.n_vocab, tok.eot, tok.identity
    return cfg


#: the model settings a new run takes from its data's tokenizer (:func:`fit_model_to_data`)
DERIVED = ("tokenizer", "eot_token", "valid_vocab_size")


def _check_derived(m, given: set[str], data: str | None, tok: DataTokenizer) -> None:
    """GptspeedError (one line) when the user set one of :data:`DERIVED` (a config file's key, a
    ``make_config`` keyword) to other than the data's: it would be replaced without a word. The data's
    own value -- a ``--print-config`` file of a run on that data -- is accepted."""
    theirs = {"tokenizer": tok.identity, "eot_token": tok.eot, "valid_vocab_size": tok.n_vocab}
    for name in DERIVED:
        if name in given and getattr(m, name) != theirs[name]:
            hint = "; a stream's tokenizer is data_tokenizer (--tokenizer)" if name == "tokenizer" else ""
            raise GptspeedError(
                f"{name} {getattr(m, name)!r} is not the data's: a new run takes {name} from its data (--data "
                f"{data or '(tiny Shakespeare)'}: {tok.said}); leave {name} out{hint}"
            )


def source_tokenizer(source: str) -> str:
    """The tokenizer identity of an ``--init-from`` model: a gptspeed export's (its config.json's
    ``gptspeed_tokenizer``, :func:`gptspeed.hf.export.export_hf`), else GPT-2's (every GPT-2 checkpoint)."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return GPT2
    from gptspeed.fileio import read_user_json

    value = read_user_json(config, "model configuration", max_bytes=1 << 20).get("gptspeed_tokenizer", GPT2)
    return value if isinstance(value, str) else GPT2


def check_data_tokenizer(model_cfg, data) -> None:
    """GptspeedError (one line naming both) unless the model of ``model_cfg`` (a
    :class:`~gptspeed.config.GPTConfig`) takes the tokenizer of ``data`` (a
    :class:`~gptspeed.data.train_data.TrainData`) with its vocabulary and ``<|endoftext|>`` id (GPT-2's
    runs as before: a smaller ``valid_vocab_size`` is the loader's to check)."""
    tok = data.tokenizer
    if model_cfg.tokenizer != tok.identity:
        raise _mismatch("the run's model", model_cfg.tokenizer, data.spec, tok)
    if tok is not GPT2_DATA and (model_cfg.valid_vocab_size != tok.n_vocab or model_cfg.eot_token != tok.eot):
        raise GptspeedError(
            f"the run's model has {model_cfg.valid_vocab_size:,} token ids and <|endoftext|> {model_cfg.eot_token}, "
            f"but --data {data.spec} has {tok.n_vocab:,} and {tok.eot}: leave valid_vocab_size and eot_token "
            "to the data (gptspeed.make_config derives them)"
        )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_tokenizer_json(folder: Path) -> str | None:
    """``folder/tokenizer.json``'s text, or None when there is none (or it cannot be read)."""
    from gptspeed.bpe import MAX_TOKENIZER_JSON_BYTES
    from gptspeed.fileio import read_user_text

    path = folder / RUN_TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return read_user_text(path, "tokenizer file", max_bytes=MAX_TOKENIZER_JSON_BYTES)
    except GptspeedError:
        return None


def data_tokenizer_json(data_dir: str | os.PathLike, manifest: dict[str, Any] | None) -> str:
    """The ``tokenizer.json`` text an HF-tokenized prepared folder was made with: the folder's own copy
    (prepare writes one), else the TOK_DIR its manifest names -- either only if its sha256 is the
    manifest's. For a stream (``data_dir`` ``jsonl:``/``hf:``; ``manifest``: :meth:`~gptspeed.bpe.Tokenizer.manifest_fields` of its
    ``--tokenizer``) the TOK_DIR's. GptspeedError when neither is found unchanged."""
    from gptspeed.data.sources import is_stream_source

    sha = (manifest or {}).get("tokenizer_sha256")
    for folder in (Path(data_dir), Path(str((manifest or {}).get("tokenizer", ""))).expanduser()):
        text = _read_tokenizer_json(folder)
        if text is not None and _sha256(text) == sha:
            return text
    if is_stream_source(str(data_dir)):  # no folder of its own: the TOK_DIR its --tokenizer named
        raise GptspeedError(
            f"the stream {data_dir} is tokenized with {manifest.get('tokenizer')} (sha256 {str(sha)[:12]}), whose "
            f"{RUN_TOKENIZER_FILE} is gone or changed since: put it back, or start a new run"
        )
    raise GptspeedError(
        f"the data {data_dir} was prepared with the tokenizer {manifest.get('tokenizer')} (sha256 {str(sha)[:12]}), "
        f"which is neither in the folder nor unchanged there: put its {RUN_TOKENIZER_FILE} back, or prepare again"
    )


def save_run_tokenizer(run_dir: Path, model_cfg, data) -> bool:
    """Copy the data's ``tokenizer.json`` into ``run_dir`` (atomically; once) when the run's
    tokenizer is one (``sha256:...``): the run folder is then all ``sample``, ``eval`` and
    ``export-hf`` need. Returns whether it wrote the file. GptspeedError as :func:`data_tokenizer_json`."""
    identity = model_cfg.tokenizer
    if not identity.startswith(SHA_PREFIX):
        return False  # GPT-2's or a tiktoken encoding: the name is the tokenizer
    have = _read_tokenizer_json(Path(run_dir))
    if have is not None and SHA_PREFIX + _sha256(have) == identity:
        return False
    from gptspeed.fileio import write_text_atomic

    folder = data.tokenizer_folder
    write_text_atomic(Path(run_dir) / RUN_TOKENIZER_FILE, data_tokenizer_json(folder.spec, folder.manifest))
    return True


def tokenizer_of(identity: str, folder: str | os.PathLike | None = None):
    """The :class:`~gptspeed.bpe.Tokenizer` of an identity (``GPTConfig.tokenizer``, or an export's
    config.json's ``gptspeed_tokenizer``): GPT-2's, a tiktoken encoding (by name: never a folder), or
    ``folder``'s ``tokenizer.json`` of that sha256. GptspeedError when the file is missing or changed,
    or the name is no encoding's."""
    from gptspeed.bpe import load_tokenizer_dir, resolve_tokenizer

    if not identity.startswith(SHA_PREFIX):
        tok = resolve_tokenizer(identity)
        if tok.kind not in (GPT2, "tiktoken"):  # a name from a config.json: an encoding, never a folder
            raise GptspeedError(f"the tokenizer {identity!r} is not a tiktoken encoding's name")
        return tok
    tok = load_tokenizer_dir(folder) if folder is not None and (Path(folder) / RUN_TOKENIZER_FILE).is_file() else None
    if tok is None or SHA_PREFIX + tok.sha256 != identity:
        raise GptspeedError(
            f"{folder} lacks the {RUN_TOKENIZER_FILE} its model was trained with ({describe(identity)})"
            f"{' (it holds another)' if tok is not None else ''}: put it back from the run's data"
        )
    return tok


def run_tokenizer(run: str | os.PathLike, model_cfg=None):
    """The :class:`~gptspeed.bpe.Tokenizer` of the run folder ``run`` (``.encode(text) -> ids``,
    ``.decode(ids) -> text``, ``.eot``, ``.n_vocab``): the one its newest checkpoint's model (or
    ``model_cfg``, a :class:`~gptspeed.config.GPTConfig`, when given; else ``config.json``'s) was
    trained with -- GPT-2's for every run made before tokenizers were the data's.

    Raises:
        GptspeedError: the run has no configuration, or its ``tokenizer.json`` is missing or changed.
    """
    if model_cfg is None:
        model_cfg = run_model_config(run)
    return tokenizer_of(model_cfg.tokenizer, run)


def run_model_config(run: str | os.PathLike):
    """The :class:`~gptspeed.config.GPTConfig` of the run folder ``run``: its newest valid checkpoint's
    (from the seal, no torch), else the ``config.json`` it wrote at its start. GptspeedError: neither."""
    from gptspeed.checkpoint import newest_run_config, started_run

    cfg = newest_run_config(Path(run))[1] if Path(run).is_dir() else None
    if cfg is None:
        started = started_run(Path(run)) if Path(run).is_dir() else None
        if started is None:
            raise GptspeedError(f"{run} holds neither a checkpoint nor a config.json: not a run folder")
        cfg = started[0]
    return cfg.model


def training_tokenizer(model_cfg, data):
    """The :class:`~gptspeed.bpe.Tokenizer` a training run's evaluations encode and decode with
    (HellaSwag, bits per byte): None for GPT-2's (their own path, unchanged), a tiktoken encoding, or
    the data's ``tokenizer.json`` (:func:`data_tokenizer_json`, sha256-checked; not the run folder's
    copy, which rank 0 may still be writing)."""
    identity = model_cfg.tokenizer
    if identity == GPT2:
        return None
    if not identity.startswith(SHA_PREFIX):
        from gptspeed.bpe import resolve_tokenizer

        return resolve_tokenizer(identity)
    from tokenizers import Tokenizer as HFTok

    from gptspeed.bpe import HFTokenizer

    folder = data.tokenizer_folder
    text = data_tokenizer_json(folder.spec, folder.manifest)
    tok = HFTokenizer(str(folder.spec), HFTok.from_str(text), identity[len(SHA_PREFIX) :])
    tok.json_text = text
    return tok


def eval_tokenizer(run: str | os.PathLike | None, data: str | os.PathLike | None = None, init_from: str | None = None):
    """What ``sample`` and ``eval`` encode and decode with: None for GPT-2's (an ``--init-from`` GPT-2,
    or a GPT-2 run -- their own path, unchanged), else :func:`run_tokenizer`; for ``init_from``
    (without ``run``), gptspeed's export of a run on its own tokenizer, the tokenizer it ships
    (:func:`source_tokenizer`: config.json's ``gptspeed_tokenizer``; its ``tokenizer.json`` of that
    sha256, or the tiktoken encoding of that name).

    Raises:
        GptspeedError: as :func:`run_tokenizer`; ``data`` (a prepared folder to evaluate on) tokenized
            with another tokenizer than the run's (one line naming both).
    """
    identity = GPT2
    if run is None and init_from is not None:
        identity, run = source_tokenizer(init_from), Path(init_from).expanduser()
    elif run is not None:
        try:
            identity = run_model_config(run).tokenizer
        except GptspeedError:
            pass  # no run there: loading its model says so, as it always did
    if data is not None:
        tok = data_tokenizer(str(data))
        if tok.identity != identity:
            raise _mismatch(f"the model of {run}" if run is not None else "GPT-2", identity, str(data), tok)
    return None if identity == GPT2 else tokenizer_of(identity, run)


def export_tokenizer(run: str | os.PathLike, model_cfg):
    """The tokenizer ``export-hf`` ships for the run ``run`` whose model is ``model_cfg``: None for
    GPT-2's (its own files, :func:`gptspeed.hf.export.write_tokenizer_files`), else the run's
    ``tokenizer.json`` (:func:`run_tokenizer`), or a tiktoken encoding's converted to one
    (:func:`tiktoken_tokenizer_json`), as ``.json_text``. GptspeedError for a missing or changed
    file, or an encoding that cannot be loaded or converted exactly."""
    if model_cfg.tokenizer == GPT2:
        return None
    tok = run_tokenizer(run, model_cfg)
    if not model_cfg.tokenizer.startswith(SHA_PREFIX):
        tok.json_text = tiktoken_tokenizer_json(tok.encoding, tok.name)
    return tok


_PROBE = "Hello, world! It's 12345 o'clock\n\n\tça va, 東京 — 🙂  done.<|endoftext|>x"
"""Text a converted tiktoken encoding must encode to tiktoken's ids (:func:`tiktoken_tokenizer_json`)."""


def tiktoken_tokenizer_json(encoding, name: str) -> str:
    """The ``tokenizer.json`` text of the tiktoken ``encoding`` (a ``tiktoken.Encoding`` called
    ``name``), converted by transformers' own ``TikTokenConverter`` (what
    ``transformers.integrations.tiktoken.convert_tiktoken_to_fast`` uses, here fed the encoding's merge
    ranks directly, no file): a byte-level BPE of those ranks with ``ignore_merges`` (a piece in the
    vocabulary is one token, as in tiktoken) after the encoding's own split pattern. Its special
    tokens get tiktoken's ids: the converter numbers them on from the ranks, wrong where the ids
    have a gap (cl100k_base's ``<|endoftext|>`` is 100257, 100256 unused), so they are put in the
    BPE's vocabulary at their ids first. The result is checked to encode a probe text to tiktoken's
    ids and decode it back.

    Raises:
        GptspeedError: transformers is not installed; the conversion is not exact (the line says to
            sample and eval the run with gptspeed)."""
    import json

    try:
        from tokenizers import AddedToken, Tokenizer
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise GptspeedError(
            f"export-hf converts the tiktoken encoding {name} to a tokenizer.json with transformers: "
            "`pip install -e '.[hf]'`"
        ) from None

    class _FromEncoding(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url):  # the encoding's ranks, not a downloaded file
            return encoding._mergeable_ranks

    spec = json.loads(_FromEncoding(pattern=encoding._pat_str).converted().to_str())
    special = sorted(encoding._special_tokens.items(), key=lambda kv: kv[1])
    spec["model"]["vocab"].update(special)  # so the added tokens below take tiktoken's ids
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in special])
    text = tok.to_str()
    ids = encoding.encode(_PROBE, allowed_special="all")
    got = tok.encode(_PROBE, add_special_tokens=False).ids
    ok = got == ids and all(tok.token_to_id(t) == i for t, i in special)
    if not ok or tok.decode(got, skip_special_tokens=False) != _PROBE:
        raise GptspeedError(
            f"export-hf cannot convert the tiktoken encoding {name} to a tokenizer.json that encodes as tiktoken "
            "does: sample and eval the run with gptspeed, which uses tiktoken itself"
        )
    return text


def write_hf_tokenizer(folder: Path, tok, model_max_length: int) -> None:
    """``tok``'s files as transformers' ``AutoTokenizer`` loads them offline: its ``tokenizer.json``
    as it is, ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast``; ``<|endoftext|>`` its bos, eos
    and unk token, as GPT-2's) and ``special_tokens_map.json``
    (https://huggingface.co/docs/transformers/fast_tokenizers). OSError as the writes raise it."""
    import json

    from gptspeed.bpe import EOT

    (Path(folder) / RUN_TOKENIZER_FILE).write_text(tok.json_text)
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length, **special}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (Path(folder) / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
