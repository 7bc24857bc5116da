"""How much faster is gptspeed's CPU training step than a straightforward nanoGPT-style step? (issue 2)

Same model shape, same data, same fp32, one process, in the harness's interleaved rounds
(:func:`harness.time_rounds`: A B, B A, ...) so drift and the other core's load hit both alike. The
reference is the plain recipe: eager, the full fp32 logits (B*T x 50304) then F.cross_entropy, and
non-fused AdamW. gptspeed's step is what `gptspeed train` runs on a CPU: the chunked fused linear +
cross-entropy and fused AdamW. Reported: median ms per step with its IQR and min-max, tokens/s, and
the speed-up as the median (min-max) of the per-round ratios.

    python benchmarks/cpu_step_vs_plain.py [--steps 10] [--rounds 3] [--json OUT.json] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import sys

import harness
import torch

from gptspeed.config import GPTConfig, OptimConfig, RunConfig, TrainConfig
from gptspeed.runtime import resolve_runtime
from gptspeed.step import TrainStep

SHAPE = dict(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=50304)
B = 16


def make(loss: str, fused_adamw: bool, rt):
    cfg = RunConfig(
        model=GPTConfig(**SHAPE, loss=loss), optim=OptimConfig(fused_adamw=fused_adamw), train=TrainConfig(batch_size=B)
    )
    return TrainStep(cfg, rt)  # the training step of `gptspeed train`: step(next_batch) -> (loss, norm, bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--md", help="write the table here")
    a = ap.parse_args()
    rt = resolve_runtime("cpu", "float32", compile=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50257, (64, B, SHAPE["block_size"] + 1), generator=g)
    cursor = {"i": 0}

    def next_batch():
        buf = data[cursor["i"] % len(data)]
        cursor["i"] += 1
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    steps = {
        "nanoGPT-style (plain CE, AdamW)": make("plain", False, rt),
        "gptspeed (fused CE, fused AdamW)": make("fused", True, rt),
    }
    variants = {name: (lambda step=step: step(next_batch)[0].item()) for name, step in steps.items()}
    times = harness.time_rounds(
        variants, a.rounds, steps=a.steps, warmup=a.warmup, say=lambda line: print(line, file=sys.stderr, flush=True)
    )["wall"]
    tokens = B * SHAPE["block_size"]
    ref, ours = list(variants)
    rows = {}
    for name, per_round in times.items():
        ms = harness.spread(t for r in per_round for t in r)
        rows[name] = {
            "median_ms": ms["median"],
            "q25_ms": ms["q25"],
            "q75_ms": ms["q75"],
            "min_ms": ms["min"],
            "max_ms": ms["max"],
            "tokens_per_s": tokens / ms["median"] * 1000,
            "speed_vs_plain": harness.ratios(times[ref], per_round),
        }
    env = harness.environment("cpu")
    md = [
        harness.header(env),
        f"shape {SHAPE}, B={B}, fp32, {torch.get_num_threads()} threads, {a.rounds} interleaved "
        f"rounds of {a.steps} steps after {a.warmup} warm-up steps",
        "",
        "| step | median ms | IQR ms | min–max ms | tokens/s | speed vs plain (median of per-round ratios) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for k, r in rows.items():
        s = r["speed_vs_plain"]
        md.append(
            f"| {k} | {r['median_ms']:.1f} | {r['q25_ms']:.1f}–{r['q75_ms']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} "
            f"| {r['tokens_per_s']:,.0f} | {s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f}) |"
        )
    speedup = rows[ours]["speed_vs_plain"]["median"]
    harness.emit(
        "\n".join(md) + f"\n\nspeed-up: {speedup:.2f}x\n",
        {"rows": rows, "speedup": speedup, "seconds_per_round": times, "environment": env},
        a.md,
        a.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
