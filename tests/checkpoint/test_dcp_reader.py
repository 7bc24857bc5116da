"""``gptspeed.checkpoint.dcp_reader``: reading sharded (``torch.distributed.checkpoint``, DCP) checkpoints without running pickled code."""

from __future__ import annotations

import io
import pickle
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
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

from gptspeed.checkpoint.dcp_reader import SafeFileSystemReader, _one_line, _SafeBytes, read_metadata
from gptspeed.errors import GptspeedError

from support.checkpoints import SHARD, _info

pytestmark = pytest.mark.usefixtures("one_thread")


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


ACCEPTED = [
    ("tensors-fill-the-files-exactly", lambda md: md),
    ("an-empty-bytes-entry", _set("lr_info.length", 0)),
    ("no-planner-data", _set("md.planner_data", None)),
    ("planner-index-inside-the-entries", _set("md.planner_data", {"w": ("w", 1), "lr": ("lr", 0)})),
]


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


@pytest.mark.parametrize("change, reason", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_metadata_that_breaks_one_rule_is_refused_with_its_reason(tmp_path, change, reason):
    folder = _folder(tmp_path, change(_metadata()))
    (folder / "sub").mkdir()
    (folder / "a\\b").write_bytes(b"\0" * 8)  # a real file: the backslash alone is the reason
    with pytest.raises(GptspeedError) as e:
        read_metadata(folder)
    assert str(e.value) == f"refusing to load {folder}: its .metadata is not a checkpoint's metadata ({reason})"


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
