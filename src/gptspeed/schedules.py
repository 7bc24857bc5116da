"""The per-step schedules: the learning rate (warm-up, then cosine or WSD) and every warm-up of a run
(Muon's momentum, the attention window, the micro-batches of a step, the sequence length).

Each is a pure function of the optimizer step and the run's configuration, so a resumed run needs no
scheduler state: it computes the same values for the same steps. :func:`set_lr` writes the rate (and
Muon's momentum) of a step into an optimizer's param groups, times each group's ``lr_mult``
(:mod:`gptspeed.optim`).
"""

from __future__ import annotations

import math

from gptspeed.config import ATTN_WINDOW_MULTIPLE, OptimConfig


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up from ``max_lr/warmup``
    to ``max_lr`` over ``warmup_steps``; then, ``cosine``, cosine decay to ``min_lr`` at
    ``max_steps`` (GPT-3, Brown et al. 2020, appendix B); or ``wsd`` (warm-up, stable, decay:
    Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
    Durations"), ``max_lr`` until the last ``decay_ratio`` of the steps, then a linear decay to
    ``min_lr`` at ``max_steps`` (the trapezoid the modded-nanogpt speedrun uses)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        decay_steps = decay_ratio * max_steps
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start or decay_steps <= 0:
            return max_lr
        return min_lr + (max_lr - min_lr) * (max_steps - step) / (max_steps - decay_start)
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def set_lr(optimizer, cfg, step: int) -> float:
    """Set the learning rate of ``step`` (``--lr-schedule``, :func:`lr_at`, by ``cfg``'s optimizer
    settings, warm-up and ``--max-steps``) into every param group of ``optimizer``, times the
    group's ``lr_mult``. Returns the base learning rate."""
    o = cfg.optim
    lr = lr_at(
        step,
        max_lr=o.lr,
        min_lr=o.lr * o.min_lr_ratio,
        warmup_steps=cfg.warmup_steps(),
        max_steps=cfg.train.max_steps,
        schedule=o.lr_schedule,
        decay_ratio=o.decay_ratio,
    )
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    if o.optimizer == "muon" and o.muon_momentum_warmup > 0:
        momentum = muon_momentum_at(step, o)
        for group in optimizer.param_groups:
            if "momentum" in group:  # Muon's groups (AdamW's have betas)
                group["momentum"] = momentum
    return lr


def muon_momentum_at(step: int, o: OptimConfig) -> float:
    """Muon's momentum at optimizer step ``step`` (0-based) under ``--muon-momentum-warmup N``: from
    ``--muon-momentum-start`` rising linearly to ``--muon-momentum`` at step N, then held (the
    modded-nanogpt speedrun's warm-up, 0.85 to 0.95 over its first 300 steps). A pure function of the
    step, as the learning rate is: a resume needs no state for it."""
    frac = min(step / o.muon_momentum_warmup, 1.0) if o.muon_momentum_warmup > 0 else 1.0
    return o.muon_momentum_start + frac * (o.muon_momentum - o.muon_momentum_start)


def attn_window_at(step: int, cfg) -> int:
    """The attention window (tokens) of optimizer step ``step`` (0-based) under ``--attn-window W``
    (``cfg``: a :class:`~gptspeed.config.RunConfig`; 0 when the switch is off): linear in the run's
    progress ``step / --max-steps`` from ``W0 = min(--attn-window-start, W)`` to ``W``, rounded up to a
    multiple of :data:`ATTN_WINDOW_MULTIPLE` and at most ``W``, i.e. ``min(W, 128 * ceil((W0 + (W - W0) *
    step / max_steps) / 128))``, in integers (exact, the same on every machine); ``W`` from ``--max-steps``
    on. The modded-nanogpt speedrun's window warm-up (its records since the sliding window came in:
    ``next_multiple_of_n(1728 * step / num_iterations, n=128)``, 128 to 1792 tokens); a pure function of
    the step, as the learning rate is, so a resumed run continues with the same windows."""
    final, max_steps = cfg.model.attn_window, cfg.train.max_steps
    start = min(cfg.model.attn_window_start, final)
    if not final or step >= max_steps:
        return final
    m = ATTN_WINDOW_MULTIPLE
    exact = start * max_steps + (final - start) * step  # the window times max_steps
    return min(final, -(-exact // (m * max_steps)) * m)


def grad_accum_at(step: int, cfg, world_size: int = 1) -> int:
    """Micro-batches (per process) of optimizer step ``step`` (0-based) under ``--batch-warmup-steps N``
    (``cfg``: a :class:`~gptspeed.config.RunConfig` with its micro-batch resolved): from ``a0`` =
    ``--batch-start-tokens`` in whole micro-batches of ``B * T * world_size`` tokens (rounded down, at
    least 1, at most the full accumulation ``A``; default 1) rising linearly to ``A`` at step N, i.e.
    ``a0 + (A - a0) * step // N`` in integers; ``A`` = :meth:`~gptspeed.config.RunConfig.grad_accum_steps`
    without the switch and from step N on. The micro-batch's shape never changes (no recompile): the
    step takes more of them. GPT-3's batch-size warm-up (Brown et al. 2020, appendix B: 32k tokens
    rising to the full batch), the modded-nanogpt speedrun's batch-size schedule; a pure function of
    the step, as the learning rate is, so a resumed run continues with the same batches."""
    full = cfg.grad_accum_steps(world_size)
    n = cfg.train.batch_warmup_steps
    if not n or step >= n:
        return full
    micro = cfg.tokens_per_micro_batch * world_size
    start = min(full, max(1, (cfg.train.batch_start_tokens or micro) // micro))
    return start + (full - start) * step // n


def tokens_between(first: int, last: int, cfg, world_size: int = 1) -> int:
    """Tokens the whole job trains on in optimizer steps ``first`` to ``last - 1`` (0-based), by
    :func:`grad_accum_at` (``--batch-warmup-steps``'s smaller steps counted as they are): for the ETA
    and the tokens a run will have seen. 0 when ``last <= first``."""
    micro = cfg.tokens_per_micro_batch * world_size
    ramp_end = min(last, cfg.train.batch_warmup_steps)
    ramp = sum(grad_accum_at(s, cfg, world_size) for s in range(first, ramp_end))
    return micro * (ramp + max(0, last - max(first, ramp_end)) * cfg.grad_accum_steps(world_size))


def seq_lens(cfg) -> list[int]:
    """The distinct sequence lengths a run trains at, shortest first (:func:`seq_len_at` over the
    ``--seq-len-warmup-steps``, then ``--seq-len``): one compiled graph each."""
    return sorted({seq_len_at(s, cfg) for s in range(cfg.train.seq_len_warmup_steps)} | {cfg.model.block_size})


def seq_len_at(step: int, cfg) -> int:
    """The sequence length ``t`` of optimizer step ``step`` (0-based) under ``--seq-len-warmup-steps N``:
    each micro-batch's ``B x T`` tokens are trained as ``B * T / t`` sequences of ``t`` tokens (the same
    tokens, positions counted from each sequence's start, attention within it). ``t`` follows the line
    from ``t0 = --seq-len-start`` to ``T = --seq-len`` over the first N steps, rounded down to a length
    ``T / 2**k`` (one static compiled graph per length, :func:`seq_lens`; the shortest such length at or
    above ``min(t0, T)`` where the line is below it); ``T`` without the switch and from step N on. Li,
    Zhang & He 2022, "The
    Stability-Efficiency Dilemma: Investigating Sequence Length Warmup for Training GPT Models" (a
    linear warm-up of the length, the batch's tokens kept); a pure function of the step."""
    full, n = cfg.model.block_size, cfg.train.seq_len_warmup_steps
    if not n or step >= n:
        return full
    start = min(cfg.train.seq_len_start, full)
    lengths = [full >> k for k in range(full.bit_length()) if (full >> k) << k == full and full >> k >= start]
    line = start * n + (full - start) * step  # the length times n, exact in integers
    below = [t for t in lengths if t * n <= line]
    return max(below) if below else min(lengths)
