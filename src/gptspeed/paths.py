"""What a path the user gave is, so an error can say so instead of suggesting a harmful command.

``gptspeed train --data notes.txt`` must not be told to ``prepare ... --out notes.txt`` (which
would turn the text into a folder's name); ``sample --run DATA_DIR`` must not be told to ``train
--out DATA_DIR``. :func:`kind` classifies a path by what it holds; :func:`describe` turns that
into the end of an error line. No torch here: these errors print at once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_CKPT = re.compile(r"^ckpt_\d{8}\.(pt|dcp)$")
_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".gz", ".zst", ".parquet", ".md", ".csv")


def kind(path: str | os.PathLike) -> str:
    """``missing``, ``text file`` (a corpus file `gptspeed prepare` reads), ``file``, ``run folder``
    (checkpoints or a run's config.json + metrics.jsonl), ``data folder`` (manifest.json or
    ``*.bin`` shards), ``empty folder`` or ``folder``."""
    p = Path(path)
    if not p.exists():
        return "missing"
    if p.is_file():
        return "text file" if p.name.lower().endswith(_TEXT_SUFFIXES) else "file"
    try:
        names = {q.name for q in p.iterdir()}
    except OSError:
        return "folder"
    if not names:
        return "empty folder"
    if any(_CKPT.match(n) for n in names) or {"config.json", "metrics.jsonl"} <= names:
        return "run folder"
    if "manifest.json" in names or any(n.endswith(".bin") for n in names):
        return "data folder"
    return "folder"


def real_path(path: str | os.PathLike) -> Path:
    """``path`` as the system will take it once its missing folders are made: a path with a ``..``
    component resolved (:func:`os.path.realpath`: ``new/../victim`` is ``victim``, where a check of
    the path as written would see nothing, since ``new`` does not exist yet); any other path as given."""
    p = Path(path)
    return Path(os.path.realpath(p)) if ".." in p.parts else p


def describe(path: str | os.PathLike, want: str) -> str:
    """The end of an error line about ``path``, which should have been a ``want`` (``data`` or
    ``run``) folder: what it is instead, and the command that helps -- never one that would write
    over it."""
    k = kind(path)
    if want == "data":
        if k == "text file":
            return (
                f": {path} is a text file, not a prepared data folder; tokenize it first with "
                f"`gptspeed prepare {path} --out DATA_DIR` and pass --data DATA_DIR"
            )
        if k == "run folder":
            return (
                f": {path} is a run folder (checkpoints / metrics), not a data folder; pass the folder "
                "`gptspeed prepare` wrote"
            )
        if k in ("missing", "empty folder"):
            return f": run `gptspeed prepare SOURCE --out {path}` first"
        return f": it is a {k}, not a folder `gptspeed prepare` wrote; prepare one with `gptspeed prepare SOURCE --out NEW_DIR`"
    if k == "data folder":
        return (
            f": {path} is a prepared data folder (token shards), not a run folder; pass the --out of a "
            f"`gptspeed train` (e.g. `gptspeed train --data {path} --out RUN_DIR`)"
        )
    if k in ("missing", "empty folder"):
        return f": train first (`gptspeed train --data DATA_DIR --out {path}`)"
    return f": {path} is a {k}, not a gptspeed run folder; pass the --out of a `gptspeed train`"
