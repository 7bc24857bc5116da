"""Small file helpers every writer in gptspeed shares: hashing, and atomic writes.

An atomic write goes to a hidden temporary file beside the target (``.NAME.XXXXXXXX.tmp``, so it
never matches ``*.bin`` / ``ckpt_*.pt`` globs), is flushed and fsynced, then renamed over the
target with ``os.replace``: readers see the old file or the whole new one, never a part.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

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


def write_atomic(
    path: str | os.PathLike, write: Callable[[BinaryIO], Any], before_rename: Callable[[Any], Any] | None = None
) -> Any:
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


# ------------------------------------------------------------------------------------- reading
MAX_TEXT_BYTES = 64 << 20  # a configuration, manifest, seal or metrics file larger than this is not one


def read_user_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a small file gptspeed reads but did not necessarily write (a manifest,
    a seal, a configuration, ``metrics.jsonl``, an HF ``config.json``): the one place such files
    are opened, so every way they can be wrong is one line.

    Refused, each with a GptspeedError naming ``what`` and ``path``: a missing or unreadable file,
    anything that is not a regular file (a folder, a FIFO -- which would block the read forever --,
    a device such as ``/dev/zero``), a file over ``max_bytes`` bytes, and bytes that are not UTF-8.
    The file is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a
    path swapped for a FIFO between a check and the open cannot block either.
    """
    import stat

    from gptspeed.errors import GptspeedError

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise GptspeedError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise GptspeedError(f"{what} {path} is a folder, not a file") from None
    except OSError as e:
        raise GptspeedError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise GptspeedError(f"{what} {path} is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise GptspeedError(f"{what} {path} is not a regular file (a pipe, socket or device): give a file")
        if st.st_size > max_bytes:
            raise GptspeedError(
                f"{what} {path} is {st.st_size:,} bytes, more than the {max_bytes:,} such a file "
                "can hold: is it the right file?"
            )
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise GptspeedError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:  # grew while read
        raise GptspeedError(f"{what} {path} is more than {max_bytes:,} bytes: is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GptspeedError(f"{what} {path} is not UTF-8 text (byte {e.start}): is it the right file?") from None


def parse_json(text: str, what: str, expect: type | None = dict) -> Any:
    """``json.loads(text)`` for input gptspeed did not write: malformed JSON, JSON nested too deep
    for the parser (RecursionError), non-standard constants (``NaN``, ``Infinity``) and a top-level
    value that is not an ``expect`` are each a GptspeedError naming ``what``."""
    import json

    from gptspeed.errors import GptspeedError

    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise GptspeedError(f"{what} is nested too deeply to be read") from None
    except ValueError as e:
        raise GptspeedError(f"{what} is not valid JSON ({e})") from None
    if expect is not None and not isinstance(value, expect):
        raise GptspeedError(
            f"{what} holds a JSON {type(value).__name__}, not a JSON {'object' if expect is dict else expect.__name__}"
        )
    return value


def read_user_json(
    path: str | os.PathLike, what: str, expect: type | None = dict, max_bytes: int = MAX_TEXT_BYTES
) -> Any:
    """:func:`read_user_text` then :func:`parse_json`: one GptspeedError line for every way the
    file can be wrong (see both)."""
    return parse_json(read_user_text(path, what, max_bytes), f"{what} {path}", expect)
