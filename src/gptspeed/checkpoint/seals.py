"""Seals: what vouches for a checkpoint. ``ckpt_{step:08d}.json`` holds the bytes and sha256 of the
checkpoint's file (of every file of a sharded folder), the step, the run's id and its run-defining
configuration, so a resume decides without loading anything. A checkpoint counts only once sealed,
only while its bytes match the seal, and only as the checkpoint of its own run and of the step its
name says (:func:`not_of_run`). No torch here: reading a run's configuration costs no torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptspeed.checkpoint.paths import CKPT_RE, is_sharded, list_checkpoints, seal_path, step_of
from gptspeed.errors import GptspeedError
from gptspeed.fileio import sha256_file

if TYPE_CHECKING:
    from gptspeed.config import RunConfig


def seal_info(state: dict[str, Any]) -> dict[str, Any]:
    """What a seal repeats of a checkpoint, so a resume can decide without loading it."""
    info = {"step": state["step"]}
    for key in ("config", "data", "world_size", "run_id"):
        if key in state:
            info[key] = state[key]
    info["kind"] = "full" if "optimizer" in state else "weights"
    return info


def data_changed(recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether the data differ from those a checkpoint recorded: every key the checkpoint recorded
    must be unchanged (checkpoints written before a key was recorded are compared on the keys they
    have; a checkpoint with no data identity compares equal only to none)."""
    if not recorded or not now:
        return recorded != now
    return any(now.get(k) != v for k, v in recorded.items())


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


def mark_verified(path: Path) -> None:
    """Record ``path`` as valid in this process (it was just written and hashed here)."""
    _VERIFIED[_identity(path)] = True


_SEAL_BYTES = 64 << 20  # a seal lists a few files' sizes and hashes, and a configuration: far less than this


def _load_seal(path: Path) -> Any:
    """The JSON of ``path``'s seal; FileNotFoundError when there is none, GptspeedError when it
    cannot be read (a folder, a FIFO, too large, not UTF-8 or not JSON: never a hang)."""
    from gptspeed.fileio import read_user_json

    if not seal_path(path).exists():
        raise FileNotFoundError(seal_path(path))
    return read_user_json(seal_path(path), "seal", expect=None, max_bytes=_SEAL_BYTES)


def read_seal(path: Path) -> dict[str, Any] | None:
    """The parsed seal of checkpoint ``path`` (None when missing or damaged). Its ``config`` /
    ``data`` / ``world_size`` / ``kind`` / ``run_id`` are those of the checkpoint."""
    try:
        seal = _load_seal(path)
    except (OSError, GptspeedError):
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
        seal = _load_seal(path)
        if is_sharded(path):
            files = {str(k): (int(v[0]), str(v[1])) for k, v in seal["files"].items()}
        else:
            size, digest = int(seal["bytes"]), str(seal["sha256"])
    except FileNotFoundError:
        return "not sealed (interrupted while saving?)"
    except (OSError, GptspeedError, ValueError, KeyError, TypeError, IndexError, AttributeError):
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
    Reads the seal only; the loaded content is compared in :func:`gptspeed.checkpoint.formats.load_checkpoint`."""
    seal = read_seal(path)
    if seal is None:
        return None  # unsealed or damaged: check_checkpoint says so
    m = CKPT_RE.match(Path(path).name)
    if m and seal.get("step") != int(m.group(1)):
        return (
            f"its seal is of step {seal.get('step')!r}, its name of step {int(m.group(1))} "
            "(renamed, or copied in from another run?)"
        )
    theirs = seal.get("run_id")
    if run_id and theirs and theirs != run_id:
        return f"it belongs to another run (run id {str(theirs)[:12]}; this folder's run is {run_id[:12]})"
    return None


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
    """The run configuration (``RunConfig.to_dict`` form) a valid checkpoint was written with, from
    its seal. GptspeedError for a seal without one (a checkpoint of gptspeed's format 1)."""
    seal = read_seal(path)
    if seal is not None and isinstance(seal.get("config"), dict):
        return seal["config"]
    raise GptspeedError(
        f"checkpoint {path} was written by an older gptspeed (its seal holds no configuration): "
        "resume it with the gptspeed that wrote it"
    )


def newest_run_config(run_dir: Path) -> tuple[Path | None, RunConfig | None]:
    """The newest valid checkpoint of ``run_dir`` and the :class:`~gptspeed.config.RunConfig` it
    was written with (read from its seal: no torch import), or ``(None, None)`` when there is none.
    GptspeedError if the recorded configuration cannot be read."""
    from gptspeed.config import RunConfig

    path = latest_valid_checkpoint(Path(run_dir))[0]
    if path is None:
        return None, None
    return path, RunConfig.from_dict(checkpoint_config(path), f"checkpoint {path}")


def started_run(run_dir: Path) -> tuple[RunConfig, dict[str, Any]] | None:
    """What ``RUN_DIR/config.json`` records of a run that started there
    (:func:`gptspeed.runinfo.write_run_config`, written before the first step): its configuration
    and its ``derived`` entries (``run_id``, ``data``, ...) -- for a ``--resume`` of a run killed
    before its first checkpoint, which restarts as itself. None when there is no such file, or it is
    not a run's configuration (no ``model`` / ``train`` / ``derived`` objects, or an imported model's,
    which names its ``source``): the run folder's own rules judge such a file. GptspeedError (one line
    naming the file) when it is a run's configuration that cannot be read back."""
    import os

    from gptspeed.config import RunConfig
    from gptspeed.fileio import read_user_json

    path = Path(run_dir) / "config.json"
    if not os.path.lexists(path):
        return None
    try:
        doc = read_user_json(path, "run configuration", max_bytes=1 << 20)
    except GptspeedError:
        return None  # a folder, a FIFO, not JSON: not a run's (RunFolder refuses it, naming it)
    if not all(isinstance(doc.get(k), dict) for k in ("model", "train", "derived")) or "source" in doc:
        return None
    settings = {k: v for k, v in doc.items() if k not in ("derived", "environment")}
    return RunConfig.from_dict(settings, f"run configuration {path}"), doc["derived"]


def refuse_checkpoints(folder: Path, fix: str) -> None:
    """GptspeedError "FOLDER already holds checkpoints: FIX" if ``folder`` holds any checkpoint
    (valid or not): no command writes a new run over one."""
    if list_checkpoints(Path(folder)):
        raise GptspeedError(f"{folder} already holds checkpoints: {fix}")


def intact_besides(final: Path) -> str:
    """ "the checkpoint of step M is intact" for the newest valid checkpoint beside ``final`` (the
    one being written), or "no earlier checkpoint exists"."""
    older = [p for p in list_checkpoints(final.parent) if p != final and check_checkpoint(p) is None]
    return f"the checkpoint of step {step_of(older[-1])} is intact" if older else "no earlier checkpoint exists"
