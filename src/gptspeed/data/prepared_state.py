"""The state of a prepared folder between two ``gptspeed prepare`` runs: what says where an interrupted
prepare stands, whether a finished one can be reused, and what clears or removes it.

``.prepare-progress.json`` (:data:`PROGRESS_NAME`) beside the hidden staging chunks
(``.stream_NNNNNN.bin``, :data:`STAGE_NAME`) records the documents consumed per finished chunk
(:func:`write_progress`); a prepare of the same input and settings resumes after the last one
(:func:`staging_state`), a progress file that cannot be read is started over (:func:`read_progress`),
and a folder holding it but no manifest is refused by :func:`gptspeed.data.find_shards`, so nothing
half-written looks prepared. A folder prepared before from the same input and settings is reused as it
is (:func:`reuse_prepared`). The folder's lock is :func:`gptspeed.data.folder.prepare_lock`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gptspeed.data import MANIFEST_NAME, PREPARE_PROGRESS_NAME, load_manifest
from gptspeed.errors import GptspeedError
from gptspeed.fileio import read_user_json, write_text_atomic
from gptspeed.locks import FolderLock

_SHARD_GLOBS = ("train_[0-9]*.bin", "val_[0-9]*.bin", ".train_*.tmp", ".val_*.tmp", ".manifest.json.*.tmp")
PROGRESS_NAME = PREPARE_PROGRESS_NAME
STAGE_NAME = ".stream_{:06d}.bin"  # the staging chunks, in order
STAGE_RE = r"\.stream_[0-9]{6}\.bin"


def clear_prepared(out: Path) -> None:
    """Remove a previous preparation: manifest first (the folder is then incomplete), shards,
    staging chunks and the progress file."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for pattern in (
        *_SHARD_GLOBS,
        ".stream_*.bin",
        ".stream_*.tmp",
        "..stream_*.tmp",
        PROGRESS_NAME,
        ".prepare-progress.json.*.tmp",
        "..prepare-progress.json.*.tmp",
    ):
        for p in out.glob(pattern):
            if p.is_file():
                p.unlink()


def input_sha256(file_hashes: list[str]) -> str:
    """The sha256 (hex) that names an input: of its files' sha256 digests, one a line, in order."""
    return hashlib.sha256("".join(d + "\n" for d in file_hashes).encode()).hexdigest()


def write_progress(out: Path, progress: dict) -> None:
    """Write ``progress`` (:func:`fresh_state`'s fields, then the chunks staged) as ``out``'s progress file, atomically."""
    write_text_atomic(out / PROGRESS_NAME, json.dumps(progress, indent=1) + "\n")


def check_out(out: Path) -> None:
    """GptspeedError (one line) when ``out`` cannot be the output folder: it is something else than
    a folder, a part of its path is a file, or its name is too long for the file system."""
    import errno

    try:
        st = out.stat()
    except FileNotFoundError:
        return  # made by prepare
    except NotADirectoryError:
        raise GptspeedError(f"output {out}: a part of its path is a file, not a folder: choose another --out") from None
    except OSError as e:
        why = (
            "a name in it is too long for the file system" if e.errno == errno.ENAMETOOLONG else (e.strerror or str(e))
        )
        raise GptspeedError(f"output {out}: {why}: choose another --out") from None
    import stat

    if not stat.S_ISDIR(st.st_mode):
        raise GptspeedError(f"output {out} exists and is not a folder: choose another --out")


def make_out(out: Path) -> bool:
    """Create ``out`` (and its parents); True if it did not exist. GptspeedError naming it if it
    cannot be made."""
    import errno

    check_out(out)
    try:
        out.mkdir(parents=True)
        return True
    except FileExistsError:
        check_out(out)  # a folder made meanwhile is fine
        return False
    except OSError as e:
        why = (
            "a name in it is too long for the file system" if e.errno == errno.ENAMETOOLONG else (e.strerror or str(e))
        )
        raise GptspeedError(f"cannot create the output folder {out}: {why}: choose another --out") from None


def reuse_prepared(
    out: Path, source: str, val_fraction: float, shard_tokens: int, input_sha: str, settings: dict
) -> dict:
    """The manifest of ``out``, prepared before from the same input and settings, with
    ``"reused": True``; GptspeedError if it was prepared from anything else."""
    old = load_manifest(out)
    old_settings = old.get(
        "settings",
        {
            "text_field": "text",
            "shuffle_seed": None,
            "skip_bad": False,
            "max_tokens": None,
            "dataset": None,
            "hf_name": None,
            "split": "train",
        },
    )
    same = (
        old.get("source") == source
        and old.get("val_fraction") == val_fraction
        and old.get("shard_tokens") == shard_tokens
        and old.get("input_sha256") == input_sha
        and old_settings == settings
    )
    if not same:
        raise GptspeedError(f"{out} is already prepared from other input or settings; pass --force to overwrite")
    return {**old, "reused": True}


def read_progress(out: Path) -> dict | None:
    """The progress file of an interrupted prepare in ``out`` (:func:`gptspeed.data.prepare._stage` writes it), or None when there
    is none, or it cannot be read or is not one (it is then started over): read with
    :func:`gptspeed.fileio.read_user_json`, and checked field by field, chunk names included (only
    ``.stream_NNNNNN.bin`` in ``out``: a progress file never makes prepare rename or delete a file
    elsewhere).

    Raises:
        GptspeedError: the progress file's name is taken by something that is not a file (a
            folder): gptspeed does not delete it.
    """
    import re
    import stat

    path = out / PROGRESS_NAME
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise GptspeedError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise GptspeedError(
            f"{path} is not a file (gptspeed keeps the progress of a prepare under that name): "
            "remove it, or choose another --out"
        )
    try:
        state = read_user_json(path, "prepare progress file")
    except GptspeedError:
        return None
    ints = ("next_doc", "doc_offset", "documents", "tokens")
    chunks = state.get("chunks")
    if (
        not isinstance(state.get("key"), str)
        or any(type(state.get(k)) is not int or state[k] < 0 for k in ints)
        or not isinstance(chunks, list)
        or not all(
            isinstance(c, dict)
            and isinstance(c.get("name"), str)
            and re.fullmatch(STAGE_RE, c["name"])
            and type(c.get("tokens")) is int
            and c["tokens"] > 0
            for c in chunks
        )
        or [c["name"] for c in chunks] != [STAGE_NAME.format(i) for i in range(len(chunks))]
    ):
        return None
    return state


def fresh_state(key: str) -> dict:
    """The progress of a prepare that has staged nothing yet; ``key`` names its input and settings."""
    return {"key": key, "chunks": [], "next_doc": 0, "doc_offset": 0, "documents": 0, "tokens": 0}


def staging_state(out: Path, key: str, force: bool) -> dict:
    """The progress of an interrupted prepare of the same input and settings (``key``) in ``out``,
    its chunks written after the last recorded one removed; else a fresh state, ``out`` cleared."""
    state = read_progress(out) if not force else None
    if state is not None and (state["key"] != key or not all((out / c["name"]).is_file() for c in state["chunks"])):
        state = None
    if state is None:
        clear_prepared(out)
        return fresh_state(key)
    for p in out.glob(".stream_*.bin"):
        if p.name not in {c["name"] for c in state["chunks"]}:
            p.unlink()
    return state


def remove_if_nothing_staged(out: Path, lock: FolderLock) -> None:
    """Remove the folder ``out`` (made by this prepare, whose ``lock`` it holds) unless its progress
    file records staged chunks a rerun can resume from; never a folder holding anything else."""
    try:
        state = read_progress(out)
    except GptspeedError:
        return
    if state and state["chunks"]:
        return
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    lock.release()
    try:
        out.rmdir()  # only if empty
    except OSError:
        pass
