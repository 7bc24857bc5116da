"""``gptspeed.locks``: one :class:`FolderLock` for the run folder, the data folder and the prepared folder:
shared or exclusive on the folder itself, exclusive on a lock file that names its holder."""

from __future__ import annotations

import errno
import fcntl
import os
import socket

import pytest

from gptspeed.errors import GptspeedError
from gptspeed.locks import FolderLock, reader_pids

HOLDER = f"pid {os.getpid()} on {socket.gethostname()}"


def folder_lock(path, mode):
    return FolderLock(path, folder_mode=mode, in_use=lambda: f"{mode} refused")


def test_readers_share_a_folder_and_a_writer_excludes_them_both_ways(tmp_path):
    """Two shared holds of a folder stand together; an exclusive one is refused while they stand (its
    ``in_use`` line), and a shared one while an exclusive one stands; released, the folder is free."""
    first, second = folder_lock(tmp_path, "shared").acquire(), folder_lock(tmp_path, "shared").acquire()
    assert first.held and second.held
    assert reader_pids(tmp_path) in ([os.getpid()], [])  # [] where there is no /proc/locks
    with pytest.raises(GptspeedError, match="^exclusive refused$"):
        folder_lock(tmp_path, "exclusive").acquire()
    first.release()
    second.release()
    writer = folder_lock(tmp_path, "exclusive").acquire()
    with pytest.raises(GptspeedError, match="^shared refused$"):
        folder_lock(tmp_path, "shared").acquire()
    writer.release()
    writer.release()  # a second release is quiet
    folder_lock(tmp_path, "exclusive").acquire().release()


def test_a_lock_file_names_its_holder_refuses_a_second_and_is_removed_at_release_when_asked(tmp_path):
    """The lock file holds ``pid N on HOST``; a second holder is refused with that text; with
    ``remove_file`` the file is gone after release (else kept), and a failed folder hold leaves no file."""

    def lock(**kw):
        return FolderLock(tmp_path, file=".lock", busy=lambda holder: f"held by {holder}", **kw)

    held = lock(remove_file=True).acquire()
    assert (tmp_path / ".lock").read_text() == HOLDER
    with pytest.raises(GptspeedError, match=f"^held by {HOLDER}$"):
        lock().acquire()
    held.release()
    assert not (tmp_path / ".lock").exists()
    lock().acquire().release()
    assert (tmp_path / ".lock").read_text() == HOLDER  # kept without remove_file
    reader = folder_lock(tmp_path, "shared").acquire()
    with pytest.raises(GptspeedError, match="^readers$"):
        lock(folder_mode="exclusive", remove_file=True, in_use=lambda: "readers").acquire()
    assert not (tmp_path / ".lock").exists()  # the file taken first is removed again
    reader.release()


def test_a_lock_file_its_releasing_holder_removed_meanwhile_is_never_taken(tmp_path, monkeypatch):
    """A holder removing its file as it releases: a process that opened the old file and locked it
    after that holds a file no longer at the path; it notices and locks the file at the path instead."""
    real, calls = fcntl.flock, []

    def flock(fd, op):
        real(fd, op)
        calls.append(fd)
        if len(calls) == 1:  # the old holder removes the file right after we opened it
            (tmp_path / ".lock").unlink()

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = FolderLock(tmp_path, file=".lock").acquire()
    try:
        assert len(calls) == 2  # the removed file, then the new one
        assert os.path.samestat(os.fstat(lock._file_fd), os.stat(tmp_path / ".lock"))
        assert (tmp_path / ".lock").read_text() == HOLDER
    finally:
        lock.release()


@pytest.mark.parametrize("code", [errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP])
def test_where_the_folder_cannot_be_locked_nothing_is_held(tmp_path, monkeypatch, code):
    """NFS refuses an exclusive flock of a directory (EBADF), some FUSE file systems answer ENOLCK or
    EOPNOTSUPP: the hold is skipped, not an error; another error passes through."""

    def flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = folder_lock(tmp_path, "exclusive").acquire()
    assert not lock.held
    lock.release()

    def broken(fd, op):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        folder_lock(tmp_path, "exclusive").acquire()


def test_a_lock_no_longer_referenced_is_released_at_once(tmp_path):
    """A lock dropped without release (a reader's TrainData gone out of scope) frees the folder right
    away, not whenever the cycle collector runs: nothing in it refers back to it."""
    import gc

    gc.disable()
    try:
        FolderLock(tmp_path, folder_mode="shared").acquire()  # dropped at once
        FolderLock(tmp_path, file=".lock", folder_mode="exclusive").acquire().release()
    finally:
        gc.enable()


def test_reader_pids_are_the_shared_flock_holders_of_that_folder_read_from_the_first_mib_of_proc_locks(
    tmp_path, monkeypatch
):
    """``/proc/locks`` (proc(5): id, class, mode, access, pid, major:minor:inode in hex, start, end): the pids of the
    FLOCK READ locks on the folder's inode, each once, sorted; a writer's lock, a POSIX lock, a lock on another
    inode, a blocked waiter's ``->`` line are not readers; the file is read up to 1 MiB (a line beyond is not
    seen); no ``/proc/locks``, no readers."""
    import io

    import gptspeed.locks as locks

    st = os.stat(tmp_path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    here, there = f"{dev}:{st.st_ino}", f"{dev}:{st.st_ino + 1}"
    lines = [
        f"1: FLOCK  ADVISORY  READ 4242 {here} 0 EOF",
        f"2: FLOCK  ADVISORY  WRITE 11 {here} 0 EOF",
        f"3: POSIX  ADVISORY  READ 12 {here} 0 EOF",
        f"4: FLOCK  ADVISORY  READ 13 {there} 0 EOF",
        f"4: -> FLOCK  ADVISORY  READ 14 {here} 0 EOF",
        f"5: FLOCK  ADVISORY  READ 77 {here} 0 EOF",
        f"6: FLOCK  ADVISORY  READ 4242 {here} 0 EOF",
    ]
    text = "\n".join(lines) + "\n"
    text += "x" * ((1 << 20) - len(text) + 10) + f"\n7: FLOCK  ADVISORY  READ 99 {here} 0 EOF\n"
    real_open = open
    monkeypatch.setattr(
        locks,
        "open",
        lambda p, *a, **k: io.StringIO(text) if p == "/proc/locks" else real_open(p, *a, **k),
        raising=False,
    )
    assert reader_pids(tmp_path) == [77, 4242]
    monkeypatch.setattr(locks, "open", lambda p, *a, **k: real_open(tmp_path / "no-proc-locks"), raising=False)
    assert reader_pids(tmp_path) == []
