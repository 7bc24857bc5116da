"""Reading sharded (``torch.distributed.checkpoint``, DCP) checkpoints without running pickled code.

DCP's own ``FileSystemReader.read_metadata`` reads ``CKPT.dcp/.metadata`` with plain
``pickle.load``, and its ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry of the
``*.distcp`` files (an optimizer's param-group values: lr, betas, ...) with
``torch.load(weights_only=False)``: a checkpoint folder someone else supplied could run any code on
``gptspeed consolidate`` or ``train --resume``, and its seal cannot help (whoever writes the folder
writes the seal too). Tensors themselves are already read with ``torch.load(weights_only=True)``.

:class:`SafeFileSystemReader` closes both holes, for every planner:

* ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, the "restricting globals" technique
  of the Python documentation (https://docs.python.org/3/library/pickle.html#restricting-globals):
  ``find_class`` resolves only the names in :data:`ALLOWED_GLOBALS` (what DCP's ``Metadata`` is made
  of), and the ``BUILD`` opcode may set the state only of a fresh instance of one of DCP's metadata
  classes (never of a class, a function, an enum member or a dtype), so a crafted file can neither
  call anything else nor alter a shared object. The result is then checked to be a ``Metadata``
  of that shape, whose storage entries name plain files of the folder itself, inside their size,
  with no stream transforms, and whose tensors fit in the bytes the folder holds.
* every non-tensor entry is read with ``torch.load(weights_only=True)`` (PyTorch's restricted
  unpickler: https://pytorch.org/docs/stable/notes/serialization.html#weights-only) and handed on
  re-serialized from the plain values it yielded, so DCP's ``weights_only=False`` load sees only
  gptspeed's own bytes.

Anything else is refused with one :class:`~gptspeed.errors.GptspeedError` line naming the folder.
:func:`load_into` (``torch.distributed.checkpoint.load``, for a resume) and :func:`load_full` (the
``dcp_to_torch_save`` of ``torch.distributed.checkpoint.format_utils``, in memory, for
``consolidate``) read through it and turn DCP's ``CheckpointException`` into that one line too.

The allow-list was read off real ``.metadata`` files (model + AdamW, model + Muon + AdamW, written
by :class:`gptspeed.checkpoint.Checkpointer`) with a tracing unpickler, under torch 2.13; every name
is one of torch's since 2.4 (``StorageMeta``) or earlier, so torch 2.11's files need the same.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
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

from gptspeed.errors import GptspeedError

METADATA_NAME = ".metadata"


_DCP = "torch.distributed.checkpoint"
#: Every global a DCP ``.metadata`` pickle may name: DCP's metadata dataclasses and the storage
#: entry of its file system writer; ``torch.Size`` (tensor sizes, chunk offsets); the dtypes a
#: training state holds (a ``torch.dtype`` pickles as the global ``torch.<name>``); a layout
#: (pickled through ``torch.serialization._get_layout(name)``); the memory-format encoding
#: (``TensorProperties`` pickles an enum for it); and the folder the checkpoint was written to
#: (``StorageMeta.checkpoint_id``, a ``PosixPath``; ``pathlib._local`` from Python 3.13).


ALLOWED_GLOBALS = frozenset(
    {
        f"{_DCP}.metadata.Metadata",
        f"{_DCP}.metadata.StorageMeta",
        f"{_DCP}.metadata.MetadataIndex",
        f"{_DCP}.metadata.TensorStorageMetadata",
        f"{_DCP}.metadata.BytesStorageMetadata",
        f"{_DCP}.metadata.ChunkStorageMetadata",
        f"{_DCP}.metadata.TensorProperties",
        f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
        f"{_DCP}.filesystem._StorageInfo",
        "torch.Size",
        "torch.serialization._get_layout",
        *(
            f"torch.{d}"
            for d in (
                "float32",
                "float16",
                "bfloat16",
                "float64",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
                "float8_e4m3fn",
                "float8_e5m2",
            )
        ),
        "pathlib.PosixPath",
        "pathlib._local.PosixPath",
    }
)
# The only types whose state a .metadata pickle may set (BUILD): fresh instances of these.


_BUILDABLE = (
    Metadata,
    StorageMeta,
    MetadataIndex,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    _StorageInfo,
)


class _Refused(Exception):
    """Raised inside the unpickler; :func:`read_metadata` words it."""


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python ``pickle.Unpickler`` (its opcodes can be overridden, unlike the C one's)
    with ``find_class`` limited to :data:`ALLOWED_GLOBALS` and ``BUILD`` to :data:`_BUILDABLE`;
    persistent ids are refused by ``pickle``'s default ``persistent_load``."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in ALLOWED_GLOBALS:
            raise _Refused(f"asks for {qualified}, which a checkpoint's metadata never holds")
        found = super().find_class(module, name)
        if module == "torch" and name != "Size" and not isinstance(found, torch.dtype):
            raise _Refused(f"asks for {qualified}, which a checkpoint's metadata never holds")
        return found

    def _load_build(self) -> None:
        target = self.stack[-2]  # BUILD pops the state and applies it to the object beneath
        if type(target) not in _BUILDABLE:
            raise _Refused(
                f"sets the state of a {type(target).__module__}.{type(target).__qualname__}, "
                "which a checkpoint's metadata never does"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _refuse(folder: Path, why: str) -> GptspeedError:
    return GptspeedError(f"refusing to load {folder}: its {METADATA_NAME} {why}")


def _regular_size(path: Path) -> int | None:
    """The size of ``path`` if it is a regular file (not a FIFO, which would block the read, a
    device or a folder), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def read_metadata(folder: Path) -> Metadata:
    """The ``Metadata`` of the sharded checkpoint ``folder``, unpickled by the restricted
    unpickler and checked (see the module's docstring). GptspeedError, one line, if the file is
    missing, damaged, asks for anything else, or describes what the folder does not hold."""
    folder = Path(folder)
    path = folder / METADATA_NAME
    if _regular_size(path) is None:
        raise GptspeedError(f"checkpoint {folder} has no {METADATA_NAME} file: it is not a complete sharded checkpoint")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _refuse(folder, str(e)) from None
    except Exception as e:  # pickle raises many types for a damaged file
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise GptspeedError(
            f"checkpoint {folder} is unreadable: its {METADATA_NAME} is damaged "
            f"({type(e).__name__}{': ' + first if first else ''})"
        ) from None
    why = _check_metadata(md, folder)
    if why:
        raise _refuse(folder, f"is not a checkpoint's metadata ({why})")
    if not isinstance(md.storage_meta, StorageMeta):
        md.storage_meta = StorageMeta()
    return md


def _is_size(x: Any) -> bool:
    return type(x) is torch.Size and all(type(n) is int and n >= 0 for n in x)


def _check_entries(entries: dict) -> tuple[str | None, int]:
    """``(why a state-dict entry is malformed or None, the bytes the tensors take)``: each entry named by
    a string and of DCP's own types (a tensor's properties, size and chunks; or bytes)."""
    tensor_bytes = 0
    for key, entry in entries.items():
        if type(key) is not str:
            return f"an entry named {key!r}", 0
        if type(entry) is TensorStorageMetadata:
            props = entry.properties
            if (
                type(props) is not TensorProperties
                or not isinstance(props.dtype, torch.dtype)
                or not _is_size(entry.size)
                or type(entry.chunks) is not list
            ):
                return f"entry {key[:80]} is malformed", 0
            for chunk in entry.chunks:
                if (
                    type(chunk) is not ChunkStorageMetadata
                    or not _is_size(chunk.offsets)
                    or not _is_size(chunk.sizes)
                    or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                ):
                    return f"entry {key[:80]} has a malformed chunk", 0
            numel = 1
            for n in entry.size:
                numel *= n
            tensor_bytes += numel * props.dtype.itemsize
        elif type(entry) is not BytesStorageMetadata:
            return f"entry {key[:80]} is a {type(entry).__name__}", 0
    return None, tensor_bytes


def _check_metadata(md: Any, folder: Path) -> str | None:
    """Why ``md`` is not the metadata of a checkpoint in ``folder`` (a short reason), or None: its entries
    (:func:`_check_entries`), planner data and storage of DCP's own types, every file inside the folder."""
    if type(md) is not Metadata:
        return f"it holds a {type(md).__name__}"
    entries, storage, planner = md.state_dict_metadata, md.storage_data, md.planner_data
    if type(entries) is not dict or type(storage) is not dict:
        return "its entries or storage are not dicts"
    why, tensor_bytes = _check_entries(entries)
    if why is not None:
        return why
    if planner is not None:
        if type(planner) is not dict:
            return "its planner data is not a dict"
        for key, where in planner.items():
            if (
                type(key) is not str
                or type(where) not in (tuple, list)
                or not all(type(p) is str or (type(p) is int and 0 <= p < max(len(entries), 1)) for p in where)
            ):
                return f"its planner data for {str(key)[:80]} is malformed"
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            return "a storage entry is malformed"
        name = info.relative_path
        if type(name) is not str or name in ("", ".", "..") or Path(name).name != name or "\\" in name or "\0" in name:
            return f"a storage entry points outside the folder ({str(name)[:80]!r})"
        if name not in sizes:
            size = _regular_size(folder / name)
            if size is None:
                return f"a storage entry names {name[:80]}, which is not a file of the folder"
            sizes[name] = size
        if (
            type(info.offset) is not int
            or type(info.length) is not int
            or info.offset < 0
            or info.length < 0
            or info.offset + info.length > sizes[name]
        ):
            return f"a storage entry lies outside {name[:80]}"
        transforms = getattr(info, "transform_descriptors", None)  # a field of newer torch versions only
        if transforms:
            return f"a storage entry asks for stream transforms {list(transforms)[:3]!r}, which gptspeed never writes"
    if tensor_bytes > sum(sizes.values()):
        return f"its tensors would take {tensor_bytes:,} bytes, but its files hold {sum(sizes.values()):,}"
    return None


# torch.load(weights_only=True)'s refusal: "Unsupported global: GLOBAL os.system was not an allowed
# global" (torch 2.4-2.5), "Trying to load unsupported GLOBAL posix.system whose module ..." (later)


_UNSUPPORTED_GLOBAL = re.compile(r"(?i)unsupported global:? (?:GLOBAL )?([\w.]+)")


class _SafeBytes:
    """A load planner as :meth:`SafeFileSystemReader.read_data` hands it on: every non-tensor
    entry is loaded with ``weights_only=True`` first and passed on re-serialized; everything else
    goes to the wrapped planner unchanged."""

    def __init__(self, planner: Any, folder: Path):
        self._planner, self._folder = planner, folder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a foreign or damaged entry
            m = _UNSUPPORTED_GLOBAL.search(str(e))
            what = (
                f"asks for {m.group(1)}, which a checkpoint never holds" if m else f"is unreadable ({type(e).__name__})"
            )
            raise GptspeedError(f"refusing to load {self._folder}: its entry {str(fqn)[:80]} {what}") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that reads ``.metadata`` with
    :func:`read_metadata` (restricted unpickler, checked) and every non-tensor entry with
    ``torch.load(weights_only=True)``; the storage reader of every DCP load in gptspeed. Source:
    https://pytorch.org/docs/stable/distributed.checkpoint.html (``StorageReader``)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._folder = Path(path)
        self._metadata: Metadata | None = None  # read (and checked) once per load

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._folder, self._metadata = Path(checkpoint_id), None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to rank-local files, which gptspeed never writes
            raise GptspeedError(f"checkpoint {self._folder} has no readable {METADATA_NAME}")
        if self._metadata is None:
            self._metadata = read_metadata(self._folder)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _SafeBytes(planner, self._folder))


def _one_line(folder: Path, e: BaseException) -> GptspeedError:
    """DCP's ``CheckpointException`` (every rank's failures) as one GptspeedError line: a rank's
    own GptspeedError if there is one, else the first failure."""
    failures = [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and f] or [e]
    for exc in failures:
        if isinstance(exc, GptspeedError):
            return GptspeedError(str(exc))
    exc = failures[0]
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return GptspeedError(f"could not read the shards of {folder} ({type(exc).__name__}{': ' + first if first else ''})")


def load_into(state_dict: dict[str, Any], folder: Path) -> None:
    """``torch.distributed.checkpoint.load(state_dict, storage_reader=SafeFileSystemReader(folder))``:
    the sharded checkpoint ``folder`` loaded in place into ``state_dict`` (re-sharded to this world
    size; every rank calls it). The metadata is read and checked first, on every rank alike, so a
    refusal is the same GptspeedError line everywhere, before any collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()
    try:
        dcp.load(state_dict, storage_reader=reader)
    except CheckpointException as e:
        raise _one_line(folder, e) from None


def load_full(folder: Path) -> dict[str, Any]:
    """Every entry of the sharded checkpoint ``folder`` as one nested state dict of full tensors,
    in this process: what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes
    (its ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner`` and ``no_dist=True``), through
    :class:`SafeFileSystemReader`. GptspeedError, one line, for a refused or damaged checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise _one_line(folder, e) from None
    except Exception as e:  # torch raises many types for damaged shards
        raise _one_line(folder, e) from None
    return state
