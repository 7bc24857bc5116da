"""The run folder: one writer at a time (:func:`run_lock`), gptspeed's own or refused
(:func:`refuse_foreign_folder`), created and -- when a new run fails before its first step -- left
as it was found (:class:`RunFolder`); and the room a checkpoint needs there."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from gptspeed.checkpoint.paths import CKPT_RE, LOCK_NAME, OWN_NAMES, STALE_NAMES, list_checkpoints
from gptspeed.errors import GptspeedError
from gptspeed.locks import FolderLock
from gptspeed.paths import real_path


def estimate_checkpoint_bytes(model, optimizer_states: int = 2) -> int:
    """Bytes a checkpoint of ``model`` takes: weights plus ``optimizer_states`` fp32 tensors per
    parameter (AdamW's two moments), plus 1 MiB for the rest."""
    n = sum(p.numel() * p.element_size() + optimizer_states * p.numel() * 4 for p in model.parameters())
    return n + (1 << 20)


def check_free_space(run_dir: Path, need_bytes: int) -> None:
    """GptspeedError if ``run_dir``'s file system has less than ``need_bytes`` free."""
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise GptspeedError(
            f"{run_dir} has {free / 2**30:.2f} GiB free but a checkpoint needs about "
            f"{need_bytes / 2**30:.2f} GiB: free some space or choose another --out"
        )


def run_lock(run_dir: str | os.PathLike) -> FolderLock:
    """One writer per run folder (a :class:`~gptspeed.locks.FolderLock`, not yet taken): an exclusive
    ``fcntl.flock`` on ``RUN_DIR/.gptspeed.lock``, which holds the owner's pid and host. The kernel
    drops the lock when its process dies (even by SIGKILL), so a stale lock file never blocks
    ``--resume``. Its ``acquire`` raises GptspeedError naming the holder when another live process has
    it, and when the lock file cannot be opened (a folder, a symbolic link -- never followed: the lock
    is truncated -- under its name)."""
    run_dir = Path(run_dir)
    return FolderLock(
        run_dir,
        file=LOCK_NAME,
        busy=lambda holder: (
            f"{run_dir} is being written by {holder} (another `gptspeed train`): "
            "wait for it to finish or stop it, or choose another --out"
        ),
        cannot_open=lambda e: (
            f"cannot take the run folder's lock {run_dir / LOCK_NAME}: {e.strerror or e}; it is gptspeed's "
            "own file: move whatever is there away (gptspeed makes it again)"
        ),
    )


def _is_own_config(path: Path) -> bool:
    """Whether ``path`` is a config.json gptspeed wrote: a JSON object with the ``model`` and ``train``
    groups of a RunConfig and what only gptspeed adds beside them -- a run's ``derived`` entries
    naming its run id (:func:`gptspeed.runinfo.write_run_config`), or an imported model's ``source``
    (``import-hf``). Another program's file with ``model`` and ``train`` keys is not taken for one."""
    from gptspeed.fileio import read_user_json

    try:
        doc = read_user_json(path, "config", max_bytes=1 << 20)
    except GptspeedError:
        return False
    if not (isinstance(doc.get("model"), dict) and isinstance(doc.get("train"), dict)):
        return False
    derived = doc.get("derived")
    run_id = derived.get("run_id") if isinstance(derived, dict) else None
    return (isinstance(run_id, str) and bool(run_id)) or isinstance(doc.get("source"), dict)


def _is_own_metrics(path: Path) -> bool:
    """Whether ``path`` is a metrics.jsonl gptspeed wrote: a regular file whose first line is a
    JSON record with an integer ``step`` (an empty file counts: a run killed before its first record)."""
    import stat

    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return False
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
        if not first.strip():
            return True
        record = json.loads(first)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and type(record.get("step")) is int


# gptspeed's names that a user's folder may hold too (a JSON-lines log, TensorBoard's or W&B's folder): gptspeed's own
# only in a run folder -- beside a checkpoint or a config.json of gptspeed's (written before any of them)
_RUN_ONLY_NAMES = frozenset({"metrics.jsonl", "tensorboard", "wandb", "wandb_run_id"})


def foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that gptspeed does not write in a run folder, sorted: any name but
    :data:`OWN_NAMES` and :data:`STALE_NAMES`; a ``config.json`` not of gptspeed's form
    (:func:`_is_own_config`); and ``metrics.jsonl`` (unless of gptspeed's form: a first record with an
    integer ``step``), ``tensorboard``, ``wandb`` and ``wandb_run_id`` unless beside a checkpoint or
    gptspeed's ``config.json`` -- names a folder of the user's may hold, which alone never make it a
    run's. An unreadable folder counts as foreign."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return [f"(unreadable: {e.strerror or e})"]
    out = [n for n in names if not (OWN_NAMES.match(n) or STALE_NAMES.match(n))]
    own_config = "config.json" in names and _is_own_config(folder / "config.json")
    if "config.json" in names and not own_config:
        out.append("config.json")
    if not (own_config or any(CKPT_RE.match(n) for n in names)):
        out += [n for n in names if n in _RUN_ONLY_NAMES and n not in out]
    elif "metrics.jsonl" in names and not _is_own_metrics(folder / "metrics.jsonl"):
        out.append("metrics.jsonl")
    return sorted(out)


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a gptspeed run's: it holds a checkpoint, a checkpoint's seal, the run
    folder's lock or a ``config.json`` of gptspeed's (:func:`_is_own_config`) -- what a user's files
    cannot be mistaken for."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    if any(_RUN_MARKS.match(n) for n in names):
        return True
    return "config.json" in names and _is_own_config(Path(folder) / "config.json")


_RUN_MARKS = re.compile(r"^(ckpt_\d{8}\.(pt|dcp|json)|\.gptspeed\.lock)$")


def climbs_out_of_missing(path: Path) -> Path | None:
    """The folder that a ``..`` of ``path`` climbs out of when it does not exist yet (``new`` in
    ``new/../victim``: checked as written, such a path is missing, though once ``new`` is made it is
    ``victim``), else None."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if part == ".." and i and not os.path.lexists(Path(*parts[:i])):
            return Path(*parts[:i])
    return None


def refuse_foreign_folder(folder: Path, what: str = "--out") -> None:
    """GptspeedError when ``folder`` exists, holds no checkpoint and holds entries gptspeed did
    not write (:func:`foreign_entries`): a new run, import or consolidation never writes into the
    user's folder (``/``, a home folder, a data folder, a Hugging Face model folder). A folder
    with checkpoints is a run folder; extra files there (notes, plots) are left alone."""
    folder = Path(folder)
    if not folder.is_dir() or list_checkpoints(folder):
        return
    foreign = foreign_entries(folder)
    if not foreign:
        return
    from gptspeed.paths import kind

    if kind(folder) == "data folder":
        raise GptspeedError(
            f"{what} {folder} is a prepared data folder (token shards): a run needs a folder of its own; "
            f"choose another {what} (e.g. runs/NAME)"
        )
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise GptspeedError(
        f"{what} {folder} already holds files gptspeed did not write ({shown}): a run folder must be new, "
        f"empty or a gptspeed run's; choose another {what}"
    )


class RunFolder:
    """The run folder of one writer: created if new, refused if it holds files gptspeed did not
    write (:func:`refuse_foreign_folder`) or where something other than a file stands under the
    name of one of its own (config.json, metrics.jsonl, the lock), locked (:func:`run_lock`) by rank
    0 for the whole run, and -- when a new run fails before its first step -- left as it was found: only the files
    this run created are removed, and only gptspeed's own stale temporary names are cleaned."""

    def __init__(self, path: Path, is_main: bool):
        self.path, self.is_main = Path(path), is_main
        self.created = self.opened = False
        self.written: set[str] = set()  # files this run wrote (abandon removes those it created)
        self.existing: set[str] = set()  # names in the folder when it was opened (abandon keeps them)
        self.lock: FolderLock | None = None

    def open(self) -> None:
        if not self.is_main:
            return
        missing = climbs_out_of_missing(self.path)
        if missing is not None:
            raise GptspeedError(
                f"--out {self.path} climbs out of {missing}, which does not exist, with '..': give the run "
                f"folder's own path ({real_path(self.path)})"
            )
        refuse_foreign_folder(self.path)  # before anything is written into it
        try:
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise GptspeedError(f"cannot write to run folder {self.path}: {e.strerror or e}") from e
        for name in ("config.json", "metrics.jsonl"):  # gptspeed's own files, written over as the run goes
            own = self.path / name
            if os.path.lexists(own) and not own.is_file():
                raise GptspeedError(
                    f"{own} is not a file (a folder?), where the run writes its {name}: move it away, then run again"
                )
        self.lock = run_lock(self.path).acquire()
        self.opened = True
        self.existing = {p.name for p in self.path.iterdir()} - {LOCK_NAME}
        for stale in self.path.iterdir():  # left by a gptspeed process killed while writing (a file, or a .dcp folder)
            if not STALE_NAMES.match(stale.name):
                continue
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def abandon(self) -> None:
        """A new run failed before its first checkpoint: remove the files it created (config.json,
        metrics.jsonl, the lock; never one that was there before it started) and the folder itself
        if this run created it and it is now empty."""
        if not self.opened or list_checkpoints(self.path):
            return
        for name in self.written - self.existing:
            p = self.path / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        self.close()
        (self.path / LOCK_NAME).unlink(missing_ok=True)
        if self.created:
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
