"""``gptspeed.checkpoint.seals``: seals: what vouches for a checkpoint. ``ckpt_{step:08d}.json`` holds the bytes and sha256 of the checkpoint's file (of every file of a sharded folder), the step, the run's id and its run-defining configuration, so a resume decides without loading anything. A checkpoint counts only once sealed, only while its bytes match the seal, and only as the checkpoint of its own run and of the step its name says (:func:`not_of_run`). No torch here: reading a run's configuration costs no torch import."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from gptspeed.checkpoint import (
    check_checkpoint,
    data_changed,
    folder_run_id,
    write_checkpoint_file,
)
from gptspeed.checkpoint.formats import (
    write_failure,
)
from gptspeed.checkpoint.seals import intact_besides

from support.checkpoints import RUN_ID

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_failed_save_names_the_newest_intact_checkpoint_before_it(tmp_path):
    final = tmp_path / "ckpt_00000003.pt"
    full = OSError(errno.ENOSPC, "No space left on device")
    assert intact_besides(final) == "no earlier checkpoint exists"
    (tmp_path / "ckpt_00000002.pt").write_bytes(b"unsealed")  # not intact: never named as such
    assert intact_besides(final) == "no earlier checkpoint exists"
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1})
    assert intact_besides(final) == "the checkpoint of step 1 is intact"
    assert write_failure(final, 3, full).endswith("; the checkpoint of step 1 is intact: free space, then --resume")


def test_a_checkpoint_is_hashed_once_per_process(tmp_path, monkeypatch):
    import gptspeed.checkpoint.seals as seals

    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1})
    st = ckpt.stat()
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # not the file written here: not known valid
    hashed = []
    real = seals.sha256_file
    monkeypatch.setattr(seals, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert check_checkpoint(ckpt) is None and check_checkpoint(ckpt) is None
    assert hashed == [ckpt], f"a valid checkpoint must be hashed once, then known valid; hashed {hashed}"


@pytest.mark.parametrize(
    "recorded, now, changed",
    [
        (None, None, False),
        ({"a": 1}, None, True),
        (None, {"a": 1}, True),
        ({}, {"a": 1}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),  # a key recorded only later: compared on the recorded keys
        ({"a": 1}, {"a": 2}, True),
        ({"a": 1}, {"b": 1}, True),
    ],
)
def test_data_changed_compares_the_keys_the_checkpoint_recorded(recorded, now, changed):
    assert data_changed(recorded, now) is changed, f"data_changed({recorded}, {now}) should be {changed}"


@pytest.mark.parametrize(
    "config, run_id",
    [
        ({"model": {}, "train": {}}, None),
        ({"derived": [1]}, None),
        ({"derived": {}}, None),
        ({"derived": {"run_id": 5}}, None),
        ({"derived": {"run_id": ""}}, None),
        ({"derived": {"run_id": "abc"}}, "abc"),
    ],
    ids=["no-derived", "derived-a-list", "no-run-id", "run-id-an-int", "run-id-empty", "run-id"],
)
def test_folder_run_id_is_a_non_empty_string_or_none(tmp_path, config, run_id):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert folder_run_id(tmp_path) == run_id, f"config {config}: run id should be {run_id!r}"


def test_not_of_run_names_the_first_12_characters_of_both_run_ids(tmp_path):
    ckpt = tmp_path / "ckpt_00000003.pt"
    ckpt.with_suffix(".json").write_text(json.dumps({"step": 3, "run_id": "abcdefghijklmnopqrstuvwxyz"}))
    from gptspeed.checkpoint import not_of_run

    assert (
        not_of_run(ckpt, "0123456789ABCDEFGHIJ")
        == "it belongs to another run (run id abcdefghijkl; this folder's run is 0123456789AB)"
    ), "the reason must name the seal's run id and this folder's, each cut to 12 characters"
    assert not_of_run(ckpt, "abcdefghijklmnopqrstuvwxyz") is None


def test_a_seal_that_is_json_but_not_an_object_is_no_seal(tmp_path):
    from gptspeed.checkpoint import not_of_run, read_seal

    ckpt = tmp_path / "ckpt_00000003.pt"
    ckpt.with_suffix(".json").write_text("[3, 4]")
    assert read_seal(ckpt) is None, "read_seal must return None for a seal that is not a JSON object"
    assert not_of_run(ckpt, RUN_ID) is None  # unsealed or damaged: check_checkpoint's to say


def test_a_copy_with_the_same_names_sizes_and_times_in_another_folder_is_hashed_not_taken_as_verified(tmp_path):
    """The once-per-process cache is keyed by the checkpoint's resolved path too: a byte-flipped copy
    of a verified checkpoint elsewhere, with the same file names, sizes and mtimes, is still hashed."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_checkpoint_file(a / "ckpt_00000001.pt", {"step": 1})  # marked verified in this process
    for name in ("ckpt_00000001.pt", "ckpt_00000001.json"):
        shutil.copyfile(a / name, b / name)
    data = bytearray((b / "ckpt_00000001.pt").read_bytes())
    data[-1] ^= 0xFF
    (b / "ckpt_00000001.pt").write_bytes(bytes(data))
    for name in ("ckpt_00000001.pt", "ckpt_00000001.json"):
        st = (a / name).stat()
        os.utime(b / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert check_checkpoint(a / "ckpt_00000001.pt") is None
    assert check_checkpoint(b / "ckpt_00000001.pt") == "sha256 does not match its seal (corrupted)", (
        "a corrupted copy in another folder must not pass as the verified original"
    )


def test_marking_an_unlistable_checkpoint_verified_vouches_for_no_other(tmp_path):
    """A checkpoint whose files cannot be listed (gone) is cached under its own path: marking one
    such path verified leaves another missing checkpoint "not sealed"."""
    from gptspeed.checkpoint.seals import mark_verified

    mark_verified(tmp_path / "gone" / "ckpt_00000001.pt")
    assert check_checkpoint(tmp_path / "ckpt_00000002.pt") == "not sealed (interrupted while saving?)", (
        "a missing checkpoint must not be taken as verified because another missing path was marked"
    )


@pytest.mark.parametrize(
    "extra, derived, is_run",
    [
        ({}, {"run_id": "abc"}, True),
        ({"environment": {"device": "cpu"}}, {"run_id": "abc"}, True),
        ({"source": {"hf_source": "gpt2"}}, {"run_id": "abc"}, False),
        ({}, None, False),
        ({}, ["abc"], False),
    ],
    ids=["a-runs", "with-its-environment", "an-imported-models", "no-derived", "derived-a-list"],
)
def test_started_run_reads_only_a_runs_own_configuration(tmp_path, extra, derived, is_run):
    """config.json of a run that started (model, train and derived objects; environment beside them)
    gives back its configuration and derived entries; an imported model's (it names its source), or
    one without a derived object, is no run's start: None."""
    from gptspeed.checkpoint import started_run

    doc = {"model": {"n_layer": 2}, "train": {}, **extra}
    if derived is not None:
        doc["derived"] = derived
    (tmp_path / "config.json").write_text(json.dumps(doc))
    got = started_run(tmp_path)
    if not is_run:
        assert got is None, f"{doc} is not a run's configuration: started_run must return None"
        return
    cfg, got_derived = got
    assert cfg.model.n_layer == 2 and cfg.preset == "custom"
    assert got_derived == {"run_id": "abc"}


@pytest.mark.parametrize(
    "size, is_run", [(1 << 20, True), ((1 << 20) + 1, False)], ids=["one-MiB", "one-MiB-and-a-byte"]
)
def test_a_runs_configuration_is_read_up_to_one_mib_as_the_folders_rules_read_it(tmp_path, size, is_run):
    """started_run reads config.json only up to 1 MiB (a run's is a few KiB; the read is bounded), the
    bound the run folder's rules judge it by: a run's configuration padded with JSON whitespace to 1 MiB
    is the run's start and its own file; one byte more is no run's start (None) and a foreign file."""
    from gptspeed.checkpoint import started_run
    from gptspeed.checkpoint.folder import foreign_entries

    text = json.dumps({"model": {"n_layer": 2}, "train": {}, "derived": {"run_id": "abc"}}).encode()
    (tmp_path / "config.json").write_bytes(text[:-1] + b" " * (size - len(text)) + b"}")
    assert (tmp_path / "config.json").stat().st_size == size
    got = started_run(tmp_path)
    if is_run:
        assert got is not None and got[0].model.n_layer == 2 and got[1] == {"run_id": "abc"}
        assert foreign_entries(tmp_path) == []
    else:
        assert got is None, "a config.json over 1 MiB must not be read as a run's start"
        assert foreign_entries(tmp_path) == ["config.json"]


def test_a_runs_configuration_that_cannot_be_read_back_names_the_file(tmp_path):
    from gptspeed.checkpoint import started_run
    from gptspeed.errors import GptspeedError

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": {"n_layer": "four"}, "train": {}, "derived": {"run_id": "abc"}}))
    with pytest.raises(GptspeedError) as e:
        started_run(tmp_path)
    assert str(e.value) == f"run configuration {path}: n_layer must be int, got 'four'"
