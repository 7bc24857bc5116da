"""Small file helpers every writer in gptspeed shares: hashing, and atomic writes.

An atomic write goes to a hidden temporary file beside the target (``.NAME.XXXXXXXX.tmp``, so it
never matches ``*.bin`` / ``ckpt_*.pt`` globs), is flushed and fsynced, then renamed over the
target with ``os.replace``: readers see the old file or the whole new one, never a part.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Any, Callable, BinaryIO

_HASH_CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def create_temp(dest: Path) -> tuple[int, Path]:
    """Create and open (write-only) a new hidden temp file ``.NAME.XXXXXXXX.tmp`` beside
    ``dest``, for an atomic write by ``os.replace``. Unlike ``tempfile.mkstemp`` the file gets
    the usual permissions (0o666 less the umask), which the renamed file keeps.

    Returns:
        ``(fd, path)``; the caller closes ``fd`` and replaces or removes ``path``.
    """
    while True:
        tmp = dest.parent / f".{dest.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], Any],
                 before_rename: Callable[[Any], Any] | None = None) -> Any:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it to ``path``.

    ``before_rename(result)``, when given, runs between the fsync and the rename (a checkpoint's
    seal is written there, so the file never stands under its name unsealed). Returns what
    ``write`` returned. On any failure (including KeyboardInterrupt) the temporary file is removed
    and ``path`` is untouched; the OSError or other exception propagates.
    """
    path = Path(path)
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(result)
        os.replace(tmp, path)
        return result
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """:func:`write_atomic` of UTF-8 text."""
    write_atomic(path, lambda f: f.write(text.encode()))


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder so that renames inside it survive a power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
