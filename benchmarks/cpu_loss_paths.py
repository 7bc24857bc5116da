"""Is the fused loss faster than the plain one on the CPU, and is evaluation without gradient work faster? (issue 12)

Two measurements in the harness's interleaved rounds (:func:`harness.time_rounds`), each printing
Markdown tables (median, interquartile range and min-max of the per-step times, and the median of
the per-round ratios against the first variant) and optionally writing JSON. Each step is timed twice: wall clock (``perf_counter``) and the
process's CPU time (``process_time``); on a shared machine the CPU time is the steadier figure
(another job's load stretches the wall time, not the work done), so both are printed. One
thread by default (``--threads``) so that the CPU time is the work of one core.

``eval``: a no-grad forward with the fused loss (what ``gptspeed eval``, the periodic val loss
and HellaSwag run) against a training step, with this checkout's ``gptspeed.loss`` and with the
one of ``--baseline-commit`` (loaded from git into the same process), so that "before" and
"after" alternate round by round on the same model and batches.

``default``: a training step (forward, backward, AdamW step) with ``--loss fused`` against
``--loss plain`` at the nano shape and at GPT-2 124M, fp32 and eager (the CPU defaults): the
figure behind ``resolve_loss("auto", "cpu")``.

    python benchmarks/cpu_loss_paths.py eval [--baseline-commit 21567fc] [--rounds 7] [--steps 3] [--json OUT]
    python benchmarks/cpu_loss_paths.py default [--rounds 5] [--steps 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import torch

import gptspeed.model as model_mod
from gptspeed.config import GPTConfig
from gptspeed.model import GPT

ROOT = Path(__file__).resolve().parents[1]
NANO = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=50304)
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _load_loss_at(commit: str):
    """``gptspeed/loss.py`` as of ``commit``, imported under another name."""
    src = _git("show", f"{commit}:src/gptspeed/loss.py")
    path = Path(tempfile.mkdtemp()) / f"loss_{commit}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"gptspeed_loss_{commit}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_linear_cross_entropy


def _interleave(variants: dict, rounds: int, steps: int, warmup: int) -> dict[str, dict[str, list[list[float]]]]:
    """Per clock ("wall", "cpu"), per variant, per round, the seconds of each step
    (:func:`harness.time_rounds`, which times milliseconds)."""
    times = harness.time_rounds(variants, rounds, steps=steps, warmup=warmup)
    return {clock: {k: [[ms / 1000 for ms in r] for r in v] for k, v in per.items()} for clock, per in times.items()}


def _tables(times: dict, ref: str, tokens: int) -> tuple[str, dict]:
    texts, out = [], {}
    for clock, per_clock in times.items():
        text, out[clock] = _table(per_clock, ref, tokens, clock)
        texts.append(text)
    return "\n\n".join(texts), out


def _table(times: dict[str, list[list[float]]], ref: str, tokens: int, clock: str) -> tuple[str, dict]:
    rows, out = [], {}
    lines = [
        f"{clock} time per step:",
        "",
        f"| variant | median ms | IQR ms | min–max ms | tokens/s (median) | "
        f"median (min–max) of per-round speed-up vs {ref} |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name, per_round in times.items():
        sp = harness.spread(1000 * t for r in per_round for t in r)
        s = {
            "median_ms": sp["median"],
            "min_ms": sp["min"],
            "max_ms": sp["max"],
            "q1_ms": sp["q25"],
            "q3_ms": sp["q75"],
            "n": sp["n"],
        }
        speed = harness.ratios(times[ref], per_round)
        s["ratio_vs_ref_median"], s["ratio_vs_ref_min"], s["ratio_vs_ref_max"] = (
            speed["median"],
            speed["min"],
            speed["max"],
        )
        s["tokens_per_s"] = tokens / (s["median_ms"] / 1000)
        s["per_round_s"] = per_round
        out[name] = s
        rows.append(
            f"| {name} | {s['median_ms']:.0f} | {s['q1_ms']:.0f}–{s['q3_ms']:.0f} | "
            f"{s['min_ms']:.0f}–{s['max_ms']:.0f} | {s['tokens_per_s']:,.0f} | "
            f"{s['ratio_vs_ref_median']:.2f}× ({s['ratio_vs_ref_min']:.2f}–{s['ratio_vs_ref_max']:.2f}) |"
        )
    return "\n".join(lines + rows), out


def _batches(B: int, T: int, n: int = 8):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50257, (n, B, T + 1), generator=g)
    state = {"i": 0}

    def next_batch():
        buf = data[state["i"] % n]
        state["i"] += 1
        return buf[:, :-1], buf[:, 1:]

    return next_batch


def _train_step(model, opt, next_batch):
    def step():
        x, y = next_batch()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _with_loss_fn(fn, step):
    """``step`` run with ``gptspeed.model``'s fused loss function swapped for ``fn``."""

    def run():
        saved = model_mod.fused_linear_cross_entropy
        model_mod.fused_linear_cross_entropy = fn
        try:
            return step()
        finally:
            model_mod.fused_linear_cross_entropy = saved

    return run


def measure_eval(a) -> dict:
    old = _load_loss_at(a.baseline_commit)
    new = model_mod.fused_linear_cross_entropy
    torch.manual_seed(0)
    shape = {**NANO, "block_size": a.seq_len}
    model = GPT(GPTConfig(**shape, loss="fused"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    next_batch = _batches(a.batch_size, a.seq_len)

    def forward_no_grad():
        x, y = next_batch()
        with torch.no_grad():
            return model(x, y)[1].item()

    train = _train_step(model, opt, next_batch)
    variants = {
        f"no-grad forward, before ({a.baseline_commit})": _with_loss_fn(old, forward_no_grad),
        "no-grad forward, after": _with_loss_fn(new, forward_no_grad),
        f"training step, before ({a.baseline_commit})": _with_loss_fn(old, train),
        "training step, after": _with_loss_fn(new, train),
    }
    times = _interleave(variants, a.rounds, a.steps, a.warmup)
    table, rows = _tables(times, f"no-grad forward, before ({a.baseline_commit})", a.batch_size * a.seq_len)
    print(f"nano shape {shape}, B={a.batch_size}, fp32, eager, {torch.get_num_threads()} threads")
    print(table)
    return {"what": "eval", "shape": shape, "batch_size": a.batch_size, "rows": rows}


def measure_default(a) -> dict:
    results = {}
    for label, shape, B, T in (("nano", NANO, 16, 128), ("gpt2-124M", GPT2, 4, 64)):
        variants = {}
        torch.manual_seed(0)
        base = GPT(GPTConfig(**shape, loss="plain"))
        for loss in ("plain", "fused"):
            model = GPT(GPTConfig(**shape, loss=loss))
            model.load_state_dict(base.state_dict())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            variants[f"{label} --loss {loss}"] = _train_step(model, opt, _batches(B, T))
        del base
        times = _interleave(variants, a.rounds, a.steps, a.warmup)
        table, rows = _tables(times, f"{label} --loss plain", B * T)
        print(f"{label}: {shape}, B={B}, T={T}, fp32, eager, fused AdamW, {torch.get_num_threads()} threads")
        print(table)
        results[label] = {"shape": shape, "B": B, "T": T, "rows": rows}
        del variants
    return {"what": "default", "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("eval", "default"))
    p.add_argument("--baseline-commit", default="21567fc", help="eval: the commit whose loss.py is 'before'")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", help="write the figures and the environment here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = measure_eval(a) if a.what == "eval" else measure_default(a)
    out |= {
        "environment": harness.environment("cpu", ["benchmarks/cpu_loss_paths.py", *(argv or sys.argv[1:])]),
        "rounds": a.rounds,
        "steps": a.steps,
        "threads": a.threads,
        "load_average_at_end": list(os.getloadavg()),
    }
    harness.write_outputs(None, out, None, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
