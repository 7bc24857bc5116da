"""Checkpoints built by hand for the checkpoint package's tests: parts that record what was saved and loaded, a sharded save of them, a configuration and a run id; a sharded checkpoint re-sealed as a forger would, and a pickle that runs code."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from gptspeed.checkpoint import (
    check_checkpoint,
)
from gptspeed.checkpoint.formats import (
    DcpFormat,
)
from gptspeed.fileio import sha256_file

SHARD = "__0_0.distcp"


def _info(md, fqn="w") -> _StorageInfo:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


# ------------------------------------------------------------------ sharded checkpoints of plain state dicts
class Part:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


CONFIG = {"model": {"n_layer": 1}, "train": {"lr": 0.1}, "runtime": {"parallel": "fsdp", "device": "cpu"}}


RUN_ID = "run-one"


def _parts(scale=1.0):
    return {
        "model": Part({"w": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.ones(3) * scale}),
        "optimizer": Part(
            {
                "state": {"w": {"exp_avg": torch.full((2, 3), 0.5 * scale), "step": torch.tensor(1.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}],
            }
        ),
        "rng": Part({"torch": torch.arange(4, dtype=torch.uint8)}),
    }


def _save(run: Path, step: int, keep: int = 2, run_id: str = RUN_ID) -> Path:
    fmt = DcpFormat(run, True, lambda: None, keep)
    return fmt.save(
        step, _parts(), {"config": CONFIG, "run_id": run_id}, {"optimizer_layout": None}, {"model", "optimizer"}
    )


# ------------------------------------------------------------------ save_checkpoint: keep's default, its run id
def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ the Checkpointer: defaults, where parts go
class _ThreeGroups:
    """An optimizer as OptimizerState sees it: three param groups and a state_dict (a real torch.optim
    optimizer's first construction imports torch._dynamo, ~2 s)."""

    def __init__(self):
        self.param_groups = [{"lr": 0.1 * (i + 1), "params": [i]} for i in range(3)]

    def state_dict(self):
        return {"state": {}, "param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, sd):
        self.param_groups = sd["param_groups"]


def reseal(ckpt: Path) -> None:
    """Re-hash every file of the sharded checkpoint ``ckpt`` into its seal, as a forger would."""
    seal = ckpt.with_suffix(".json")
    info = json.loads(seal.read_text())
    info["files"] = {p.name: [p.stat().st_size, sha256_file(p)] for p in sorted(ckpt.iterdir()) if p.is_file()}
    seal.write_text(json.dumps(info))
    assert check_checkpoint(ckpt) is None


class _Payload:
    """Pickles as ``os.system("touch MARKER")``: what a crafted checkpoint runs when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)
