"""Does the training loader deliver tokens faster than a GPU consumes them? ``python benchmarks/loader_keeps_up.py``

Times :class:`gptspeed.data.loader.TokenLoader` delivering micro-batches of the ``gpt2`` preset's
shape (B=16, T=1024 by default) on the CPU, with ``--loader-workers`` 0 (in the loop) and N
(background threads), sequential and random sampling: each variant a loader of its own, read for
``--seconds`` in all, split over the harness's interleaved rounds (:func:`harness.interleave`).
Reports the median tokens/s over the rounds (and their range) next to the ~600k tokens/s the gpt2
preset is to consume on one H100 (a target, not a measurement; the loader's target: >= 10x).
Without ``--data`` it writes a synthetic 50M-token shard to a temporary folder.

    python benchmarks/loader_keeps_up.py [--data DIR] [--workers 2] [--seconds 3] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import harness
import numpy as np

from gptspeed.data import find_shards, write_shard
from gptspeed.data.loader import TokenLoader

H100_GPT2_TOKENS_PER_S = 600_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="reading time per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.data:
            shards = find_shards(a.data, "train")
        else:
            shards = [Path(tmp) / "train_000000.bin"]
            write_shard(shards[0], np.random.default_rng(0).integers(0, 50257, 50_000_000, dtype=np.uint16))
        loaders = {
            f"{sampling}, {w} workers": TokenLoader(shards, a.batch_size, a.seq_len, sampling=sampling, workers=w)
            for sampling in ("sequential", "random")
            for w in (0, a.workers)
        }
        for loader in loaders.values():
            loader.next_batch()

        def read(name: str, rnd: int) -> float:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < a.seconds / a.rounds:
                x, _ = loaders[name].next_batch()
                n += x.numel()
            return n / (time.perf_counter() - t0)

        rates = harness.interleave(loaders, a.rounds, read)
        for loader in loaders.values():
            loader.close()
    env = harness.environment("cpu")
    md = [
        harness.header(env),
        f"{len(shards)} shard(s), B={a.batch_size} T={a.seq_len}, {a.rounds} interleaved rounds",
        "",
        "| sampling, loader workers | tokens/s (median of rounds) | min–max | × 600k |",
        "|---|--:|--:|--:|",
    ]
    rows = {}
    for name, r in rates.items():
        s = rows[name] = harness.spread(r)
        md.append(
            f"| {name} | {s['median']:,.0f} | {s['min']:,.0f}–{s['max']:,.0f} | "
            f"{s['median'] / H100_GPT2_TOKENS_PER_S:.1f}x |"
        )
    harness.emit("\n".join(md) + "\n", {"tokens_per_s": rows, "per_round": rates, "environment": env}, None, a.json)


if __name__ == "__main__":
    main()
