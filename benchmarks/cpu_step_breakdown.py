"""Where does the eager fp32 CPU step spend its time, and which of its parts pay? (issue 14 (c))

In one process, at one shape, from the same initial weights and the same batches (tinyshakespeare
tokens from a prepared folder; random ids with ``--random-tokens``), in the harness's interleaved
rounds (:func:`harness.time_rounds`): every variant is built first and takes ``--warmup`` untimed
steps, then each round runs ``--steps`` timed steps (default 1) of every variant in turn, the order
rotated by one variant a round, so a load change on a shared machine hits all variants within a
round alike; ratios are taken per round (then their median):

- ``gptspeed``: gptspeed's own training step (:func:`gptspeed_step`, the one adapter to its
  trainer): chunked fused linear + cross-entropy, vocab 50304 with the padded columns at -inf,
  fused AdamW, non-finite checks, ``zero_grad(set_to_none=True)``.
- ``step``: the same model and optimizer driven by the straightforward loop below (forward,
  backward, clip 1.0, ``opt.step()``, ``zero_grad(set_to_none=True)``): gptspeed's step overhead
  is the difference.
- one switch changed from ``step`` at a time: ``plain-loss`` (full fp32 logits +
  ``F.cross_entropy``), ``vocab-50257`` (no padding, so no -inf mask; the LM-head matmul is
  50257 wide), ``adamw-foreach`` / ``adamw-forloop`` (torch's other AdamW implementations; the
  for-loop one is torch's CPU default), ``zero-grad-keep`` (``set_to_none=False``), ``threads-N``
  (``torch.set_num_threads(N)``; the others run ``--threads``);
- ``nanogpt-like``: plain loss + for-loop AdamW (torch's CPU default), the straightforward recipe;
- ``bf16``: gptspeed's step under ``torch.autocast("cpu", bfloat16)`` (``--dtype bfloat16``: loss
  softmax and optimizer stay fp32); ``compile`` / ``bf16-compile``: gptspeed's step on the
  ``torch.compile``-d model (``--compile``); the first call's seconds (the compile) are reported.

Then a ``torch.profiler`` trace of ``--profile-steps`` steps of ``gptspeed`` and of
``nanogpt-like``: the top ops by self CPU time. And the cost of the -inf padding mask alone
(``logits[:, 50257:] = -inf`` on one chunk of the fused loss, times the chunks per step).

    python benchmarks/cpu_step_breakdown.py --shape small|124m [--rounds 10] [--steps 1] [--warmup 2]
        [--variants gptspeed,step,plain-loss,...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import harness
import numpy as np
import torch
from vs_peers_cpu import SEED, SHAPES, prepare_data, train_tokens

from gptspeed.config import GPTConfig, OptimConfig
from gptspeed.model import GPT
from gptspeed.optim import build_optimizer

ALL = (
    "gptspeed",
    "step",
    "plain-loss",
    "vocab-50257",
    "adamw-foreach",
    "adamw-forloop",
    "zero-grad-keep",
    "threads-1",
    "nanogpt-like",
    "bf16",
)
GPTSPEED_VARIANTS = {
    "gptspeed": ("float32", False),
    "bf16": ("bfloat16", False),
    "compile": ("float32", True),
    "bf16-compile": ("bfloat16", True),
}


def gptspeed_step(model, ocfg, batch_size: int, dtype: str = "float32", compile: bool = False):
    """THE adapter to gptspeed's training step (:class:`gptspeed.step.TrainStep`: ``resolve_runtime`` +
    ``parallelize``, dtype and compile applied from outside the model; its optimizer ``ocfg``; no
    accumulation; clip ``ocfg.grad_clip``), as ``gptspeed train`` runs it on a CPU. Returns
    ``step(next_batch) -> loss tensor``."""
    from gptspeed.config import RunConfig
    from gptspeed.runtime import resolve_runtime
    from gptspeed.step import TrainStep

    rt = resolve_runtime("cpu", dtype, compile=compile)
    cfg = RunConfig(model=model.config, optim=ocfg)
    cfg.train.batch_size, cfg.train.total_batch_tokens = batch_size, None
    cfg.runtime.dtype, cfg.runtime.compile = dtype, compile
    train = TrainStep(cfg, rt, model=model)
    return lambda next_batch: train(next_batch)[0]


def plain_step(model, optimizer, set_to_none: bool = True):
    """The straightforward step (nanoGPT's train.py loop without accumulation or scaler)."""
    params = list(model.parameters())

    def step(next_batch):
        x, y = next_batch()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        return loss

    return step


def build(variant: str, shape, threads: int):
    """``(step, threads)`` for ``variant``: the model from the same seed, its optimizer."""
    loss = "plain" if variant in ("plain-loss", "nanogpt-like") else "fused"
    vocab = 50257 if variant == "vocab-50257" else 50304
    torch.manual_seed(SEED)
    model = GPT(
        GPTConfig(
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            n_embd=shape.n_embd,
            block_size=shape.seq_len,
            vocab_size=vocab,
            loss=loss,
        )
    )
    ocfg = OptimConfig()
    if variant in ("adamw-forloop", "nanogpt-like"):
        ocfg.fused_adamw = False  # torch.optim.AdamW(fused=None, foreach=None): the for-loop on CPU
    if variant in GPTSPEED_VARIANTS:
        return gptspeed_step(model, ocfg, shape.batch_size, *GPTSPEED_VARIANTS[variant]), variant_threads(
            variant, threads
        )
    if variant == "adamw-foreach":
        from gptspeed.optim import param_groups

        opt = torch.optim.AdamW(
            param_groups(model, ocfg.weight_decay),
            lr=ocfg.lr,
            betas=(ocfg.beta1, ocfg.beta2),
            eps=ocfg.eps,
            foreach=True,
        )
        fused = False
    else:
        opt, fused = build_optimizer(model, ocfg, "cpu")
    step = plain_step(model, opt, set_to_none=variant != "zero-grad-keep")
    return step, variant_threads(variant, threads)


def variant_threads(variant: str, threads: int) -> int:
    """``threads-N`` runs the ``step`` variant with N intra-op threads; the others with ``threads``."""
    return int(variant.split("-", 1)[1]) if variant.startswith("threads-") else threads


def batches(tokens: np.ndarray, shape):
    n = shape.batch_size * shape.seq_len
    state = {"i": 0}

    def next_batch():
        off = (state["i"] * n) % (len(tokens) - n - 1)
        state["i"] += 1
        buf = torch.from_numpy(tokens[off : off + n + 1].astype(np.int64))
        return buf[:-1].view(shape.batch_size, shape.seq_len), buf[1:].view(shape.batch_size, shape.seq_len)

    return next_batch


def mask_cost(shape, reps: int = 50) -> dict:
    """Median seconds of ``logits[:, 50257:] = -inf`` on one fp32 chunk of the fused loss (rows =
    2**22 // 50304 = 83), next to one chunk's forward matmul, and the chunks per step."""
    from gptspeed.loss import CHUNK_ELEMENTS

    rows = CHUNK_ELEMENTS["cpu"] // 50304
    x, w = torch.randn(rows, shape.n_embd), torch.randn(50304, shape.n_embd)
    logits = x @ w.t()
    t_mask, t_mm = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits[:, 50257:] = float("-inf")
        t1 = time.perf_counter()
        torch.mm(x, w.t(), out=logits)
        t2 = time.perf_counter()
        t_mask.append(t1 - t0)
        t_mm.append(t2 - t1)
    chunks = -(-shape.batch_size * shape.seq_len // rows)
    return {
        "chunk_rows": rows,
        "chunks_per_step": chunks,
        "mask_ms": 1000 * statistics.median(t_mask),
        "chunk_matmul_ms": 1000 * statistics.median(t_mm),
        "mask_ms_per_step": 1000 * statistics.median(t_mask) * chunks,
    }


def log_cost(reps: int = 2000) -> dict:
    """What one log record costs on the host, the work ``--log-every 1`` adds per step beyond the
    step itself: ``memory_stats`` (getrusage) + a JSON line appended to metrics.jsonl + the console
    line (printed to /dev/null here). Median microseconds over ``reps`` records."""
    import contextlib
    import tempfile

    from gptspeed.metrics import RunLog, memory_stats

    rec = {
        "step": 1,
        "max_steps": 19073,
        "tokens": 2048,
        "documents": 3,
        "epoch": 0.01,
        "time_s": 1.0,
        "skipped_steps": 0,
        "train_loss": 10.8,
        "lr": 6e-4,
        "grad_norm": 1.0,
        "step_ms": 700.0,
        "tokens_per_s": 2900.0,
        "tokens_per_s_per_device": 2900.0,
        "data_wait_ms": 0.1,
        "mfu": None,
        "mem_peak_bytes": 1 << 30,
        "mem_total_bytes": 1 << 34,
        "mem_frac": 0.06,
        "eta_s": 100.0,
        "epoch_eta_s": 50.0,
        "includes_warmup": False,
    }
    ts = []
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        log = RunLog(Path(d) / "metrics.jsonl", echo=True)
        for i in range(reps):
            t0 = time.perf_counter()
            memory_stats(torch.device("cpu"))
            log.write({**rec, "step": i})
            ts.append(time.perf_counter() - t0)
    return {"record_us": 1e6 * statistics.median(ts), "reps": reps}


def profile(step, next_batch, steps: int, rows: int = 15) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    step(next_batch)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step(next_batch).item()
    avg = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in avg)
    top = [
        {
            "op": e.key,
            "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / steps,
            "share": e.self_cpu_time_total / total,
            "calls_per_step": e.count / steps,
        }
        for e in avg[:rows]
    ]
    return {"total_self_cpu_ms_per_step": total / 1000 / steps, "top": top}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--variants", default=",".join(ALL))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=1, help="timed steps of each variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=3, help="0: no profile")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--ref", default=None, help="the row ratios are taken against (default: step)")
    ap.add_argument("--random-tokens", action="store_true")
    ap.add_argument("--work", default="/tmp/gptspeed-peers")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    if a.random_tokens:
        tokens = np.random.default_rng(0).integers(0, 50257, 1 << 20)
    else:
        tokens = train_tokens(prepare_data(Path(a.work), None))[0]
    names = a.variants.split(",")
    steps, feeds, first_loss, first_call_s = {}, {}, {}, {}
    losses: dict[str, list[float]] = {n: [] for n in names}  # every step's loss, warm-up included
    for name in names:  # build and warm up every variant (compiles happen here)
        steps[name], threads = build(name, shape, a.threads)
        feeds[name] = batches(tokens, shape)
        torch.set_num_threads(threads)
        for i in range(a.warmup):
            t0 = time.perf_counter()
            loss = steps[name](feeds[name]).item()
            losses[name].append(loss)
            if i == 0:
                first_call_s[name] = time.perf_counter() - t0
                first_loss[name] = loss
        torch.set_num_threads(a.threads)
        print(f"built {name}: first step {first_call_s.get(name, 0):.1f} s", flush=True)
    loads = []

    def timed(name: str):
        def step() -> None:
            losses[name].append(steps[name](feeds[name]).item())

        return step

    def round_line(line: str) -> None:
        loads.append(harness.loadavg())
        print(line, flush=True)

    times = harness.time_rounds(
        {n: timed(n) for n in names},
        a.rounds,
        steps=a.steps,
        before=lambda n: torch.set_num_threads(variant_threads(n, a.threads)),
        after=lambda n: torch.set_num_threads(a.threads),
        say=round_line,
    )["wall"]
    steps.clear()
    rows = {}
    for name, per_round in times.items():
        ms = harness.spread(t for r in per_round for t in r)
        rows[name] = {
            "median_ms": statistics.median(statistics.median(r) for r in per_round),
            "round_medians_ms": [statistics.median(r) for r in per_round],
            "q25_ms": ms["q25"],
            "q75_ms": ms["q75"],
            "min_ms": ms["min"],
            "max_ms": ms["max"],
            "first_loss": first_loss.get(name),
            "first_step_s": first_call_s.get(name),
        }
    ref = a.ref or ("step" if "step" in times else names[0])
    for name in names:  # per-round ratio against the reference row, then its median
        speed = harness.ratios(times[ref], times[name])
        rows[name]["speed_vs_" + ref] = speed["median"]
        rows[name]["speed_vs_" + ref + "_per_round"] = speed["per_round"]
        # same initial weights, same batches in the same order: the loss of step i is comparable
        rows[name]["max_abs_loss_diff_vs_" + ref] = max(abs(x - y) for x, y in zip(losses[name], losses[ref]))
        rows[name]["losses"] = losses[name]
    result = {
        "environment": harness.environment("cpu"),
        "shape": shape.__dict__,
        "settings": vars(a),
        "loadavg_per_round": loads,
        "rows": rows,
        "mask": mask_cost(shape),
    }
    print(
        f"\n{shape.name}: n_layer {shape.n_layer} n_embd {shape.n_embd} B={shape.batch_size} T={shape.seq_len}, "
        f"fp32 eager, {a.threads} threads, loads {loads}"
    )
    print(
        f"| variant | median ms | round medians | min–max | speed vs {ref} (median of per-round ratios) | "
        f"first step s | loss step 0 | max abs loss diff vs {ref} ({len(losses[ref])} steps) |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['median_ms']:.1f} | {', '.join(f'{m:.0f}' for m in r['round_medians_ms'])} | "
            f"{r['min_ms']:.0f}–{r['max_ms']:.0f} | {r['speed_vs_' + ref]:.3f}× | {r['first_step_s']:.1f} | "
            f"{r['first_loss']:.4f} | {r['max_abs_loss_diff_vs_' + ref]:.2e} |"
        )
    result["log_record"] = log_cost()
    print(
        f"\none log record (memory_stats + metrics.jsonl line + console line): "
        f"{result['log_record']['record_us']:.0f} µs"
    )
    m = result["mask"]
    print(
        f"\n-inf padding mask: {m['mask_ms']:.3f} ms per chunk of {m['chunk_rows']} rows (chunk matmul "
        f"{m['chunk_matmul_ms']:.2f} ms) x {m['chunks_per_step']} chunks = {m['mask_ms_per_step']:.2f} ms/step"
    )
    if a.profile_steps:
        result["profile"] = {}
        for name in ("gptspeed", "nanogpt-like"):
            step, _ = build(name, shape, a.threads)
            p = profile(step, batches(tokens, shape), a.profile_steps)
            result["profile"][name] = p
            print(f"\nprofile {name}: {p['total_self_cpu_ms_per_step']:.1f} ms self CPU per step")
            print("| op | self CPU ms/step | share | calls/step |")
            print("|---|--:|--:|--:|")
            for r in p["top"]:
                print(
                    f"| {r['op']} | {r['self_cpu_ms_per_step']:.1f} | {100 * r['share']:.1f}% | {r['calls_per_step']:.0f} |"
                )
            del step
    harness.write_outputs(None, result, None, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
