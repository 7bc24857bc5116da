"""The data folder keeps what it promises: one writer or many readers at a time
(:class:`DataFolderLock`), and ``gptspeed prepare`` writes only into a folder that is new, empty
or gptspeed's own data folder (:func:`check_prepare_target`).

The lock is an ``fcntl.flock`` of the folder itself (an open directory), not of a file in it: a
reader needs no write permission and adds nothing to the folder. ``gptspeed train`` holds it
shared for its whole run (:func:`gptspeed.data.train_data.find_train_data` takes it before it
lists the shards; the :class:`~gptspeed.data.train_data.TrainData` keeps it); ``gptspeed prepare``
holds it exclusive while it writes (:class:`gptspeed.data.prepare.PrepareLock`). So a ``prepare
--force`` is refused while a train reads the folder (naming the readers' pids, from
``/proc/locks`` where there is one), and a train is refused while a prepare writes it (naming the
prepare). The kernel drops a lock when its process dies, even by SIGKILL. Where the file system
cannot lock a folder (NFS refuses an exclusive ``flock`` of a directory with EBADF; some FUSE file
systems answer ENOLCK or EOPNOTSUPP) nothing is locked, and what a running train notices is what
it checks anyway: a shard that changed under it stops it in one line naming the shard, after
saving its last finished step (:class:`gptspeed.data.loader.TokenLoader`).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from gptspeed.errors import GptspeedError

PREPARE_LOCK_NAME = ".prepare.lock"
"""The file of :class:`gptspeed.data.prepare.PrepareLock` (the pid and host of the prepare)."""

_UNLOCKABLE = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


class DataFolderLock:
    """A shared (readers) or exclusive (``prepare``) ``fcntl.flock`` on the data folder ``folder``.
    :meth:`release` (or the object being collected, or the process ending) drops it.

    Use :meth:`for_reading` / :meth:`for_writing`: each returns the held lock, or None where the
    folder cannot be locked (no ``fcntl``, or a file system that refuses: see the module
    docstring), and raises GptspeedError (one line, naming the other side) when the folder is
    held the other way."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self._fd = folder, fd

    @classmethod
    def _take(cls, folder: Path, exclusive: bool) -> tuple[DataFolderLock | None, bool]:
        """(the lock or None, whether another process holds it the other way)."""
        try:
            import fcntl
        except ImportError:  # Windows: no flock
            return None, False
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return None, False  # not a folder, or unreadable: the caller's own checks say so
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None, True
            if e.errno in _UNLOCKABLE:
                return None, False
            raise
        return cls(folder, fd), False

    @classmethod
    def for_reading(cls, folder: str | os.PathLike) -> DataFolderLock | None:
        """A shared lock: any number of readers, no ``prepare``. GptspeedError naming the prepare
        (its ``.prepare.lock``) when one is writing the folder."""
        folder = Path(folder)
        lock, busy = cls._take(folder, exclusive=False)
        if busy:
            holder = _prepare_holder(folder)
            raise GptspeedError(
                f"data folder {folder} is being prepared{holder} (a `gptspeed prepare` is writing "
                "its shards): wait for it to finish, then start again"
            )
        return lock

    @classmethod
    def for_writing(cls, folder: str | os.PathLike) -> DataFolderLock | None:
        """An exclusive lock: no reader. GptspeedError naming the readers (their pids, where
        ``/proc/locks`` tells) when a ``gptspeed train`` or another reader holds the folder."""
        folder = Path(folder)
        lock, busy = cls._take(folder, exclusive=True)
        if busy:
            pids = _reader_pids(folder)
            who = f" by pid {', '.join(map(str, pids))}" if pids else ""
            raise GptspeedError(
                f"data folder {folder} is in use{who} (a running `gptspeed train` reads its shards; "
                "preparing it again would change them under the run): wait for the run to finish or "
                "stop it, or prepare into another --out"
            )
        return lock

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def _prepare_holder(folder: Path) -> str:
    """`` by pid N on HOST`` from the folder's ``.prepare.lock``, or ``""``."""
    try:
        with open(folder / PREPARE_LOCK_NAME, "rb") as f:
            text = f.read(200).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" by {text}" if text.startswith("pid ") and "\n" not in text else ""


def _reader_pids(folder: Path) -> list[int]:
    """The pids holding a shared ``flock`` on ``folder``, from ``/proc/locks`` (Linux; [] elsewhere)."""
    try:
        st = os.stat(folder)
        with open("/proc/locks") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return []
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in lines:  # "1: FLOCK  ADVISORY  READ 12345 fe:00:2146356 0 EOF"
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "READ" and parts[5] == where and parts[4].isdigit():
            pids.add(int(parts[4]))
    return sorted(pids)


# ------------------------------------------------------------------ what prepare may write into
OWN_NAMES = re.compile(
    r"(?:train|val)_\d{6,}\.bin|\.stream_\d{6,}\.bin|\.prepare\.lock|\.prepare-progress\.json"
    r"|\.\.?(?:(?:train|val)_\d{6,}\.bin|stream_\d{6,}\.bin|manifest\.json|prepare-progress\.json)\.[0-9a-f]{8}\.tmp"
)
"""The names ``gptspeed prepare`` writes in a data folder besides ``manifest.json``: shards,
staging chunks, its lock and progress files, and their temporary names (``.NAME.XXXXXXXX.tmp``)."""
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
    return [n for n in names if not (OWN_NAMES.fullmatch(n) or n in _IGNORED)]


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
