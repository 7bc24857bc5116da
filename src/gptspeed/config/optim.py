"""The ``optim`` group of settings: :class:`OptimConfig`, the optimizer and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from gptspeed.config.declare import LR_SCHEDULES, OPTIMIZERS, _f


def _group_lr(help: str, replaced_by: str | None = None):
    """A param group's own peak learning rate (``--embed-lr``, ``--head-lr``, ``--scalar-lr``, replaced by
    its ``--GROUP-lr-ratio`` when that is given), or that ratio: None follows ``--lr``; else a positive
    finite number, run-defining."""
    return _f(
        None,
        help,
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        replaced_by=replaced_by,
        run_defining=True,
    )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (GPT-3 paper, appendix B)."""

    lr: float = _f(
        6e-4,
        "peak learning rate",
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        run_defining=True,
    )
    min_lr_ratio: float = _f(
        0.1,
        "final learning rate as a fraction of --lr (cosine decay target)",
        min=0,
        max=1,
        text="in [0, 1]",
        run_defining=True,
    )
    warmup_steps: int = _f(715, "linear warm-up steps", min=0, replaced_by="warmup_ratio", run_defining=True)
    warmup_ratio: float | None = _f(
        None,
        "linear warm-up as a fraction of --max-steps (e.g. 0.05); replaces --warmup-steps when given",
        min=0,
        max=1,
        max_note=None,
        text="in [0, 1)",
        run_defining=True,
    )
    lr_schedule: str = _f(
        "cosine",
        "cosine (warm-up, then cosine decay to --min-lr-ratio; GPT-3) | wsd (warm-up, "
        "stable at --lr, then linear decay over the last --decay-ratio of the steps; Hagele et al. "
        "2024)",
        choices=LR_SCHEDULES,
        run_defining=True,
    )
    decay_ratio: float = _f(
        0.2,
        "--lr-schedule wsd: the share of --max-steps that decays (the cooldown)",
        min=0,
        max=1,
        text="in [0, 1]",
        only_with={"lr_schedule": "wsd"},
        run_defining=True,
    )
    weight_decay: float = _f(
        0.1, "AdamW weight decay, applied to tensors with 2 or more dims only", min=0, run_defining=True
    )
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1, text="in [0, 1)", run_defining=True)
    beta2: float = _f(0.95, "AdamW beta2", min=0, max=1, text="in [0, 1)", run_defining=True)
    eps: float = _f(
        1e-8, "AdamW epsilon", min=0, min_open=True, finite=True, text="a positive finite number", run_defining=True
    )
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)", min=0, run_defining=True)
    fused_adamw: bool | None = _f(None, "fused AdamW kernel (default: where the device supports it)", kind="bool")
    optimizer: str = _f(
        "adamw",
        "adamw | muon (Muon for the blocks' 2-D weights at --muon-lr, AdamW at --lr for "
        "embeddings, head, gains and biases; Jordan et al. 2024, as modded-nanogpt; Muon cannot skip a "
        "non-finite step on the device, so that check costs one host-device sync a step)",
        choices=OPTIMIZERS,
        run_defining=True,
    )
    muon_lr: float = _f(
        0.02,
        "Muon peak learning rate (scaled by sqrt(max(1, rows/cols)); same schedule as --lr)",
        min=0,
        min_open=True,
        text="positive",
        only_with={"optimizer": "muon"},
        run_defining=True,
    )
    muon_momentum: float = _f(
        0.95,
        "Muon (Nesterov) momentum",
        min=0,
        max=1,
        text="in [0, 1)",
        only_with={"optimizer": "muon"},
        run_defining=True,
    )
    muon_momentum_warmup: int = _f(
        0,
        "steps over which Muon's momentum rises linearly from --muon-momentum-start to --muon-momentum (the "
        "modded-nanogpt speedrun: 0.85 to 0.95 over 300 steps); 0 = off",
        min=0,
        off=0,
        only_with={"optimizer": "muon"},
        below=("max_steps", "the run would end inside the warm-up, never at --muon-momentum"),
        run_defining=True,
    )
    muon_momentum_start: float = _f(
        0.85,
        "--muon-momentum-warmup's first momentum",
        min=0,
        max=1,
        text="in [0, 1)",
        needs="muon_momentum_warmup",
        run_defining=True,
    )
    embed_lr: float | None = _group_lr(
        "AdamW peak learning rate of the token, position and value embeddings (default: --lr); with --head-lr and "
        "--scalar-lr, the speedrun's per-group Adam rates",
        replaced_by="embed_lr_ratio",
    )
    head_lr: float | None = _group_lr(
        "AdamW peak learning rate of the untied LM head (needs --no-tie-embeddings; default: --lr)",
        replaced_by="head_lr_ratio",
    )
    scalar_lr: float | None = _group_lr(
        "AdamW peak learning rate of the gains and biases (tensors of under 2 dims; default: --lr)",
        replaced_by="scalar_lr_ratio",
    )
    embed_lr_ratio: float | None = _group_lr("--embed-lr as a multiple of --lr; replaces --embed-lr when given")
    head_lr_ratio: float | None = _group_lr("--head-lr as a multiple of --lr; replaces --head-lr when given")
    scalar_lr_ratio: float | None = _group_lr("--scalar-lr as a multiple of --lr; replaces --scalar-lr when given")

    def group_lr(self, group: str) -> float | None:
        """The peak learning rate of param group ``group`` (``embed``, ``head`` or ``scalar``): its
        ``--GROUP-lr-ratio`` times ``--lr`` when given, else its ``--GROUP-lr``; None: ``--lr``."""
        ratio = getattr(self, f"{group}_lr_ratio")
        return ratio * self.lr if ratio is not None else getattr(self, f"{group}_lr")
