"""Token data: the shard format (:mod:`.shards`), corpus preparation (:mod:`.prepare`), and
finding the shards of a prepared folder.

A prepared folder holds ``train_000000.bin ...``, ``val_000000.bin ...`` and a ``manifest.json``
written last (its presence marks the folder complete). Folders without a manifest, such as
modded-nanogpt's ``fineweb10B/fineweb_train_000001.bin ...``, are found by file name.
"""

from __future__ import annotations

import json
import os
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
    "read_header",
    "read_shard",
    "write_shard",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "gptspeed-shards"
MANIFEST_FORMAT_VERSION = 1
SPLITS = ("train", "val")


def _prepare_hint(data_dir: Path) -> str:
    from gptspeed.paths import describe

    return describe(data_dir, want="data")


def load_manifest(data_dir: str | os.PathLike) -> dict | None:
    """The parsed ``manifest.json`` of a prepared folder, or ``None`` if it has none.

    Raises:
        GptspeedError: the manifest is not valid JSON, not a gptspeed shard manifest, or of a
            newer format version than this gptspeed reads.
    """
    path = Path(data_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GptspeedError(
            f"{path} is not valid JSON ({e}): prepare the folder again with --force"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise GptspeedError(
            f"{path} is not a gptspeed shard manifest (format is not {MANIFEST_FORMAT!r}): "
            "prepare the folder again with --force"
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > MANIFEST_FORMAT_VERSION:
        raise GptspeedError(
            f"{path} has format_version {version!r}, this gptspeed reads up to "
            f"{MANIFEST_FORMAT_VERSION}: upgrade gptspeed or prepare the folder again with --force"
        )
    return manifest


def find_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """Sorted shard paths of ``split`` ("train" or "val") in the prepared folder ``data_dir``.

    With a ``manifest.json`` its shard list is used (and every listed file must exist); without
    one, the files matching ``*{split}*.bin`` (so modded-nanogpt / llm.c folders work as well).
    Shard contents are not opened here; :func:`read_shard` validates them.

    Raises:
        ValueError: ``split`` is not "train" or "val" (a caller bug).
        GptspeedError: ``data_dir`` does not exist, its manifest is bad or lists a missing
            shard, or it holds no shard of that split.
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
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise GptspeedError(
                f"{data_dir / MANIFEST_NAME} has no shard list for split {split!r}: "
                "prepare the folder again with --force"
            )
        paths = sorted(data_dir / name for name in names)
        for p in paths:
            if not p.is_file():
                raise GptspeedError(
                    f"shard {p} listed in {data_dir / MANIFEST_NAME} is missing: "
                    "prepare the folder again with --force"
                )
    else:
        paths = sorted(p for p in data_dir.glob(f"*{split}*.bin") if p.is_file())
    if not paths:
        raise GptspeedError(
            f"no {split} shards (*{split}*.bin) in {data_dir}{_prepare_hint(data_dir)}"
        )
    return paths
