"""``gptspeed.checkpoint.folder``: the run folder: one writer at a time (:func:`run_lock`), gptspeed's own or refused (:func:`refuse_foreign_folder`), created and -- when a new run fails before its first step -- left as it was found (:class:`RunFolder`); and the room a checkpoint needs there."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptspeed.checkpoint import (
    LOCK_NAME,
    RunFolder,
    refuse_foreign_folder,
    write_checkpoint_file,
)
from gptspeed.checkpoint.folder import foreign_entries
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_main
from support.run_folders import BASE, train
from support.training import flags

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ RunFolder.abandon
def _opened(path: Path, written=("config.json",)):
    rf = RunFolder(path, True)
    rf.open()
    for name in written:
        (path / name).write_text("{}")
    rf.written.update(written)
    return rf


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ the run folder's small rules
RUN_CONFIG = {"model": {}, "train": {}, "derived": {"run_id": "abc"}}


@pytest.mark.parametrize(
    "name, content, foreign",
    [
        ("config.json", RUN_CONFIG, False),
        ("config.json", {"model": {}, "train": {}, "source": {"hf_source": "gpt2"}}, False),
        ("config.json", {"model": {}, "train": {}}, True),
        ("config.json", {"model": {}, "train": {}, "derived": {}}, True),
        ("config.json", {"model": {}, "derived": {"run_id": "abc"}}, True),
        ("config.json", {"train": {}, "derived": {"run_id": "abc"}}, True),
        ("metrics.jsonl", {"step": 3, "train_loss": 1.0}, False),
        ("metrics.jsonl", {"epoch": 3}, True),
        ("metrics.jsonl", {"step": "3"}, True),
    ],
    ids=[
        "config-of-a-run",
        "config-of-an-imported-model",
        "config-with-model-and-train-only",
        "config-without-a-run-id",
        "config-without-train",
        "config-without-model",
        "metrics-of-a-run",
        "metrics-without-step",
        "metrics-with-a-text-step",
    ],
)
def test_a_config_or_metrics_file_is_gptspeeds_only_in_gptspeeds_form(tmp_path, name, content, foreign):
    """config.json is gptspeed's with a RunConfig's model and train groups and what only gptspeed adds (a
    run id, an import's source); metrics.jsonl (beside a run's config.json) with a first record whose step
    is an integer."""
    if name == "metrics.jsonl":
        (tmp_path / "config.json").write_text(json.dumps(RUN_CONFIG))
    (tmp_path / name).write_text(json.dumps(content) + "\n")
    assert foreign_entries(tmp_path) == ([name] if foreign else [])


@pytest.mark.parametrize("names", [["metrics.jsonl"], ["metrics.jsonl", LOCK_NAME], ["wandb"], ["tensorboard"]])
def test_a_metrics_log_or_a_trackers_folder_alone_is_the_users_and_never_written_over(tmp_path, names):
    """A folder holding only the user's metrics.jsonl (records with an integer step: gptspeed's form) or a
    W&B / TensorBoard folder is not a run's: gptspeed writes config.json before any of them, so alone they
    are the user's. `train --out` refuses the folder naming the file, writes nothing (it overwrote the
    log); beside a run's config.json or a checkpoint the same names are the run's."""
    for name in names:
        if name in ("wandb", "tensorboard"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "events").write_text("the user's")
        else:
            (tmp_path / name).write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    before = snapshot(tmp_path)
    folder = RunFolder(tmp_path, is_main=True)
    with pytest.raises(GptspeedError) as e:
        folder.open()
    assert str(e.value) == (
        f"--out {tmp_path} already holds files gptspeed did not write ({names[0]}): a run folder must be new, "
        "empty or a gptspeed run's; choose another --out"
    )
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == sorted(names)
    (tmp_path / "config.json").write_text(json.dumps(RUN_CONFIG))
    assert foreign_entries(tmp_path) == []
    (tmp_path / "config.json").unlink()
    (tmp_path / "ckpt_00000001.pt").write_bytes(b"")
    assert foreign_entries(tmp_path) == []


def test_an_out_through_a_missing_folder_and_back_is_checked_as_the_folder_it_names(tmp_path, monkeypatch):
    """`train --out nothere/../victim` wrote into victim, a folder of the user's files: checked as written,
    the path did not exist (nothere is missing), and once the run made nothere it named victim. The
    configuration resolves it (checked and written as victim); a RunFolder given such a path refuses it."""
    from gptspeed.configure import build_train_config

    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("\\chapter{One}")
    cfg = build_train_config("pico", {"out": "nothere/../victim", "data": "x"})
    assert cfg.train.out == str(victim)
    with pytest.raises(
        GptspeedError, match=r"--out .*victim already holds files gptspeed did not write \(thesis.tex\)"
    ):
        RunFolder(Path(cfg.train.out), is_main=True).open()
    with pytest.raises(GptspeedError) as e:
        RunFolder(Path("nothere/../victim"), is_main=True).open()
    assert str(e.value) == (
        f"--out nothere/../victim climbs out of nothere, which does not exist, with '..': give the run folder's "
        f"own path ({victim})"
    )
    assert sorted(os.listdir(tmp_path)) == ["victim"] and os.listdir(victim) == ["thesis.tex"]


MiB, KiB = 1 << 20, 1 << 10


@pytest.mark.parametrize("size, foreign", [(MiB, False), (MiB + 1, True)], ids=["one-MiB", "one-MiB-and-a-byte"])
def test_a_config_json_is_read_as_gptspeeds_up_to_one_mib(tmp_path, size, foreign):
    """A config.json is judged gptspeed's only up to 1 MiB (a run's is a few KiB; the read is bounded):
    one of gptspeed's form padded with JSON whitespace to 1 MiB is the run's own, one byte more is foreign."""
    text = json.dumps(RUN_CONFIG).encode()
    (tmp_path / "config.json").write_bytes(text[:-1] + b" " * (size - len(text)) + b"}")
    assert (tmp_path / "config.json").stat().st_size == size
    assert foreign_entries(tmp_path) == (["config.json"] if foreign else [])


def _record_of(size: int, pad: str) -> bytes:
    """A metrics record ``{"step": 1, "note": "..."}`` of exactly ``size`` bytes of UTF-8, its note ``pad`` repeated."""
    head, tail, unit = b'{"step": 1, "note": "', b'"}', pad.encode()
    n, rest = divmod(size - len(head) - len(tail), len(unit))
    return head + unit * n + b"x" * rest + tail


@pytest.mark.parametrize(
    "size, pad, foreign",
    [(64 * KiB, "x", False), (64 * KiB + 1, "x", True), (64 * KiB, "\u00e9", False), (64 * KiB + 1, "\u00e9", True)],
    ids=["64-KiB", "64-KiB-and-a-byte", "64-KiB-of-two-byte-characters", "64-KiB-and-a-byte-of-two-byte-characters"],
)
def test_the_first_metrics_record_is_read_as_gptspeeds_up_to_64_kib_of_bytes(tmp_path, size, pad, foreign):
    """metrics.jsonl is judged by its first line, read up to 64 KiB -- bytes, whatever characters they
    encode (gptspeed's records are a few hundred bytes): a first record of 64 KiB is the run's own, one
    of a byte more (cut short by the bounded read: not a JSON record) makes the file foreign."""
    record = _record_of(size, pad)
    assert len(record) == size
    (tmp_path / "config.json").write_text(json.dumps(RUN_CONFIG))
    (tmp_path / "metrics.jsonl").write_bytes(record + b"\n" + b'{"step": 2}\n')
    assert foreign_entries(tmp_path) == (["metrics.jsonl"] if foreign else [])


def test_abandon_removes_what_the_run_wrote_folders_too_and_the_folder_it_made(tmp_path):
    run = tmp_path / "run"
    rf = _opened(run)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_bytes(b"x")
    rf.written.add("tensorboard")
    rf.abandon()
    assert not run.exists(), f"left behind: {sorted(p.name for p in run.iterdir()) if run.exists() else ''}"


def test_abandon_keeps_a_made_folder_the_user_put_a_file_into(tmp_path):
    run = tmp_path / "run"
    rf = _opened(run)
    (run / "notes.txt").write_text("mine")
    rf.abandon()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_abandon_does_nothing_once_the_run_has_a_checkpoint_or_on_a_rank_that_did_not_open_it(tmp_path):
    run = tmp_path / "run"
    rf = _opened(run)
    write_checkpoint_file(run / "ckpt_00000001.pt", {"step": 1})
    rf.abandon()
    rf.close()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "ckpt_00000001.json", "ckpt_00000001.pt", "config.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_NAME).write_text("pid 1 on host")  # rank 0's lock; this rank (not main) never opened the folder
    not_main = RunFolder(other, False)
    not_main.open()
    not_main.abandon()
    assert (other / LOCK_NAME).exists(), "a rank that did not open the folder removed rank 0's lock"


def test_abandon_neither_follows_nor_raises_on_a_symlink_to_a_folder(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("theirs")
    rf = _opened(run)
    (run / "tensorboard").symlink_to(elsewhere)
    rf.written.add("tensorboard")
    rf.abandon()  # rmtree refuses a symlink: ignored, as every failure to remove is
    assert (elsewhere / "keep").read_text() == "theirs"
    assert not (run / LOCK_NAME).exists() and not (run / "config.json").exists()


def test_abandon_of_a_folder_deleted_meanwhile_raises_nothing(tmp_path):
    run = tmp_path / "run"
    rf = _opened(run)
    shutil.rmtree(run)  # the user removed it while the run failed
    rf.abandon()
    assert not run.exists()


# ------------------------------------------------------------------ the run folder and its lock
def test_a_checkpoint_that_needs_more_space_than_is_free_names_both_in_gib(tmp_path, monkeypatch):
    from gptspeed.checkpoint import folder as folder_mod

    monkeypatch.setattr(folder_mod.shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 30))
    folder_mod.check_free_space(tmp_path, 1 << 30)  # exactly enough: no refusal
    with pytest.raises(GptspeedError) as e:
        folder_mod.check_free_space(tmp_path, 3 * (1 << 29))
    assert f"{tmp_path} has 1.00 GiB free but a checkpoint needs about 1.50 GiB" in str(e.value)


@pytest.mark.parametrize(
    "n, shown",
    [
        (5, "a0, a1, a2, a3, a4)"),
        (6, "a0, a1, a2, a3, a4 and 1 more)"),
        (7, "a0, a1, a2, a3, a4 and 2 more)"),
    ],
)
def test_a_foreign_folder_shows_its_first_five_entries_and_counts_the_rest(tmp_path, n, shown):
    from gptspeed.checkpoint.folder import refuse_foreign_folder

    for i in range(n):
        (tmp_path / f"a{i}").write_text("the user's")
    with pytest.raises(GptspeedError) as e:
        refuse_foreign_folder(tmp_path)
    assert f"holds files gptspeed did not write ({shown}: a run folder must be new" in str(e.value)


def test_a_folder_and_lock_never_opened_close_and_release_quietly(tmp_path):
    """Another rank's RunFolder (never opened, holds no lock) closes without error; a lock is
    released once even when release is called again (as close and abandon both may)."""
    from gptspeed.checkpoint.folder import run_lock

    other_rank = RunFolder(tmp_path, is_main=False)
    other_rank.open()
    other_rank.close()
    assert other_rank.lock is None and not other_rank.opened and not other_rank.created
    run_lock(tmp_path).release()  # never acquired
    lock = run_lock(tmp_path).acquire()
    lock.release()
    lock.release()
    again = run_lock(tmp_path).acquire()  # the first one's flock is gone
    again.release()


def test_the_lock_file_names_its_holder_and_is_not_executable(tmp_path):
    """A new lock file is made rw-r--r-- (under umask 022), not executable; it holds exactly
    ``pid P on HOST``, also over an earlier holder's longer text."""
    import socket
    import stat

    from gptspeed.checkpoint.folder import run_lock

    path, holder = tmp_path / LOCK_NAME, f"pid {os.getpid()} on {socket.gethostname()}".encode()
    old = os.umask(0o022)
    try:
        lock = run_lock(tmp_path).acquire()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_bytes() == holder
    lock.release()
    path.write_text("pid 1 on an-earlier-holder-with-a-longer-name-than-this-one-" + "x" * len(holder))
    lock = run_lock(tmp_path).acquire()
    assert path.read_bytes() == holder
    lock.release()


@pytest.mark.parametrize(
    "make, code",
    [(lambda p: p.mkdir(), errno.EISDIR), (lambda p: p.symlink_to(p.with_name("notes.txt")), errno.ELOOP)],
    ids=["a-folder", "a-link-to-a-file"],
)
def test_the_lock_is_never_taken_through_what_stands_under_its_name(tmp_path, make, code):
    """A folder or a symbolic link under the lock's name is refused in one line with the system's
    reason; a link is never followed, so the file it points to is not truncated."""
    from gptspeed.checkpoint.folder import run_lock

    (tmp_path / "notes.txt").write_text("the user's notes")
    path = tmp_path / LOCK_NAME
    make(path)
    with pytest.raises(GptspeedError) as e:
        run_lock(tmp_path).acquire()
    assert str(e.value) == (
        f"cannot take the run folder's lock {path}: {os.strerror(code)}; it is gptspeed's own file: "
        "move whatever is there away (gptspeed makes it again)"
    )
    assert (tmp_path / "notes.txt").read_text() == "the user's notes"


def test_the_lock_is_taken_where_the_system_has_no_o_nofollow(tmp_path, monkeypatch):
    """os.O_NOFOLLOW is not on every platform: without it the lock is opened read-write as before and
    names its holder."""
    import socket

    from gptspeed.checkpoint.folder import run_lock

    monkeypatch.delattr(os, "O_NOFOLLOW", raising=False)
    lock = run_lock(tmp_path).acquire()
    try:
        assert (tmp_path / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    finally:
        lock.release()


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
def test_a_folder_under_the_name_of_a_runs_own_file_is_refused_beside_checkpoints(tmp_path, name):
    """Beside a checkpoint the folder counts as a run's (its extra entries are left alone), but a
    folder standing where the run writes its config.json or metrics.jsonl is refused, naming it,
    before the lock is taken."""
    (tmp_path / "ckpt_00000002.pt").write_bytes(b"")
    (tmp_path / name).mkdir()
    folder = RunFolder(tmp_path, is_main=True)
    with pytest.raises(GptspeedError) as e:
        folder.open()
    assert str(e.value) == (
        f"{tmp_path / name} is not a file (a folder?), where the run writes its {name}: move it away, then run again"
    )
    assert not folder.opened and not (tmp_path / LOCK_NAME).exists()


def test_a_write_probe_left_by_a_killed_start_is_not_a_foreign_file(tmp_path, monkeypatch):
    """A start killed between writing its write-test probe and removing it leaves the probe: the
    next start must not take the folder for the user's."""
    run = tmp_path / "run"
    real_unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)  # the kill, just before
    folder = RunFolder(run, is_main=True)
    folder.open()
    folder.close()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    left = sorted(p.name for p in run.iterdir())
    assert len(left) == 2 and LOCK_NAME in left  # the lock and the probe
    assert foreign_entries(run) == []
    RunFolder(run, is_main=True).open()  # the next start takes it


def test_a_stale_temporary_folder_that_cannot_be_removed_does_not_stop_a_start(tmp_path, monkeypatch):
    """A leftover ``.ckpt_N.dcp.tmp`` folder whose removal fails (another user's files in it, a
    read-only mount) is left: the start goes on."""
    from gptspeed.checkpoint import folder as folder_mod

    stale = tmp_path / ".ckpt_00000010.dcp.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")

    def rmtree_that_fails(path, ignore_errors=False, **kw):
        if not ignore_errors:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(folder_mod.shutil, "rmtree", rmtree_that_fails)
    folder = RunFolder(tmp_path, is_main=True)
    folder.open()
    assert folder.opened
    folder.close()


# ------------------------------------------------------------------ the size estimate, the parts' defaults, seals' small rules
def test_the_checkpoint_size_estimate_is_weights_plus_fp32_moments_plus_one_mib():
    """estimate_checkpoint_bytes: each parameter's bytes (numel x element size) plus
    ``optimizer_states`` (default 2, AdamW's moments) fp32 copies of it, plus 1 MiB; numbers by hand."""
    from gptspeed.checkpoint import estimate_checkpoint_bytes

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2, 3))  # 6 fp32: 24 bytes
    model.b = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))  # 10 bf16: 20 bytes
    weights, moments = 24 + 20, (6 + 10) * 4
    for states, expected in [
        (None, weights + 2 * moments + 2**20),
        (0, weights + 2**20),
        (1, weights + moments + 2**20),
    ]:
        got = estimate_checkpoint_bytes(model) if states is None else estimate_checkpoint_bytes(model, states)
        assert type(got) is int and got == expected, (
            f"optimizer_states={states}: expected {expected} bytes (weights + fp32 moments + 1 MiB), got {got!r}"
        )


# ------------------------------------------------------------------------ the folder is gptspeed's
def test_a_folder_of_the_users_files_is_refused_and_left_untouched(shakespeare_data, tmp_path):
    """`train --out DIR` over an HF model folder used to overwrite its config.json and metrics.jsonl,
    and a run failing before step 1 then deleted them."""
    hf = tmp_path / "my_model"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (hf / "metrics.jsonl").write_text("epoch,acc\n1,0.5\n")
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    before = snapshot(hf)
    proc = run_main(
        "train", "--preset", "pico", *flags(BASE), "--data", str(shakespeare_data), "--out", str(hf), "--max-steps", "1"
    )
    assert_user_error(
        proc,
        f"--out {hf} already holds files gptspeed did not write",
        "config.json, metrics.jsonl, model.safetensors",
        "choose another --out",
    )
    assert snapshot(hf) == before and sorted(p.name for p in hf.iterdir()) == sorted(before)  # not even a lock file


def test_the_data_folder_and_the_root_are_not_run_folders(shakespeare_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    before = snapshot(data)
    proc = run_main(
        "train", "--preset", "pico", *flags(BASE), "--data", str(data), "--out", str(data), "--max-steps", "1"
    )
    assert_user_error(proc, f"--out {data} is a prepared data folder", "choose another --out")
    assert snapshot(data) == before
    with pytest.raises(GptspeedError, match=r"--out / already holds files gptspeed did not write \(.*and \d+ more\)"):
        refuse_foreign_folder(Path("/"))  # checked alone: a test must not risk writing into /


def test_an_empty_folder_and_a_killed_runs_folder_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse_foreign_folder(empty)
    killed = tmp_path / "killed"  # a run killed before its first checkpoint: config.json, metrics.jsonl, lock
    killed.mkdir()
    (killed / "config.json").write_text(json.dumps({"model": {"n_layer": 1}, "train": {}, "derived": {"run_id": "r1"}}))
    (killed / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 10.9}) + "\n")
    (killed / ".gptspeed.lock").write_text("pid 1 on host")
    (killed / ".config.json.0123abcd.tmp").write_text("{")  # left by a kill inside an atomic write
    refuse_foreign_folder(killed)


def test_a_start_deletes_only_the_temporary_names_gptspeed_makes(shakespeare_data, tmp_path):
    """Opening a run folder deleted every hidden `.*.tmp` entry, the user's folders recursively."""
    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=1)
    thesis = run / ".thesis.tmp"
    thesis.mkdir()
    (thesis / "ch1.tex").write_text("\\chapter{One}")
    (run / ".notes.tmp").write_text("mine")
    (run / "loss.png").write_bytes(b"png")  # `gptspeed plot RUN --out RUN/loss.png`: kept on resume
    stale = [run / ".ckpt_00000009.pt.0a1b2c3d.tmp", run / ".ckpt_00000009.json.0a1b2c3d.tmp"]
    for p in stale:
        p.write_bytes(b"half")
    (run / ".ckpt_00000009.dcp.tmp").mkdir()
    (run / ".ckpt_00000009.dcp.tmp" / "__0_0.distcp").write_bytes(b"half")
    train(shakespeare_data, run, max_steps=2, resume=True)
    assert (thesis / "ch1.tex").read_text() == "\\chapter{One}" and (run / ".notes.tmp").read_text() == "mine"
    assert (run / "loss.png").exists()
    assert not any(p.exists() for p in stale) and not (run / ".ckpt_00000009.dcp.tmp").exists()


@pytest.mark.parametrize("run_id", ["", 7, ["abc"]], ids=["empty", "a-number", "a-list"])
def test_a_config_whose_run_id_is_not_a_named_string_is_not_gptspeeds(tmp_path, run_id):
    """gptspeed's run id is a non-empty string: a config.json with model and train groups whose derived run id
    is empty or not a string (another program's file) is foreign."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "train": {}, "derived": {"run_id": run_id}}))
    assert foreign_entries(tmp_path) == ["config.json"]
