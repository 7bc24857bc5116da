"""The training step, the optimizer groups, sampling and the val loss, each checked against an
independent reference -- not against another path of the same code (issue 33).

Each test names the bug it was written to catch; the mutation check (tools/mutation/README.md) keeps
the suite honest about the rest.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, make_step, one_step

from gptspeed.runtime import Runtime

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(TINY_MODEL, loss="plain")
T = TINY_MODEL["block_size"]


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50257, (rows, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def first_moments(step) -> list[torch.Tensor]:
    """AdamW's exp_avg after its first step, parameter by parameter: ``(1 - beta1) * grad`` exactly,
    so it shows the gradient the optimizer was handed (after clipping, unscaling, accumulation)."""
    return [step.optimizer.state[p]["exp_avg"].clone() for p in step.params]


def total_norm(tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


# ---------------------------------------------------------------------------------- clipping
def test_clipping_scales_the_gradient_by_clip_over_norm():
    """--grad-clip ignored, or applied to the wrong tensor, changes what AdamW is handed."""
    x, y = batch(4)
    free = make_step(SHAPE, dict(grad_clip=0.0))
    _, norm, _ = one_step(free, x, y)
    norm = float(norm)
    clip = norm / 4  # certainly clips
    clipped = make_step(SHAPE, dict(grad_clip=clip))
    _, norm_clipped, _ = one_step(clipped, x, y)
    assert float(norm_clipped) == pytest.approx(norm, rel=1e-6)  # the logged norm is the one before clipping
    beta1 = clipped.optimizer.param_groups[0]["betas"][0]
    for a, b in zip(first_moments(clipped), first_moments(free)):
        torch.testing.assert_close(a, b * (clip / norm), rtol=1e-5, atol=1e-9)
    assert total_norm(first_moments(clipped)) == pytest.approx((1 - beta1) * clip, rel=1e-5)
    # a clip above the norm changes nothing
    loose = make_step(SHAPE, dict(grad_clip=norm * 2))
    one_step(loose, x, y)
    for a, b in zip(first_moments(loose), first_moments(free)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_float16_clips_the_unscaled_gradient_like_float32():
    """Clipping before GradScaler.unscale_ sees the gradient times the loss scale: the logged norm
    read 144,565 instead of 2.21 and the threshold became grad_clip / scale."""
    x, y = batch(4)
    ref = make_step(SHAPE, dict(grad_clip=0.0))
    _, norm32, _ = one_step(ref, x, y)
    clip = float(norm32) / 3
    s32 = make_step(SHAPE, dict(grad_clip=clip))
    loss32, n32, _ = one_step(s32, x, y)
    rt16 = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    s16 = make_step(SHAPE, dict(grad_clip=clip), rt=rt16)
    s16.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # no overflow at this scale; unscale_ must divide it
    assert s16.scaler.is_enabled()
    loss16, n16, bad16 = one_step(s16, x, y)
    assert not bool(bad16)
    assert float(loss16) == pytest.approx(float(loss32), rel=1e-2)
    assert float(n16) == pytest.approx(float(n32), rel=2e-2), "float16's logged gradient norm is not the unscaled one"
    beta1 = s16.optimizer.param_groups[0]["betas"][0]
    assert total_norm(first_moments(s16)) == pytest.approx((1 - beta1) * clip, rel=2e-2)
    for a, b in zip(first_moments(s16), first_moments(s32)):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3 * (1 - beta1) * clip)
    # AdamW's first update is about lr * sign(grad): float16's noise may flip the sign of a gradient
    # near 0, so the weights agree to 2 lr (the moments above are the sharp check)
    lr = s16.optimizer.param_groups[0]["lr"]
    for p16, p32 in zip(s16.params, s32.params):
        torch.testing.assert_close(p16, p32, rtol=0, atol=2.5 * lr)


# ---------------------------------------------------------------------------------- accumulation
def test_accumulated_gradient_equals_the_one_batch_gradient():
    """Backward before dividing by the micro-steps doubled the gradient; only a DDP test caught it,
    by 3.5e-4 against a 1e-5 tolerance."""
    x, y = batch(4, seed=1)
    whole = make_step(SHAPE, dict(grad_clip=0.0), train_kw=dict(batch_size=4, total_batch_tokens=4 * T))
    split = make_step(SHAPE, dict(grad_clip=0.0), train_kw=dict(batch_size=2, total_batch_tokens=4 * T))
    assert (whole.accum, split.accum) == (1, 2)
    loss_whole, norm_whole, _ = one_step(whole, x, y)
    halves = iter([(x[:2], y[:2]), (x[2:], y[2:])])
    loss_split, norm_split, _ = split(lambda: next(halves))
    assert float(loss_split) == pytest.approx(float(loss_whole), rel=1e-6)
    assert float(norm_split) == pytest.approx(float(norm_whole), rel=1e-5)
    for a, b in zip(first_moments(split), first_moments(whole)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    for a, b in zip(split.params, whole.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------- weight decay
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weight_decay_goes_to_matrices_only(optimizer):
    """Muon's AdamW group decayed biases and LayerNorm gains; only the Muon / AdamW split was checked."""
    wd = 0.123
    step = make_step(SHAPE, dict(optimizer=optimizer, weight_decay=wd))
    seen = []
    for group in step.optimizer.param_groups:
        for p in group["params"]:
            seen.append(p)
            expected = wd if p.dim() >= 2 else 0.0
            assert group["weight_decay"] == expected, (optimizer, tuple(p.shape), group["weight_decay"])
    assert sorted(map(id, seen)) == sorted(map(id, step.params))  # every parameter once
    assert any(p.dim() < 2 for p in seen) and any(p.dim() >= 2 for p in seen)


# ---------------------------------------------------------------------------------- sampling
def draws(logits: torch.Tensor, n: int, temperature: float, top_k):
    from gptspeed.sample import sample_next

    g = torch.Generator().manual_seed(0)
    return sample_next(logits.expand(n, -1).clone(), temperature, top_k, g)


@pytest.mark.parametrize("temperature, top_k", [(0.8, 2), (0.8, None), (1.3, 3), (1.0, 5)])
def test_sampling_draws_from_softmax_over_temperature_restricted_to_top_k(temperature, top_k):
    """Top-k ignored put 32% of draws outside the top 2; temperature applied twice moved p(top)
    from 0.777 to 0.829. 20,000 draws: each frequency within 5 standard errors of the reference."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    ref = F.softmax(logits[0].double() / temperature, dim=-1)
    if top_k is not None:
        keep = torch.topk(ref, top_k).indices
        mask = torch.zeros_like(ref, dtype=torch.bool)
        mask[keep] = True
        ref = torch.where(mask, ref, torch.zeros_like(ref))
        ref = ref / ref.sum()
    n = 20_000
    counts = np.bincount(draws(logits, n, temperature, top_k).numpy(), minlength=logits.size(1))
    freq = counts / n
    se = np.sqrt(np.maximum(ref.numpy() * (1 - ref.numpy()), 1e-12) / n)
    for i, (f, p, s) in enumerate(zip(freq, ref.numpy(), se)):
        if p == 0:
            assert counts[i] == 0, f"token {i} is outside the top {top_k} but was drawn {counts[i]} times"
        else:
            assert abs(f - p) < 5 * s, (
                f"token {i}: frequency {f:.4f}, softmax(logits / {temperature}) top-{top_k} gives {p:.4f}"
            )


def test_top_1_and_temperature_0_are_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g)
    from gptspeed.sample import sample_next

    assert torch.equal(sample_next(logits, 1.0, 1, g), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 0.0, None, g), logits.argmax(-1))


# ---------------------------------------------------------------------------------- val loss
def test_val_loss_weighs_a_partial_last_batch_by_its_tokens(tmp_path):
    """A partial last batch weighted as a full one read 14.42 instead of 10.82."""
    from gptspeed.data.shards import write_shard
    from gptspeed.eval.val_loss import evaluate
    from gptspeed.runtime import resolve_runtime

    windows, B = 6, 4  # batches of 4 windows and 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, windows * T + 1 + 7, dtype=np.uint16)  # 7 tokens too few for a 7th window
    shard = tmp_path / "val_000000.bin"
    write_shard(shard, tokens)
    step = make_step(SHAPE, {})
    model = step.model.eval()
    # make the two batches' losses differ a lot, so the weighting shows
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
    t = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        per_window = [
            F.cross_entropy(
                model(t[i * T : (i + 1) * T][None])[0][0, :, :50257].float(),
                t[i * T + 1 : (i + 1) * T + 1],
                reduction="sum",
            )
            for i in range(windows)
        ]
    reference = float(sum(per_window)) / (windows * T)
    loss, n = evaluate(model, resolve_runtime("cpu", "float32", False), [shard], B, T)
    assert n == windows * T
    assert loss == pytest.approx(reference, rel=1e-5)
    first, last = float(sum(per_window[:4])) / (4 * T), float(sum(per_window[4:])) / (2 * T)
    assert abs(first - last) > 0.5  # equal weighting of the two batches would be far off
    assert abs(loss - (first + last) / 2) > 0.1
