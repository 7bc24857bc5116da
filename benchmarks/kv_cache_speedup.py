"""How much faster does the KV cache make sampling? ``python benchmarks/kv_cache_speedup.py``

Builds a randomly initialised GPT of a preset's shape (default ``gpt2``, 124M; the weights do not
change the speed), then times :func:`gptspeed.sample.generate` (cache-free: every step re-reads
the whole sequence) and :func:`gptspeed.sample.generate_cached` on the same prompt with the same
seed, and checks they drew the same tokens (in fp32). tokens/s = new tokens x batch / wall
seconds, prefill included; the median of ``--repeats`` of the harness's interleaved rounds (each
variant once a round, the order rotated) after ``--warmup`` untimed runs of each. Prints a markdown
table (header and one row) with the environment, to paste into benchmarks/LOG.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness
import torch

from gptspeed.config import PRESETS, preset
from gptspeed.model import GPT
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import generate, generate_cached


def timed(fn, model, idx, args, rt) -> tuple[float, torch.Tensor]:
    """Seconds for one generation of ``args.new_tokens`` tokens, and the tokens ``(B, N)``."""
    gen = torch.Generator(device=rt.device).manual_seed(args.seed)
    kw = dict(temperature=1.0, top_k=args.top_k, generator=gen, autocast=rt.autocast())
    if fn is generate_cached:
        kw["compile"] = args.compile
    rt.synchronize()
    t0 = time.perf_counter()
    toks = torch.stack(list(fn(model, idx, args.new_tokens, **kw)), dim=1)
    rt.synchronize()
    return time.perf_counter() - t0, toks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2", choices=list(PRESETS), help="model shape")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", choices=("auto", "cuda", "mps", "cpu"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the cached decode step")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = resolve_runtime(args.device, args.dtype, compile=args.compile)
    cfg = preset(args.preset).model
    torch.manual_seed(0)
    model = GPT(cfg).to(rt.device).eval()
    if args.prompt_tokens + args.new_tokens > cfg.block_size:
        print(
            f"note: {args.prompt_tokens} + {args.new_tokens} tokens exceed block_size {cfg.block_size}: "
            "the cached path recomputes the window past it",
            file=sys.stderr,
        )
    idx = torch.randint(
        0, cfg.valid_vocab_size, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(args.seed)
    ).to(rt.device)
    fns = {"no cache": generate, "KV cache": generate_cached}
    for fn in fns.values():
        for _ in range(args.warmup):
            timed(fn, model, idx, args, rt)
    runs = harness.interleave(fns, args.repeats, lambda name, _: timed(fns[name], model, idx, args, rt))
    results = {name: (statistics.median(t for t, _ in r), r[0][1]) for name, r in runs.items()}
    n = args.new_tokens * args.batch
    slow, fast = (n / results[k][0] for k in ("no cache", "KV cache"))
    same = torch.equal(results["no cache"][1], results["KV cache"][1])
    env = harness.environment(rt.device.type)
    print(
        "| model | device | threads | dtype | batch x (prompt + new) | no cache tok/s | KV cache tok/s | speed-up "
        "| same tokens | torch | commit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.preset} ({model.num_params(False) / 1e6:.0f}M) | {env['device']} | {torch.get_num_threads()} "
        f"| {rt.dtype}{' +compile' if args.compile else ''} | {args.batch} x ({args.prompt_tokens} + {args.new_tokens}) "
        f"| {slow:,.1f} | {fast:,.1f} | {fast / slow:.2f}x | {'yes' if same else 'no'} | {env['torch']} "
        f"| {(env['git_commit'] or '?')[:8]} |"
    )


if __name__ == "__main__":
    main()
