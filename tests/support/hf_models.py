"""Tiny Hugging Face GPT-2 folders and gptspeed runs for the tests of :mod:`gptspeed.hf` (and of
sample / eval on such runs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch

from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import preset
from gptspeed.data.shards import write_shard
from gptspeed.hf.export import export_hf
from gptspeed.model import GPT, GPTConfig

from support.cli import child_env

TINY_HF_GPT2 = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)
"""``transformers.GPT2Config`` fields of the tiny GPT-2 the tests import (and of the runs they export)."""

IDX = torch.randint(0, 50257, (2, 48), generator=torch.Generator().manual_seed(1))
"""Token ids ``(2, 48)`` int64 to compare logits on."""


def gptspeed_cli(*args, cwd=None):
    env = child_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "gptspeed", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def assert_one_line_error(res):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], res.stderr


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def our_logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


def write_run(run_dir: Path, seed: int = 0) -> GPT:
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(cfg.model).eval()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    return model


def write_data(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 20_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    return folder


def copy_hf(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the HF folder ``src`` with config.json fields and tensors (HF names) replaced."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    sd = load_file(str(src / "model.safetensors"))
    sd.update(tensors or {})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_run_pico(run_dir: Path, poison: float | None = None) -> Path:
    """A run folder with one pico-sized checkpoint (step 7); ``poison`` written into one weight."""
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    if poison is not None:
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = poison
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    (run_dir / "metrics.jsonl").write_text('{"step": 7, "train_loss": 9.0}\n')
    return run_dir


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256): to show nothing was touched."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_data_pico(folder: Path, manifest: bool = True) -> Path:
    """Token shards (val: 2,000 tokens) and, with ``manifest``, a manifest.json that only names the
    folder as a data folder (``gptspeed.paths.kind``); without it, eval finds the shards by name."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 2_000, dtype=np.uint16))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({"note": "a prepared data folder"}))
    return folder


def exported(tmp_path):
    """A tiny run's export (an HF GPT-2 folder)."""
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return run, export_hf(run, tmp_path / "hf")


def undeclare(monkeypatch, cls: type, name: str, key: str) -> None:
    """Remove the declaration ``key`` (``init_from`` / ``export``) from the field ``name`` of the
    dataclass ``cls`` for one test: the field then stands for a setting added without one."""
    f = cls.__dataclass_fields__[name]
    assert key in f.metadata and f in dataclasses.fields(cls)
    monkeypatch.setattr(f, "metadata", types.MappingProxyType({k: v for k, v in f.metadata.items() if k != key}))
