"""Loader throughput: ``python benchmarks/bench_loader.py --data DIR``.

Times :class:`gptspeed.data.loader.TokenLoader` delivering micro-batches of the ``gpt2`` preset's
shape (B=16, T=1024 by default) on the CPU, with ``--loader-workers`` 0 (in the loop) and N
(background threads), sequential and random sampling, for ``--seconds`` each. Reports tokens/s
delivered next to the ~600k tokens/s the gpt2 preset consumes on one H100 (target: >= 10x).
Without ``--data`` it writes a synthetic 50M-token shard to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gptspeed.data import find_shards, write_shard  # noqa: E402
from gptspeed.data.loader import TokenLoader  # noqa: E402

H100_GPT2_TOKENS_PER_S = 600_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.data:
            shards = find_shards(a.data, "train")
        else:
            shards = [Path(tmp) / "train_000000.bin"]
            write_shard(shards[0], np.random.default_rng(0).integers(0, 50257, 50_000_000, dtype=np.uint16))
        print(f"{len(shards)} shard(s), B={a.batch_size} T={a.seq_len}, {os.cpu_count()} CPUs")
        print("| sampling | loader workers | tokens/s | x 600k |\n|---|---|---|---|")
        for sampling in ("sequential", "random"):
            for w in (0, a.workers):
                loader = TokenLoader(shards, a.batch_size, a.seq_len, sampling=sampling, workers=w)
                loader.next_batch()
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < a.seconds:
                    x, _ = loader.next_batch()
                    n += x.numel()
                tps = n / (time.perf_counter() - t0)
                loader.close()
                print(f"| {sampling} | {w} | {tps:,.0f} | {tps / H100_GPT2_TOKENS_PER_S:.1f}x |")


if __name__ == "__main__":
    main()
