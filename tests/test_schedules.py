"""``gptspeed.schedules``: the per-step schedules -- the learning rate (warm-up, cosine, WSD), Muon's momentum
warm-up, the attention window's, the batch's and the sequence length's -- each against its closed form."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from gptspeed.config import OptimConfig
from gptspeed.model import GPT, GPTConfig
from gptspeed.optim import build_optimizer
from gptspeed.schedules import lr_at

from support.references import toy_sgd
from support.training import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))


# ------------------------------------------------------------------ the learning-rate schedule, set into the groups
def test_set_lr_writes_the_schedules_rate_times_each_groups_lr_mult():
    """set_lr follows the run's settings (wsd, its decay share, --min-lr-ratio, warm-up, max steps)
    and writes lr * lr_mult into every group (a group without lr_mult gets lr). Worked out by hand:
    lr 1e-2, min ratio 0.25 (min 2.5e-3), warm-up 2, 10 steps, wsd with decay share 0.5 (decay from
    step 5): step 7: lr = 2.5e-3 + 7.5e-3 * (10 - 7) / 5 = 7e-3."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import set_lr

    cfg = RunConfig(
        optim=OptimConfig(lr=1e-2, min_lr_ratio=0.25, warmup_steps=2, lr_schedule="wsd", decay_ratio=0.5),
        train=TrainConfig(max_steps=10),
    )
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 4.0}], lr=1.0)
    assert set_lr(opt, cfg, 7) == pytest.approx(7e-3, rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([7e-3, 2.8e-2], rel=1e-12), (
        "each group's lr must be the schedule's rate times its lr_mult (1 without one)"
    )
    assert set_lr(opt, cfg, 4) == pytest.approx(1e-2, rel=1e-12), "before the decay share wsd holds the peak"
    assert set_lr(opt, cfg, 10) == pytest.approx(2.5e-3, rel=1e-12), "at max_steps: lr * min_lr_ratio"


def test_lr_at_defaults_to_a_decay_share_of_one_fifth_for_wsd():
    """wsd without decay_ratio decays over the last 20% of the steps: at step 50 of 100 (no
    warm-up) it still holds the peak, at step 90 it is half way down."""
    from gptspeed.schedules import lr_at

    kw = dict(max_lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=100, schedule="wsd")
    assert lr_at(50, **kw) == 1.0, "wsd's default decay share is 0.2: step 50 of 100 is before it"
    assert lr_at(90, **kw) == pytest.approx(0.5, rel=1e-12)


def test_lr_at_is_the_final_rate_from_max_steps_on_even_when_warm_up_lasts_the_whole_run():
    """A step at or past max_steps gets min_lr, also when the warm-up is as long as the run (the
    cosine's progress would read 0 there and give the peak)."""
    from gptspeed.schedules import lr_at

    for schedule in ("cosine", "wsd"):
        assert lr_at(10, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=10, schedule=schedule) == 0.1, schedule


def test_lr_schedule_warmup_then_cosine():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lrs = [lr_at(s, **kw) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # rising warm-up
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:110]))  # decaying
    assert lrs[60] == pytest.approx(0.55)  # half-way through the cosine
    assert lrs[110] == lrs[119] == pytest.approx(0.1)


def test_the_wsd_schedule_warms_up_holds_then_decays_linearly():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, schedule="wsd", decay_ratio=0.2)
    lrs = [lr_at(s, **kw) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(lr == 1.0 for lr in lrs[10:80])
    assert lrs[90] == pytest.approx(0.55) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:]))
    cosine = lr_at(55, **{**kw, "schedule": "cosine"})
    assert cosine == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def schedule_by_hand(step: int, schedule: str, peak: float, floor: float, warmup: int, steps: int, share: float):
    """The learning rate of 0-based step ``step``, from the papers' shapes: a linear warm-up in which
    step ``s`` of ``warmup`` runs at ``(s + 1) / warmup`` of the peak; then ``cosine`` (GPT-3, Brown
    et al. 2020, appendix B): ``floor + (peak - floor) * (1 + cos(pi * t)) / 2``, ``t`` the share of
    the steps after the warm-up done; or ``wsd`` (Hägele et al. 2024): the peak until the last
    ``share`` of the run (never inside the warm-up), then a straight line from the peak there to
    ``floor`` at ``steps``; ``floor`` from ``steps`` on."""
    if step >= steps:
        return floor
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "cosine":
        return floor + (peak - floor) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2
    start = max(warmup, steps * (1 - share))
    return peak if step < start else peak - (peak - floor) * (step - start) / (steps - start)


@pytest.mark.parametrize(
    "schedule, warmup", [("cosine", dict(warmup_steps=4)), ("wsd", dict(warmup_ratio=0.2))], ids=["cosine", "wsd"]
)
def test_the_lr_of_every_step_of_a_run_is_the_schedules_closed_form_in_every_group(schedule, warmup):
    """What the trainer's loop sets before each step (``set_lr``), for a 20-step run with a 4-step
    warm-up (given as steps, or as a ratio of the run), a floor of 0.25 of the peak and, for wsd, a
    decay share of 0.33 (the decay starts between two steps, at 13.4): the base rate is the closed
    form at every step, AdamW's groups run at it and Muon's at it times ``muon_lr / lr``."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import set_lr

    o = OptimConfig(
        optimizer="muon", lr=1e-2, muon_lr=0.05, min_lr_ratio=0.25, lr_schedule=schedule, decay_ratio=0.33, **warmup
    )
    cfg = RunConfig(optim=o, train=TrainConfig(max_steps=20))
    opt, _ = build_optimizer(tiny(), o, "cpu")
    for step in range(23):
        want = schedule_by_hand(step, schedule, 1e-2, 2.5e-3, 4, 20, 0.33)
        assert set_lr(opt, cfg, step) == pytest.approx(want, rel=1e-12, abs=0), f"step {step}"
        assert [g["lr"] for g in opt.adamw.param_groups] == pytest.approx([want, want], rel=1e-12, abs=0)
        assert [g["lr"] for g in opt.muon.param_groups] == pytest.approx([want * 5], rel=1e-12, abs=0)


@pytest.mark.parametrize("warmup", [300, 1, 0])
def test_muons_momentum_warms_up_linearly_then_holds_and_adamw_is_untouched(warmup):
    """--muon-momentum-warmup N with start 0.85 and --muon-momentum 0.95 (the speedrun's: N = 300): the
    momentum of step s is 0.85 + min(s / N, 1) * 0.10 (N = 1: 0.85 at step 0 only), what
    ``muon_momentum_at`` gives and ``set_lr`` sets into Muon's groups with the learning rate; AdamW's betas
    do not move; N = 0 (the default, off) is 0.95 at every step, Muon's momentum left as built."""
    from gptspeed.config import preset
    from gptspeed.schedules import muon_momentum_at, set_lr

    cfg = preset("pico").override(
        dict(TINY_MODEL, optimizer="muon", muon_momentum_warmup=warmup, muon_momentum_start=0.85, muon_momentum=0.95)
    )
    opt, _ = build_optimizer(GPT(cfg.model), cfg.optim, "cpu")
    for step in (0, 1, 150, 299, 300, 1000):
        frac = min(Fraction(step, warmup), 1) if warmup else 1
        want = float(Fraction("0.85") + frac * Fraction("0.10"))
        assert muon_momentum_at(step, cfg.optim) == pytest.approx(want, rel=1e-12), f"step {step}"
        set_lr(opt, cfg, step)
        assert [g["momentum"] for g in opt.muon.param_groups] == [pytest.approx(want, rel=1e-12)], f"step {step}"
        assert all(g["betas"] == (cfg.optim.beta1, cfg.optim.beta2) for g in opt.adamw.param_groups)


def test_the_muon_momentum_warm_up_leaves_another_optimizers_momentum_alone():
    """--muon-momentum-warmup moves Muon's momentum only: a registered optimizer with a ``momentum`` of its
    own (the toy SGD's 0.9) keeps it at every step."""
    from gptspeed.config import preset
    from gptspeed.schedules import set_lr

    with toy_sgd():
        cfg = preset("pico").override(
            dict(
                TINY_MODEL, optimizer="toy-sgd", muon_momentum_warmup=300, muon_momentum_start=0.85, muon_momentum=0.95
            )
        )
        opt, _ = build_optimizer(GPT(cfg.model), cfg.optim, "cpu")
    for step in (0, 150, 300):
        set_lr(opt, cfg, step)
        assert [g["momentum"] for g in opt.param_groups] == [0.9], f"step {step}"


# ------------------------------------------------------------------ --attn-window: the window's warm-up
def window_by_hand(step: int, start: int, final: int, max_steps: int) -> int:
    """The speedrun's window warm-up written out: linear in ``step / max_steps`` from ``start`` (at most
    ``final``) to ``final``, rounded up to a multiple of 128 tokens, never past ``final`` (``final`` from
    ``max_steps`` on); exact rationals, so no float rounding can move a step across a multiple of 128."""

    start = min(start, final)
    if step >= max_steps:
        return final
    linear = start + Fraction(final - start) * step / max_steps
    return min(final, 128 * math.ceil(linear / 128))


@pytest.mark.parametrize(
    "start, final, max_steps",
    [(128, 1792, 37), (128, 1792, 1750), (1, 1000, 20), (300, 200, 9), (64, 100, 5), (128, 1024, 896)],
)
def test_the_attention_window_of_every_step_is_the_linear_warm_up_rounded_up_to_128(start, final, max_steps):
    """``attn_window_at``, what the trainer's loop sets into the model before each step, equals the
    closed form at every step of a run and past it; the windows never shrink, are multiples of 128 or
    the final window, start at the start rounded up, and reach the final window. A start above the
    final window is taken as the final window (constant); a final window of 128 or less is constant."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import attn_window_at

    cfg = RunConfig(
        model=GPTConfig(block_size=2048, attn_window=final, attn_window_start=start),
        train=TrainConfig(max_steps=max_steps),
    )
    got = [attn_window_at(s, cfg) for s in range(max_steps + 3)]
    assert got == [window_by_hand(s, start, final, max_steps) for s in range(max_steps + 3)]
    assert all(a <= b for a, b in zip(got, got[1:]))
    assert all(w % 128 == 0 or w == final for w in got)
    assert got[0] == min(final, 128 * math.ceil(min(start, final) / 128)) and got[-1] == final
    if final <= 128 or start >= final:
        assert set(got) == {final}
    off = RunConfig(model=GPTConfig(block_size=2048), train=TrainConfig(max_steps=max_steps))
    assert {attn_window_at(s, off) for s in range(max_steps + 1)} == {0}


def test_the_speedruns_windows_are_128_to_1792_growing_one_block_at_a_time():
    """The modded-nanogpt speedrun's warm-up (``next_multiple_of_n(1728 * step / num_iterations, n=128)``,
    from 128 to 1792 tokens) as ``--attn-window 1792 --attn-window-start 128``: the same range, one
    128-token block at a time, each of the 14 windows in use for a run of consecutive steps."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import attn_window_at

    cfg = RunConfig(
        model=GPTConfig(block_size=2048, attn_window=1792, attn_window_start=128), train=TrainConfig(max_steps=1750)
    )
    got = [attn_window_at(s, cfg) for s in range(1750)]
    assert sorted(set(got)) == list(range(128, 1793, 128))
    assert all(b - a in (0, 128) for a, b in zip(got, got[1:]))


def accum_by_hand(step: int, start_tokens: int | None, micro: int, full: int, n: int) -> int:
    """The batch-size warm-up's micro-batches, written from its definition (GPT-3's linear ramp in whole
    micro-batches): exact fractions, floored."""
    if n == 0 or step >= n:
        return full
    a0 = min(full, max(1, (start_tokens or micro) // micro))
    return a0 + math.floor(Fraction(full - a0) * step / n)


@pytest.mark.parametrize(
    "start_tokens, full, n, world",
    [
        (None, 8, 5, 1),
        (3 * 256, 8, 7, 1),
        (1, 4, 3, 2),
        (10**9, 6, 4, 1),
        (512, 1, 4, 2),
        (2 * 256, 16, 100, 1),
        (3 * 256 + 100, 8, 5, 2),
    ],
)
def test_the_batch_of_every_step_is_the_linear_warm_up_in_whole_micro_batches(start_tokens, full, n, world):
    """``grad_accum_at``, the micro-batches the trainer's loop gives each step, equals the ramp written from its
    definition at every step of the warm-up and past it; it never shrinks, starts at ``--batch-start-tokens`` in
    whole micro-batches of all the processes' tokens (rounded down, at least one, at most the full batch) and
    ends at the full accumulation; ``tokens_between`` is the sum of the steps' tokens over any span. Both count
    one process unless told the world size."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import grad_accum_at, tokens_between

    B, T = 4, 32
    micro = B * T * world
    cfg = RunConfig(
        model=GPTConfig(block_size=T),
        train=TrainConfig(
            batch_size=B, total_batch_tokens=full * micro, batch_warmup_steps=n, batch_start_tokens=start_tokens
        ),
    )
    got = [grad_accum_at(s, cfg, world) for s in range(n + 3)]
    assert got == [accum_by_hand(s, start_tokens, micro, full, n) for s in range(n + 3)]
    assert all(a <= b for a, b in zip(got, got[1:])) and got[-1] == full
    assert got[0] == min(full, max(1, (start_tokens or micro) // micro))
    for first, last in [(0, n + 3), (1, n), (n - 1, n + 2), (n + 1, n + 3), (2, 2), (5, 1)]:
        want = micro * sum(got[s] for s in range(first, last)) if last <= n + 3 else None
        assert tokens_between(first, last, cfg, world) == want
    assert tokens_between(0, 1000, cfg, world) == micro * (sum(got[:n]) + (1000 - n) * full)
    if world == 1:
        assert [grad_accum_at(s, cfg) for s in range(n + 3)] == got
        assert tokens_between(0, 1000, cfg) == micro * (sum(got[:n]) + (1000 - n) * full)
    off = RunConfig(model=GPTConfig(block_size=T), train=TrainConfig(batch_size=B, total_batch_tokens=full * micro))
    assert {grad_accum_at(s, off, world) for s in range(n + 1)} == {full}
    assert tokens_between(3, 10, off, world) == 7 * full * micro


def seq_len_by_hand(step: int, start: int, full: int, n: int) -> int:
    """The sequence-length warm-up's length, from its definition: the line from ``start`` to ``full`` over ``n``
    steps, rounded down to a halving of ``full`` (never below the shortest halving at or above ``start``)."""
    if n == 0 or step >= n:
        return full
    start = min(start, full)
    halvings = {full // 2**k for k in range(12) if full % 2**k == 0 and full // 2**k >= start}
    line = start + Fraction(full - start) * step / n
    return max([t for t in halvings if t <= line], default=min(halvings))


@pytest.mark.parametrize(
    "start, full, n", [(64, 1024, 100), (16, 64, 3), (100, 1024, 50), (8, 96, 20), (5000, 1024, 9), (1, 7, 4)]
)
def test_the_sequence_length_of_every_step_is_the_linear_warm_up_rounded_down_to_a_halving(start, full, n):
    """``seq_len_at``, the length the trainer's loop trains each step's sequences at, equals the warm-up written from
    its definition at every step and past it; every length divides ``--seq-len`` (the micro-batch's tokens cut
    whole), the lengths never shrink and end at ``--seq-len``."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.schedules import seq_len_at

    cfg = RunConfig(model=GPTConfig(block_size=full), train=TrainConfig(seq_len_warmup_steps=n, seq_len_start=start))
    got = [seq_len_at(s, cfg) for s in range(n + 3)]
    assert got == [seq_len_by_hand(s, start, full, n) for s in range(n + 3)]
    assert all(full % t == 0 for t in got) and all(a <= b for a, b in zip(got, got[1:])) and got[-1] == full
    off = RunConfig(model=GPTConfig(block_size=full))
    assert {seq_len_at(s, off) for s in range(n + 1)} == {full}
