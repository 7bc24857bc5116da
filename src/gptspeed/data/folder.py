"""The data folder keeps what it promises: one writer or many readers at a time
(:func:`data_folder_lock`, :func:`prepare_lock`), and ``gptspeed prepare`` writes only into a folder that is new, empty
or gptspeed's own data folder (:func:`check_prepare_target`).

The lock is an ``fcntl.flock`` of the folder itself (an open directory), not of a file in it: a
reader needs no write permission and adds nothing to the folder. ``gptspeed train`` holds it
shared for its whole run (:func:`gptspeed.data.train_data.find_train_data` takes it before it
lists the shards; the :class:`~gptspeed.data.train_data.TrainData` keeps it); ``gptspeed prepare``
holds it exclusive while it writes (:func:`prepare_lock`). So a ``prepare
--force`` is refused while a train reads the folder (naming the readers' pids, from
``/proc/locks`` where there is one), and a train is refused while a prepare writes it (naming the
prepare). The kernel drops a lock when its process dies, even by SIGKILL. Where the file system
cannot lock a folder (NFS refuses an exclusive ``flock`` of a directory with EBADF; some FUSE file
systems answer ENOLCK or EOPNOTSUPP) nothing is locked, and what a running train notices is what
it checks anyway: a shard that changed under it stops it in one line naming the shard, after
saving its last finished step (:class:`gptspeed.data.loader.TokenLoader`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gptspeed.errors import GptspeedError
from gptspeed.locks import FolderLock, reader_pids

PREPARE_LOCK_NAME = ".prepare.lock"
"""The lock file of :func:`prepare_lock` (the pid and host of the prepare)."""


def data_folder_lock(folder: str | os.PathLike, *, exclusive: bool = False) -> FolderLock:
    """The data folder ``folder``'s own lock (a :class:`~gptspeed.locks.FolderLock` of the folder itself,
    not yet taken): shared (any number of readers, no ``prepare``) or ``exclusive`` (no reader). Its
    :meth:`~gptspeed.locks.FolderLock.acquire` raises GptspeedError naming the prepare (its
    ``.prepare.lock``) when one is writing the folder, or the readers (their pids, where ``/proc/locks``
    tells) when a ``gptspeed train`` or another reader holds it; where the folder cannot be locked
    nothing is held."""
    folder = Path(folder)
    return FolderLock(
        folder,
        folder_mode="exclusive" if exclusive else "shared",
        in_use=(lambda: _in_use(folder)) if exclusive else (lambda: _being_prepared(folder)),
    )


def prepare_lock(out: str | os.PathLike) -> FolderLock:
    """One ``prepare`` per output folder, and no reader while it writes (a
    :class:`~gptspeed.locks.FolderLock`, not yet taken): an exclusive flock on ``OUT/.prepare.lock``,
    which holds the owner's pid and host and is removed at release (a prepared folder holds only its
    shards and manifest), then on the folder itself, exclusive (as :func:`data_folder_lock`). Its
    ``acquire`` raises GptspeedError naming the holder when another prepare has it, naming the readers
    when a train reads the folder (the lock file is removed again), or naming the folder when the lock
    file cannot be made."""
    out = Path(out)
    return FolderLock(
        out,
        file=PREPARE_LOCK_NAME,
        folder_mode="exclusive",
        remove_file=True,
        busy=lambda holder: (
            f"{out} is being prepared by {holder} (another `gptspeed prepare`): wait for it to finish or "
            "stop it, or choose another --out"
        ),
        in_use=lambda: _in_use(out),
        cannot_open=lambda e: f"cannot write the data folder {out}: {e.strerror or e}: choose another --out",
    )


def _being_prepared(folder: Path) -> str:
    """The refusal of a reader while a prepare writes ``folder``, naming the prepare."""
    return (
        f"data folder {folder} is being prepared{_prepare_holder(folder)} (a `gptspeed prepare` is writing "
        "its shards): wait for it to finish, then start again"
    )


def _in_use(folder: Path) -> str:
    """The refusal of a prepare while readers hold ``folder``, naming their pids where they can be known."""
    pids = reader_pids(folder)
    who = f" by pid {', '.join(map(str, pids))}" if pids else ""
    return (
        f"data folder {folder} is in use{who} (a running `gptspeed train` reads its shards; preparing it "
        "again would change them under the run): wait for the run to finish or stop it, or prepare into "
        "another --out"
    )


def _prepare_holder(folder: Path) -> str:
    """`` by pid N on HOST`` from the folder's ``.prepare.lock``, or ``""``."""
    try:
        with open(folder / PREPARE_LOCK_NAME, "rb") as f:
            text = f.read(200).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" by {text}" if text.startswith("pid ") and "\n" not in text else ""


# ------------------------------------------------------------------ what prepare may write into
OWN_NAMES = re.compile(
    r"(?:train|val)_\d{6,}\.bin|\.stream_\d{6,}\.bin|\.prepare\.lock|\.prepare-progress\.json"
    r"|\.\.?(?:(?:train|val)_\d{6,}\.bin|stream_\d{6,}\.bin|manifest\.json|prepare-progress\.json)\.[0-9a-f]{8}\.tmp"
)
"""The names ``gptspeed prepare`` writes in a data folder besides ``manifest.json``: shards,
staging chunks, its lock and progress files, and their temporary names (``.NAME.XXXXXXXX.tmp``)."""
CARRIED_NAMES = re.compile(r"tokenizer\.json|\.tokenizer\.json\.[0-9a-f]{8}\.tmp")
"""What else ``prepare`` writes there: the ``tokenizer.json`` of the tokenizer folder it tokenized with
(:func:`gptspeed.data.prepare_tokenizer.save_data_tokenizer`) and its temporary name. Allowed in a data
folder like :data:`OWN_NAMES`, but never what makes a folder one (a tokenizer or run folder holds one too)."""
_IGNORED = {".DS_Store"}  # what macOS's Finder leaves in any folder it showed


def _own_manifest(folder: Path, names: list[str]) -> bool:
    """Whether ``folder/manifest.json`` is gptspeed's: a manifest of its format, or -- when it
    cannot be read as JSON (a damaged one) -- beside gptspeed's own shards."""
    from gptspeed.data import MANIFEST_FORMAT, MANIFEST_NAME
    from gptspeed.fileio import read_user_json

    try:
        doc = read_user_json(folder / MANIFEST_NAME, "manifest")
    except GptspeedError:
        return any(OWN_NAMES.fullmatch(n) and n.endswith(".bin") for n in names)
    return doc.get("format") == MANIFEST_FORMAT


def foreign_entries(folder: Path) -> list[str]:
    """The entries of the existing folder ``folder`` that make it something else than a gptspeed
    data folder, sorted: none when it holds gptspeed's manifest (extra files of the user's in a
    prepared folder are left alone) or only gptspeed's own names (:data:`OWN_NAMES`); else every
    entry that is not one of those. An unreadable folder counts as foreign."""
    from gptspeed.data import MANIFEST_NAME

    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return [f"(unreadable: {e.strerror or e})"]
    if MANIFEST_NAME in names and _own_manifest(folder, names):
        return []
    return [n for n in names if not (OWN_NAMES.fullmatch(n) or CARRIED_NAMES.fullmatch(n) or n in _IGNORED)]


def is_data_folder(folder: Path) -> bool:
    """Whether ``folder`` is one ``gptspeed prepare`` wrote (or is writing): it holds gptspeed's
    manifest, or a shard or file under a name of prepare's own (:data:`OWN_NAMES`) -- not merely some
    ``*.bin`` file of the user's."""
    from gptspeed.data import MANIFEST_NAME

    try:
        names = os.listdir(folder)
    except OSError:
        return False
    if MANIFEST_NAME in names and _own_manifest(Path(folder), names):
        return True
    return any(OWN_NAMES.fullmatch(n) for n in names)


def check_prepare_target(out: Path) -> None:
    """GptspeedError (one line, before anything is written) when ``gptspeed prepare`` must not
    write into ``out``: the root folder, the home folder, or an existing folder holding files
    that gptspeed did not write and no gptspeed manifest (:func:`foreign_entries`) -- a source
    folder, a run folder, a project. A new folder, an empty one, a prepared one and an
    interrupted prepare's are fine."""
    try:
        real = out.resolve()
    except (OSError, RuntimeError):  # a symlink loop: _check_out names it
        return
    if real == Path(real.anchor):
        raise GptspeedError(f"--out {out} is the root folder: prepare into a folder of its own, e.g. data/NAME")
    try:
        home = Path.home().resolve()
    except (OSError, RuntimeError, KeyError):  # no HOME and no password entry
        home = None
    if real == home:
        raise GptspeedError(f"--out {out} is your home folder: prepare into a folder of its own, e.g. ~/data/NAME")
    if not real.is_dir():
        return
    foreign = foreign_entries(real)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise GptspeedError(
            f"--out {out} already holds files `gptspeed prepare` did not write ({shown}): a data folder "
            "must be new, empty or one gptspeed prepared; choose another --out"
        )
