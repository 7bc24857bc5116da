"""``gptspeed.checkpoint.consolidate``: ``gptspeed consolidate``: a sharded (FSDP2) checkpoint made one file, in one process, without GPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gptspeed.checkpoint import (
    consolidate,
)
from gptspeed.checkpoint.consolidate import split_optimizer_state
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_consolidate_keeps_an_existing_file_unless_forced(run, tmp_path):
    out = tmp_path / "model.pt"
    out.write_bytes(b"the user's file")
    with pytest.raises(GptspeedError, match="already exists: pass --force"):
        consolidate(run, out)
    assert out.read_bytes() == b"the user's file"


def test_consolidate_into_a_folder_copies_only_the_files_the_run_has(run, tmp_path):
    (run / "metrics.jsonl").unlink()
    out = consolidate(run, tmp_path / "new")
    assert sorted(p.name for p in out.parent.iterdir()) == ["ckpt_00000002.json", "ckpt_00000002.pt", "config.json"]
    assert (out.parent / "config.json").read_bytes() == (run / "config.json").read_bytes()


def test_out_named_as_a_checkpoint_suggests_a_file_beside_it(run, tmp_path):
    out = tmp_path / "ckpt_00000010.pt"
    with pytest.raises(GptspeedError) as e:
        consolidate(run, out, force=True)
    assert f"name another file (e.g. {tmp_path / 'model.pt'}) or a new run folder" in str(e.value)


def test_out_folder_with_checkpoints_is_refused_with_what_to_choose(run, tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / "ckpt_00000005.pt").write_bytes(b"theirs")
    with pytest.raises(GptspeedError) as e:
        consolidate(run, out, force=True)
    assert str(e.value) == f"{out} already holds checkpoints: choose a new or empty folder, or a FILE.pt"


def test_out_file_whose_seal_name_holds_json_without_a_hash_is_refused(run, tmp_path):
    (tmp_path / "model.json").write_text('{"bytes": 3}')
    with pytest.raises(GptspeedError, match="which is not a checkpoint's seal"):
        consolidate(run, tmp_path / "model.pt", force=True)
    assert (tmp_path / "model.json").read_text() == '{"bytes": 3}'


def test_optimizer_state_is_split_by_a_layout_of_three_optimizers():
    groups = [{"lr": i, "params": [f"p{i}"]} for i in range(4)]
    optim = {"state": {f"p{i}": {"m": i} for i in range(4)}, "param_groups": groups}
    out = split_optimizer_state(optim, [["a", 1], ["b", 2], ["c", 1]])
    assert [g["lr"] for g in out["a"]["param_groups"]] == [0]
    assert [g["lr"] for g in out["b"]["param_groups"]] == [1, 2]
    assert out["c"] == {"state": {0: {"m": 3}}, "param_groups": [{"lr": 3, "params": [0]}]}


def test_consolidate_never_writes_into_another_runs_or_a_data_folder(run, tmp_path):
    """The docs promise consolidate never writes into a run folder: a FILE.pt inside another run's folder
    (its checkpoints, or the config.json of a run killed before its first) or inside a prepared data folder,
    and a new folder inside either, were written; each is one line, nothing written."""
    other, killed, data = tmp_path / "other", tmp_path / "killed", tmp_path / "data"
    other.mkdir()
    (other / "ckpt_00000005.pt").write_bytes(b"theirs")
    killed.mkdir()
    (killed / "config.json").write_text(json.dumps({"model": {}, "train": {}, "derived": {"run_id": "another"}}))
    data.mkdir()
    (data / "train_000000.bin").write_bytes(b"shard")
    before = sorted(tmp_path.rglob("*"))
    for out, holder, what in [
        (other / "model.pt", other, "another run's folder"),
        (other / "sub", other, "another run's folder"),
        (killed / "model.pt", killed, "another run's folder"),
        (data / "model.pt", data, "a prepared data folder"),
        (data / "sub" / "deeper", data, "a prepared data folder"),
    ]:
        with pytest.raises(GptspeedError) as e:
            consolidate(run, out, force=True)
        assert str(e.value).startswith(f"--out {out} is inside {holder}, {what}: consolidate never writes"), e.value
    with pytest.raises(GptspeedError, match=f"--out {data} is {data}, a prepared data folder"):
        consolidate(run, data, force=True)
    assert sorted(tmp_path.rglob("*")) == before


def test_an_upper_case_pt_is_a_file_and_a_path_through_a_missing_folder_is_the_one_it_names(run, tmp_path, monkeypatch):
    """`--out H3B.PT` made a folder H3B.PT holding ckpt_N.pt: the suffix decides, whatever its case. `--out
    nothere/../victim` wrote into victim, a folder of the user's files (checked as written, it did not exist)."""
    monkeypatch.chdir(tmp_path)
    out = consolidate(run, Path("H3B.PT"))
    assert out.resolve() == tmp_path / "H3B.PT" and out.is_file() and (tmp_path / "H3B.json").is_file()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    with pytest.raises(GptspeedError, match=f"--out {victim} already holds files gptspeed did not write"):
        consolidate(run, Path("nothere/../victim"))
    assert os.listdir(victim) == ["notes.txt"] and not (tmp_path / "nothere").exists()


def test_consolidate_into_a_folder_takes_the_runs_tokenizer_json(run, tmp_path):
    """A run of its data's own tokenizer keeps it in its folder (gptspeed.run_tokenizer); the consolidated
    run folder has it too, so sample and eval decode there as in the run."""
    (run / "tokenizer.json").write_text('{"model": "the run\'s"}')
    out = consolidate(run, tmp_path / "new")
    assert (out.parent / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text('{"model": "another"}')
    with pytest.raises(GptspeedError, match="already holds a tokenizer.json that is not"):
        consolidate(run, tmp_path / "other")


def test_the_filesystem_root_as_out_is_one_line_refused_as_the_folder_it_is(run):
    """``--out /`` (a folder with no parent to search for a run or data folder) is checked as itself: one line,
    the folder of files gptspeed did not write, never an exception of the search."""
    with pytest.raises(GptspeedError, match="^--out / already holds files gptspeed did not write"):
        consolidate(run, Path("/"), force=True)
