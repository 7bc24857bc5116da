"""Mutation-check gaps in gptspeed.checkpoint (tools/mutation/README.md): the allow-list check of a
sharded checkpoint's ``.metadata`` clause by clause (a hand-built metadata object that breaks
exactly one rule is refused with its reason; the same object without the break is read), damaged
entries named in one line, what a sharded save writes and prunes, the rules for ``consolidate
--out``, and the small rules of the run folder (whose config.json / metrics.jsonl is gptspeed's,
which checkpoint is still intact, the step in a name); and what load_checkpoint refuses and how it
says so, a part that does not fit its checkpoint, the RNG part, seals (hashed once, configuration,
run id, data identity) and what RunFolder.abandon removes.

Sharded checkpoints here are written by :class:`~gptspeed.checkpoint.formats.DcpFormat` from
plain state dicts (a two-tensor "model", an AdamW-shaped "optimizer", an "rng" part): the same
``.metadata`` / ``__0_0.distcp`` / ``meta.pt`` folder and seal as a model's, in ~50 ms."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_safe_dcp import _Payload, reseal
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from gptspeed.checkpoint import (
    LOCK_NAME,
    Checkpointer,
    RNGState,
    RunFolder,
    check_checkpoint,
    checkpoint_config,
    consolidate,
    data_changed,
    folder_run_id,
    load_checkpoint,
    load_part,
    newest_run_config,
    write_checkpoint_file,
)
from gptspeed.checkpoint.consolidate import split_optimizer_state
from gptspeed.checkpoint.dcp_reader import SafeFileSystemReader, _one_line, _SafeBytes, read_metadata
from gptspeed.checkpoint.folder import foreign_entries
from gptspeed.checkpoint.formats import (
    DcpFormat,
    check_room,
    load_latest,
    load_latest_run,
    save_checkpoint,
    write_failure,
)
from gptspeed.checkpoint.paths import step_of
from gptspeed.checkpoint.seals import intact_besides
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD = "__0_0.distcp"
SHARD_BYTES = 32  # exactly the bytes of the one tensor below (float32, 2 x 4)


# ------------------------------------------------------------------ hand-built .metadata, clause by clause
def _metadata() -> Metadata:
    """A valid metadata object: tensor ``w`` (float32 2x4, one chunk) and bytes entry ``lr``, both in
    ``__0_0.distcp``; planner paths; a StorageMeta."""
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([2, 4]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4]))],
    )
    storage = {
        MetadataIndex("w", torch.Size([0, 0]), 0): _StorageInfo(SHARD, 0, 24),
        MetadataIndex("lr"): _StorageInfo(SHARD, 24, 8),
    }
    return Metadata(
        {"w": w, "lr": BytesStorageMetadata()},
        planner_data={"w": ("w",), "lr": ("lr",)},
        storage_data=storage,
        storage_meta=StorageMeta(save_id="the-save"),
    )


def _info(md, fqn="w") -> _StorageInfo:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def _folder(tmp_path: Path, md) -> Path:
    """A checkpoint folder holding ``md`` (pickled as DCP does) and a 32-byte shard."""
    folder = tmp_path / "ckpt_00000002.dcp"
    folder.mkdir()
    (folder / SHARD).write_bytes(b"\0" * SHARD_BYTES)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return folder


def _set(attr_path, value):
    """change(md): set ``md.<attr_path>`` (dots; ``w`` = the tensor entry, ``chunk`` its chunk,
    ``info`` its storage entry, ``lr_info`` the bytes entry's) to ``value``."""

    def change(md):
        roots = {
            "md": md,
            "w": md.state_dict_metadata["w"],
            "chunk": md.state_dict_metadata["w"].chunks[0],
            "info": _info(md),
            "lr_info": _info(md, "lr"),
        }
        *path, last = attr_path.split(".")
        obj = roots[path[0]]
        for name in path[1:]:
            obj = getattr(obj, name)
        setattr(obj, last, value)
        return md

    return change


def _only_w_with_planner_index(p):
    def change(md):
        md.state_dict_metadata.pop("lr")
        md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn == "w"}
        md.planner_data = {"w": ("w", p)}
        return md

    return change


def _rekey(attr, key):
    def change(md):
        d = getattr(md, attr)
        first = next(iter(d))
        d[key] = d.pop(first)
        return md

    return change


def _put(attr, key, value):
    """change(md): ``md.<attr>[key] = value`` (key None: the first key)."""

    def change(md):
        d = getattr(md, attr)
        d[next(iter(d)) if key is None else key] = value
        return md

    return change


def _bigger_tensor(md):
    w = md.state_dict_metadata["w"]
    w.size = torch.Size([4, 4])
    w.chunks[0].sizes = torch.Size([4, 4])
    return md


REFUSED = [
    ("not-a-Metadata", lambda md: {"state_dict_metadata": md.state_dict_metadata}, "it holds a dict"),
    (
        "entries-not-a-dict",
        lambda md: _set("md.state_dict_metadata", list(md.state_dict_metadata.values()))(md),
        "its entries or storage are not dicts",
    ),
    (
        "storage-not-a-dict",
        lambda md: _set("md.storage_data", list(md.storage_data.items()))(md),
        "its entries or storage are not dicts",
    ),
    ("entry-name-not-a-str", _rekey("state_dict_metadata", 5), "an entry named 5"),
    ("entry-properties-not-TensorProperties", _set("w.properties", None), "entry w is malformed"),
    ("entry-dtype-not-a-dtype", _set("w.properties.dtype", "float32"), "entry w is malformed"),
    ("entry-size-not-a-Size", _set("w.size", (2, 4)), "entry w is malformed"),
    (
        "entry-chunks-not-a-list",
        lambda md: _set("w.chunks", tuple(md.state_dict_metadata["w"].chunks))(md),
        "entry w is malformed",
    ),
    ("chunk-not-a-ChunkStorageMetadata", _set("w.chunks", [BytesStorageMetadata()]), "entry w has a malformed chunk"),
    ("chunk-offsets-not-a-Size", _set("chunk.offsets", (0, 0)), "entry w has a malformed chunk"),
    ("chunk-offsets-negative", _set("chunk.offsets", torch.Size([-1, 0])), "entry w has a malformed chunk"),
    ("chunk-sizes-not-a-Size", _set("chunk.sizes", (2, 4)), "entry w has a malformed chunk"),
    (
        "chunk-rank-not-the-tensors",
        lambda md: _set("chunk.sizes", torch.Size([8]))(_set("chunk.offsets", torch.Size([0]))(md)),
        "entry w has a malformed chunk",
    ),
    (
        "entry-of-another-kind",
        _put("state_dict_metadata", "lr", ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))),
        "entry lr is a ChunkStorageMetadata",
    ),
    ("planner-not-a-dict", _set("md.planner_data", [("w",)]), "its planner data is not a dict"),
    ("planner-name-not-a-str", _rekey("planner_data", 5), "its planner data for 5 is malformed"),
    ("planner-path-a-str", _set("md.planner_data", {"w": "w"}), "its planner data for w is malformed"),
    ("planner-index-not-an-int", _set("md.planner_data", {"w": ("w", 0.0)}), "its planner data for w is malformed"),
    ("planner-index-negative", _set("md.planner_data", {"w": ("w", -1)}), "its planner data for w is malformed"),
    ("planner-index-past-the-entries", _only_w_with_planner_index(1), "its planner data for w is malformed"),
    ("storage-key-not-a-MetadataIndex", _rekey("storage_data", "w"), "a storage entry is malformed"),
    ("storage-value-not-a-StorageInfo", _put("storage_data", None, (SHARD, 0, 24)), "a storage entry is malformed"),
    ("path-not-a-str", _set("info.relative_path", 5), "a storage entry points outside the folder ('5')"),
    ("path-empty", _set("info.relative_path", ""), "a storage entry points outside the folder ('')"),
    ("path-dot", _set("info.relative_path", "."), "a storage entry points outside the folder ('.')"),
    ("path-parent", _set("info.relative_path", ".."), "a storage entry points outside the folder ('..')"),
    ("path-in-a-subfolder", _set("info.relative_path", "sub/x"), "a storage entry points outside the folder ('sub/x')"),
    (
        "path-with-a-backslash",
        _set("info.relative_path", "a\\b"),
        "a storage entry points outside the folder ('a\\\\b')",
    ),
    ("path-with-a-nul", _set("info.relative_path", "a\0b"), "a storage entry points outside the folder ('a\\x00b')"),
    (
        "path-names-a-folder",
        _set("info.relative_path", "sub"),
        "a storage entry names sub, which is not a file of the folder",
    ),
    (
        "path-names-a-missing-file",
        _set("info.relative_path", "__1_0.distcp"),
        "a storage entry names __1_0.distcp, which is not a file of the folder",
    ),
    ("offset-not-an-int", _set("info.offset", 0.0), f"a storage entry lies outside {SHARD}"),
    ("length-not-an-int", _set("info.length", 24.0), f"a storage entry lies outside {SHARD}"),
    ("offset-negative", _set("info.offset", -1), f"a storage entry lies outside {SHARD}"),
    ("length-negative", _set("lr_info.length", -1), f"a storage entry lies outside {SHARD}"),
    ("past-the-end-of-the-file", _set("info.length", SHARD_BYTES + 1), f"a storage entry lies outside {SHARD}"),
    (
        "stream-transforms",
        _set("info.transform_descriptors", ["zstandard"]),
        "a storage entry asks for stream transforms ['zstandard'], which gptspeed never writes",
    ),
    ("tensors-larger-than-the-files", _bigger_tensor, "its tensors would take 64 bytes, but its files hold 32"),
]


@pytest.mark.parametrize("change, reason", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_metadata_that_breaks_one_rule_is_refused_with_its_reason(tmp_path, change, reason):
    folder = _folder(tmp_path, change(_metadata()))
    (folder / "sub").mkdir()
    (folder / "a\\b").write_bytes(b"\0" * 8)  # a real file: the backslash alone is the reason
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == f"refusing to load {folder}: its .metadata is not a checkpoint's metadata ({reason})"


ACCEPTED = [
    ("tensors-fill-the-files-exactly", lambda md: md),
    ("an-empty-bytes-entry", _set("lr_info.length", 0)),
    ("no-planner-data", _set("md.planner_data", None)),
    ("planner-index-inside-the-entries", _set("md.planner_data", {"w": ("w", 1), "lr": ("lr", 0)})),
]


@pytest.mark.parametrize("change", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_metadata_within_every_rule_is_read(tmp_path, change):
    md = read_metadata(_folder(tmp_path, change(_metadata())))
    assert type(md) is Metadata and sorted(md.state_dict_metadata) == ["lr", "w"]
    assert md.storage_meta.save_id == "the-save"  # the file's own StorageMeta, kept


def test_metadata_without_a_storage_meta_is_given_an_empty_one(tmp_path):
    folder = _folder(tmp_path, _set("md.storage_meta", None)(_metadata()))
    md = read_metadata(folder)
    assert type(md.storage_meta) is StorageMeta and md.storage_meta.save_id == StorageMeta().save_id
    # torch's reader then stamps it with its load id
    reader = SafeFileSystemReader(folder)
    assert reader.read_metadata().storage_meta.load_id == reader.load_id is not None


def test_a_metadata_folder_in_place_of_the_file_is_no_metadata(tmp_path):
    folder = _folder(tmp_path, _metadata())
    (folder / ".metadata").unlink()
    (folder / ".metadata").mkdir()
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == f"checkpoint {folder} has no .metadata file: it is not a complete sharded checkpoint"


@pytest.mark.parametrize(
    "content, why",
    [(b"", "EOFError"), (b"\x80\x09", "ValueError: unsupported pickle protocol: 9")],
    ids=["empty", "unknown-protocol"],
)
def test_damaged_metadata_names_the_error_and_its_message(tmp_path, content, why):
    folder = _folder(tmp_path, _metadata())
    (folder / ".metadata").write_bytes(content)
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == f"checkpoint {folder} is unreadable: its .metadata is damaged ({why})"


# A name longer than a refusal shows: every refusal shows its first 80 characters ("one line, never a
# wall of text"); digits, so that the cut point shows in a failure.
LONG = "0123456789" * 10
CUT = LONG[:80]


def _long_entry(change_w):
    """change(md): the tensor entry ``w`` renamed to LONG, then ``change_w(entry)`` applied to it."""

    def change(md):
        w = md.state_dict_metadata.pop("w")
        change_w(w)
        md.state_dict_metadata[LONG] = w
        return md

    return change


def _long_path(path):
    """change(md): the tensor's storage entry names ``path`` (its bytes entry still the shard)."""
    return _set("info.relative_path", path)


LONG_REFUSED = [
    ("entry-malformed", _long_entry(lambda w: setattr(w, "properties", None)), f"entry {CUT} is malformed"),
    (
        "entry-chunk-malformed",
        _long_entry(lambda w: setattr(w, "chunks", [BytesStorageMetadata()])),
        f"entry {CUT} has a malformed chunk",
    ),
    (
        "entry-of-another-kind",
        lambda md: _put("state_dict_metadata", LONG, ChunkStorageMetadata(torch.Size([0]), torch.Size([1])))(md),
        f"entry {CUT} is a ChunkStorageMetadata",
    ),
    (
        "planner-data-malformed",
        _set("md.planner_data", {"w": ("w",), LONG: "w"}),
        f"its planner data for {CUT} is malformed",
    ),
    (
        "path-outside",
        _long_path("sub/" + LONG),
        f"a storage entry points outside the folder ({('sub/' + LONG)[:80]!r})",
    ),
    ("path-missing", _long_path(LONG), f"a storage entry names {CUT}, which is not a file of the folder"),
    (
        "path-too-short",
        lambda md: _set("info.length", SHARD_BYTES + 1)(_long_path("x" + LONG[1:])(md)),
        f"a storage entry lies outside {('x' + LONG[1:])[:80]}",
    ),
]


@pytest.mark.parametrize("change, reason", [c[1:] for c in LONG_REFUSED], ids=[c[0] for c in LONG_REFUSED])
def test_a_refusal_shows_the_first_80_characters_of_a_long_name(tmp_path, change, reason):
    folder = _folder(tmp_path, change(_metadata()))
    (folder / ("x" + LONG[1:])).write_bytes(b"\0" * SHARD_BYTES)  # a real file, too short for the entry
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == f"refusing to load {folder}: its .metadata is not a checkpoint's metadata ({reason})", (
        "a name in a refusal must be cut to exactly its first 80 characters"
    )


def test_a_refusal_lists_the_first_3_stream_transforms(tmp_path):
    folder = _folder(tmp_path, _set("info.transform_descriptors", ["t1", "t2", "t3", "t4", "t5"])(_metadata()))
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == (
        f"refusing to load {folder}: its .metadata is not a checkpoint's metadata (a storage entry "
        "asks for stream transforms ['t1', 't2', 't3'], which gptspeed never writes)"
    ), "the refusal must list exactly the first 3 stream transforms"


@pytest.mark.parametrize("name", ["XX.XX", "...", ".hidden", "a.b.distcp"])
def test_a_storage_file_with_dots_in_its_name_is_read(tmp_path, name):
    """Only "", "." and ".." are refused as names; any other plain name with dots is a file of the folder."""
    md = _metadata()
    for info in md.storage_data.values():
        info.relative_path = name
    folder = _folder(tmp_path, md)
    (folder / SHARD).rename(folder / name)
    assert sorted(read_metadata(folder).state_dict_metadata) == ["lr", "w"], f"a shard named {name!r} was refused"


def test_metadata_of_a_torch_without_stream_transforms_is_read(tmp_path, monkeypatch):
    """Older torch versions' _StorageInfo has no transform_descriptors field: simulated by removing the
    class default (the pickled entries never hold a None field), the metadata is still read."""
    folder = _folder(tmp_path, _metadata())
    monkeypatch.delattr(_StorageInfo, "transform_descriptors")
    md = read_metadata(folder)
    assert not any(hasattr(info, "transform_descriptors") for info in md.storage_data.values())
    assert sorted(md.state_dict_metadata) == ["lr", "w"]


def test_damaged_metadata_shows_the_first_160_characters_of_the_error(tmp_path):
    folder = _folder(tmp_path, _metadata())
    # an allowed global (torch.serialization._get_layout) called with an unknown 300-character layout name:
    # KeyError, whose message is the name quoted
    name = ("abcdefghij" * 30).encode()
    (folder / ".metadata").write_bytes(
        b"\x80\x02ctorch.serialization\n_get_layout\nX" + len(name).to_bytes(4, "little") + name + b"\x85R."
    )
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    shown = ("'" + "abcdefghij" * 30 + "'")[:160]
    assert str(e.value) == f"checkpoint {folder} is unreadable: its .metadata is damaged (KeyError: {shown})", (
        "the error's message must be cut to exactly its first 160 characters"
    )


def test_an_unreadable_bytes_entry_shows_the_first_80_characters_of_its_name(tmp_path):
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn=LONG))
    with pytest.raises(GptspeedError) as e:
        _SafeBytes(None, tmp_path).load_bytes(item, io.BytesIO(b"garbage"))
    assert str(e.value) == f"refusing to load {tmp_path}: its entry {CUT} is unreadable (UnpicklingError)", (
        "the entry's name must be cut to exactly its first 80 characters"
    )


@pytest.mark.parametrize(
    "error, shown",
    [
        (ValueError("first line\nsecond line"), "ValueError: first line"),
        (ValueError("y" * 300), "ValueError: " + "y" * 200),
        (ValueError(), "ValueError"),
        (ValueError(" \n "), "ValueError"),
    ],
    ids=["first-line", "cut-at-200", "no-message", "blank-message"],
)
def test_a_failed_shard_read_is_one_line_with_the_first_line_of_the_error(tmp_path, error, shown):
    from torch.distributed.checkpoint.api import CheckpointException

    failure = CheckpointException("load failed", {0: (error, traceback.StackSummary())})
    assert str(_one_line(tmp_path, failure)) == f"could not read the shards of {tmp_path} ({shown})", (
        "the failure must show its type and its message's first line cut at 200 characters, or its type alone"
    )


def test_an_error_torch_raises_itself_while_reading_the_shards_is_one_line_too(tmp_path, monkeypatch):
    """load_full's catch-all hands _one_line torch's own exception (no CheckpointException, so no
    ``failures``): it is shown as a rank's failure is, not lost to an AttributeError."""
    import torch.distributed.checkpoint.state_dict_loader as dcp_loader

    from gptspeed.checkpoint.dcp_reader import load_full

    folder = _folder(tmp_path, _metadata())

    def fails(*args, **kwargs):
        raise ValueError("bad shard\nsecond line")

    monkeypatch.setattr(dcp_loader, "_load_state_dict", fails)
    with pytest.raises(GptspeedError) as e:
        load_full(folder)
    assert str(e.value) == f"could not read the shards of {folder} (ValueError: bad shard)", (
        "an exception without failures must be shown with its type and first line"
    )


def test_a_bytes_entry_holding_a_tensor_saved_on_a_gpu_is_read_onto_the_cpu(tmp_path, monkeypatch):
    """consolidate runs without GPUs: a non-tensor entry that holds a tensor saved on a GPU (its
    storage tagged cuda:0, as torch.save writes it there) is read onto the CPU and passed on, not
    refused for the lack of CUDA."""
    import torch.serialization

    saved = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"t": torch.arange(3.0)}, saved)
    assert b"cuda:0" in saved.getvalue()
    passed = []
    planner = SimpleNamespace(load_bytes=lambda item, value: passed.append(torch.load(value, weights_only=True)))
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="extra.t"))
    _SafeBytes(planner, tmp_path).load_bytes(item, io.BytesIO(saved.getvalue()))
    ((got,),) = [list(p.values()) for p in passed]
    assert got.device.type == "cpu" and torch.equal(got, torch.arange(3.0)), (
        "a bytes entry's tensor must be loaded with map_location='cpu'"
    )


def test_the_reader_never_falls_back_to_rank_local_metadata(tmp_path):
    folder = _folder(tmp_path, _metadata())
    reader = SafeFileSystemReader(folder)
    with pytest.raises(GptspeedError, match=f"checkpoint {folder} has no readable .metadata"):
        reader.read_metadata(rank=0)


# ------------------------------------------------------------------ sharded checkpoints of plain state dicts
class Part:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


CONFIG = {"model": {"n_layer": 1}, "train": {"lr": 0.1}, "runtime": {"parallel": "fsdp", "device": "cpu"}}
RUN_ID = "run-one"


def _parts(scale=1.0):
    return {
        "model": Part({"w": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.ones(3) * scale}),
        "optimizer": Part(
            {
                "state": {"w": {"exp_avg": torch.full((2, 3), 0.5 * scale), "step": torch.tensor(1.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}],
            }
        ),
        "rng": Part({"torch": torch.arange(4, dtype=torch.uint8)}),
    }


def _save(run: Path, step: int, keep: int = 2, run_id: str = RUN_ID) -> Path:
    fmt = DcpFormat(run, True, lambda: None, keep)
    return fmt.save(
        step, _parts(), {"config": CONFIG, "run_id": run_id}, {"optimizer_layout": None}, {"model", "optimizer"}
    )


@pytest.fixture
def run(tmp_path):
    """A run folder with config.json, metrics.jsonl and the sharded checkpoint of step 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**CONFIG, "derived": {"run_id": RUN_ID}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    _save(run, 2)
    return run


def _damage(ckpt: Path, fqn: str) -> None:
    """Overwrite the bytes of entry ``fqn`` in the shard with garbage and reseal, as a forger can."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = _info(md, fqn)
    data = bytearray((ckpt / SHARD).read_bytes())
    data[info.offset : info.offset + info.length] = (b"\0garbage" * info.length)[: info.length]
    (ckpt / SHARD).write_bytes(bytes(data))
    reseal(ckpt)


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


# ------------------------------------------------------------------ the run folder's small rules
@pytest.mark.parametrize(
    "name, content, foreign",
    [
        ("config.json", {"model": {}, "train": {}}, False),
        ("config.json", {"model": {}}, True),
        ("config.json", {"train": {}}, True),
        ("metrics.jsonl", {"step": 3, "train_loss": 1.0}, False),
        ("metrics.jsonl", {"epoch": 3}, True),
        ("metrics.jsonl", {"step": "3"}, True),
    ],
    ids=[
        "config-of-a-run",
        "config-without-train",
        "config-without-model",
        "metrics-of-a-run",
        "metrics-without-step",
        "metrics-with-a-text-step",
    ],
)
def test_a_config_or_metrics_file_is_gptspeeds_only_in_gptspeeds_form(tmp_path, name, content, foreign):
    (tmp_path / name).write_text(json.dumps(content) + "\n")
    assert foreign_entries(tmp_path) == ([name] if foreign else [])


def test_a_failed_save_names_the_newest_intact_checkpoint_before_it(tmp_path):
    final = tmp_path / "ckpt_00000003.pt"
    full = OSError(errno.ENOSPC, "No space left on device")
    assert intact_besides(final) == "no earlier checkpoint exists"
    (tmp_path / "ckpt_00000002.pt").write_bytes(b"unsealed")  # not intact: never named as such
    assert intact_besides(final) == "no earlier checkpoint exists"
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1})
    assert intact_besides(final) == "the checkpoint of step 1 is intact"
    assert write_failure(final, 3, full).endswith("; the checkpoint of step 1 is intact: free space, then --resume")


def test_load_latest_reads_the_newest_checkpoint_onto_the_cpu_by_default(tmp_path):
    write_checkpoint_file(tmp_path / "ckpt_00000001.pt", {"step": 1, "w": torch.ones(2)})
    write_checkpoint_file(tmp_path / "ckpt_00000002.pt", {"step": 2, "w": torch.full((2,), 2.0)})
    ck = load_latest(tmp_path)
    assert ck["step"] == 2 and ck["w"].device == torch.device("cpu") and torch.equal(ck["w"], torch.full((2,), 2.0))


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


def test_step_of_reads_a_checkpoints_name_and_is_0_for_another():
    assert step_of(Path("run/ckpt_00000042.dcp")) == 42
    assert step_of(Path("run/model.pt")) == 0


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


class _Raises:
    def __init__(self, error):
        self.error = error

    def load_state_dict(self, state):
        raise self.error


_TAIL = "resume with the settings it was written with, or start a new --out"


@pytest.mark.parametrize(
    "part, state, detail",
    [
        # torch's errors: a first line naming the module, then the telling line
        (torch.nn.Linear(2, 3), {"weight": torch.zeros(3, 2)}, 'Missing key(s) in state_dict: "bias".'),
        (
            torch.nn.Linear(2, 3),
            {"weight": torch.zeros(3, 2), "bias": torch.zeros(3), "extra": torch.zeros(1)},
            'Unexpected key(s) in state_dict: "extra".',
        ),
        # any other error: its first line, cut at 200 characters; its type when it has no message
        (_Raises(ValueError("bad value\nsecond line")), {}, "bad value"),
        (_Raises(RuntimeError("x" * 300)), {}, "x" * 200),
        (_Raises(RuntimeError()), {}, "RuntimeError"),
    ],
    ids=["missing-key", "unexpected-key", "first-line", "cut-at-200", "no-message"],
)
def test_a_part_that_does_not_fit_is_one_line_with_the_telling_line_of_the_error(part, state, detail):
    with pytest.raises(GptspeedError) as e:
        load_part(Path("run/ckpt_00000002.pt"), "model", part, state)
    assert str(e.value) == f"checkpoint ckpt_00000002.pt: its model state does not fit this run ({detail}): {_TAIL}"


def test_rng_state_sets_the_cuda_generator_only_on_a_cuda_device_and_only_when_saved(monkeypatch):
    """On this CPU machine torch.cuda.set_rng_state is replaced by a recorder: a RNGState of device
    cuda restores a saved CUDA state on its device; of device cpu, or with none saved, it sets none."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    cpu_state, cuda_state = torch.get_rng_state(), torch.arange(8, dtype=torch.uint8)
    cuda = torch.device("cuda")
    RNGState(cuda).load_state_dict({"torch": cpu_state, "cuda": cuda_state})
    assert len(calls) == 1 and calls[0][0] is cuda_state and calls[0][1] == cuda, (
        f"the saved CUDA state must be set once on the cuda device, got {calls}"
    )
    calls.clear()
    RNGState(cuda).load_state_dict({"torch": cpu_state, "cuda": None})
    RNGState(torch.device("cpu")).load_state_dict({"torch": cpu_state, "cuda": cuda_state})
    assert calls == [], "no CUDA state may be set without a saved one, or on a CPU device"


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


# ------------------------------------------------------------------ RunFolder.abandon
def _opened(path: Path, written=("config.json",)):
    rf = RunFolder(path, True)
    rf.open()
    for name in written:
        (path / name).write_text("{}")
    rf.written.update(written)
    return rf


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


# ------------------------------------------------------------------ save_checkpoint: keep's default, its run id
def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


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


# ------------------------------------------------------------------ the Checkpointer: defaults, where parts go
class _ThreeGroups:
    """An optimizer as OptimizerState sees it: three param groups and a state_dict (a real torch.optim
    optimizer's first construction imports torch._dynamo, ~2 s)."""

    def __init__(self):
        self.param_groups = [{"lr": 0.1 * (i + 1), "params": [i]} for i in range(3)]

    def state_dict(self):
        return {"state": {}, "param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, sd):
        self.param_groups = sd["param_groups"]


def _tiny(ck: Checkpointer) -> Checkpointer:
    ck.register("model", Part({"w": torch.ones(2)}))
    return ck


def test_a_checkpointer_keeps_the_newest_two_by_default(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, meta={"run_id": RUN_ID}))
    for step in (1, 2, 3):
        ck.save(step)
    assert _names(tmp_path) == ["ckpt_00000002.json", "ckpt_00000002.pt", "ckpt_00000003.json", "ckpt_00000003.pt"], (
        "a Checkpointer made without keep must keep the newest 2 checkpoints"
    )


def test_a_checkpointer_saves_only_at_the_last_step_by_default(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, last_step=3))
    assert [ck.due(step) for step in (1, 2, 3)] == [False, False, True], "every defaults to 0: never, but the last step"
    assert [ck.save_if_due(step) for step in (1, 2)] == [None, None]
    assert ck.save_if_due(3) == tmp_path / "ckpt_00000003.pt"
    assert _names(tmp_path) == ["ckpt_00000003.json", "ckpt_00000003.pt"]


def test_save_if_due_saves_a_step_that_is_not_due_only_when_stopping(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, every=4, last_step=10))
    assert ck.save_if_due(3) is None and _names(tmp_path) == [], "stopping defaults to False: step 3 is not due"
    assert ck.save_if_due(3, stopping=True) == tmp_path / "ckpt_00000003.pt"
    assert ck.save_if_due(4) == tmp_path / "ckpt_00000004.pt"


def test_a_pt_checkpoint_records_the_optimizers_layout_and_one_without_an_optimizer_records_none(tmp_path):
    from gptspeed.checkpoint import ModelState, OptimizerState

    model, optimizer = torch.nn.Linear(3, 2), _ThreeGroups()
    ck = Checkpointer(tmp_path)
    ck.register("model", ModelState(model))
    ck.register("optimizer", OptimizerState(model, optimizer))
    state = load_checkpoint(ck.save(1))
    layout = state.get("optimizer_layout")
    assert layout == [["optimizer", 3]], (
        f"the checkpoint must record the optimizer's layout (one optimizer, 3 param groups), got {layout!r}"
    )
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.2, 0.1 * 3]
    weights = tmp_path / "weights"
    weights.mkdir()
    ck = Checkpointer(weights)
    ck.register("model", ModelState(model))
    state = load_checkpoint(ck.save(1))
    assert sorted(state) == ["format", "format_version", "model", "step"], (
        "a checkpoint without an optimizer records no optimizer_layout"
    )


def test_a_sharded_checkpointer_shards_the_parts_registered_sharded_and_puts_the_others_in_meta_pt(tmp_path):
    from gptspeed.checkpoint import ModelState, OptimizerState

    model, optimizer = torch.nn.Linear(3, 2), _ThreeGroups()
    ck = Checkpointer(tmp_path, sharded=True, meta={"run_id": RUN_ID})
    ck.register("model", ModelState(model), sharded=True)
    ck.register("optimizer", OptimizerState(model, optimizer))  # not sharded: meta.pt's
    ck.register("rng", Part({"torch": torch.arange(4, dtype=torch.uint8)}))
    final = ck.save(2)
    assert final == tmp_path / "ckpt_00000002.dcp"
    assert sorted(read_metadata(final).state_dict_metadata) == ["model.bias", "model.weight"], (
        "only the parts registered with sharded=True go into the shards"
    )
    meta = load_checkpoint(final)
    assert "model" not in meta and "optimizer" in meta and "rng" in meta, (
        f"a part registered without sharded=True must be saved in meta.pt; meta.pt holds {sorted(meta)}"
    )
    layout = meta.get("optimizer_layout")
    assert layout == [["optimizer", 3]], (
        f"a sharded checkpoint must record the optimizer's layout (one optimizer, 3 param groups), got {layout!r}"
    )
    # ... and a checkpointer registered the same way restores each part from its place
    model2 = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(model2.weight)
    rng = Part({})
    back = Checkpointer(tmp_path, sharded=True)
    back.register("model", ModelState(model2), sharded=True)
    back.register("rng", rng)
    rest = back.load(final)
    assert torch.equal(model2.weight, model.weight) and torch.equal(rng.sd["torch"], torch.arange(4, dtype=torch.uint8))
    assert "rng" not in rest and "model" not in rest and rest["step"] == 2


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
    from gptspeed.checkpoint.folder import RunLock

    other_rank = RunFolder(tmp_path, is_main=False)
    other_rank.open()
    other_rank.close()
    assert other_rank.lock is None and not other_rank.opened and not other_rank.created
    RunLock(tmp_path).release()  # never acquired
    lock = RunLock(tmp_path).acquire()
    lock.release()
    lock.release()
    again = RunLock(tmp_path).acquire()  # the first one's flock is gone
    again.release()


def test_the_lock_file_names_its_holder_and_is_not_executable(tmp_path):
    """A new lock file is made rw-r--r-- (under umask 022), not executable; it holds exactly
    ``pid P on HOST``, also over an earlier holder's longer text."""
    import socket
    import stat

    from gptspeed.checkpoint.folder import RunLock

    path, holder = tmp_path / LOCK_NAME, f"pid {os.getpid()} on {socket.gethostname()}".encode()
    old = os.umask(0o022)
    try:
        lock = RunLock(tmp_path).acquire()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_bytes() == holder
    lock.release()
    path.write_text("pid 1 on an-earlier-holder-with-a-longer-name-than-this-one-" + "x" * len(holder))
    lock = RunLock(tmp_path).acquire()
    assert path.read_bytes() == holder
    lock.release()


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


def test_a_model_state_is_the_plain_modules_by_default_and_refuses_an_empty_state():
    """ModelState(model) is not sharded unless told: loading an empty model state into a plain module
    is a strict load that misses every weight (the sharded path takes an empty dict as nothing to load)."""
    from gptspeed.checkpoint import ModelState

    model = torch.nn.Linear(2, 2)
    part = ModelState(model)
    assert part.sharded is False, "ModelState's sharded must default to False"
    with pytest.raises(GptspeedError) as e:
        load_part(Path("ckpt_00000001.pt"), "model", part, {})
    assert str(e.value) == (
        "checkpoint ckpt_00000001.pt: its model state does not fit this run (Missing key(s) in "
        'state_dict: "weight", "bias".): resume with the settings it was written with, or start a '
        "new --out"
    ), f"an empty model state must be refused as missing every weight, got {e.value}"


def test_the_optimizer_layout_names_each_underlying_optimizer_by_the_optimizers_names():
    """OptimizerState.layout: ``[[name, param groups], ...]`` with the names the optimizer gives
    (MuonWithAdamW: ("adamw", "muon")), "optimizer" for one without names."""
    from gptspeed.checkpoint import OptimizerState

    both = SimpleNamespace(
        names=("adamw", "muon"), optimizers=[SimpleNamespace(param_groups=[{}, {}]), SimpleNamespace(param_groups=[{}])]
    )
    layout = OptimizerState(None, both).layout()
    assert layout == [["adamw", 2], ["muon", 1]], f"the layout must use the optimizer's names, got {layout!r}"
    assert OptimizerState(None, _ThreeGroups()).layout() == [["optimizer", 3]]


def test_rng_state_saves_the_cuda_generator_of_its_device_under_cuda_and_none_on_a_cpu(monkeypatch):
    """On this CPU machine torch.cuda.get_rng_state is replaced by a recorder: a RNGState of device
    cuda saves {"torch": the CPU state, "cuda": its device's CUDA state}; of device cpu, "cuda": None."""
    calls, cuda_state = [], torch.arange(8, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(device) or cuda_state)
    cuda = torch.device("cuda", 0)
    sd = RNGState(cuda).state_dict()
    assert sorted(sd) == ["cuda", "torch"] and sd["cuda"] is cuda_state, (
        f"a cuda RNGState must save its CUDA generator's state under 'cuda', got {sd}"
    )
    assert calls == [cuda], f"the CUDA state must be read from the RNGState's own device, read from {calls}"
    assert torch.equal(sd["torch"], torch.get_rng_state())
    calls.clear()
    sd = RNGState(torch.device("cpu")).state_dict()
    assert sorted(sd) == ["cuda", "torch"] and sd["cuda"] is None and calls == [], (
        f"a cpu RNGState saves 'cuda': None and reads no CUDA state, got {sd} and reads {calls}"
    )


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
