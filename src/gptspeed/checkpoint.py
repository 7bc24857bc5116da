"""Checkpoints: everything a run needs to continue exactly, written so that no crash can lose one.

A run's state is a set of named *stateful* parts, each with ``state_dict()`` / ``load_state_dict()``
(the torchtitan / ``torch.distributed.checkpoint.stateful.Stateful`` protocol): the model, the
optimizer (AdamW or Muon + AdamW), the GradScaler, the data loader's position, the RNG states and
the trainer's own counters. A :class:`Checkpointer` has them registered by name, so adding a piece of
state is one ``register`` call; it decides when to save (:meth:`Checkpointer.save_if_due`), picks the
format, seals, prunes, finds the newest valid checkpoint and checks that a resume continues the
same run. The run folder itself is this module's too: :class:`RunFolder` creates and locks it
(:class:`RunLock`), :func:`newest_run_config` / :func:`load_latest_run` read it, and
:func:`refuse_checkpoints` keeps every command from writing a new run over one.

Two formats, one rule. Single-process and DDP runs write ``RUN_DIR/ckpt_{step:08d}.pt``
(``torch.save`` of every part, by rank 0); FSDP2 runs write ``ckpt_{step:08d}.dcp/``, where every
rank saves its shards of model and optimizer with ``torch.distributed.checkpoint`` and rank 0 adds
``meta.pt`` with the other parts. Either is *sealed* by ``ckpt_{step:08d}.json``: the bytes and
sha256 of every file, plus the step and the run-defining configuration, so ``--resume`` reads the
configuration without loading the checkpoint. Each file (each sharded folder) is written under a
hidden temporary name, flushed and fsynced; then the seal is written; then the file (folder) is
renamed to its checkpoint name, and the folder is fsynced. So a checkpoint never stands under its
name unsealed: a ``SIGKILL`` at any instant leaves either no new checkpoint (a seal without its
file does not count) or a sealed one. A checkpoint counts only once sealed and only while its
bytes match the seal, so the newest complete checkpoint stays loadable, and a torn, truncated or
altered file is detected and skipped. Loading uses ``torch.load(weights_only=True)``: no pickled code runs.

This module imports torch only inside the functions that need it, so reading seals (and the
configuration a resume continues with) costs no torch import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from gptspeed.errors import GptspeedError
from gptspeed.fileio import fsync_dir, sha256_file, write_atomic, write_text_atomic

if TYPE_CHECKING:
    from gptspeed.config import RunConfig

CKPT_RE = re.compile(r"^ckpt_(\d{8})\.(pt|dcp)$")
# What gptspeed itself writes into a run folder: checkpoints, seals, config.json, metrics.jsonl, the lock,
# the trackers' files (TensorBoard's folder, W&B's folder and run id) and the write probe.
OWN_NAMES = re.compile(r"^(ckpt_\d{8}\.(pt|dcp|json)|config\.json|metrics\.jsonl|\.gptspeed\.lock|\.write-test|"
                       r"tensorboard|wandb|wandb_run_id)$")
# Temporary names gptspeed's own writes leave when killed (fileio.create_temp: ``.NAME.XXXXXXXX.tmp``; a
# sharded save: ``.ckpt_N.dcp.tmp``; consolidate's work folder): the only hidden entries a start removes.
STALE_NAMES = re.compile(r"^\.((ckpt_\d{8}\.(pt|json)|config\.json|wandb_run_id)\.[0-9a-f]{8}\.tmp|"
                         r"ckpt_\d{8}\.dcp\.tmp|consolidate-[A-Za-z0-9_]+)$")
SHARDED_META = "meta.pt"  # inside a sharded checkpoint folder: every part but model and optimizer
LOCK_NAME = ".gptspeed.lock"
FORMAT = "gptspeed-checkpoint"
FORMAT_VERSION = 2  # 2: parts by name ("trainer" holds step / skipped_steps); seals carry the config


class Stateful(Protocol):
    """A piece of run state: ``state_dict()`` returns plain data and tensors; ``load_state_dict``
    restores it exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------------------------ paths
def checkpoint_path(run_dir: Path, step: int, sharded: bool = False) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}.{'dcp' if sharded else 'pt'}"


def is_sharded(path: Path) -> bool:
    """A sharded (FSDP2, torch.distributed.checkpoint) checkpoint: a ``ckpt_*.dcp`` folder."""
    return Path(path).suffix == ".dcp"


def seal_path(ckpt: Path) -> Path:
    return Path(ckpt).with_suffix(".json")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints (``.pt`` files and sharded ``.dcp`` folders, sealed or not) in ``run_dir``,
    oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if CKPT_RE.match(p.name)), key=lambda p: (p.name[:13], p.suffix))


# ---------------------------------------------------------------------------------------- writing
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


def estimate_checkpoint_bytes(model, optimizer_states: int = 2) -> int:
    """Bytes a checkpoint of ``model`` takes: weights plus ``optimizer_states`` fp32 tensors per
    parameter (AdamW's two moments), plus 1 MiB for the rest."""
    n = sum(p.numel() * p.element_size() + optimizer_states * p.numel() * 4 for p in model.parameters())
    return n + (1 << 20)


def check_free_space(run_dir: Path, need_bytes: int) -> None:
    """GptspeedError if ``run_dir``'s file system has less than ``need_bytes`` free."""
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise GptspeedError(f"{run_dir} has {free / 2**30:.2f} GiB free but a checkpoint needs about "
                            f"{need_bytes / 2**30:.2f} GiB: free some space or choose another --out")


def _seal_info(state: dict[str, Any]) -> dict[str, Any]:
    """What a seal repeats of a checkpoint, so a resume can decide without loading it."""
    info = {"step": state["step"]}
    for key in ("config", "data", "world_size", "run_id"):
        if key in state:
            info[key] = state[key]
    info["kind"] = "full" if "optimizer" in state else "weights"
    return info


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
        raise GptspeedError(f"not enough space to save step {step} in {run_dir}: {free / 2**20:,.1f} MiB free, the last "
                            f"checkpoint took {need / 2**20:,.1f} MiB; {_intact_besides(final)}: free space, then --resume")


def _intact_besides(final: Path) -> str:
    """"the checkpoint of step M is intact" for the newest valid checkpoint beside ``final`` (the
    one being written), or "no earlier checkpoint exists"."""
    older = [p for p in list_checkpoints(final.parent) if p != final and check_checkpoint(p) is None]
    return f"the checkpoint of step {_step_of(older[-1])} is intact" if older else "no earlier checkpoint exists"


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
        write_text_atomic(seal_path(final), json.dumps({**_seal_info(state), "bytes": w.bytes,
                                                        "sha256": w.sha.hexdigest()}))

    try:
        seal_path(final).unlink(missing_ok=True)  # an old seal must never vouch for new bytes
        write_atomic(final, write_pt, before_rename=seal)
        fsync_dir(final.parent)
    except OSError as e:
        seal_path(final).unlink(missing_ok=True)
        raise GptspeedError(write_failure(final, state.get("step"), e)) from None
    _VERIFIED[_identity(final)] = True  # written and hashed here: no need to hash it again


def data_changed(recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether the data differ from those a checkpoint recorded: every key the checkpoint recorded
    must be unchanged (checkpoints written before a key was recorded are compared on the keys they
    have; a checkpoint with no data identity compares equal only to none)."""
    if not recorded or not now:
        return recorded != now
    return any(now.get(k) != v for k, v in recorded.items())


def write_failure(final: Path, step: int | None, e: OSError) -> str:
    """One line for a checkpoint that could not be written: what failed, that the newest earlier
    checkpoint is intact (nothing of the failed one is left: its temporary files are removed), and
    what to do."""
    import errno

    intact = _intact_besides(final)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {final.parent} while saving step {step}; {intact}: free space, then --resume"
    return f"could not write checkpoint {final} ({e.strerror or e}); {intact}"


def _step_of(path: Path) -> int:
    return int("".join(c for c in path.stem if c.isdigit()) or 0)


def prune_checkpoints(run_dir: Path, keep: int, run_id: str | None = None) -> None:
    """Delete all but the newest ``keep`` of this run's checkpoints, each unsealed first. Only
    sealed checkpoints of run ``run_id`` (or of no recorded run) whose seal names the step their
    name says are counted and deleted: a checkpoint copied in from another run, or renamed, is
    never deleted and never makes this run's own newer ones look old."""
    mine = [p for p in list_checkpoints(run_dir) if read_seal(p) is not None and not_of_run(p, run_id) is None]
    for old in mine[:-keep]:
        seal_path(old).unlink(missing_ok=True)  # unseal first: a half-deleted one is invalid
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


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
    _VERIFIED[_identity(final)] = True


# -------------------------------------------------------------------------------------- checking
# Checkpoints found valid in this process, by (path, size, mtime): a resume hashes each file once.
_VERIFIED: dict[tuple, bool] = {}


def _identity(path: Path) -> tuple:
    path = Path(path)
    try:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        seal = seal_path(path).stat()
        return (str(path.resolve()), tuple(stats), seal.st_size, seal.st_mtime_ns)
    except OSError:
        return (str(path), None)


def read_seal(path: Path) -> dict[str, Any] | None:
    """The parsed seal of checkpoint ``path`` (None when missing or damaged). Its ``config`` /
    ``data`` / ``world_size`` / ``kind`` are present for checkpoints written since format 2."""
    try:
        seal = json.loads(seal_path(path).read_text())
    except (OSError, ValueError):
        return None
    return seal if isinstance(seal, dict) else None


def check_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a valid checkpoint (a short reason), or None if its seal matches.
    Each checkpoint is hashed once per process (later calls reuse the answer while the files
    and the seal are unchanged)."""
    path = Path(path)
    key = _identity(path)
    if _VERIFIED.get(key):
        return None
    try:
        seal = json.loads(seal_path(path).read_text())
        if is_sharded(path):
            files = {str(k): (int(v[0]), str(v[1])) for k, v in seal["files"].items()}
        else:
            size, digest = int(seal["bytes"]), str(seal["sha256"])
    except FileNotFoundError:
        return "not sealed (interrupted while saving?)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "its seal file is damaged"
    if is_sharded(path):
        for name, (size, digest) in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size or sha256_file(f) != digest:
                return f"{name} does not match its seal (truncated or corrupted)"
    else:
        try:
            actual_size = path.stat().st_size
        except OSError:
            return "missing"
        if actual_size != size:
            return f"size {actual_size} bytes, sealed as {size} (truncated or altered)"
        if sha256_file(path) != digest:
            return "sha256 does not match its seal (corrupted)"
    _VERIFIED[key] = True
    return None


def folder_run_id(run_dir: Path) -> str | None:
    """The id of the run in ``run_dir``: ``derived.run_id`` of its ``config.json``, drawn at the
    run's first start and carried by every checkpoint and seal since. None when the folder has no
    readable config.json or it records no id (a run of an earlier gptspeed, an imported model)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    from gptspeed.fileio import read_user_json

    try:
        derived = read_user_json(path, "run configuration").get("derived")
    except GptspeedError:
        return None
    run_id = derived.get("run_id") if isinstance(derived, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def not_of_run(path: Path, run_id: str | None) -> str | None:
    """Why the sealed checkpoint ``path`` is not run ``run_id``'s checkpoint of the step its name
    says (a short reason), or None when it is. The seal's step must equal the name's (a checkpoint
    renamed or copied in under another step is not used); the seal's run id must equal ``run_id``
    when both are known (checkpoints of earlier gptspeed versions record none and are accepted).
    Reads the seal only; the loaded content is compared in :func:`load_checkpoint`."""
    seal = read_seal(path)
    if seal is None:
        return None  # unsealed or damaged: check_checkpoint says so
    m = CKPT_RE.match(Path(path).name)
    if m and seal.get("step") != int(m.group(1)):
        return (f"its seal is of step {seal.get('step')!r}, its name of step {int(m.group(1))} "
                "(renamed, or copied in from another run?)")
    theirs = seal.get("run_id")
    if run_id and theirs and theirs != run_id:
        return f"it belongs to another run (run id {str(theirs)[:12]}; this folder's run is {run_id[:12]})"
    return None


def load_checkpoint(path: Path, map_location: Any = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``, after checking it against its seal.

    Raises GptspeedError naming the file if it is missing, unsealed, corrupted or not a
    gptspeed checkpoint. A sharded checkpoint folder (``.dcp``) yields its ``meta.pt`` only
    (every part but ``model`` / ``optimizer``) with ``"sharded": True``: :class:`Checkpointer`
    loads the shards with :mod:`torch.distributed.checkpoint`; everything else needs a single
    file (``gptspeed consolidate``). Checkpoints of format 1 are read too (their ``step`` /
    ``skipped_steps`` become the ``trainer`` part).
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
        raise GptspeedError(f"checkpoint {path} is unreadable ({type(e).__name__}): delete it or resume from another") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GptspeedError(f"{path} is not a gptspeed checkpoint")
    seal, m = read_seal(path) or {}, CKPT_RE.match(path.name)
    named = int(m.group(1)) if m else seal.get("step", state.get("step"))
    if state.get("step") != named or ("step" in seal and seal["step"] != named) or \
            ("run_id" in seal and seal["run_id"] != state.get("run_id")):
        raise GptspeedError(f"checkpoint {path} holds step {state.get('step')!r} of run {str(state.get('run_id'))[:12]}, "
                            f"but its name says step {named} and its seal step {seal.get('step')!r} of run "
                            f"{str(seal.get('run_id'))[:12]}: it was renamed or pieced together; delete it or resume from another")
    if "trainer" not in state and "optimizer" in state:  # format 1
        state["trainer"] = {"step": state["step"], "skipped_steps": state.pop("skipped_steps", 0)}
        if state.get("scaler") is None:
            state.pop("scaler", None)
    return state


_FOLDER = object()


def latest_valid_checkpoint(run_dir: Path, run_id: Any = _FOLDER) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest valid checkpoint of run ``run_id`` (default: the folder's,
    :func:`folder_run_id`) in ``run_dir`` (or None) and the newer ones skipped, each with the
    reason: unsealed, damaged, or not this run's checkpoint of its step (:func:`not_of_run`)."""
    if run_id is _FOLDER:
        run_id = folder_run_id(run_dir)
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        reason = check_checkpoint(path) or not_of_run(path, run_id)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def checkpoint_config(path: Path) -> dict[str, Any]:
    """The run configuration (``RunConfig.to_dict`` form) a valid checkpoint was written with:
    from its seal, or, for checkpoints older than format 2, from the checkpoint itself."""
    seal = read_seal(path)
    if seal is not None and isinstance(seal.get("config"), dict):
        return seal["config"]
    return load_checkpoint(path, verify=False)["config"]


def newest_run_config(run_dir: Path) -> tuple[Path | None, "RunConfig | None"]:
    """The newest valid checkpoint of ``run_dir`` and the :class:`~gptspeed.config.RunConfig` it
    was written with (read from its seal: no torch import), or ``(None, None)`` when there is none.
    GptspeedError if the recorded configuration cannot be read."""
    from gptspeed.config import RunConfig

    path = latest_valid_checkpoint(Path(run_dir))[0]
    if path is None:
        return None, None
    return path, RunConfig.from_dict(checkpoint_config(path), f"checkpoint {path}")


def load_latest_run(run_dir: Path, map_location: Any = "cpu") -> tuple[dict[str, Any], "RunConfig"]:
    """:func:`load_latest` and the :class:`~gptspeed.config.RunConfig` the checkpoint holds."""
    from gptspeed.config import RunConfig

    ckpt = load_latest(run_dir, map_location)
    return ckpt, RunConfig.from_dict(ckpt["config"])


def refuse_checkpoints(folder: Path, fix: str) -> None:
    """GptspeedError "FOLDER already holds checkpoints: FIX" if ``folder`` holds any checkpoint
    (valid or not): no command writes a new run over one."""
    if list_checkpoints(Path(folder)):
        raise GptspeedError(f"{folder} already holds checkpoints: {fix}")


def load_latest(run_dir: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The newest valid checkpoint in ``run_dir``; GptspeedError if the folder has none."""
    path, skipped = latest_valid_checkpoint(run_dir)
    if path is None:
        if not Path(run_dir).is_dir():
            raise GptspeedError(f"run folder {run_dir} does not exist")
        if skipped:
            raise GptspeedError(f"no valid checkpoint in {run_dir}: {skipped[0][0].name} is {skipped[0][1]}")
        from gptspeed.paths import describe

        raise GptspeedError(f"no checkpoint in {run_dir}{describe(run_dir, want='run')}")
    if is_sharded(path):
        raise GptspeedError(f"{path} is a sharded (FSDP) checkpoint: make a single file first with "
                            f"`gptspeed consolidate --run {run_dir} --out RUN_OR_FILE`")
    return load_checkpoint(path, map_location, verify=False)


# ------------------------------------------------------------------------------------ run lock
class RunLock:
    """One writer per run folder: an exclusive ``fcntl.flock`` on ``RUN_DIR/.gptspeed.lock``,
    which holds the owner's pid and host. The kernel drops the lock when its process dies (even
    by SIGKILL), so a stale lock file never blocks ``--resume``. Raises GptspeedError naming the
    holder when another live process has it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise GptspeedError(f"{self.path.parent} is being written by {holder} (another `gptspeed train`): "
                                "wait for it to finish or stop it, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _is_own_config(path: Path) -> bool:
    """Whether ``path`` is a config.json gptspeed wrote (a run's, or an imported model's): a JSON
    object with the ``model`` and ``train`` groups of a RunConfig."""
    from gptspeed.fileio import read_user_json

    try:
        doc = read_user_json(path, "config", max_bytes=1 << 20)
    except GptspeedError:
        return False
    return isinstance(doc.get("model"), dict) and isinstance(doc.get("train"), dict)


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


def foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that gptspeed does not write in a run folder (:data:`OWN_NAMES`,
    :data:`STALE_NAMES`, a ``config.json`` / ``metrics.jsonl`` of gptspeed's own form), sorted.
    An unreadable folder counts as foreign."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return [f"(unreadable: {e.strerror or e})"]
    out = [n for n in names if not (OWN_NAMES.match(n) or STALE_NAMES.match(n))]
    if "config.json" in names and not _is_own_config(folder / "config.json"):
        out.append("config.json")
    if "metrics.jsonl" in names and not _is_own_metrics(folder / "metrics.jsonl"):
        out.append("metrics.jsonl")
    return sorted(out)


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
        raise GptspeedError(f"{what} {folder} is a prepared data folder (token shards): a run needs a folder of its own; "
                            f"choose another {what} (e.g. runs/NAME)")
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise GptspeedError(f"{what} {folder} already holds files gptspeed did not write ({shown}): a run folder must be new, "
                        f"empty or a gptspeed run's; choose another {what}")


class RunFolder:
    """The run folder of one writer: created if new, refused if it holds files gptspeed did not
    write (:func:`refuse_foreign_folder`), locked (:class:`RunLock`) by rank 0 for the whole run,
    and -- when a new run fails before its first step -- left as it was found: only the files
    this run created are removed, and only gptspeed's own stale temporary names are cleaned."""

    def __init__(self, path: Path, is_main: bool):
        self.path, self.is_main = Path(path), is_main
        self.created = self.opened = False
        self.written: set[str] = set()  # files this run wrote (abandon removes those it created)
        self.existing: set[str] = set()  # names in the folder when it was opened (abandon keeps them)
        self.lock: RunLock | None = None

    def open(self) -> None:
        if not self.is_main:
            return
        refuse_foreign_folder(self.path)  # before anything is written into it
        try:
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise GptspeedError(f"cannot write to run folder {self.path}: {e.strerror or e}") from e
        self.lock = RunLock(self.path).acquire()
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


# --------------------------------------------------------------------------- stateful parts
class RNGState:
    """The CPU RNG and, on CUDA, the device's RNG, as a stateful part."""

    def __init__(self, device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        import torch

        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and state.get("cuda") is not None:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class ModelState:
    """The model's weights as a stateful part. ``sharded`` (FSDP2): DTensor shards through
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict``;
    otherwise the plain module's ``state_dict`` (full tensors, the usual parameter names)."""

    def __init__(self, model, sharded: bool = False):
        self.model, self.sharded = model, sharded

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model)
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state)
        else:
            self.model.load_state_dict(state)


def optimizers_of(optimizer) -> list:
    """The ``torch.optim.Optimizer`` objects behind ``optimizer`` (Muon + AdamW: both)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


class OptimizerState:
    """The optimizer's state as a stateful part. ``sharded`` (FSDP2): every underlying
    ``torch.optim.Optimizer`` (both of :class:`gptspeed.optim.MuonWithAdamW`) through
    ``get_optimizer_state_dict(model, optimizers)``: one dict keyed by parameter name, param
    groups in optimizer order; otherwise the optimizer's own ``state_dict``."""

    def __init__(self, model, optimizer, sharded: bool = False):
        self.model, self.optimizer, self.sharded = model, optimizer, sharded

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, optimizers_of(self.optimizer))
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.model, optimizers_of(self.optimizer), state)
        else:
            self.optimizer.load_state_dict(state)

    def layout(self) -> list[list]:
        """``[[name, param groups], ...]`` per underlying optimizer, to split a consolidated
        name-keyed state back into the optimizer's own form."""
        names = list(getattr(self.optimizer, "names", ["optimizer"]))
        return [[n, len(o.param_groups)] for n, o in zip(names, optimizers_of(self.optimizer))]


# ----------------------------------------------------------------------------- the checkpointer
class Checkpointer:
    """Saves and restores a run's registered stateful parts; owns format, sealing, pruning,
    newest-valid resume and the resume compatibility check.

    Args:
        run_dir: the run folder.
        sharded: FSDP2 (``.dcp`` folders: the parts registered with ``sharded=True`` are saved
            by every rank with ``torch.distributed.checkpoint``); else one ``.pt`` file by rank 0.
        is_main: this process is rank 0 (the one that writes files and seals).
        barrier: waits for every rank (a no-op in one process).
        keep: newest checkpoints to keep.
        meta: what identifies the run (``config``, ``data``, ``world_size``): saved in every
            checkpoint and its seal.

    ``save(step)`` writes one checkpoint of every part; ``resume_point()`` finds the newest valid
    one; ``load(path)`` restores every registered part found in it and returns the rest.
    """

    def __init__(self, run_dir: Path, *, sharded: bool = False, is_main: bool = True,
                 barrier: Callable[[], None] = lambda: None, keep: int = 2, meta: dict[str, Any] | None = None,
                 every: int = 0, last_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.sharded, self.is_main, self.barrier, self.keep = sharded, is_main, barrier, keep
        self.every, self.last_step = every, last_step  # when to save: every N steps (0: never) and at the end
        self.meta = dict(meta or {})
        self.parts: dict[str, Stateful] = {}
        self._dcp_parts: set[str] = set()

    def register(self, name: str, part: Stateful, *, sharded: bool = False) -> None:
        """Add a stateful part under ``name``; ``sharded`` parts go through
        ``torch.distributed.checkpoint`` when the checkpointer is sharded."""
        self.parts[name] = part
        if sharded:
            self._dcp_parts.add(name)

    # ------------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        """Whether ``step`` is a step to save at: every ``every`` steps, and the last step."""
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    def save_if_due(self, step: int, *, stopping: bool = False) -> Path | None:
        """Save ``step`` when it is :meth:`due`, or when the run is ``stopping`` (a signal); the
        checkpointer decides, as torchtitan's does. Returns the checkpoint written, or None."""
        return self.save(step) if stopping or self.due(step) else None

    def save(self, step: int) -> Path:
        """Write and seal the checkpoint of ``step`` (every rank calls this; rank 0 writes the
        ``.pt``, or all ranks their shards), then prune to ``keep``. GptspeedError if it cannot
        be written; the earlier checkpoints are untouched then."""
        if self.sharded:
            return self._save_sharded(step)
        path = checkpoint_path(self.run_dir, step)
        if self.is_main:
            state = {"step": step, **self.meta, **{name: part.state_dict() for name, part in self.parts.items()}}
            extra = self._layout()
            if extra:
                state["optimizer_layout"] = extra
            save_checkpoint(self.run_dir, state, keep=self.keep)
        self.barrier()
        return path

    def _layout(self):
        part = self.parts.get("optimizer")
        return part.layout() if isinstance(part, OptimizerState) else None

    def _save_sharded(self, step: int) -> Path:
        """FSDP2: every rank writes its shards of the sharded parts with
        ``torch.distributed.checkpoint.save`` into the hidden ``.ckpt_{step:08d}.dcp.tmp/``;
        rank 0 adds ``meta.pt`` (the other parts) and, after a barrier, the seal listing every
        file's sha256, then renames the folder to ``ckpt_{step:08d}.dcp``, so a crash at any point
        leaves neither a sealed incomplete checkpoint nor an unsealed one under its name. Source:
        https://pytorch.org/docs/stable/distributed.checkpoint.html"""
        import torch
        import torch.distributed.checkpoint as dcp

        final = checkpoint_path(self.run_dir, step, sharded=True)
        folder = final.with_name(f".{final.name}.tmp")  # renamed to `final` once sealed; stale ones go at start
        if self.is_main:
            seal_path(final).unlink(missing_ok=True)  # an old seal must never vouch for new files
            shutil.rmtree(final, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)  # a save killed part-way
            folder.mkdir(parents=True)
        self.barrier()
        sharded = {name: self.parts[name].state_dict() for name in self._dcp_parts}
        rest = {name: part.state_dict() for name, part in self.parts.items() if name not in self._dcp_parts}
        try:
            dcp.save(sharded, checkpoint_id=folder)
            if self.is_main:
                meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "sharded": True, "step": step,
                        **self.meta, **rest, "optimizer_layout": self._layout()}
                torch.save(meta, folder / SHARDED_META)
        except OSError as e:
            raise GptspeedError(f"could not write checkpoint {folder}: {e.strerror or e}") from e
        self.barrier()
        if self.is_main:
            seal_sharded(folder, {**_seal_info({"step": step, **self.meta, "optimizer": True})}, final=final)
            prune_checkpoints(self.run_dir, self.keep, self.meta.get("run_id"))
        self.barrier()
        return final

    # ------------------------------------------------------------------ resuming
    def resume_point(self, say: Callable[[str], Any] = print) -> Path | None:
        """The newest valid checkpoint (saying which newer ones were skipped, and why), or None."""
        path, skipped = latest_valid_checkpoint(self.run_dir)
        for bad_path, reason in skipped:
            say(f"skipping {bad_path.name}: {reason}")
        return path

    def check_resume(self, path: Path, run_defining_changes: Callable[[dict], list[str]], *,
                     force: bool, say: Callable[[str], Any] = print) -> dict[str, Any]:
        """Refuse (GptspeedError) to resume ``path`` when it would not continue the same run.

        ``run_defining_changes(config_dict)`` names the run-defining settings that differ from
        the checkpoint's configuration; the data identity is compared with ``meta["data"]``; a
        weights-only checkpoint (``gptspeed import-hf``) need only match the model shape. A
        sharded checkpoint needs ``sharded``, a single file needs not-``sharded``. With ``force``
        the changes are reported through ``say`` instead. Reads the seal only (checkpoints older
        than format 2: the checkpoint). Returns the seal-level information."""
        seal = read_seal(path) or {}
        if "config" not in seal:  # format 1: the seal has no configuration
            old = load_checkpoint(path, verify=False)
            seal = {**_seal_info(old), **seal}
        if seal.get("kind") == "full":
            if self.sharded and not is_sharded(path):
                raise GptspeedError(f"cannot resume the single-file checkpoint {path.name} with --parallel fsdp: "
                                    "resume it with --parallel ddp (or one process), or start a new --out")
            if not self.sharded and is_sharded(path):
                raise GptspeedError(f"{path.name} is a sharded (FSDP) checkpoint: resume with --parallel fsdp, or "
                                    f"make a single file with `gptspeed consolidate --run {self.run_dir} --out NEW_RUN`")
            ck_world, world = seal.get("world_size", 1), self.meta.get("world_size", 1)
            if ck_world != world:  # the loader re-shards its position or refuses (naming both sizes)
                say(f"resuming {path.name} (world size {ck_world}) with world size {world}")
        changed = run_defining_changes(seal["config"])
        if seal.get("kind") != "full":  # weights only: only the model must match
            changed = [c for c in changed if c.startswith("model.")]
        elif data_changed(seal.get("data"), self.meta.get("data")):
            changed.append("data")
        if changed and not force:
            raise GptspeedError(f"cannot resume {path.name} with a different configuration ({', '.join(changed)}): "
                                "use the original settings, a new --out, or --force-resume")
        if changed:
            say(f"--force-resume: continuing {path.name} with changed {', '.join(changed)}")
        return seal

    def load(self, path: Path) -> dict[str, Any]:
        """Restore every registered part present in checkpoint ``path`` (verified already by
        :meth:`resume_point`); returns the checkpoint's other entries (``step``, ``config`` ...).
        A weights-only checkpoint restores the model only."""
        state = load_checkpoint(path, verify=False)
        if is_sharded(path):
            from gptspeed.safe_dcp import load_into

            sharded = {name: self.parts[name].state_dict() for name in self._dcp_parts}
            load_into(sharded, path)  # dcp.load in place, re-sharded to this world size; no pickled code runs
            for name, sd in sharded.items():
                self.parts[name].load_state_dict(sd)
        for name, part in self.parts.items():
            if name in state and not (is_sharded(path) and name in self._dcp_parts):
                load_part(path, name, part, state[name])
        return {k: v for k, v in state.items() if k not in self.parts}


def load_part(path: Path, name: str, part: Stateful, state: Any) -> None:
    """``part.load_state_dict(state)``, with a checkpoint whose ``name`` does not fit the part
    (other tensor shapes or names: a checkpoint whose seal does not describe its content, or
    ``--force-resume`` with another model shape) as one GptspeedError line naming both."""
    try:
        part.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()
        detail = next((line.strip() for line in first if "size mismatch" in line or "Missing key" in line
                       or "Unexpected key" in line), first[0] if first else type(e).__name__)
        raise GptspeedError(f"checkpoint {Path(path).name}: its {name} state does not fit this run ({detail[:200]}): "
                            "resume with the settings it was written with, or start a new --out") from None


# --------------------------------------------------------------------------------- consolidate
def _optim_by_index(optim: dict[str, Any], groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_state_dict``'s form) -> the
    index-keyed form ``torch.optim.Optimizer.load_state_dict`` takes: parameters numbered in
    param-group order, as an optimizer built the same way numbers them. ``groups``: the param
    groups of one optimizer (default: all of ``optim``'s)."""
    index: dict[str, int] = {}
    out_groups = []
    for g in optim["param_groups"] if groups is None else groups:
        ids = []
        for name in g["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        out_groups.append({**g, "params": ids})
    return {"state": {index[k]: v for k, v in optim["state"].items() if k in index}, "param_groups": out_groups}


def split_optimizer_state(optim: dict[str, Any], layout: list[list] | None) -> dict[str, Any]:
    """A consolidated (name-keyed) optimizer state -> the optimizer's own ``state_dict`` form:
    one index-keyed dict, or ``{"adamw": ..., "muon": ...}`` for Muon + AdamW, split by
    ``layout`` (``[[name, param groups], ...]`` in optimizer order, from the checkpoint)."""
    if not layout or len(layout) == 1:
        return _optim_by_index(optim)
    out, first = {}, 0
    for name, n_groups in layout:
        out[name] = _optim_by_index(optim, optim["param_groups"][first:first + n_groups])
        first += n_groups
    return out


def _consolidate_target(out: Path, run_dir: Path, step: int, force: bool) -> Path:
    """The file :func:`consolidate` writes for ``--out out``, after refusing (one GptspeedError
    line each) every ``out`` that would overwrite what is not the user's to lose: a checkpoint's
    name, anything inside the run folder being consolidated, an existing file (without
    ``force``), a file beside it that its seal would replace, a folder with checkpoints, files
    gptspeed did not write, or another run's config.json / metrics.jsonl."""
    import filecmp

    if CKPT_RE.match(out.name):
        raise GptspeedError(f"--out {out} is a checkpoint's name: consolidate never writes over or beside a run's "
                            f"checkpoints; name another file (e.g. {out.with_name('model.pt')}) or a new run folder")
    as_file = out.suffix == ".pt"
    where = (Path(os.path.realpath(out.parent)) / out.name) if as_file else Path(os.path.realpath(out))
    source = Path(os.path.realpath(run_dir))
    if where == source or source in where.parents:
        raise GptspeedError(f"--out {out} is inside {run_dir}, the run being consolidated: choose a path outside it")
    if not as_file:
        if out.exists() and not out.is_dir():
            raise GptspeedError(f"--out {out} is a file: name a FILE.pt to write, "
                                f"or a folder to receive ckpt_{step:08d}.pt")
        refuse_checkpoints(out, "choose a new or empty folder, or a FILE.pt")
        refuse_foreign_folder(out)
        for name in ("config.json", "metrics.jsonl"):
            mine, theirs = run_dir / name, out / name
            if (theirs.exists() or theirs.is_symlink()) and not (
                    mine.is_file() and theirs.is_file() and filecmp.cmp(mine, theirs, shallow=False)):
                raise GptspeedError(f"--out {out} already holds a {name} that is not {run_dir}'s: consolidate never "
                                    "overwrites another run's files; choose a new or empty folder")
        return checkpoint_path(out, step)
    if out.is_dir():
        raise GptspeedError(f"--out {out} is a folder: name a FILE.pt, "
                            f"or a folder without .pt to receive ckpt_{step:08d}.pt")
    seal = seal_path(out)
    if seal.exists() or seal.is_symlink():
        old = read_seal(out)
        if not (seal.is_file() and old is not None and "sha256" in old and "bytes" in old):
            raise GptspeedError(f"--out {out} would replace {seal}, which is not a checkpoint's seal: "
                                "name another file")
    if (out.exists() or out.is_symlink()) and not force:
        raise GptspeedError(f"--out {out} already exists: pass --force to replace it, or name another file")
    return out


def consolidate(run: Path, out: Path, force: bool = False) -> Path:
    """Merge the newest valid sharded (FSDP2) checkpoint of ``run`` (a run folder or a ``.dcp``
    folder) into one single-file checkpoint, in one process and without GPUs: the
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` conversion, read through
    :func:`gptspeed.safe_dcp.load_full` (no pickled code runs, whoever wrote the folder).

    ``out`` ending in ``.pt`` is written as that file (sealed by ``out`` with ``.json``);
    otherwise it is a run folder that receives ``ckpt_{step}.pt`` (and the run's config.json and
    metrics.jsonl), so ``gptspeed sample/eval --run OUT`` and one-process ``train --out OUT
    --resume`` load it. Model weights are full fp32 tensors under the usual names, the optimizer
    state is in the optimizer's own ``state_dict`` form (AdamW, or Muon + AdamW). Returns the
    file written. GptspeedError if ``run`` has no valid sharded checkpoint, or ``out`` is refused
    by :func:`_consolidate_target` (an existing ``out`` file only without ``force``; a checkpoint
    name, a path inside the source run, another run's files never). Every file is written under a
    temporary name and renamed, the checkpoint last.
    """
    from gptspeed.safe_dcp import load_full

    run = Path(run)
    if is_sharded(run):
        src, reason = run, check_checkpoint(run)
        if reason:
            raise GptspeedError(f"checkpoint {run} is not valid: {reason}")
        run_dir = run.parent
    else:
        src, skipped = latest_valid_checkpoint(run)
        run_dir = run
        if src is None:
            why = f": {skipped[0][0].name} is {skipped[0][1]}" if skipped else ""
            raise GptspeedError(f"no valid checkpoint in {run}{why}")
    if not is_sharded(src):
        raise GptspeedError(f"{src} is already a single-file checkpoint: nothing to consolidate")
    meta = load_checkpoint(src, verify=False)
    out = Path(out)
    target = _consolidate_target(out, run_dir, meta["step"], force)
    full = load_full(src)
    state = {k: v for k, v in meta.items() if k not in ("format", "format_version", "sharded")}
    state["model"] = full["model"]
    state["optimizer"] = split_optimizer_state(full["optimizer"], meta.get("optimizer_layout"))
    state["consolidated_from"] = str(src)
    state["config"] = {**state["config"], "runtime": {**state["config"].get("runtime", {}), "parallel": "auto"}}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target != out:  # a run folder: the run's config.json and metrics.jsonl, then the checkpoint
            for name in ("config.json", "metrics.jsonl"):
                if (run_dir / name).is_file() and not (out / name).exists():
                    with open(run_dir / name, "rb") as src_file:
                        write_atomic(out / name, lambda f, s=src_file: shutil.copyfileobj(s, f))
    except OSError as e:
        raise GptspeedError(f"cannot write to {target.parent}: {e.strerror or e}") from None
    write_checkpoint_file(target, state)
    return target
