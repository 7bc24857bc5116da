"""The tests' one tiny model, training steps built as ``gptspeed train`` builds them, and a run's logged records."""

from __future__ import annotations

from pathlib import Path

#: The one tiny model of the tests (each test states what it changes): seconds on a CPU.
TINY_MODEL = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)


def flags(settings: dict) -> list[str]:
    """Settings (RunConfig field names) as ``gptspeed train`` / ``bench`` flags."""
    out = []
    for k, v in settings.items():
        out += [f"--{'seq-len' if k == 'block_size' else k.replace('_', '-')}", str(v)]
    return out


def records(run_dir: Path) -> list[dict]:
    """Every record of a run's ``metrics.jsonl``, in order."""
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """``{step: train_loss}`` of a run's ``metrics.jsonl``."""
    return {r["step"]: r["train_loss"] for r in records(run_dir) if "train_loss" in r}


def make_step(model_kw: dict, optim_kw: dict | None = None, rt=None, train_kw: dict | None = None, **runtime_kw):
    """The training step of ``gptspeed train`` (:class:`gptspeed.step.TrainStep`, every rule checked)
    for a model shape (GPTConfig fields), optimizer and train settings, on the CPU in fp32 unless
    ``rt`` is given."""
    from gptspeed.config import GPTConfig, OptimConfig, RunConfig, RuntimeConfig, TrainConfig
    from gptspeed.runtime import resolve_runtime
    from gptspeed.step import TrainStep

    cfg = RunConfig(
        model=GPTConfig(**model_kw),
        optim=OptimConfig(**(optim_kw or {})),
        train=TrainConfig(**(train_kw or {})),
        runtime=RuntimeConfig(**runtime_kw),
    )
    cfg.validate()
    return TrainStep(cfg, rt or resolve_runtime("cpu", "float32", False))


def one_step(step, x, y):
    """One optimizer step of a :class:`gptspeed.step.TrainStep` on the micro-batch ``(x, y)`` (its
    one micro-batch per step): ``(loss, grad_norm, bad)``."""
    return step(lambda: (x, y))
