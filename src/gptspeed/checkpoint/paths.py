"""Names in a run folder: the checkpoints (``ckpt_{step:08d}.pt`` files, ``ckpt_{step:08d}.dcp``
folders), their seals (``ckpt_{step:08d}.json``), the other files gptspeed writes there, and the
temporary names its writes leave when killed. No torch, no I/O beyond listing a folder."""

from __future__ import annotations

import re
from pathlib import Path

CKPT_RE = re.compile(r"^ckpt_(\d{8})\.(pt|dcp)$")
# What gptspeed itself writes into a run folder: checkpoints, seals, config.json, metrics.jsonl, the lock,
# the trackers' files (TensorBoard's folder, W&B's folder and run id) and the write probe.
OWN_NAMES = re.compile(
    r"^(ckpt_\d{8}\.(pt|dcp|json)|config\.json|metrics\.jsonl|tokenizer\.json|\.gptspeed\.lock|\.write-test|"
    r"tensorboard|wandb|wandb_run_id)$"
)
# Temporary names gptspeed's own writes leave when killed (fileio.create_temp: ``.NAME.XXXXXXXX.tmp``; a
# sharded save: ``.ckpt_N.dcp.tmp``): the only hidden entries a start removes.
STALE_NAMES = re.compile(
    r"^\.((ckpt_\d{8}\.(pt|json)|config\.json|tokenizer\.json|wandb_run_id)\.[0-9a-f]{8}\.tmp|"
    r"ckpt_\d{8}\.dcp\.tmp)$"
)
SHARDED_META = "meta.pt"  # inside a sharded checkpoint folder: every part but model and optimizer
LOCK_NAME = ".gptspeed.lock"
FORMAT = "gptspeed-checkpoint"
FORMAT_VERSION = 2  # 2: parts by name ("trainer" holds step / skipped_steps); seals carry the config


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


def step_of(path: Path) -> int:
    """The step in a checkpoint's name (``ckpt_00000042.pt`` -> 42; 0 for another name)."""
    m = CKPT_RE.match(Path(path).name)
    return int(m.group(1)) if m else 0
