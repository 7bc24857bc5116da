"""Does FP8 train to bf16's loss over a short run? (issue 7; needs an Ada / Hopper GPU)

Two `gptspeed train` runs on the same data, shape, seed, batches and schedule: bf16 autocast, and
bf16 autocast with ``--fp8`` (torchao's float8 training for the blocks' Linear layers large
enough to gain: e4m3 forward, e5m2 gradients, tensorwise dynamic scaling; see gptspeed/fp8.py;
needs ``pip install -e '.[fp8]'``). Prints the train and
validation losses side by side at every evaluation and the largest gap; FP8 is at parity when the
final validation losses differ by well under the run-to-run noise (a few 0.01 nats).

The two runs are minutes each, so they run one after the other, not in interleaved rounds; the
table is printed under the harness's environment line (GPU, versions, commit, date, command): paste
it into benchmarks/LOG.md. On a machine without FP8 tensor cores it stops with one line.

    python benchmarks/fp8_vs_bf16_loss.py --data data/fineweb-edu-10B [--preset gpt2] [--steps 500]
        [--eval-every 50] [--batch-size 16] [--total-batch-tokens 524288] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import harness

from gptspeed.errors import GptspeedError
from gptspeed.fp8 import check_fp8_device
from gptspeed.runtime import resolve_device
from gptspeed.trainer import build_train_config, fit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="prepared data folder")
    p.add_argument("--out", help="folder for both runs (default: a temporary folder)")
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--total-batch-tokens", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=100)
    a = p.parse_args(argv)
    try:
        check_fp8_device(resolve_device("cuda"))
    except GptspeedError as e:
        print(f"fp8_vs_bf16_loss: {e}", file=sys.stderr)
        return 2
    out = Path(a.out or tempfile.mkdtemp(prefix="fp8-parity-"))
    recs = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        cfg = build_train_config(
            a.preset,
            dict(
                data=a.data,
                out=str(out / name),
                fp8=fp8,
                dtype="bfloat16",
                device="cuda",
                max_steps=a.steps,
                batch_size=a.batch_size,
                total_batch_tokens=a.total_batch_tokens,
                warmup_steps=a.warmup_steps,
                eval_every=a.eval_every,
                log_every=a.eval_every,
                save_every=0,
            ),
        )
        fit(cfg, echo=False)
        recs[name] = {r["step"]: r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())}
    print(harness.header(harness.environment("cuda")))
    print("| step | bf16 train | fp8 train | bf16 val | fp8 val | fp8 tokens/s | bf16 tokens/s |")
    print("|---|---|---|---|---|---|---|")
    gap = 0.0
    for step in sorted(set(recs["bf16"]) & set(recs["fp8"])):
        b, f = recs["bf16"][step], recs["fp8"][step]
        if b.get("val_loss") is not None and f.get("val_loss") is not None:
            gap = max(gap, abs(b["val_loss"] - f["val_loss"]))
        fmt = lambda r, k: f"{r[k]:.4f}" if r.get(k) is not None else "-"  # noqa: E731
        tps = lambda r: f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"  # noqa: E731
        print(
            f"| {step} | {fmt(b, 'train_loss')} | {fmt(f, 'train_loss')} | {fmt(b, 'val_loss')} | "
            f"{fmt(f, 'val_loss')} | {tps(f)} | {tps(b)} |"
        )
    print(f"largest validation-loss gap: {gap:.4f} nats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
