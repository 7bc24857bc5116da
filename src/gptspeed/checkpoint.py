"""Checkpoints: everything a run needs to continue exactly, written atomically.

A checkpoint is one file ``RUN_DIR/ckpt_{step:08d}.pt`` (``torch.save``) holding the model and
optimizer state, the GradScaler state, the step, the data loader's position, RNG states, the
counters (tokens, documents) and the run configuration. It is written to a temporary file,
flushed and fsynced, then renamed, so a crash at any instant leaves the previous checkpoint
intact and never a partial file under a checkpoint's name. Loading uses ``weights_only=True``:
no pickled code runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from gptspeed.errors import GptspeedError

CKPT_RE = re.compile(r"^ckpt_(\d{8})\.pt$")
FORMAT = "gptspeed-checkpoint"
FORMAT_VERSION = 1


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files in ``run_dir``, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if CKPT_RE.match(p.name))


def _fsync_dir(path: Path) -> None:
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


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` (must contain ``step``) atomically; keep the newest ``keep`` checkpoints.

    Raises GptspeedError if the file cannot be written (disk full, permissions); the previous
    checkpoints are untouched in that case.
    """
    run_dir = Path(run_dir)
    final = checkpoint_path(run_dir, state["step"])
    tmp = run_dir / f".{final.name}.tmp"
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, **state}
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise GptspeedError(f"could not write checkpoint {final}: {e.strerror or e}") from e
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; GptspeedError naming the file if it is not
    a readable gptspeed checkpoint."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError as e:
        raise GptspeedError(f"checkpoint {path} does not exist") from e
    except Exception as e:  # torch raises many types for a damaged file
        raise GptspeedError(f"checkpoint {path} is unreadable ({type(e).__name__}): delete it or resume from another") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GptspeedError(f"{path} is not a gptspeed checkpoint")
    return state


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The newest checkpoint in ``run_dir``; GptspeedError if the folder has none."""
    path = latest_checkpoint(run_dir)
    if path is None:
        if not Path(run_dir).is_dir():
            raise GptspeedError(f"run folder {run_dir} does not exist")
        raise GptspeedError(f"no checkpoint in {run_dir}: train first (`gptspeed train --out {run_dir}`)")
    return load_checkpoint(path, map_location)
