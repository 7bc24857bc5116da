"""The DCLM eval bundle that the CORE score is computed on (Li et al. 2024, "DataComp-LM", the
22 "low variance" in-context-learning tasks; packaged as nanochat's ``eval_bundle.zip``): where it
comes from, how it is unpacked, and how its three parts are read.

A bundle is a folder holding ``core.yaml`` (``icl_tasks``: each task's ``label``, ``dataset_uri``,
``num_fewshot``, ``icl_task_type`` and optional ``continuation_delimiter``, default one space),
``eval_meta_data.csv`` (the columns ``Eval Task`` and ``Random baseline``: each task's accuracy by
chance, in percent) and ``eval_data/<dataset_uri>`` (one JSON example a line).

The official bundle is verified by sha256 and taken from ``$GPTSPEED_DATA_MIRROR/core/eval_bundle.zip``
when present, else from the cache (``$GPTSPEED_CACHE`` or ``~/.cache/gptspeed``: ``core/eval_bundle.zip``),
else downloaded into it through pooch (:func:`gptspeed.data.corpora._download`); it is unpacked once,
member by member (no ``extractall``), into ``core/eval_bundle/`` of the cache.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gptspeed.errors import GptspeedError, show_value

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's base_eval.py
# Neither nanochat nor DCLM publishes a checksum of this file. This is the sha256 that independent
# downloads of the URL above recorded and pinned in public projects (vpareek2/vpMoE's
# docs/eval_suite.md, "sha256 (pinned for v1)", and others that pin the same value for the 22-task
# bundle); it was not measured here (no network). A file with any other hash is refused.
EVAL_BUNDLE_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
RELATIVE_PATH = "core/eval_bundle.zip"  # under the mirror and the cache
UNPACKED = "core/eval_bundle"  # under the cache
ZIP_ROOT = "eval_bundle/"  # the members of the zip that are the bundle
STAMP = ".from-sha256"  # in an unpacked bundle: the sha256 of the zip it came from
MAX_BUNDLE_BYTES = 4 << 30  # unpacked; the official bundle is far smaller, a zip bomb is not
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
# the fields each task type's examples hold (nanochat's core_eval.py reads these)
FIELDS = {
    "multiple_choice": "query (text), choices (2 or more texts), gold (index of the right choice)",
    "schema": "context_options (2 or more texts), continuation (text), gold (index of the right context)",
    "language_modeling": "context (text), continuation (text)",
}


@dataclass(frozen=True)
class CoreTask:
    """One task of ``core.yaml``: its ``label``, ``kind`` (one of :data:`TASK_TYPES`), the jsonl
    ``path`` of its examples, ``shots`` (few-shot examples per prompt), the ``delimiter`` between a
    prompt's context and continuation, and its random ``baseline`` accuracy in percent (None when
    ``eval_meta_data.csv`` has no row for it, or no number in [0, 100))."""

    label: str
    kind: str
    path: Path
    shots: int
    delimiter: str
    baseline: float | None


# ------------------------------------------------------------------------------ the official bundle
def official_bundle(progress: bool = True) -> Path:
    """The folder of the official bundle, unpacked in the cache from the sha256-verified zip (the
    mirror's, else the cache's, else downloaded into the cache: the only step that uses the network).
    An unpacked folder stamped with :data:`EVAL_BUNDLE_SHA256` is reused as it is.

    Raises:
        GptspeedError: a mirror or cached zip with the wrong sha256, a failed download (offline: set
            ``GPTSPEED_DATA_MIRROR``), or a zip that is not a bundle (see :func:`unpack_bundle`).
    """
    from gptspeed.data.corpora import MIRROR_ENV, _download, _mismatch, cache_dir, mirror_file
    from gptspeed.fileio import sha256_file

    target = cache_dir() / UNPACKED
    if _stamp(target) == EVAL_BUNDLE_SHA256:
        return target
    path = mirror_file(RELATIVE_PATH)
    if path is not None:
        actual = sha256_file(path)
        if actual != EVAL_BUNDLE_SHA256:
            raise _mismatch(
                path, actual, EVAL_BUNDLE_SHA256, f"replace it with the official file or unset {MIRROR_ENV}"
            )
    else:
        path = cache_dir() / RELATIVE_PATH
        if not path.is_file() or sha256_file(path) != EVAL_BUNDLE_SHA256:
            _download((EVAL_BUNDLE_URL,), path, EVAL_BUNDLE_SHA256, RELATIVE_PATH, progress)
    unpack_bundle(path, target, EVAL_BUNDLE_SHA256)
    return target


def _stamp(folder: Path) -> str | None:
    try:
        return (folder / STAMP).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _member_path(name: str) -> PurePosixPath | None:
    """The path under the bundle's root of the zip member ``name``; None for a member outside
    :data:`ZIP_ROOT` (ignored). GptspeedError for a name that could leave the folder (``..``, an
    absolute path or a backslash)."""
    if not name.startswith(ZIP_ROOT):
        return None
    rel = PurePosixPath(name[len(ZIP_ROOT) :])
    if "\\" in name or rel.is_absolute() or any(p in ("..", ".") for p in rel.parts):
        raise GptspeedError(f"the CORE bundle zip has a member named {show_value(name)} outside its folder: refused")
    return rel


def unpack_bundle(zip_path: Path, target: Path, sha256: str) -> None:
    """Unpack the members under ``eval_bundle/`` of ``zip_path`` into ``target`` (replaced), through
    a hidden folder beside it renamed when whole, stamped with ``sha256``. Each member's path is
    checked to stay inside (no ``..``, absolute path or backslash: zip slip), links and other
    non-files are refused, and the unpacked size is bounded by :data:`MAX_BUNDLE_BYTES` (the sizes
    the zip declares, which bound what :mod:`zipfile` reads).

    Raises:
        GptspeedError: a zip that cannot be read, a member refused as above, or no ``core.yaml``.
    """
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _unpack_members(zip_path, tmp)
        (tmp / STAMP).write_text(sha256 + "\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if _stamp(target) != sha256:  # not another process unpacking the same bundle at once
                raise
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise GptspeedError(f"cannot unpack {zip_path} ({e}): delete it and try again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpack_members(zip_path: Path, dest: Path) -> None:
    with zipfile.ZipFile(zip_path) as z:
        infos = [(info, _member_path(info.filename)) for info in z.infolist()]
        infos = [(info, rel) for info, rel in infos if rel is not None and rel.parts]
        total = sum(info.file_size for info, _ in infos)
        if total > MAX_BUNDLE_BYTES:
            raise GptspeedError(
                f"{zip_path} would unpack to {total:,} bytes, more than a CORE bundle's {MAX_BUNDLE_BYTES:,}: refused"
            )
        for info, rel in infos:
            mode = info.external_attr >> 16
            if info.is_dir():
                (dest / rel).mkdir(parents=True, exist_ok=True)
                continue
            if mode and not stat.S_ISREG(mode):
                raise GptspeedError(f"the CORE bundle zip's member {show_value(info.filename)} is not a file: refused")
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest / rel, "xb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    if not (dest / "core.yaml").is_file():
        raise GptspeedError(f"{zip_path} holds no {ZIP_ROOT}core.yaml: it is not the CORE eval bundle")


# ------------------------------------------------------------------------------ reading a bundle
def bundle_root(folder: str | Path) -> Path:
    """The bundle in ``folder``: itself when it holds ``core.yaml``, else its ``eval_bundle/``
    (the folder the zip unpacks to). GptspeedError (one line) when neither is a bundle."""
    folder = Path(folder).expanduser()
    for root in (folder, folder / "eval_bundle"):
        if (root / "core.yaml").is_file():
            return root
    what = "does not exist" if not folder.exists() else "is not a folder" if not folder.is_dir() else "has no core.yaml"
    raise GptspeedError(
        f"--core-bundle {folder} {what}: give the folder nanochat's eval_bundle.zip unpacks to "
        "(core.yaml, eval_meta_data.csv, eval_data/)"
    )


def read_tasks(folder: str | Path) -> list[CoreTask]:
    """The tasks of the bundle in ``folder`` (:func:`bundle_root`), in ``core.yaml``'s order, each
    with its baseline from ``eval_meta_data.csv``.

    Raises:
        GptspeedError: not a bundle, or a ``core.yaml`` / ``eval_meta_data.csv`` that cannot be read
            or does not hold what it should (one line naming the file and the entry).
    """
    import yaml

    from gptspeed.fileio import read_user_text

    root = bundle_root(folder)
    config = root / "core.yaml"
    try:
        doc = yaml.safe_load(read_user_text(config, "CORE config"))
    except yaml.YAMLError as e:
        raise GptspeedError(f"{config} is not valid YAML: {' '.join(str(e).split())}"[:300]) from None
    except RecursionError:
        raise GptspeedError(f"{config} is nested too deeply to be read") from None
    entries = doc.get("icl_tasks") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise GptspeedError(f"{config} has no list icl_tasks: it is not a CORE bundle's config")
    baselines = read_baselines(root / "eval_meta_data.csv")
    tasks = [_task(config, i, entry, root, baselines) for i, entry in enumerate(entries, 1)]
    seen = set()
    for t in tasks:
        if t.label in seen:
            raise GptspeedError(f"{config}: the task {t.label} is listed twice")
        seen.add(t.label)
    return tasks


def _task(config: Path, i: int, entry: Any, root: Path, baselines: dict[str, float | None]) -> CoreTask:
    def bad(what: str) -> GptspeedError:
        return GptspeedError(f"{config}: icl_tasks entry {i} {what}"[:300])

    if not isinstance(entry, dict):
        raise bad("is not a mapping")
    label, uri, kind = entry.get("label"), entry.get("dataset_uri"), entry.get("icl_task_type")
    shots, delimiter = entry.get("num_fewshot"), entry.get("continuation_delimiter", " ")
    if not isinstance(label, str) or not label:
        raise bad("has no label")
    if kind not in TASK_TYPES:
        raise bad(f"({label}) has icl_task_type {show_value(kind)}, not one of {', '.join(TASK_TYPES)}")
    shots = shots[0] if isinstance(shots, list) and shots else shots  # a list in DCLM's file: nanochat takes [0]
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
        raise bad(f"({label}) has num_fewshot {show_value(entry.get('num_fewshot'))}, not a count")
    if not isinstance(delimiter, str):
        raise bad(f"({label}) has a continuation_delimiter that is not text")
    rel = PurePosixPath(uri) if isinstance(uri, str) and uri else None
    if rel is None or rel.is_absolute() or ".." in rel.parts or "\\" in uri:
        raise bad(f"({label}) has dataset_uri {show_value(uri)}, not a path inside eval_data/")
    return CoreTask(label, kind, root / "eval_data" / rel, shots, delimiter, baselines.get(label))


def read_baselines(path: Path) -> dict[str, float | None]:
    """Each task's random baseline (percent) from ``eval_meta_data.csv``'s ``Eval Task`` and ``Random
    baseline`` columns; None for a value that is not a number in [0, 100) (refused only when that
    task is scored: :func:`gptspeed.eval.core.load_core`). GptspeedError (one line) for a file that
    cannot be read or lacks the columns."""
    from gptspeed.fileio import read_user_text

    text = read_user_text(path, "CORE baselines").removeprefix("\ufeff")  # a spreadsheet's byte-order mark
    rows = csv.DictReader(io.StringIO(text))
    if not rows.fieldnames or not {"Eval Task", "Random baseline"} <= set(rows.fieldnames):
        raise GptspeedError(f"{path} has no columns 'Eval Task' and 'Random baseline': it is not a CORE bundle's")
    out: dict[str, float | None] = {}
    for row in rows:
        try:
            value: float | None = float(row["Random baseline"])
        except (TypeError, ValueError):
            value = None
        out[row["Eval Task"]] = value if value is not None and 0 <= value < 100 else None
    return out


def _valid(kind: str, ex: Any) -> bool:
    if not isinstance(ex, dict):
        return False
    texts = ex.get("choices") if kind == "multiple_choice" else ex.get("context_options")
    if kind == "language_modeling":
        return isinstance(ex.get("context"), str) and isinstance(ex.get("continuation"), str)
    if kind == "multiple_choice" and not isinstance(ex.get("query"), str):
        return False
    if kind == "schema" and not isinstance(ex.get("continuation"), str):
        return False
    gold = ex.get("gold")
    return (
        isinstance(texts, list)
        and len(texts) >= 2
        and all(isinstance(t, str) for t in texts)
        and isinstance(gold, int)
        and not isinstance(gold, bool)
        and 0 <= gold < len(texts)
    )


def read_examples(task: CoreTask) -> list[dict[str, Any]]:
    """The examples of ``task``, in its file's order (blank lines skipped).

    Raises:
        GptspeedError: the file cannot be read, holds nothing, or a line is not an example of the
            task's type (naming the file, the line and the fields it needs: :data:`FIELDS`).
    """
    examples = []
    try:
        with open(task.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ex = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    ex = None
                if not _valid(task.kind, ex):
                    raise GptspeedError(f"{task.path}:{n} is not a {task.kind} example ({FIELDS[task.kind]})")
                examples.append(ex)
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise GptspeedError(f"cannot read the examples of CORE task {task.label}, {task.path}: {why}") from None
    if not examples:
        raise GptspeedError(f"{task.path} holds no examples of CORE task {task.label}")
    return examples
