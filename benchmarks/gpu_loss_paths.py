"""Which LM-head loss is fastest on one GPU: plain (logits + F.cross_entropy, eager or
torch.compile-d), gptspeed's fused linear + cross-entropy, or Liger-Kernel's (when installed)?

One forward + backward of ``loss(x @ W.T, targets)`` at GPT-2 124M's head: N = B x T tokens
(default 16 x 1024), C = 768, V = 50304 (the padded rows excluded from the softmax: Liger is
given the first 50257 rows of W, a view, so the padding gets no gradient), under bf16 autocast
like a training step. Variants run in the harness's interleaved rounds (A B C D, B C D A, ...;
:func:`harness.time_rounds`), each step timed with CUDA events; reported: median ms (IQR, min-max),
peak memory above the inputs, and each variant's loss and gradients against an fp64 reference of
the plain path (max relative error).

    python benchmarks/gpu_loss_paths.py [--tokens 16384] [--rounds 5] [--steps 10] [--json OUT] [--md OUT]
    python benchmarks/gpu_loss_paths.py --device cpu --tokens 256 --vocab 1024 --width 64   # the test's shape

Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989; ``pip install liger-kernel``, Triton kernels,
CUDA only) is called through ``liger_kernel.ops.fused_linear_cross_entropy``'s
``LigerFusedLinearCrossEntropyFunction``; without it, or on a CPU, its row says why it was skipped.
"""

from __future__ import annotations

import argparse
import sys

import harness
import torch
import torch.nn.functional as F

from gptspeed.loss import fused_linear_cross_entropy

VALID = 50257


def liger_problem(device: torch.device) -> str | None:
    """Why Liger-Kernel's fused loss cannot run here, or None."""
    if device.type != "cuda":
        return f"Liger-Kernel's Triton kernels need a CUDA GPU; not {device.type}"
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not installed ({e}); pip install liger-kernel"
    return None


def variants(device: torch.device, valid: int, vocab: int, backend: str = "inductor") -> dict:
    """name -> ``fn(x, w, t) -> loss`` (or the reason it does not run here, a str)."""

    def plain(x, w, t):
        logits = x @ w.t()
        if vocab > valid:
            logits[:, valid:] = float("-inf")
        return F.cross_entropy(logits.float(), t)

    out = {
        "plain": plain,
        "plain-compiled": torch.compile(plain, backend=backend),
        "gptspeed-fused": lambda x, w, t: fused_linear_cross_entropy(x, w, t, valid_vocab_size=valid),
    }
    problem = liger_problem(device)
    if problem:
        out["liger"] = problem
    else:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # (input, weight, target): the first `valid` rows of W, so the padding is outside the softmax
        out["liger"] = lambda x, w, t: LigerFusedLinearCrossEntropyFunction.apply(x, w[:valid], t)[0]  # (loss, z, ...)
    return out


def one_step(fn, x, w, t, dtype):
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = fn(xg, wg, t)
    loss.backward()
    return loss.detach().float(), xg.grad, wg.grad


def measure(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    torch.manual_seed(0)
    N, C, V = args.tokens, args.width, args.vocab
    valid = min(VALID, V - 1) if V > 1 else V
    x = torch.randn(N, C, device=device)
    w = torch.randn(V, C, device=device) * 0.02
    t = torch.randint(0, valid, (N,), device=device)
    table = variants(device, valid, V, args.compile_backend)
    runnable = {k: v for k, v in table.items() if callable(v)}

    ref_loss, ref_gx, ref_gw = one_step(table["plain"], x.double(), w.double(), t, None)  # fp64 reference
    result = {
        "shape": {"tokens": N, "width": C, "vocab": V, "valid_vocab": valid, "dtype": args.dtype},
        "variants": {k: {"skipped": v} for k, v in table.items() if not callable(v)},
    }
    errors = {}
    for name, fn in runnable.items():
        loss, gx, gw = one_step(fn, x, w, t, dtype)
        rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
        errors[name] = {
            "loss_rel": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "grad_x_rel": rel(gx, ref_gx),
            "grad_w_rel": rel(gw[:valid], ref_gw[:valid]),
            "padding_grad_zero": bool((gw[valid:] == 0).all()) if V > valid else True,
        }
        for _ in range(args.warmup):
            one_step(fn, x, w, t, dtype)
    peaks: dict[str, int] = {}
    base = {}

    def before(name: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
            base[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def after(name: str) -> None:
        if device.type == "cuda":
            peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - base[name])

    steps = {name: (lambda fn=fn: one_step(fn, x, w, t, dtype)) for name, fn in runnable.items()}
    times = harness.time_rounds(
        steps, args.rounds, steps=args.steps, device_type=device.type, before=before, after=after
    )["wall"]
    for name in runnable:
        ms = harness.spread(m for r in times[name] for m in r)
        result["variants"][name] = {
            "median_ms": ms["median"],
            "q25_ms": ms["q25"],
            "q75_ms": ms["q75"],
            "min_ms": ms["min"],
            "max_ms": ms["max"],
            "steps": ms["n"],
            "peak_mem_above_inputs_bytes": peaks.get(name),
            **errors[name],
        }
    result["order"] = list(table)
    return result


def markdown(result: dict) -> str:
    s = result["shape"]
    out = [
        f"LM-head loss, forward + backward: N={s['tokens']:,} tokens, C={s['width']}, V={s['vocab']:,} "
        f"({s['valid_vocab']:,} valid), {s['dtype']}",
        "",
        "| variant | median ms | IQR ms | min–max ms | peak memory above inputs | loss rel. err | grad x rel. err | "
        "grad W rel. err | padding grad 0 |",
        "|---|--:|--:|--:|--:|--:|--:|--:|:-:|",
    ]
    for name in result["order"]:
        v = result["variants"][name]
        if "skipped" in v:
            out.append(f"| {name} | skipped: {v['skipped']} | | | | | | | |")
            continue
        mem = f"{v['peak_mem_above_inputs_bytes'] / 2**20:,.0f} MiB" if v["peak_mem_above_inputs_bytes"] else "—"
        out.append(
            f"| {name} | {v['median_ms']:.2f} | {v['q25_ms']:.2f}–{v['q75_ms']:.2f} | {v['min_ms']:.2f}–{v['max_ms']:.2f} "
            f"| {mem} | {v['loss_rel']:.1e} "
            f"| {v['grad_x_rel']:.1e} | {v['grad_w_rel']:.1e} | {'yes' if v['padding_grad_zero'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tokens", type=int, default=16 * 1024)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of plain-compiled (tests: eager)"
    )
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    result = measure(args)
    result["environment"] = harness.environment(args.device, sys.argv)
    harness.emit(harness.header(result["environment"]) + markdown(result), result, args.md, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
