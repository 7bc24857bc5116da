"""Token data: the shard format (:mod:`.shards`), corpus preparation (:mod:`.prepare`), and
finding the shards of a prepared folder.

A prepared folder holds ``train_000000.bin ...``, ``val_000000.bin ...`` and a ``manifest.json``
written last (its presence marks the folder complete). Folders without a manifest, such as
modded-nanogpt's ``fineweb10B/fineweb_train_000001.bin ...``, are found by file name
(:func:`shard_name_split`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gptspeed.data.shards import (
    HEADER_BYTES,
    HEADER_INTS,
    SHARD_MAGIC,
    SHARD_VERSION,
    ShardError,
    read_header,
    read_shard,
    write_shard,
)
from gptspeed.errors import GptspeedError

__all__ = [
    "HEADER_BYTES",
    "HEADER_INTS",
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_VERSION",
    "MANIFEST_NAME",
    "SPLITS",
    "SHARD_MAGIC",
    "SHARD_VERSION",
    "ShardError",
    "find_shards",
    "load_manifest",
    "shard_name_split",
    "read_header",
    "read_shard",
    "write_shard",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "gptspeed-shards"
MANIFEST_FORMAT_VERSION = 1
PREPARE_PROGRESS_NAME = ".prepare-progress.json"
"""The progress file of a ``gptspeed prepare`` under way or interrupted (:mod:`.prepare`)."""
SPLITS = ("train", "val")


def _prepare_hint(data_dir: Path) -> str:
    from gptspeed.paths import describe

    return describe(data_dir, want="data")


def load_manifest(data_dir: str | os.PathLike) -> dict | None:
    """The parsed ``manifest.json`` of a prepared folder, or ``None`` if it has none.

    Read with :func:`gptspeed.fileio.read_user_json`: a manifest that is a folder, a FIFO or a
    device, oversize, not UTF-8, not JSON or nested too deeply is one line, as is one of another
    format.

    Raises:
        GptspeedError: the manifest cannot be read, is not valid JSON, not a gptspeed shard
            manifest, or of a newer format version than this gptspeed reads.
    """
    from gptspeed.fileio import read_user_json

    path = Path(data_dir) / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    try:
        manifest = read_user_json(path, "manifest")
    except GptspeedError as e:
        raise GptspeedError(f"{e}: prepare the folder again with --force") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise GptspeedError(
            f"{path} is not a gptspeed shard manifest (format is not {MANIFEST_FORMAT!r}): "
            "prepare the folder again with --force"
        )
    version = manifest.get("format_version")
    if type(version) is not int or version > MANIFEST_FORMAT_VERSION:
        raise GptspeedError(
            f"{path} has format_version {version!r}, this gptspeed reads up to "
            f"{MANIFEST_FORMAT_VERSION}: upgrade gptspeed or prepare the folder again with --force"
        )
    return manifest


_SPLIT_WORD = re.compile(r"(?:^|[_.-])(train|val)(?=[_.-]|$)")


def shard_name_split(name: str) -> str | None:
    """The split a shard file named ``name`` belongs to in a folder without a manifest: ``"train"``
    or ``"val"`` when the name ends in ``.bin``, does not start with a dot, and holds that word
    alone between ``_`` / ``-`` / ``.`` separators (or at an end) -- the names ``gptspeed prepare``
    writes (``val_000000.bin``), llm.c's and modded-nanogpt's (``fineweb_val_000000.bin``,
    ``tiny_shakespeare_val.bin``). A word that merely contains it is not it
    (``retrieval_train_000000.bin`` is train, ``interval_000.bin`` and ``eval_000.bin`` are
    neither). None when the name holds neither word, or both."""
    if name.startswith(".") or not name.endswith(".bin"):
        return None
    found = {m.group(1) for m in _SPLIT_WORD.finditer(name[: -len(".bin")])}
    return found.pop() if len(found) == 1 else None


def _manifest_shard(data_dir: Path, name: object) -> Path:
    """``data_dir / name`` for a shard name listed in the manifest; GptspeedError unless ``name``
    is a plain file name in the folder (no folder part, no ``..``, not absolute): a manifest
    never makes the folder train on another folder's files under its own identity."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or Path(name).is_absolute()
    ):
        raise GptspeedError(
            f"{data_dir / MANIFEST_NAME} lists the shard {name!r}, which is not a file name inside "
            f"{data_dir} (a manifest names its own shards only): prepare the folder again with --force"
        )
    return data_dir / name


def find_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """Sorted shard paths of ``split`` ("train" or "val") in the prepared folder ``data_dir``.

    With a ``manifest.json`` its shard list is used (each a plain file name in the folder, and
    every listed file must exist); without one, the ``.bin`` files whose name holds the word
    ``split`` (:func:`shard_name_split`: ``val_000000.bin``, ``fineweb_val_000000.bin``), so
    modded-nanogpt / llm.c folders work as well. A folder that holds the progress file of an
    unfinished ``gptspeed prepare`` and no manifest is refused: its shards are not all there.
    Shard contents are not opened here; :func:`read_shard` validates them.

    Raises:
        ValueError: ``split`` is not "train" or "val" (a caller bug).
        GptspeedError: ``data_dir`` does not exist, its manifest is bad or lists a missing
            shard or a path outside the folder, a prepare into it is unfinished, or it holds no
            shard of that split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "does not exist" if not data_dir.exists() else "is not a data folder"
        raise GptspeedError(f"data folder {data_dir} {what}{_prepare_hint(data_dir)}")
    manifest = load_manifest(data_dir)
    if manifest is not None:
        try:
            names = manifest["splits"][split]["shards"]
        except (KeyError, TypeError):
            names = None
        if not isinstance(names, list):
            raise GptspeedError(
                f"{data_dir / MANIFEST_NAME} has no shard list for split {split!r}: "
                "prepare the folder again with --force"
            )
        paths = sorted(_manifest_shard(data_dir, name) for name in names)
        for p in paths:
            if not p.is_file():
                raise GptspeedError(
                    f"shard {p} listed in {data_dir / MANIFEST_NAME} is missing: prepare the folder again with --force"
                )
    else:
        if os.path.lexists(data_dir / PREPARE_PROGRESS_NAME):
            raise GptspeedError(
                f"{data_dir} holds an unfinished `gptspeed prepare` ({PREPARE_PROGRESS_NAME} and no "
                f"{MANIFEST_NAME}): run the same prepare again to finish it"
            )
        paths = sorted(p for p in data_dir.iterdir() if shard_name_split(p.name) == split and p.is_file())
    if not paths:
        raise GptspeedError(
            f"no {split} shards ({split}_000000.bin, or NAME_{split}_000000.bin as llm.c and modded-nanogpt "
            f"name them) in {data_dir}{_prepare_hint(data_dir)}"
        )
    return paths
