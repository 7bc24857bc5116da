"""Optimizer construction and the learning-rate schedule.

AdamW (Loshchilov & Hutter 2019) with weight decay on tensors of 2 or more dimensions only
(matmul weights and embeddings; not biases or LayerNorm gains), as in GPT-3 / nanoGPT. The
schedule is a pure function of the step, so resuming needs no scheduler state.
"""

from __future__ import annotations

import math

import torch

from gptspeed.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: tensors with ``dim >= 2`` decayed, the rest not. Tied weights count once."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() de-duplicates ties
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def fused_adamw_available(device_type: str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` has a kernel for this device type (PyTorch docs:
    CUDA, and CPU / MPS from PyTorch 2.4 / 2.5)."""
    return device_type in ("cuda", "cpu", "mps")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device_type: str) -> tuple[torch.optim.AdamW, bool]:
    """AdamW over :func:`param_groups`; returns ``(optimizer, fused)``.

    ``cfg.fused_adamw``: None picks the fused kernel where available; True demands it
    (ValueError from torch if the device has none); False uses PyTorch's default implementation.
    """
    fused = fused_adamw_available(device_type) if cfg.fused_adamw is None else cfg.fused_adamw
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )
    return opt, fused


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up from ``max_lr/warmup``
    to ``max_lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
