"""Issue 2's CPU benchmark: gptspeed's training step vs a straightforward nanoGPT-style step.

Same model shape, same data, same fp32, one process, measured interleaved (A, B, A, B, ...) so
drift and the other core's load hit both alike. The reference is the plain recipe: eager, the
full fp32 logits (B*T x 50304) then F.cross_entropy, and non-fused AdamW. gptspeed's step is
what `gptspeed train` runs on a CPU: the chunked fused linear + cross-entropy and fused AdamW.

    python benchmarks/cpu_step.py [--steps 10] [--rounds 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from gptspeed.config import GPTConfig, OptimConfig, RunConfig, TrainConfig
from gptspeed.metrics import environment
from gptspeed.runtime import resolve_runtime
from gptspeed.step import TrainStep

SHAPE = dict(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=50304)
B = 16


def make(loss: str, fused_adamw: bool, rt):
    cfg = RunConfig(model=GPTConfig(**SHAPE, loss=loss), optim=OptimConfig(fused_adamw=fused_adamw),
                    train=TrainConfig(batch_size=B))
    return TrainStep(cfg, rt)  # the training step of `gptspeed train`: step(next_batch) -> (loss, norm, bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    rt = resolve_runtime("cpu", "float32", compile=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50257, (64, B, SHAPE["block_size"] + 1), generator=g)
    cursor = {"i": 0}

    def next_batch():
        buf = data[cursor["i"] % len(data)]
        cursor["i"] += 1
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    variants = {"nanoGPT-style (plain CE, AdamW)": make("plain", False, rt),
                "gptspeed (fused CE, fused AdamW)": make("fused", True, rt)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step_fn in variants.values():
        for _ in range(a.warmup):
            step_fn(next_batch)
    for _ in range(a.rounds):
        for name, step_fn in variants.items():
            for _ in range(a.steps):
                t0 = time.perf_counter()
                loss, _, _ = step_fn(next_batch)
                loss.item()
                times[name].append(time.perf_counter() - t0)
    tokens = B * SHAPE["block_size"]
    rows = {k: {"median_ms": 1000 * statistics.median(v), "min_ms": 1000 * min(v), "max_ms": 1000 * max(v),
                "tokens_per_s": tokens / statistics.median(v)} for k, v in times.items()}
    base, ours = (rows[k]["tokens_per_s"] for k in variants)
    print(f"shape {SHAPE}, B={B}, fp32, {torch.get_num_threads()} threads, {environment(rt.device)['cpu']}")
    print("| step | median ms | min | max | tokens/s |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | {r['tokens_per_s']:,.0f} |")
    print(f"speed-up: {ours / base:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "speedup": ours / base, "environment": environment(rt.device)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
