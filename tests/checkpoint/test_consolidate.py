"""``gptspeed.checkpoint.consolidate``: ``gptspeed consolidate``: a sharded (FSDP2) checkpoint made one file, in one process, without GPUs."""

from __future__ import annotations

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
