"""One lock for every folder gptspeed writes or reads: :class:`FolderLock`, an ``fcntl.flock`` held
exclusive (one writer) or shared (any number of readers).

It holds a folder in either or both of two ways. Through a lock file in it (``file``): an exclusive
flock of that file, which then holds its holder's ``pid N on HOST`` for the refusal to name; works
wherever ``flock`` does. Through the folder itself (``folder_mode``): a shared or exclusive flock of
the open directory, no file added (a reader needs no write permission); where the file system cannot
lock a folder (NFS refuses an exclusive ``flock`` of a directory with EBADF; some FUSE file systems
answer ENOLCK or EOPNOTSUPP) that hold is skipped, and the callers check what they read anyway. The
kernel drops every flock when its process dies, even by SIGKILL, so a stale lock never blocks.

Its users: the run folder (:func:`gptspeed.checkpoint.folder.run_lock`: the file ``.gptspeed.lock``),
the data folder (:func:`gptspeed.data.folder.data_folder_lock`: the folder, shared by every train,
exclusive by a prepare) and the prepared folder (:func:`gptspeed.data.prepared_state.prepare_lock`:
the file ``.prepare.lock``, removed at release, and the folder exclusive).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path

from gptspeed.errors import GptspeedError

_UNLOCKABLE = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
_BUSY = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}


class FolderLock:
    """A lock on ``folder``: :meth:`acquire` takes it (returns ``self``), :meth:`release` drops it
    (also when called again, or never acquired; the object being collected or the process ending
    drops it too).

    Args:
        folder: the folder held.
        file: the name of a lock file in ``folder`` to hold exclusive (made if missing, never opened
            through a symbolic link -- it is truncated --, checked after locking to be the file at its
            path, so one its releasing holder removed meanwhile is never taken), holding the holder's
            ``pid N on HOST``; None: no lock file.
        folder_mode: ``"shared"`` or ``"exclusive"``: hold the folder itself that way, after the file;
            None: not the folder.
        remove_file: remove the lock file at :meth:`release`, before its flock drops.
        busy: the refusal when another process holds the lock file: ``busy(holder)``, the holder's
            text in it (or ``"another process"``).
        in_use: the refusal when another process holds the folder the other way: ``in_use()``.
        cannot_open: the refusal when the lock file cannot be opened: ``cannot_open(error)``.

    Raises:
        GptspeedError: from :meth:`acquire`: ``busy``'s, ``in_use``'s or ``cannot_open``'s line (nothing
            held then).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        file: str | None = None,
        folder_mode: str | None = None,
        remove_file: bool = False,
        busy: Callable[[str], str] | None = None,
        in_use: Callable[[], str] | None = None,
        cannot_open: Callable[[OSError], str] | None = None,
    ):
        self.folder = Path(folder)
        self.path = self.folder / file if file is not None else None
        self.folder_mode, self.remove_file = folder_mode, remove_file
        # no default refers to self: a lock no longer referenced is released at once, not by the cycle collector
        self.busy = busy or (lambda holder: f"{folder} is locked by {holder}")
        self.in_use = in_use or (lambda: f"{folder} is in use by another process")
        self.cannot_open = cannot_open or (lambda e: f"cannot lock {file} in {folder}: {e.strerror or e}")
        self._file_fd: int | None = None
        self._folder_fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether anything is held (False where the folder cannot be locked and there is no lock file)."""
        return self._file_fd is not None or self._folder_fd is not None

    def acquire(self) -> FolderLock:
        try:
            import fcntl
        except ImportError:  # Windows: no flock
            if self.path is not None:
                raise
            return self  # a folder alone: nothing held, as where the file system cannot lock it
        if self.path is not None:
            self._file_fd = self._lock_file(fcntl)
        if self.folder_mode is not None:
            try:
                self._folder_fd = self._lock_folder(fcntl)
            except BaseException:
                self.release()
                raise
        return self

    def _lock_file(self, fcntl) -> int:
        """The descriptor of the lock file, flocked exclusive, holding this process's pid and host."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError as e:  # a folder, a link, a file it may not write under the lock's name
                raise GptspeedError(self.cannot_open(e)) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise GptspeedError(self.busy(holder)) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed it as we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        return fd

    def _lock_folder(self, fcntl) -> int | None:
        """The descriptor of the folder, flocked as ``folder_mode`` says; None where it cannot be locked."""
        try:
            fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return None  # not a folder, or unreadable: the caller's own checks say so
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if self.folder_mode == "exclusive" else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _BUSY:
                raise GptspeedError(self.in_use()) from None
            if e.errno in _UNLOCKABLE:
                return None
            raise
        return fd

    def release(self) -> None:
        """Remove the lock file if asked (before its flock drops: see ``file``), drop the file's flock,
        then the folder's."""
        if self._file_fd is not None:
            if self.remove_file:
                try:
                    self.path.unlink(missing_ok=True)
                except OSError:
                    pass
            os.close(self._file_fd)  # closing the descriptor drops the flock
            self._file_fd = None
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def reader_pids(folder: Path) -> list[int]:
    """The pids holding a shared ``flock`` on ``folder`` (a :class:`FolderLock` held ``"shared"``), from
    ``/proc/locks`` (Linux; [] elsewhere)."""
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
