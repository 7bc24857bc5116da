"""``gptspeed.checkpoint.formats``: the two checkpoint formats, one rule."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptspeed.checkpoint import (
    Checkpointer,
    RunFolder,
    check_checkpoint,
    checkpoint_config,
    consolidate,
    list_checkpoints,
    load_checkpoint,
    newest_run_config,
    save_checkpoint,
    write_checkpoint_file,
)
from gptspeed.checkpoint.formats import (
    DcpFormat,
    PtFormat,
    check_room,
    load_latest,
    load_latest_run,
)
from gptspeed.errors import GptspeedError

from support.checkpoints import CONFIG, RUN_ID, SHARD, Part, _info, _names, _parts, _Payload, _save, reseal

pytestmark = pytest.mark.usefixtures("one_thread")


def _damage(ckpt: Path, fqn: str) -> None:
    """Overwrite the bytes of entry ``fqn`` in the shard with garbage and reseal, as a forger can."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = _info(md, fqn)
    data = bytearray((ckpt / SHARD).read_bytes())
    data[info.offset : info.offset + info.length] = (b"\0garbage" * info.length)[: info.length]
    (ckpt / SHARD).write_bytes(bytes(data))
    reseal(ckpt)


# ------------------------------------------------------------------ load_checkpoint: what it refuses, and how it says so
_DROP = object()


def _edit_seal(ckpt: Path, **changes) -> None:
    """Rewrite the seal of the ``.pt`` checkpoint ``ckpt`` with ``changes`` (``_DROP``: remove the key);
    its bytes and sha256 still vouch for the file, so the checkpoint stays valid."""
    seal = ckpt.with_suffix(".json")
    info = json.loads(seal.read_text())
    for key, value in changes.items():
        if value is _DROP:
            info.pop(key)
        else:
            info[key] = value
    seal.write_text(json.dumps(info))


def _renamed(path, state_step, state_run, name_step, seal_step, seal_run):
    """The one-line refusal of a checkpoint whose step or run id disagrees with its name or seal."""
    return (
        f"checkpoint {path} holds step {state_step} of run {state_run}, but its name says step {name_step} and its "
        f"seal step {seal_step} of run {seal_run}: it was renamed or pieced together; delete it or resume from another"
    )


# ------------------------------------------------------------------ check_room: the free space a .pt save needs
MiB = 2**20


def _free(monkeypatch, free: int) -> None:
    """The run folder's file system has ``free`` bytes free (shutil.disk_usage, which check_room asks)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**40, used=2**40 - free, free=free))


def _sized(path: Path, size: int) -> Path:
    """An unsealed file of exactly ``size`` bytes under a checkpoint's name (sparse: nothing is written)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


class Killed(BaseException):
    """The process dying at this instant (nothing after it runs: no except OSError, no cleanup)."""


def test_a_sharded_save_puts_every_other_part_in_meta_pt_and_seals_a_full_checkpoint(run):
    ckpt = run / "ckpt_00000002.dcp"
    state = load_checkpoint(ckpt)  # sealed, format and step checked
    assert state["sharded"] is True and state["step"] == 2 and state["run_id"] == RUN_ID
    assert state["config"] == CONFIG and state["optimizer_layout"] is None
    assert torch.equal(state["rng"]["torch"], torch.arange(4, dtype=torch.uint8))
    assert "model" not in state and "optimizer" not in state  # those are the shards'
    seal = json.loads((run / "ckpt_00000002.json").read_text())
    assert seal["kind"] == "full" and seal["step"] == 2 and seal["run_id"] == RUN_ID


def test_a_sharded_load_restores_the_shards_in_place_and_returns_the_rest(run):
    parts = _parts(scale=0.0)
    rest = DcpFormat(run, True, lambda: None, 2).load(run / "ckpt_00000002.dcp", parts, {"model", "optimizer"})
    assert torch.equal(parts["model"].sd["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(parts["optimizer"].sd["state"]["w"]["exp_avg"], torch.full((2, 3), 0.5))
    assert "model" not in rest and "optimizer" not in rest
    assert rest["step"] == 2 and torch.equal(rest["rng"]["torch"], torch.arange(4, dtype=torch.uint8))


def test_a_sharded_save_replaces_a_leftover_of_its_step_and_a_killed_saves_temporary_folder(tmp_path):
    run = tmp_path / "run"
    for leftover in (run / "ckpt_00000002.dcp", run / ".ckpt_00000002.dcp.tmp"):
        leftover.mkdir(parents=True)
        (leftover / "stale.distcp").write_bytes(b"old")
    final = _save(run, 2)
    assert sorted(p.name for p in final.iterdir()) == [".metadata", SHARD, "meta.pt"]
    assert not (run / ".ckpt_00000002.dcp.tmp").exists() and check_checkpoint(final) is None


def test_a_sharded_save_prunes_its_own_run_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    theirs = run / "ckpt_00000001.pt"  # copied in from another run: never counted, never deleted
    write_checkpoint_file(theirs, {"step": 1, "run_id": "another-run"})
    _save(run, 2, keep=1)
    _save(run, 3, keep=1)
    assert sorted(p.name for p in run.iterdir()) == [
        "ckpt_00000001.json",
        "ckpt_00000001.pt",
        "ckpt_00000003.dcp",
        "ckpt_00000003.json",
    ]


def test_a_damaged_bytes_entry_is_named_in_one_line(run, tmp_path):
    ckpt = run / "ckpt_00000002.dcp"
    _damage(ckpt, "optimizer.param_groups.0.lr")  # a non-tensor entry torch.load cannot read
    with pytest.raises(GptspeedError) as e:
        consolidate(run, tmp_path / "out.pt")
    assert (
        str(e.value)
        == f"refusing to load {ckpt}: its entry optimizer.param_groups.0.lr is unreadable (UnpicklingError)"
    )
    assert not (tmp_path / "out.pt").exists()


def test_a_crafted_bytes_entry_is_refused_even_where_torch_is_told_to_unpickle_freely(run, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns every torch.load that does not pass weights_only into a
    full unpickle: the reader passes it, so a crafted entry still runs nothing."""
    marker = tmp_path / "pwned"
    ckpt = run / "ckpt_00000002.dcp"
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    offset = (ckpt / SHARD).stat().st_size
    with open(ckpt / SHARD, "ab") as f:
        f.write(payload.getvalue())
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = _info(md, "optimizer.param_groups.0.lr")
    info.offset, info.length = offset, len(payload.getvalue())
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    reseal(ckpt)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(GptspeedError, match="its entry optimizer.param_groups.0.lr asks for posix.system"):
        consolidate(run, tmp_path / "out.pt")
    assert not marker.exists()


def test_a_damaged_tensor_entry_names_the_folder_on_consolidate_and_on_resume(run, tmp_path):
    ckpt = run / "ckpt_00000002.dcp"
    _damage(ckpt, "model.w")
    with pytest.raises(GptspeedError) as e:
        consolidate(run, tmp_path / "out.pt")
    assert str(e.value).startswith(f"could not read the shards of {ckpt} (UnpicklingError: ")
    with pytest.raises(GptspeedError) as e:
        DcpFormat(run, True, lambda: None, 2).load(ckpt, _parts(), {"model"})
    assert str(e.value).startswith(f"could not read the shards of {ckpt} (UnpicklingError: ")
    assert not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------ consolidate
def test_the_consolidated_file_records_its_source_and_runs_on_any_parallelism(run, tmp_path):
    out = consolidate(run, tmp_path / "a" / "b" / "model.pt")  # its folders are made
    assert out == tmp_path / "a" / "b" / "model.pt"
    ck = load_checkpoint(out)
    assert ck["consolidated_from"] == str(run / "ckpt_00000002.dcp")
    assert ck["config"] == {**CONFIG, "runtime": {"parallel": "auto", "device": "cpu"}}
    assert "sharded" not in ck  # one file, not a sharded checkpoint
    assert torch.equal(ck["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert ck["optimizer"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]


def test_out_symlink_to_a_folder_inside_the_run_is_refused(run, tmp_path):
    (run / "sub").mkdir()
    link = tmp_path / "link"
    link.symlink_to(run / "sub")
    with pytest.raises(GptspeedError, match="the run being consolidated: choose a path outside it"):
        consolidate(run, link, force=True)
    assert list((run / "sub").iterdir()) == []


def test_out_file_that_is_a_symlink_is_replaced_not_followed(run, tmp_path):
    (run / "notes.pt").write_bytes(b"the run's file")
    link = tmp_path / "link.pt"
    link.symlink_to(run / "notes.pt")
    assert consolidate(run, link, force=True) == link
    assert not link.is_symlink() and load_checkpoint(link)["step"] == 2
    assert (run / "notes.pt").read_bytes() == b"the run's file"


def test_out_config_json_of_the_same_size_and_time_but_other_bytes_is_refused(run, tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    mine, theirs = run / "config.json", out / "config.json"
    theirs.write_text(mine.read_text().replace(RUN_ID, "run-two"))
    st = mine.stat()
    os.utime(theirs, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert theirs.stat().st_size == st.st_size and theirs.read_bytes() != mine.read_bytes()
    with pytest.raises(GptspeedError, match=f"already holds a config.json that is not {run}'s"):
        consolidate(run, out, force=True)


def test_load_latest_reads_the_newest_checkpoint_onto_the_cpu_by_default(tmp_path):
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1, "w": torch.ones(2)})
    write_checkpoint_file(tmp_path / "ckpt_00000002.pt", {"step": 2, "w": torch.full((2,), 2.0)})
    ck = load_latest(tmp_path)
    assert ck["step"] == 2 and ck["w"].device == torch.device("cpu") and torch.equal(ck["w"], torch.full((2,), 2.0))


def test_load_latest_says_which_newer_checkpoint_it_skipped_and_why_and_which_it_uses(tmp_path, capsys):
    """`sample` (and eval, export-hf) fell back to an older checkpoint without a word when the newest one's
    seal was unreadable; now one line on stderr names the skipped one, its reason and the one used, as
    --resume does. Nothing is said when the newest is valid."""
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1, "w": torch.ones(2)})
    assert load_latest(tmp_path)["step"] == 1 and capsys.readouterr().err == ""
    write_checkpoint_file(tmp_path / "ckpt_00000002.pt", {"step": 2, "w": torch.full((2,), 2.0)})
    (tmp_path / "ckpt_00000002.json").write_bytes(b"\xff\xfe not a seal")
    assert load_latest(tmp_path)["step"] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("skipping ckpt_00000002.pt (") and "seal" in err, err
    assert err.endswith("): using ckpt_00000001.pt, the newest valid checkpoint\n"), err


def test_load_latest_and_load_latest_run_put_the_tensors_where_map_location_says(tmp_path):
    from gptspeed.config import RunConfig

    write_checkpoint_file(
        tmp_path / "ckpt_00000001.pt", {"step": 1, "w": torch.ones(2), "config": RunConfig().to_dict()}
    )
    assert load_latest(tmp_path, map_location="meta")["w"].device.type == "meta", (
        "load_latest did not pass its map_location on"
    )
    ck, config = load_latest_run(tmp_path, map_location="meta")
    assert ck["w"].device.type == "meta", "load_latest_run did not pass its map_location on"
    assert config == RunConfig()


def test_load_checkpoint_verifies_the_seal_unless_told_not_to(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1})
    _edit_seal(ckpt, sha256="0" * 64)  # the bytes are the same, the seal no longer vouches for them
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == f"checkpoint {ckpt} is not valid: sha256 does not match its seal (corrupted)", (
        "load_checkpoint must check the seal by default"
    )
    assert load_checkpoint(ckpt, verify=False)["step"] == 1


def test_load_checkpoint_puts_the_tensors_where_map_location_says(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1, "w": torch.ones(2)})
    assert load_checkpoint(ckpt, map_location="meta")["w"].device.type == "meta", (
        "map_location was not passed to torch.load"
    )


def test_load_checkpoint_never_unpickles_code_even_where_torch_is_told_to(tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes every torch.load that does not pass weights_only=True a
    full unpickle: a sealed file holding a crafted object is refused, and the object's code never runs."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1, "x": _Payload(marker)})  # sealed: only the unpickling can refuse it
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    assert not marker.exists(), "torch.load ran the checkpoint's pickled code: weights_only=True was not passed"
    assert str(e.value) == f"checkpoint {ckpt} is unreadable (UnpicklingError): delete it or resume from another"


def test_load_checkpoint_refuses_a_dict_of_another_format(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"format": "another-tool", "step": 1})  # format_version 2, step and seal right
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == f"{ckpt} is not a gptspeed checkpoint", "a dict whose format is not gptspeed's was loaded"


def test_load_checkpoint_refuses_a_seal_of_another_run_and_names_both_ids(tmp_path):
    ckpt = tmp_path / "ckpt_00000002.pt"
    write_checkpoint_file(ckpt, {"step": 2, "run_id": "aaaaaaaaaaaa-inside"})
    _edit_seal(ckpt, run_id="bbbbbbbbbbbb-sealed")  # steps agree; only the run ids differ
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    # each run id cut to its first 12 characters, as not_of_run shows them
    assert str(e.value) == _renamed(ckpt, 2, "aaaaaaaaaaaa", 2, 2, "bbbbbbbbbbbb")


def test_load_checkpoint_refuses_a_seal_of_another_step(tmp_path):
    ckpt = tmp_path / "ckpt_00000002.pt"
    write_checkpoint_file(ckpt, {"step": 2, "run_id": RUN_ID})
    _edit_seal(ckpt, step=3)  # the name and the content say 2, the seal 3
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == _renamed(ckpt, 2, RUN_ID, 2, 3, RUN_ID)


def test_a_file_not_named_as_a_checkpoint_takes_its_step_from_the_seal(tmp_path):
    ckpt = tmp_path / "model.pt"  # e.g. consolidate --out model.pt: the name says no step
    write_checkpoint_file(ckpt, {"step": 3, "run_id": RUN_ID})
    _edit_seal(ckpt, step=5)
    with pytest.raises(GptspeedError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == _renamed(ckpt, 3, RUN_ID, 5, 5, RUN_ID), "the step to expect is the seal's (5)"
    _edit_seal(ckpt, step=_DROP)  # a seal without a step: only the bytes are vouched for, any step goes
    assert load_checkpoint(ckpt)["step"] == 3, "a seal without a step must not refuse the file's step"


# ------------------------------------------------------------------ Checkpointer.load and load_part
def test_a_weights_only_checkpoint_restores_the_model_only_and_returns_the_other_entries(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1, "note": "hi", "model": {"w": torch.full((2,), 7.0)}})
    model, optimizer = Part({"w": torch.zeros(2)}), Part({"state": {}})
    ck = Checkpointer(tmp_path)
    ck.register("model", model)
    ck.register("optimizer", optimizer)
    rest = ck.load(ckpt)
    assert torch.equal(model.sd["w"], torch.full((2,), 7.0))
    assert optimizer.sd == {"state": {}}, "a part the checkpoint does not hold must be left as it is"
    assert rest == {"format": "gptspeed-checkpoint", "format_version": 2, "step": 1, "note": "hi"}, (
        "load must return the checkpoint's entries other than the registered parts"
    )


# ------------------------------------------------------------------ seals
def test_a_sharded_file_of_the_right_size_but_other_bytes_does_not_match_its_seal(run):
    ckpt = run / "ckpt_00000002.dcp"
    shard = ckpt / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    st = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # surely another identity than the cached one
    assert check_checkpoint(ckpt) == f"{SHARD} does not match its seal (truncated or corrupted)"


def test_checkpoint_config_refuses_a_seal_without_a_configuration(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1})  # sealed, no "config"
    for path in (ckpt, tmp_path / "ckpt_00000009.pt"):  # ... and one with no seal at all
        with pytest.raises(GptspeedError) as e:
            checkpoint_config(path)
        assert str(e.value) == (
            f"checkpoint {path} was written by an older gptspeed (its seal holds no configuration): "
            "resume it with the gptspeed that wrote it"
        )


def test_newest_run_config_names_the_checkpoint_whose_configuration_is_malformed(tmp_path):
    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1, "config": {"model": 5}})
    with pytest.raises(GptspeedError) as e:
        newest_run_config(tmp_path)
    assert str(e.value) == f"checkpoint {ckpt}: 'model' must be an object, got int", (
        "the error must name the checkpoint"
    )


def test_check_room_says_both_sizes_in_mib_and_which_checkpoint_is_intact(tmp_path, monkeypatch):
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1})  # sealed: the intact one
    _sized(tmp_path / "ckpt_00000002.pt", 5 * MiB // 2)  # the newest .pt: 2.5 MiB (unsealed: not named intact)
    _free(monkeypatch, 3 * MiB // 2)  # 1.5 MiB
    with pytest.raises(GptspeedError) as e:
        check_room(tmp_path, 3)
    assert str(e.value) == (
        f"not enough space to save step 3 in {tmp_path}: 1.5 MiB free, the last checkpoint took "
        "2.5 MiB; the checkpoint of step 1 is intact: free space, then --resume"
    ), "check_room must give the free space (1.5) and the last checkpoint's size (2.5) in MiB (bytes / 2**20)"


def test_check_room_lets_a_save_go_when_the_free_space_equals_the_last_checkpoints_size(tmp_path, monkeypatch):
    _sized(tmp_path / "ckpt_00000002.pt", 5 * MiB // 2)
    _free(monkeypatch, 5 * MiB // 2)
    check_room(tmp_path, 3)  # exactly as much free space as the last checkpoint took: enough
    _free(monkeypatch, 5 * MiB // 2 - 1)
    with pytest.raises(GptspeedError, match="not enough space to save step 3"):
        check_room(tmp_path, 3)


def test_check_room_counts_neither_the_step_being_saved_nor_a_sharded_folder(tmp_path, monkeypatch):
    _free(monkeypatch, 0)
    (tmp_path / "ckpt_00000002.dcp").mkdir()  # sharded: a full disk there is write_failure's to report
    _sized(tmp_path / "ckpt_00000003.pt", 5 * MiB // 2)  # a leftover of the step being saved: replaced, not kept
    try:
        check_room(tmp_path, 3)  # no other .pt checkpoint: nothing to compare with, no error
    except GptspeedError as e:
        pytest.fail(f"check_room counted the step being saved or a sharded folder as the last checkpoint: {e}")


def test_save_checkpoint_keeps_the_newest_two_by_default(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step, "run_id": RUN_ID})
    assert _names(tmp_path) == ["ckpt_00000002.json", "ckpt_00000002.pt", "ckpt_00000003.json", "ckpt_00000003.pt"], (
        "save_checkpoint without keep must keep the newest 2 checkpoints"
    )


def test_save_checkpoint_prunes_its_own_runs_checkpoints_only(tmp_path):
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1, "run_id": "another-run"})  # copied in
    save_checkpoint(tmp_path, {"step": 2, "run_id": RUN_ID}, keep=1)
    save_checkpoint(tmp_path, {"step": 3, "run_id": RUN_ID}, keep=1)
    assert _names(tmp_path) == ["ckpt_00000001.json", "ckpt_00000001.pt", "ckpt_00000003.json", "ckpt_00000003.pt"], (
        "save_checkpoint must prune by the state's run id: another run's checkpoint is never counted nor deleted"
    )


# ------------------------------------------------------------------ prune_checkpoints: what is already gone; seals: what they record
@pytest.mark.parametrize("gone", ["seal", "file"])
def test_prune_does_not_raise_when_another_process_removed_part_of_an_old_checkpoint_meanwhile(
    tmp_path, monkeypatch, gone
):
    import gptspeed.checkpoint.formats as formats

    old, new = tmp_path / "ckpt_00000001.pt", tmp_path / "ckpt_00000002.pt"
    write_checkpoint_file(old, {"step": 1})
    write_checkpoint_file(new, {"step": 2})
    real = formats.not_of_run

    def listed_then_removed(p, run_id):  # the other process deletes between the listing and the unlink
        answer = real(p, run_id)
        if p == old:
            (old.with_suffix(".json") if gone == "seal" else old).unlink()
        return answer

    monkeypatch.setattr(formats, "not_of_run", listed_then_removed)
    try:
        formats.prune_checkpoints(tmp_path, keep=1)
    except FileNotFoundError as e:
        pytest.fail(f"pruning must not raise when the old checkpoint's {gone} is already gone: {e}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000002.json", "ckpt_00000002.pt"]


def test_prune_neither_raises_on_nor_follows_a_checkpoint_folder_that_is_a_symlink(tmp_path):
    from gptspeed.checkpoint.formats import prune_checkpoints

    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "meta.pt").write_bytes(b"theirs")
    (run / "ckpt_00000001.dcp").symlink_to(elsewhere, target_is_directory=True)
    (run / "ckpt_00000001.json").write_text(json.dumps({"step": 1, "files": {}}))
    write_checkpoint_file(run / "ckpt_00000002.pt", {"step": 2})
    try:
        prune_checkpoints(run, keep=1)
    except OSError as e:
        pytest.fail(f"pruning must not raise on an old checkpoint folder it cannot delete (a symlink): {e}")
    assert (elsewhere / "meta.pt").read_bytes() == b"theirs", "pruning must not delete what a symlink points to"
    assert not (run / "ckpt_00000001.json").exists(), "the old checkpoint must still be unsealed"


def test_a_checkpoint_written_in_this_process_is_known_valid_without_hashing_it_again(tmp_path, monkeypatch):
    import gptspeed.checkpoint.seals as seals

    ckpt = tmp_path / "ckpt_00000001.pt"
    write_checkpoint_file(ckpt, {"step": 1})  # hashed while written, then marked verified
    hashed = []
    real = seals.sha256_file
    monkeypatch.setattr(seals, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert check_checkpoint(ckpt) is None
    assert hashed == [], f"a checkpoint written and sealed here must be known valid, not hashed again; hashed {hashed}"


@pytest.mark.parametrize("fmt", [PtFormat, DcpFormat], ids=["pt", "dcp"])
def test_a_formats_load_leaves_verifying_to_its_caller_and_hashes_nothing(tmp_path, monkeypatch, fmt):
    """A format's load reads the checkpoint without hashing it: Checkpointer.load is given a checkpoint
    that find_resume_point verified already, so a resume hashes a checkpoint once, in that check -- here
    one this process did not write (its seal touched since), which check_checkpoint would hash afresh."""
    import gptspeed.checkpoint.seals as seals

    if fmt is DcpFormat:
        ckpt, parts, sharded = _save(tmp_path, 2), _parts(scale=0.0), {"model", "optimizer"}
    else:
        ckpt, parts, sharded = tmp_path / "ckpt_00000002.pt", {}, set()
        write_checkpoint_file(ckpt, {"step": 2, "run_id": RUN_ID})
    seal = ckpt.with_suffix(".json")
    st = seal.stat()
    os.utime(seal, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # not the checkpoint written here: not known valid
    hashed = []
    real = seals.sha256_file
    monkeypatch.setattr(seals, "sha256_file", lambda p: hashed.append(p) or real(p))
    rest = fmt(tmp_path, True, lambda: None, 2).load(ckpt, parts, sharded)
    assert rest["step"] == 2 and rest["run_id"] == RUN_ID
    assert hashed == [], f"a format's load must not hash the checkpoint (its caller verified it); it hashed {hashed}"
    assert check_checkpoint(ckpt) is None and hashed, "the checkpoint is valid: the check hashes it"


@pytest.mark.parametrize("optimizer, kind", [(False, "weights"), (True, "full")])
def test_a_seal_repeats_the_step_config_data_world_size_and_run_id_and_says_the_kind(tmp_path, optimizer, kind):
    ckpt = tmp_path / "ckpt_00000003.pt"
    state = {"step": 3, "config": CONFIG, "data": {"tokens": 10}, "world_size": 4, "run_id": RUN_ID, "other": 1}
    if optimizer:
        state["optimizer"] = {"state": {}, "param_groups": []}
    write_checkpoint_file(ckpt, state)
    seal = json.loads(ckpt.with_suffix(".json").read_text())
    assert {k: v for k, v in seal.items() if k not in ("bytes", "sha256")} == {
        "step": 3,
        "config": CONFIG,
        "data": {"tokens": 10},
        "world_size": 4,
        "run_id": RUN_ID,
        "kind": kind,
    }, f"the seal must repeat step, config, data, world_size and run_id, and say kind {kind!r}; it holds {seal}"


@pytest.mark.parametrize("where", ["torch.save", "inside torch's zip writer"])
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    """A full disk while saving is one line naming the step and the intact checkpoint. Inside
    torch.save's zip writer the OSError used to be hidden behind "[enforce fail at
    inline_container.cc] unexpected pos" (a RuntimeError: a traceback, not a user error)."""
    import gptspeed.checkpoint.formats as ck

    first = save_checkpoint(tmp_path, {"step": 1, "w": torch.ones(3)})

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    if where == "torch.save":
        monkeypatch.setattr(torch, "save", full_disk)
    else:
        real_write = ck._HashingWriter.write
        monkeypatch.setattr(
            ck._HashingWriter, "write", lambda self, b: full_disk() if self.bytes > 64 else real_write(self, b)
        )
    with pytest.raises(GptspeedError) as e:
        save_checkpoint(tmp_path, {"step": 2, "w": torch.ones(3000)})
    assert str(e.value) == (
        f"no space left on the device of {tmp_path} while saving step 2; the checkpoint of step 1 "
        "is intact: free space, then --resume"
    )
    assert list_checkpoints(tmp_path) == [first] and check_checkpoint(first) is None
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", ["pt", "dcp"])
def test_a_checkpoint_never_stands_under_its_name_unsealed(tmp_path, monkeypatch, kind, when):
    """A kill just before or just after a checkpoint's rename to its name: before, there is no
    checkpoint (a seal alone is not one) and a --resume starts again; after, it is sealed and valid.
    The seal used to be written after the rename, so a kill in between left an unsealed checkpoint,
    the only one of a run killed during its first save, and --resume refused the folder."""
    import os

    import gptspeed.checkpoint.formats as ck
    import gptspeed.fileio as fio

    run = tmp_path / "run"
    run.mkdir()
    real_replace = os.replace

    def dying_replace(src, dst):
        if ck.CKPT_RE.match(Path(dst).name):
            if when == "before":
                raise Killed
            real_replace(src, dst)
            raise Killed
        real_replace(src, dst)

    if kind == "pt":
        monkeypatch.setattr(fio.os, "replace", dying_replace)
        with pytest.raises(Killed):
            save_checkpoint(run, {"step": 1, "w": torch.ones(3)})
    else:
        partial = run / ".ckpt_00000001.dcp.tmp"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"shard bytes")
        (partial / "meta.pt").write_bytes(b"meta")
        monkeypatch.setattr(ck.os, "replace", dying_replace)
        with pytest.raises(Killed):
            ck.seal_sharded(partial, {"step": 1}, final=ck.checkpoint_path(run, 1, sharded=True))
    monkeypatch.setattr(ck.os, "replace", real_replace)
    found = list_checkpoints(run)
    RunFolder(run, is_main=True).open()  # the next start removes what the killed save left under a hidden name
    assert not list(run.glob(".*.tmp"))
    if when == "before":
        assert found == []
    else:
        assert [p.name for p in found] == [f"ckpt_00000001.{kind}"] and check_checkpoint(found[0]) is None


def test_a_disk_too_full_for_the_next_checkpoint_is_said_before_writing(tmp_path, monkeypatch):
    """Less free space than the last checkpoint took: one line before anything is written (the
    disk is not filled halfway through the save); with room, the save goes ahead."""
    import shutil as sh

    first = save_checkpoint(tmp_path, {"step": 1, "w": torch.ones(3000)})
    size = first.stat().st_size
    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10 * size, 9 * size, size - 1))
    with pytest.raises(GptspeedError) as e:
        save_checkpoint(tmp_path, {"step": 2, "w": torch.ones(3000)})
    assert str(e.value).startswith(f"not enough space to save step 2 in {tmp_path}: ")
    assert str(e.value).endswith("the checkpoint of step 1 is intact: free space, then --resume")
    assert list_checkpoints(tmp_path) == [first] and not list(tmp_path.glob(".*.tmp"))
    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10 * size, 8 * size, 2 * size))
    assert save_checkpoint(tmp_path, {"step": 2, "w": torch.ones(3000)}).name == "ckpt_00000002.pt"


def test_a_prune_killed_midway_never_leaves_an_unsealed_checkpoint_under_its_name(tmp_path, monkeypatch):
    """A SIGKILL between deleting an old checkpoint's file and its seal: the prune used to unseal first,
    so the kill left an unsealed ``.pt`` that every later prune skipped (unverifiable) and kept for good."""
    from gptspeed.checkpoint import check_checkpoint, list_checkpoints
    from gptspeed.checkpoint.formats import prune_checkpoints

    for step in (1, 2, 3):
        write_checkpoint_file(tmp_path / f"ckpt_{step:08d}.pt", {"step": step})
    real_unlink = Path.unlink
    calls = []

    def killed_after_one(self, *a, **k):  # the process dies after its first deletion
        if calls:
            raise SystemExit("killed")
        calls.append(self.name)
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", killed_after_one)
    with pytest.raises(SystemExit):
        prune_checkpoints(tmp_path, keep=2)
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert [check_checkpoint(c) for c in list_checkpoints(tmp_path)] == [None, None]  # steps 2 and 3, sealed
    prune_checkpoints(tmp_path, keep=2)  # the next prune finds nothing of step 1 to keep or refuse
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt_00000001")) in (
        [],
        ["ckpt_00000001.json"],
    )


def test_load_latest_names_every_newer_checkpoint_it_skipped_in_one_line(tmp_path, capsys):
    """Two newer checkpoints with unreadable seals: the one line names both, newest first, each with its
    reason, separated by a comma, then the one used."""
    for step in (1, 2, 3):
        write_checkpoint_file(tmp_path / f"ckpt_{step:08d}.pt", {"step": step, "w": torch.ones(2)})
    for step in (2, 3):
        (tmp_path / f"ckpt_{step:08d}.json").write_bytes(b"\xff\xfe not a seal")
    assert load_latest(tmp_path)["step"] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("skipping ckpt_00000003.pt ("), err
    assert "), ckpt_00000002.pt (" in err and err.endswith("): using ckpt_00000001.pt, the newest valid checkpoint\n")
