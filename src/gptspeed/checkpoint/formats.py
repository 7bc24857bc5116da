"""The two checkpoint formats, one rule.

:class:`PtFormat` -- one process or DDP: rank 0 writes ``RUN_DIR/ckpt_{step:08d}.pt``, a
``torch.save`` of every part. :class:`DcpFormat` -- FSDP2: every rank saves its shards of the model
and optimizer with ``torch.distributed.checkpoint`` into ``ckpt_{step:08d}.dcp/``, and rank 0 adds
``meta.pt`` with the other parts. Either is *sealed* (:mod:`gptspeed.checkpoint.seals`). Each file
(each sharded folder) is written under a hidden temporary name, flushed and fsynced; then the seal
is written; then the file (folder) is renamed to its checkpoint name, and the folder is fsynced.
So a checkpoint never stands under its name unsealed: a ``SIGKILL`` at any instant leaves either no
new checkpoint (a seal without its file does not count) or a sealed one. Loading uses
``torch.load(weights_only=True)``, and a sharded folder is read through
:mod:`gptspeed.checkpoint.dcp_reader`: no pickled code runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptspeed.checkpoint.parts import Stateful
from gptspeed.checkpoint.paths import (
    CKPT_RE,
    FORMAT,
    FORMAT_VERSION,
    SHARDED_META,
    checkpoint_path,
    is_sharded,
    list_checkpoints,
    seal_path,
)
from gptspeed.checkpoint.seals import (
    check_checkpoint,
    intact_besides,
    latest_valid_checkpoint,
    mark_verified,
    not_of_run,
    read_seal,
    seal_info,
)
from gptspeed.errors import GptspeedError
from gptspeed.fileio import fsync_dir, sha256_file, write_atomic, write_text_atomic

if TYPE_CHECKING:
    from gptspeed.config import RunConfig


class _HashingWriter:
    """File wrapper for ``torch.save`` that hashes the bytes as they are written."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.bytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write and seal ``state`` (must contain ``step``); keep the newest ``keep`` checkpoints.

    Raises GptspeedError if it cannot be written (disk full, permissions); the earlier
    checkpoints are untouched then. Returns the ``.pt`` path.
    """
    run_dir = Path(run_dir)
    final = checkpoint_path(run_dir, state["step"])
    check_room(run_dir, state["step"])
    write_checkpoint_file(final, state)
    prune_checkpoints(run_dir, keep, state.get("run_id"))
    return final


def check_room(run_dir: Path, step: int) -> None:
    """GptspeedError, before anything is written, when ``run_dir``'s file system has less free
    space than its newest ``.pt`` checkpoint takes (the next one is as large, and the older one is
    pruned only after it): the disk is not filled halfway through a save. One ``stat`` and one
    ``statvfs``. (Sharded checkpoints are written by every rank: a full disk there is reported
    by :func:`write_failure` instead.)"""
    final = checkpoint_path(run_dir, step)
    older = [p for p in list_checkpoints(run_dir) if p.suffix == ".pt" and p != final]
    if not older:
        return
    need, free = older[-1].stat().st_size, shutil.disk_usage(run_dir).free
    if free < need:
        raise GptspeedError(
            f"not enough space to save step {step} in {run_dir}: {free / 2**20:,.1f} MiB free, the last "
            f"checkpoint took {need / 2**20:,.1f} MiB; {intact_besides(final)}: free space, then --resume"
        )


def write_checkpoint_file(final: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to the file ``final`` atomically and seal it (``final`` with ``.json``): the
    bytes go to a hidden temporary file, the seal (their size and sha256) is written, and only then
    is the file renamed to ``final``. A process killed at any instant leaves either no ``final`` (a
    seal without its file does not count) or a sealed one."""
    import torch

    final = Path(final)
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, **state}

    def write_pt(f):
        w = _HashingWriter(f)
        try:
            torch.save(payload, w)
        except RuntimeError as e:
            # torch's zip writer, interrupted by a full disk or Ctrl-C, raises "unexpected pos" from its
            # __exit__ and hides the real cause as the context: raise the cause
            if isinstance(e.__context__, (OSError, KeyboardInterrupt)):
                raise e.__context__ from None
            raise
        return w

    def seal(w) -> None:  # before the rename: a .pt never stands under its name unsealed
        write_text_atomic(
            seal_path(final), json.dumps({**seal_info(state), "bytes": w.bytes, "sha256": w.sha.hexdigest()})
        )

    try:
        seal_path(final).unlink(missing_ok=True)  # an old seal must never vouch for new bytes
        write_atomic(final, write_pt, before_rename=seal)
        fsync_dir(final.parent)
    except OSError as e:
        seal_path(final).unlink(missing_ok=True)
        raise GptspeedError(write_failure(final, state.get("step"), e)) from None
    mark_verified(final)  # written and hashed here: no need to hash it again


def write_failure(final: Path, step: int | None, e: OSError) -> str:
    """One line for a checkpoint that could not be written: what failed, that the newest earlier
    checkpoint is intact (nothing of the failed one is left: its temporary files are removed), and
    what to do."""
    import errno

    intact = intact_besides(final)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {final.parent} while saving step {step}; {intact}: free space, then --resume"
    return f"could not write checkpoint {final} ({e.strerror or e}); {intact}"


def prune_checkpoints(run_dir: Path, keep: int, run_id: str | None = None) -> None:
    """Delete all but the newest ``keep`` of this run's checkpoints, each file (or folder) before its
    seal: a kill in between leaves a seal without its checkpoint (no checkpoint: never listed) or a
    sealed, half-deleted folder (invalid, and pruned again next time), never an unsealed checkpoint
    standing under its name, which no later prune could tell from a stranger's. Only
    sealed checkpoints of run ``run_id`` (or of no recorded run) whose seal names the step their
    name says are counted and deleted: a checkpoint copied in from another run, or renamed, is
    never deleted and never makes this run's own newer ones look old."""
    mine = [p for p in list_checkpoints(run_dir) if read_seal(p) is not None and not_of_run(p, run_id) is None]
    for old in mine[:-keep]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
        seal_path(old).unlink(missing_ok=True)  # last (a folder that cannot be deleted, e.g. a symlink, ends unsealed)


def seal_sharded(folder: Path, info: dict[str, Any], *, final: Path) -> None:
    """Seal a sharded checkpoint once every rank has finished writing it into the temporary
    ``folder``: the seal, written for ``final``, lists each file's size and sha256, plus ``info``
    (step, configuration...); then ``folder`` is renamed to ``final``, so the checkpoint never
    stands under its name unsealed. Call on one rank, after a barrier."""
    folder, final = Path(folder), Path(final)
    files = {p.name: [p.stat().st_size, sha256_file(p)] for p in sorted(folder.iterdir()) if p.is_file()}
    try:
        for p in folder.iterdir():
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(folder)
        write_text_atomic(seal_path(final), json.dumps({**info, "files": files}))
        os.replace(folder, final)
        fsync_dir(final.parent)
    except OSError as e:
        raise GptspeedError(f"could not seal checkpoint {final}: {e.strerror or e}") from e
    mark_verified(final)


def load_checkpoint(path: Path, map_location: Any = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``, after checking it against its seal.

    Raises GptspeedError naming the file if it is missing, unsealed, corrupted or not a
    gptspeed checkpoint. A sharded checkpoint folder (``.dcp``) yields its ``meta.pt`` only
    (every part but ``model`` / ``optimizer``) with ``"sharded": True``: :class:`Checkpointer`
    loads the shards with :mod:`torch.distributed.checkpoint`; everything else needs a single
    file (``gptspeed consolidate``). The step (and run id) inside must be those of the name and
    seal. Only format 2 is read (parts by name; gptspeed has written nothing else since its
    first release with run folders): an older checkpoint is named as such.
    """
    import torch

    path = Path(path)
    if not path.exists():
        raise GptspeedError(f"checkpoint {path} does not exist")
    if verify and (reason := check_checkpoint(path)):
        raise GptspeedError(f"checkpoint {path} is not valid: {reason}")
    file = path / SHARDED_META if is_sharded(path) else path
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise GptspeedError(
            f"checkpoint {path} is unreadable ({type(e).__name__}): delete it or resume from another"
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GptspeedError(f"{path} is not a gptspeed checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise GptspeedError(
            f"checkpoint {path} has format {state.get('format_version')!r}; this gptspeed reads format "
            f"{FORMAT_VERSION}: resume it with the gptspeed that wrote it"
        )
    seal, m = read_seal(path) or {}, CKPT_RE.match(path.name)
    named = int(m.group(1)) if m else seal.get("step", state.get("step"))
    if (
        state.get("step") != named
        or ("step" in seal and seal["step"] != named)
        or ("run_id" in seal and seal["run_id"] != state.get("run_id"))
    ):
        raise GptspeedError(
            f"checkpoint {path} holds step {state.get('step')!r} of run {str(state.get('run_id'))[:12]}, "
            f"but its name says step {named} and its seal step {seal.get('step')!r} of run "
            f"{str(seal.get('run_id'))[:12]}: it was renamed or pieced together; delete it or resume from another"
        )
    return state


def load_latest_run(run_dir: Path, map_location: Any = "cpu") -> tuple[dict[str, Any], RunConfig]:
    """:func:`load_latest` and the :class:`~gptspeed.config.RunConfig` the checkpoint holds."""
    from gptspeed.config import RunConfig

    ckpt = load_latest(run_dir, map_location)
    return ckpt, RunConfig.from_dict(ckpt["config"])


def load_latest(run_dir: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The newest valid checkpoint in ``run_dir``; GptspeedError if the folder has none. When newer
    ones fail their check (unsealed, an unreadable or mismatched seal, damaged), one line on stderr
    names them and why, and the one used (as ``--resume`` does): ``sample``, ``eval`` and
    ``export-hf`` never fall back to an older model without a word."""
    path, skipped = latest_valid_checkpoint(run_dir)
    if path is not None and skipped:
        why = ", ".join(f"{p.name} ({reason})" for p, reason in skipped)
        print(f"skipping {why}: using {path.name}, the newest valid checkpoint", file=sys.stderr, flush=True)
    if path is None:
        if not Path(run_dir).is_dir():
            raise GptspeedError(f"run folder {run_dir} does not exist")
        if skipped:
            raise GptspeedError(f"no valid checkpoint in {run_dir}: {skipped[0][0].name} is {skipped[0][1]}")
        from gptspeed.paths import describe

        raise GptspeedError(f"no checkpoint in {run_dir}{describe(run_dir, want='run')}")
    if is_sharded(path):
        raise GptspeedError(
            f"{path} is a sharded (FSDP) checkpoint: make a single file first with "
            f"`gptspeed consolidate --run {run_dir} --out RUN_OR_FILE`"
        )
    return load_checkpoint(path, map_location, verify=False)


class PtFormat:
    """Single-file checkpoints (one process, or DDP: replicas hold the same state): rank 0 writes and
    seals ``ckpt_{step:08d}.pt`` holding every part, then prunes; every rank waits for it."""

    sharded = False

    def __init__(self, run_dir: Path, is_main: bool, barrier: Callable[[], None], keep: int):
        self.run_dir, self.is_main, self.barrier, self.keep = Path(run_dir), is_main, barrier, keep

    def save(self, step: int, parts: dict[str, Stateful], meta: dict[str, Any], extra: dict[str, Any]) -> Path:
        if self.is_main:
            state = {"step": step, **meta, **{name: part.state_dict() for name, part in parts.items()}, **extra}
            save_checkpoint(self.run_dir, state, keep=self.keep)
        self.barrier()
        return checkpoint_path(self.run_dir, step)

    def load(self, path: Path, parts: dict[str, Stateful], sharded_names: set[str]) -> dict[str, Any]:
        """Every entry of the file; the caller restores the parts from them."""
        return load_checkpoint(path, verify=False)


class DcpFormat:
    """Sharded checkpoints (FSDP2): each rank writes its shards of the parts named ``sharded``
    with ``torch.distributed.checkpoint.save`` into the hidden ``.ckpt_{step:08d}.dcp.tmp/``; rank 0
    adds ``meta.pt`` (the other parts) and, after a barrier, the seal listing every file's sha256,
    then renames the folder to ``ckpt_{step:08d}.dcp``, so a crash at any point leaves neither a
    sealed incomplete checkpoint nor an unsealed one under its name. Loading re-shards to this world
    size. Source: https://pytorch.org/docs/stable/distributed.checkpoint.html"""

    sharded = True

    def __init__(self, run_dir: Path, is_main: bool, barrier: Callable[[], None], keep: int):
        self.run_dir, self.is_main, self.barrier, self.keep = Path(run_dir), is_main, barrier, keep

    def save(
        self,
        step: int,
        parts: dict[str, Stateful],
        meta: dict[str, Any],
        extra: dict[str, Any],
        sharded_names: set[str] = frozenset(),
    ) -> Path:
        final = checkpoint_path(self.run_dir, step, sharded=True)
        folder = final.with_name(f".{final.name}.tmp")  # renamed to `final` once sealed; stale ones go at start
        if self.is_main:
            seal_path(final).unlink(missing_ok=True)  # an old seal must never vouch for new files
            shutil.rmtree(final, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)  # a save killed part-way
            folder.mkdir(parents=True)
        self.barrier()
        self._write(step, folder, parts, meta, extra, sharded_names)
        self.barrier()
        if self.is_main:
            seal_sharded(folder, seal_info({"step": step, **meta, "optimizer": True}), final=final)
            prune_checkpoints(self.run_dir, self.keep, meta.get("run_id"))
        self.barrier()
        return final

    def _write(
        self,
        step: int,
        folder: Path,
        parts: dict[str, Stateful],
        meta: dict[str, Any],
        extra: dict[str, Any],
        sharded_names: set[str],
    ) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        shards = {name: parts[name].state_dict() for name in sharded_names}
        rest = {name: part.state_dict() for name, part in parts.items() if name not in sharded_names}
        try:
            dcp.save(shards, checkpoint_id=folder)
            if self.is_main:
                torch.save(
                    {
                        "format": FORMAT,
                        "format_version": FORMAT_VERSION,
                        "sharded": True,
                        "step": step,
                        **meta,
                        **rest,
                        **extra,
                    },
                    folder / SHARDED_META,
                )
        except OSError as e:
            raise GptspeedError(f"could not write checkpoint {folder}: {e.strerror or e}") from e

    def load(self, path: Path, parts: dict[str, Stateful], sharded_names: set[str]) -> dict[str, Any]:
        """Restores the sharded parts in place (through :func:`gptspeed.checkpoint.dcp_reader.load_into`:
        no pickled code runs); returns ``meta.pt``'s entries for the others."""
        from gptspeed.checkpoint.dcp_reader import load_into

        state = load_checkpoint(path, verify=False)
        shards = {name: parts[name].state_dict() for name in sharded_names}
        load_into(shards, path)  # dcp.load in place, re-sharded to this world size
        for name, sd in shards.items():
            parts[name].load_state_dict(sd)
        return {k: v for k, v in state.items() if k not in sharded_names}
