"""``gptspeed.data.folder``: the data folder keeps what it promises: one writer or many readers at a time (:func:`data_folder_lock`, :func:`prepare_lock`), and ``gptspeed prepare`` writes only into a folder that is new, empty or gptspeed's own data folder (:func:`check_prepare_target`)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from gptspeed.data import read_shard, write_shard
from gptspeed.data.folder import prepare_lock
from gptspeed.data.prepare import prepare
from gptspeed.data.train_data import find_train_data
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

from support.cli import assert_user_error, run_main
from support.records import DOCS as DOCS_RECORDS
from support.records import lines_of
from support.runs import train_args

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    f"Document {i}: " + "the quick brown fox jumps over the lazy dog, again and again. " * (4 + i % 5)
    for i in range(60)
]


def corpus(tmp_path: Path, docs=DOCS) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_bytes(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs))
    return src


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _fit(data: Path, run: Path, **over):
    from gptspeed.trainer import build_train_config, fit

    tiny = dict(
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=32,
        batch_size=4,
        warmup_steps=1,
        log_every=1,
        device="cpu",
        dtype="float32",
        compile=False,
        eval_every=0,
        data=str(data),
        out=str(run),
        max_steps=4,
        save_every=100_000,
    )
    return fit(build_train_config("pico", {**tiny, **over}), echo=False)


def _prepare_during_step(monkeypatch, at_step: int, *args: str) -> list:
    """Run ``gptspeed prepare ARGS`` (the CLI, in this process) just before the training step
    ``at_step + 1``; the result is appended to the returned list."""
    from gptspeed.trainer import Trainer

    real, seen = Trainer.train_step, []

    def step(self, *a, **kw):
        if self.step == at_step and not seen:
            seen.append(run_main("prepare", *args))
        return real(self, *a, **kw)

    monkeypatch.setattr(Trainer, "train_step", step)
    return seen


# ---------------------------------------------------------------- a folder that is what it says
def _prepared(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    prepare(str(corpus(tmp_path)), data, shard_tokens=1000, progress=False)
    return data


def _edit_manifest(data: Path, edit) -> None:
    m = json.loads((data / "manifest.json").read_text())
    edit(m["splits"])
    (data / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------------- one huge document
class _Recording:
    """A GPT-2 encoding that records the length of every text handed to the BPE."""

    def __init__(self, enc, lengths):
        self.enc, self.lengths = enc, lengths

    def encode_to_numpy(self, text, **kw):
        self.lengths.append(len(text))
        return self.enc.encode_to_numpy(text, **kw)


# ---------------------------------------------------------------- a train and a prepare, one folder
def test_prepare_force_is_refused_while_a_train_reads_the_folder(tmp_path, monkeypatch):
    """`prepare --force` under a running train deleted and rewrote its shards: the loader then read a
    new, shorter shard and died in a traceback, the steps since the last checkpoint lost. The train
    holds the folder shared for its whole run now: the prepare is one line naming the train's pid,
    the folder is untouched, the run finishes; once it has, the same prepare goes through."""
    src, data = corpus(tmp_path), tmp_path / "data"
    prepare(str(src), data, shard_tokens=1000, progress=False)
    before = snapshot(data)
    seen = _prepare_during_step(
        monkeypatch, 2, str(src), "--out", str(data), "--force", "--shard-tokens", "300", "--no-progress"
    )
    summary = _fit(data, tmp_path / "run", max_steps=12)
    assert summary["step"] == 12
    assert_user_error(seen[0], f"data folder {data} is in use by pid {os.getpid()}", "a running `gptspeed train`")
    assert snapshot(data) == before
    assert (
        run_main(
            "prepare", str(src), "--out", str(data), "--force", "--shard-tokens", "300", "--no-progress"
        ).returncode
        == 0
    )  # the run is over: its lock is gone


def test_a_train_is_refused_while_a_prepare_writes_the_folder(tmp_path):
    """A train started during a prepare found the folder half cleared and said it was not a data
    folder (or trained on the shards being rewritten). Now it names the prepare and writes nothing."""
    src, data = corpus(tmp_path), tmp_path / "data"
    prepare(str(src), data, shard_tokens=1000, progress=False)
    lock = prepare_lock(data).acquire()
    try:
        proc = run_main(*train_args(data, tmp_path / "run", max_steps=1))
        assert_user_error(proc, f"data folder {data} is being prepared by pid {os.getpid()}", "wait for it to finish")
        assert not (tmp_path / "run").exists()
    finally:
        lock.release()
    assert find_train_data(str(data)).train_shards  # free again


@pytest.mark.parametrize("change", ["another shard size", "another shuffle seed"])
def test_a_shard_changed_where_the_folder_cannot_be_locked_stops_the_run_after_saving(tmp_path, monkeypatch, change):
    """Where a folder cannot be locked (NFS refuses an exclusive flock of a folder), a prepare
    --force under the run still goes through. The loader used to read the new files as if they were
    the old (a traceback for a shorter shard; silently other tokens for a reshuffle). Each shard is
    checked against the run's data identity when first opened: one line naming it, after the
    last finished step is saved."""
    from gptspeed.checkpoint import check_checkpoint, list_checkpoints
    from gptspeed.locks import FolderLock

    monkeypatch.setattr(FolderLock, "_lock_folder", lambda self, fcntl: None)  # the folder cannot be locked
    src, data, run = corpus(tmp_path), tmp_path / "data", tmp_path / "run"
    prepare(str(src), data, shard_tokens=1000, shuffle_seed=1, progress=False)
    other = (
        ["--shard-tokens", "300", "--shuffle-seed", "1"]
        if change == "another shard size"
        else ["--shard-tokens", "1000", "--shuffle-seed", "2"]
    )
    seen = _prepare_during_step(monkeypatch, 2, str(src), "--out", str(data), "--force", "--no-progress", *other)
    with pytest.raises(GptspeedError) as e:
        _fit(data, run, max_steps=40)
    assert seen[0].returncode == 0, seen[0].stderr
    msg = str(e.value)
    assert "\n" not in msg and "train_000001.bin changed under the running job" in msg, msg
    (ck,) = list_checkpoints(run)
    step = int(ck.stem.split("_")[1])
    assert step >= 3 and f"the checkpoint of step {step} was saved" in msg and check_checkpoint(ck) is None, msg


def test_a_second_prepare_into_the_same_folder_is_refused_naming_the_first(tmp_path):
    """Two prepares into one folder deleted each other's staging chunks and left orphans."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS))
    out = tmp_path / "out"
    out.mkdir()
    staged = out / ".stream_000000.bin"
    write_shard(staged, np.arange(7))  # the first prepare's chunk, not yet in its progress file
    lock = prepare_lock(out).acquire()
    try:
        proc = run_main("prepare", str(src), "--out", str(out))
        assert_user_error(proc, f"{out} is being prepared by pid {os.getpid()}", "another `gptspeed prepare`")
        with pytest.raises(GptspeedError, match="being prepared by"):
            prepare(str(src), out, force=True, progress=False)
        assert staged.is_file() and sorted(p.name for p in out.iterdir()) == [".prepare.lock", staged.name]
    finally:
        lock.release()
    staged.unlink()
    prepare(str(src), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_000000.bin", "val_000000.bin"]


# ------------------------------------------------------------------------ where prepare writes
def test_prepare_writes_only_into_a_new_empty_or_gptspeed_data_folder(tmp_path, monkeypatch):
    """`prepare --out /` wrote its shards into `/`; a folder of the user's files was written into, and
    with --force a `manifest.json` of another program in it was deleted. Now `/`, the home folder
    and any folder holding files prepare did not write (and no gptspeed manifest) are one line,
    before anything is read or written."""
    src = corpus(tmp_path)
    # the source does not exist: before the fix this failed on it, never reaching / (safe to run anywhere)
    assert_user_error(run_main("prepare", str(tmp_path / "missing.jsonl"), "--out", "/"), "--out / is the root folder")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert_user_error(run_main("prepare", str(src), "--out", str(home)), "is your home folder")
    assert_user_error(run_main("prepare", str(src), "--out", "~"), "is your home folder")
    assert list(home.iterdir()) == []
    mine = tmp_path / "project"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "manifest.json").write_text(json.dumps({"name": "my web app"}))
    before = snapshot(mine)
    for force in ([], ["--force"]):
        proc = run_main("prepare", str(src), "--out", str(mine), *force)
        assert_user_error(proc, "already holds files `gptspeed prepare` did not write (manifest.json, notes.txt, sub)")
    assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["manifest.json", "notes.txt", "sub"]
    run = tmp_path / "run"  # a run folder's names
    run.mkdir()
    for name in ("ckpt_00000001.pt", "config.json", "metrics.jsonl"):
        (run / name).write_text("{}")
    assert_user_error(run_main("prepare", str(src), "--out", str(run), "--force"), "ckpt_00000001.pt, config.json")
    # fine: an empty folder, and a prepared one with the user's own notes beside its shards (kept)
    (tmp_path / "empty").mkdir()
    assert run_main("prepare", str(src), "--out", str(tmp_path / "empty"), "--no-progress").returncode == 0
    (tmp_path / "empty" / "README.md").write_text("notes")
    assert (
        run_main(
            "prepare", str(src), "--out", str(tmp_path / "empty"), "--force", "--shard-tokens", "500", "--no-progress"
        ).returncode
        == 0
    )
    assert (tmp_path / "empty" / "README.md").read_text() == "notes"


def test_a_source_file_that_changes_while_it_is_prepared_is_one_line_and_nothing_looks_prepared(tmp_path, monkeypatch):
    """Each file's sha256 is taken before it is read: a file still being written (a download, a
    script appending to it) gave shards of other text than the manifest's hash names. Now its
    size and time are checked after reading: one line, no manifest; once it is complete the same
    command prepares it."""
    import gptspeed.data.prepare as prepare_mod

    src, data = corpus(tmp_path, DOCS[:20]), tmp_path / "data"
    real = prepare_mod.iter_files

    def still_written(*a, **k):
        for i, doc in enumerate(real(*a, **k)):
            if i == 3:
                with open(src, "ab") as f:
                    f.write(json.dumps({"text": "one more line"}).encode() + b"\n")
            yield doc

    monkeypatch.setattr(prepare_mod, "iter_files", still_written)
    proc = run_main("prepare", str(src), "--out", str(data), "--no-progress")
    assert_user_error(proc, f"{src} changed while it was being prepared", "run the same command again")
    assert not (data / "manifest.json").exists()
    monkeypatch.setattr(prepare_mod, "iter_files", real)
    m = prepare(str(src), data, progress=False)
    assert m["documents"] == 21


@pytest.mark.parametrize(
    "case", ["a train shard twice", "a train shard as val", "val linked to train", "tokens other than the manifest's"]
)
def test_a_folder_that_is_not_what_its_manifest_says_is_refused(tmp_path, case):
    """A manifest listing a shard twice, or its train shard as val, trained silently (the same tokens
    twice an epoch; a val loss measured on training data). Now one line, where the folder is read."""
    data = _prepared(tmp_path)
    if case == "a train shard twice":
        _edit_manifest(data, lambda s: s["train"]["shards"].append("train_000000.bin"))
        expect = "lists the shard train_000000.bin twice in its train split"
    elif case == "a train shard as val":
        _edit_manifest(data, lambda s: s["val"]["shards"].append("train_000001.bin"))
        expect = "lists train_000001.bin as both a train and a val shard"
    elif case == "val linked to train":  # no manifest: shards found by name; one is a link to another
        (data / "manifest.json").unlink()
        (data / "val_000000.bin").unlink()
        (data / "val_000000.bin").symlink_to(data / "train_000000.bin")
        expect = "has train shard train_000000.bin and val shard val_000000.bin as the same file"
    else:
        toks = np.array(read_shard(data / "train_000001.bin"))
        write_shard(data / "train_000001.bin", toks[:500])  # replaced after prepare, by hand
        expect = "tokens but its manifest says"
    with pytest.raises(GptspeedError, match="prepare the folder again with --force") as e:
        find_train_data(str(data))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    if case == "a train shard as val":
        proc = run_main(*train_args(data, tmp_path / "run", max_steps=1))
        assert_user_error(proc, expect)


def test_the_default_corpus_cache_that_is_not_a_prepared_folder_is_one_line(tmp_path, monkeypatch):
    """`train` without --data prepares the shipped corpus into the cache and renames it into place:
    a folder already there without a manifest (an older or foreign one) was an OSError traceback,
    after the whole preparation. Now one line first, and the folder is left as it is."""
    from gptspeed.data.prepare import default_train_data

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    stray = tmp_path / "cache" / "prepared" / "tinyshakespeare"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(GptspeedError, match=r"tinyshakespeare exists but is not a prepared folder.*GPTSPEED_CACHE"):
        default_train_data(say=lambda m: None)
    assert snapshot(stray) == {"notes.txt": b"mine"}


def test_a_huge_document_reaches_the_bpe_in_bounded_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    """One 200 MB document (204 KB of gzip) went to tiktoken whole: ~60 bytes of memory a
    character, minutes at 10 GB. Now at most PIECE_CHARS characters go at once (here lowered to
    4,096), cut where the tokens cannot change (after a non-space, before a space or newline):
    the same tokens as the whole document (prepare and the stream loader share the code). A run with
    no such place longer than a piece (one 1M-character "word", the bomb's kind) is cut inside;
    its tokens still decode to its text."""
    from gptspeed.data import tokenize as T

    lengths: list[int] = []
    real = T.thread_encoding
    monkeypatch.setattr(T, "thread_encoding", lambda: _Recording(real(), lengths))
    monkeypatch.setattr(T, "PIECE_CHARS", 4096)
    enc = get_encoding()
    rng = np.random.default_rng(0)
    words = ["the", "cat", "don't", "1999", "naïve", "日本語", "🙂", "--", "'re", "\n", "\n\n", "  ", "\t", "\r\n"]
    prose = " ".join(rng.choice(words, 200_000))  # ~1M characters, every kind of space and word
    bomb = "a" * 1_000_000
    src = tmp_path / "bomb.jsonl.gz"
    src.write_bytes(
        gzip.compress(json.dumps({"text": prose}).encode() + b"\n" + json.dumps({"text": bomb}).encode() + b"\n")
    )
    prepare(str(src), tmp_path / "out", shard_tokens=1 << 20, workers=2, progress=False)
    assert lengths and max(lengths) <= 4096
    stream = np.concatenate([read_shard(p) for p in sorted((tmp_path / "out").glob("*.bin"))])  # train_ < val_
    second = int(np.flatnonzero(stream == EOT_TOKEN)[1])
    assert stream[1:second].tolist() == enc.encode_ordinary(prose)
    assert enc.decode(stream[second + 1 :].tolist()) == bomb


def test_a_prepared_folders_tokenizer_json_is_its_own_but_never_makes_a_folder_a_data_folder(tmp_path):
    """prepare --tokenizer TOK_DIR copies tokenizer.json into the folder before its manifest: a prepare killed
    between the two leaves nothing foreign for the next; a folder holding only a tokenizer.json (a tokenizer's
    or a run's) is no data folder."""
    from gptspeed.data.folder import foreign_entries, is_data_folder

    (tmp_path / "train_000000.bin").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / ".tokenizer.json.0123abcd.tmp").write_text("{}")
    assert foreign_entries(tmp_path) == []
    alone = tmp_path / "tok"
    alone.mkdir()
    (alone / "tokenizer.json").write_text("{}")
    assert not is_data_folder(alone) and foreign_entries(alone) == []
