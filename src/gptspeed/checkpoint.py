"""Checkpoints: everything a run needs to continue exactly, written so that no crash can lose one.

A checkpoint is two files: ``RUN_DIR/ckpt_{step:08d}.pt`` (``torch.save`` of the model and
optimizer state, GradScaler state, step, data-loader position, RNG states, counters and the run
configuration) and its seal ``ckpt_{step:08d}.json`` (``{"step", "bytes", "sha256"}`` of the
``.pt``). Each is written to a hidden temporary file, flushed, fsynced and renamed, the seal
last, and the folder is fsynced. A checkpoint counts only once sealed and only while its bytes
match the seal, so a ``SIGKILL`` at any instant leaves the newest complete checkpoint loadable,
and a torn, truncated or altered file is detected and skipped. Loading uses
``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gptspeed.errors import GptspeedError
from gptspeed.fileio import fsync_dir, sha256_file, write_atomic, write_text_atomic

CKPT_RE = re.compile(r"^ckpt_(\d{8})\.(pt|dcp)$")
SHARDED_META = "meta.pt"  # inside a sharded checkpoint folder: everything but model and optimizer
FORMAT = "gptspeed-checkpoint"
FORMAT_VERSION = 1


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


def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer_states: int = 2) -> int:
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


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write and seal ``state`` (must contain ``step``); keep the newest ``keep`` checkpoints.

    Raises GptspeedError if it cannot be written (disk full, permissions); the earlier
    checkpoints are untouched then. Returns the ``.pt`` path.
    """
    run_dir = Path(run_dir)
    final = checkpoint_path(run_dir, state["step"])
    write_checkpoint_file(final, state)
    prune_checkpoints(run_dir, keep)
    return final


def write_checkpoint_file(final: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to the file ``final`` atomically and seal it (``final`` with ``.json``)."""
    final = Path(final)
    run_dir = final.parent
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, **state}

    def write_pt(f):
        w = _HashingWriter(f)
        torch.save(payload, w)
        return w

    try:
        seal_path(final).unlink(missing_ok=True)  # an old seal must never vouch for new bytes
        w = write_atomic(final, write_pt)
        seal = {"step": state["step"], "bytes": w.bytes, "sha256": w.sha.hexdigest()}
        write_text_atomic(seal_path(final), json.dumps(seal))
        fsync_dir(run_dir)
    except OSError as e:
        raise GptspeedError(f"could not write checkpoint {final}: {e.strerror or e}") from e


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, each unsealed first."""
    for old in list_checkpoints(run_dir)[:-keep]:
        seal_path(old).unlink(missing_ok=True)  # unseal first: a half-deleted one is invalid
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def seal_sharded(folder: Path, step: int) -> None:
    """Seal a sharded checkpoint folder once every rank has finished writing it: the seal lists
    each file's size and sha256. Call on one rank, after a barrier."""
    folder = Path(folder)
    files = {p.name: [p.stat().st_size, sha256_file(p)] for p in sorted(folder.iterdir()) if p.is_file()}
    try:
        for p in folder.iterdir():
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(folder)
        write_text_atomic(seal_path(folder), json.dumps({"step": step, "files": files}))
        fsync_dir(folder.parent)
    except OSError as e:
        raise GptspeedError(f"could not seal checkpoint {folder}: {e.strerror or e}") from e


def check_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a valid checkpoint (a short reason), or None if its seal matches."""
    path = Path(path)
    try:
        seal = json.loads(seal_path(path).read_text())
        if not is_sharded(path):
            size, digest = int(seal["bytes"]), str(seal["sha256"])
        if is_sharded(path):
            files = {str(k): (int(v[0]), str(v[1])) for k, v in seal["files"].items()}
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
        return None
    try:
        actual_size = path.stat().st_size
    except OSError:
        return "missing"
    if actual_size != size:
        return f"size {actual_size} bytes, sealed as {size} (truncated or altered)"
    if sha256_file(path) != digest:
        return "sha256 does not match its seal (corrupted)"
    return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``, after checking it against its seal.

    Raises GptspeedError naming the file if it is missing, unsealed, corrupted or not a
    gptspeed checkpoint. A sharded checkpoint folder (``.dcp``) yields its metadata only (step,
    config, loader, RNG...; no ``model`` / ``optimizer``) with ``"sharded": True``: the training
    loop loads the shards with :mod:`torch.distributed.checkpoint`; everything else needs a
    single file (``gptspeed consolidate``).
    """
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
    return state


def latest_valid_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest valid checkpoint in ``run_dir`` (or None) and the newer ones skipped, each
    with the reason."""
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        reason = check_checkpoint(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The newest valid checkpoint in ``run_dir``; GptspeedError if the folder has none."""
    path, skipped = latest_valid_checkpoint(run_dir)
    if path is None:
        if not Path(run_dir).is_dir():
            raise GptspeedError(f"run folder {run_dir} does not exist")
        if skipped:
            raise GptspeedError(f"no valid checkpoint in {run_dir}: {skipped[0][0].name} is {skipped[0][1]}")
        raise GptspeedError(f"no checkpoint in {run_dir}: train first (`gptspeed train --out {run_dir}`)")
    if is_sharded(path):
        raise GptspeedError(f"{path} is a sharded (FSDP) checkpoint: make a single file first with "
                            f"`gptspeed consolidate --run {run_dir} --out RUN_OR_FILE`")
    return load_checkpoint(path, map_location, verify=False)


def _optim_by_index(optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_state_dict``'s form) -> the
    index-keyed form ``torch.optim.Optimizer.load_state_dict`` takes: parameters numbered in
    param-group order, as an optimizer built the same way numbers them."""
    index: dict[str, int] = {}
    groups = []
    for g in optim["param_groups"]:
        ids = []
        for name in g["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**g, "params": ids})
    return {"state": {index[k]: v for k, v in optim["state"].items() if k in index}, "param_groups": groups}


def consolidate(run: Path, out: Path) -> Path:
    """Merge the newest valid sharded (FSDP2) checkpoint of ``run`` (a run folder or a ``.dcp``
    folder) into one single-file checkpoint, in one process and without GPUs
    (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).

    ``out`` ending in ``.pt`` is written as that file (sealed by ``out`` with ``.json``);
    otherwise it is a run folder that receives ``ckpt_{step}.pt`` (and the run's config.json and
    metrics.jsonl), so ``gptspeed sample/eval --run OUT`` and one-process ``train --out OUT
    --resume`` load it. Model weights are full fp32 tensors under the usual names, the optimizer
    state is in ``Optimizer.state_dict`` form. Returns the file written. GptspeedError if ``run``
    has no valid sharded checkpoint or ``out`` already holds checkpoints.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

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
    as_file = out.suffix == ".pt"
    target = out if as_file else checkpoint_path(out, meta["step"])
    if not as_file and list_checkpoints(out):
        raise GptspeedError(f"{out} already holds checkpoints: choose an empty folder or a FILE.pt")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".consolidate-") as tmp:
        full_file = Path(tmp) / "full.pt"
        try:
            dcp_to_torch_save(src, full_file)
            full = torch.load(full_file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for damaged shards
            raise GptspeedError(f"could not read the shards of {src} ({type(e).__name__}: {e})") from e
    state = {k: v for k, v in meta.items() if k not in ("format", "format_version", "sharded")}
    state["model"] = full["model"]
    state["optimizer"] = _optim_by_index(full["optim"])
    state["consolidated_from"] = str(src)
    state["config"] = {**state["config"], "runtime": {**state["config"].get("runtime", {}), "parallel": "auto"}}
    write_checkpoint_file(target, state)
    if not as_file:
        for name in ("config.json", "metrics.jsonl"):
            if (run_dir / name).is_file() and not (out / name).exists():
                shutil.copyfile(run_dir / name, out / name)
    return target
