"""Where a profiled training step's time goes, summed by category: ``bench profile``'s breakdown.

From a finished :class:`torch.profiler.profile` (its :meth:`~torch.profiler.profile.events`: one
``FunctionEvent`` per CPU op and per device activity, times in microseconds from the trace start;
torch.profiler docs, "PyTorch Profiler" recipe) this module sums the profiled steps' time into
:data:`CATEGORIES` and writes it as a small JSON and a Markdown table, which fit in what a GPU window
returns when the Chrome trace does not.

- **On CUDA** (device events present) the basis is the GPU timeline: every kernel, memcpy and memset
  (kineto's activity types ``kernel``, ``gpu_memcpy``, ``gpu_memset``; user annotations such as
  ``Optimizer.step#AdamW.step`` projected onto the GPU are left out, they span other kernels) is
  classified by its name (:data:`RULES`). Where kernels overlap (two streams), each instant counts
  once, split equally among the kernels running then; ``idle`` is the profiled wall span (first to
  last event, CPU or GPU) minus the union of the kernels' busy intervals: the gaps where the GPU ran
  nothing (launch latency, host syncs, the host falling behind).
- **On a CPU** (no device events) the basis is the CPU ops' *self* intervals (an op's interval minus
  its children's), classified by op name (``aten::mm`` -> matmul, ...); ``idle`` is the wall span
  minus the union of the top-level ops (Python between ops). The CPU tests exercise the whole path.

Either way the categories plus ``idle`` sum to the wall span: the shares sum to 100%.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES = ("matmul", "attention", "memory-bound", "copies/casts", "optimizer", "other", "idle")
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's names (torch/profiler/_chrome_trace_export.py)
TOP = 5  # kernels named per category
UNCLASSIFIED = 20  # names of `other` listed, to correct RULES after a run


@dataclass(frozen=True)
class Rule:
    """A name matching ``pattern`` (``re.search``) is in ``category``; the first rule that matches wins."""

    category: str
    pattern: str
    source: str


# Ordered: the first match wins. Kernel names are as torch.profiler reports them (demangled C++); CPU op names
# are ATen's. Correct these after a GPU run: the breakdown lists what fell through to `other` ("unclassified").
RULES: tuple[Rule, ...] = (
    Rule(
        "other",
        r"^autograd::|Backward\d+$",
        "autograd's record_function per node ('autograd::engine::evaluate_function: LogSoftmaxBackward0') and the "
        "node's own (LogSoftmaxBackward0): their self time is the engine's, not the op's (first, or 'Softmax' "
        "would file it as memory-bound)",
    ),
    Rule(
        "optimizer",
        r"FusedAdam|fused_adam|multi_tensor_apply|lpnorm_cleanup|^aten::_fused_adamw?_|^aten::_foreach_"
        r"|^Optimizer\.(step|zero_grad)#",
        "ATen's fused AdamW runs multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata, FusedAdamMathFunctor..> "
        "(aten/src/ATen/native/cuda/fused_adam_utils.cuh); the foreach ops (clip_grad_norm_'s _foreach_norm: "
        "LpNormFunctor + lpnorm_cleanup, its _foreach_mul_) run multi_tensor_apply_kernel too "
        "(ForeachReduceOp.cu); torch.optim's record_function 'Optimizer.step#AdamW.step'",
    ),
    Rule(
        "attention",
        r"flash_fwd|flash_bwd|pytorch_flash::|fmha_cutlass|PyTorchMemEffAttention|flex_attention"
        r"|^cudnn|_sdpa_|^aten::_?scaled_dot_product|^aten::_(flash|efficient|cudnn)_attention",
        "SDPA's kernels: cuDNN's cudnn_generated_fort_native_sdpa_sm90_flash_fprop/bprop_wgmma_f16_knob_*; "
        "the vendored FlashAttention-2 pytorch_flash::flash_fwd_kernel / flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel "
        "/ flash_bwd_dot_do_o_kernel / flash_bwd_convert_dq_kernel; memory-efficient fmha_cutlassF/B_* "
        "(PyTorchMemEffAttention::AttentionKernel); FlexAttention's Triton template "
        "triton_tem_fused_flex_attention_*; "
        "on a CPU aten::_scaled_dot_product_flash_attention_for_cpu(_backward). cuDNN runs only SDPA in a GPT-2 "
        "step (no convolutions), so any cudnn kernel is attention. Before matmul: these names contain 'cutlass'",
    ),
    Rule(
        "matmul",
        r"nvjet|xmma|(?i:gemm|gemv)|cutlass|cublas|Cijk_|splitKreduce|_scaled_mm|^triton_tem_"
        r"|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$",
        "cuBLAS/cuBLASLt on Hopper: nvjet_tst_* (newer cuBLAS), sm90_xmma_gemm_*, cutlass3x_sm90_*; on Ampere "
        "ampere_*gemm* / cutlass_80_*gemm; cublasLt::splitKreduce_kernel and cuBLASLt epilogues; gemv*/gemmSN_*; "
        "ROCm's Cijk_*; Inductor's Triton matmul templates triton_tem_fused_mm/addmm/bmm_* (max-autotune); "
        "FP8 _scaled_mm",
    ),
    Rule(
        "copies/casts",
        r"^Memcpy|^Memset|copy_kernel|CatArrayBatchedCopy|(?<![A-Za-z])cast"
        r"|^triton_poi_fused_((_to_copy|clone|copy|t|view|permute|transpose|expand|_unsafe_view|unsqueeze|squeeze"
        r"|slice|select|cat|convert_element_type)_)+\d+$|^aten::(copy_|to|_to_copy|clone|contiguous|cat)$",
        "kineto's 'Memcpy HtoD (Pageable -> Device)', 'Memset (Device)'; ATen's direct_copy_kernel_cuda / "
        "bfloat16_copy_kernel_cuda inside elementwise_kernel<..>, CatArrayBatchedCopy (torch.cat/stack); Inductor "
        "kernels that only cast or move (triton_poi_fused__to_copy_0: autocast's per-micro-batch weight casts); "
        "'cast' as a word (not gpu_kernel_impl_nocast or LoadWithCast)",
    ),
    Rule(
        "memory-bound",
        r"^triton_(poi|red|per)_|at::native::|elementwise_kernel|reduce_kernel|(?i:layer_?norm|softmax"
        r"|cross_?entropy)|nll_loss|GammaBeta|^aten::",
        "Inductor's Triton pointwise / reduction / persistent-reduction kernels (triton_poi_ / triton_red_ / "
        "triton_per_); ATen's CUDA kernels (vectorized_elementwise_kernel, reduce_kernel, "
        "vectorized_layer_norm_kernel, "
        "GammaBetaBackwardCUDAKernel, cunn_SoftMaxForward, nll_loss_*, index/embedding kernels); Liger's Triton "
        "layer-norm / cross-entropy kernels; on a CPU every other aten:: op",
    ),
)
_COMPILED = tuple((rule.category, re.compile(rule.pattern)) for rule in RULES)

# The figures the breakdown replaces, until a GPU window measures them (issue "Every GPU minute decisive").
H100_ESTIMATE: dict[str, Any] = {
    "label": "estimate (H100)",
    "setting": "GPT-2 124M, T=1024, 16,384 tokens a micro-batch, 36.3 ms a micro-batch on an H100",
    "source": "issue 'Every GPU minute decisive': an estimate on paper, not a measurement",
    "shares": {"matmul": 0.52, "attention": 0.12, "memory-bound": 0.30, "idle": 0.05},
    "notes": {
        "matmul": "the LM head ~31% of it",
        "memory-bound": "LayerNorm, fp32 residual, GELU, bias gradients, cross-entropy passes, per-micro-batch "
        "weight casts and gradient accumulation",
        "copies/casts": "in memory-bound",
        "optimizer": "in memory-bound",
        "idle": "launch gaps",
    },
}


def classify(name: str) -> str:
    """The category of a kernel or CPU op ``name``: the first of :data:`RULES` whose pattern it
    matches, else ``"other"``."""
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return "other"


def estimate_for(device_type: str) -> dict[str, Any] | None:
    """The estimate to print beside a measured breakdown: :data:`H100_ESTIMATE` on CUDA, else None."""
    return H100_ESTIMATE if device_type == "cuda" else None


def attribute(intervals: Iterable[tuple[str, float, float]]) -> tuple[dict[str, list[float]], float]:
    """Sweep over ``(name, start, end)`` intervals (any unit; microseconds here): each instant is
    split equally among the intervals covering it, so overlaps count once.

    Returns ``({name: [time, count]}, busy)``: the time charged to each name and its number of
    intervals; ``busy`` = the length of the union of all intervals (= the sum of the times).
    Empty or reversed intervals count 0 time.
    """
    names, points = [], []
    for name, start, end in intervals:
        names.append(name)
        if end > start:
            points += [(start, 1, len(names) - 1), (end, 0, len(names) - 1)]  # an end sorts before a start
    points.sort()
    charged = [0.0] * len(names)
    active: set[int] = set()
    busy, last = 0.0, 0.0
    for t, is_start, i in points:
        if active and t > last:
            busy += t - last
            for j in active:
                charged[j] += (t - last) / len(active)
        last = t
        (active.add if is_start else active.discard)(i)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, time in zip(names, charged):
        out[name][0] += time
        out[name][1] += 1
    return dict(out), busy


def _device_type(event) -> str:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1].lower()


def device_intervals(events) -> list[tuple[str, float, float]]:
    """The GPU activities of ``events`` (``prof.events()``) as ``(name, start_us, end_us)``:
    kernels, memcpys and memsets; user annotations and CPU events are left out."""
    out = []
    for e in events:
        if _device_type(e) == "cpu" or getattr(e, "is_user_annotation", False):
            continue
        kind = getattr(e, "activity_type", None)
        if kind is None or kind in DEVICE_ACTIVITIES:  # kind None: a torch without activity_type
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def _cpu_events(events) -> list:
    return [
        e
        for e in events
        if _device_type(e) == "cpu"
        and not getattr(e, "is_async", False)
        and not getattr(e, "is_python_function", False)
    ]


def cpu_self_intervals(events) -> list[tuple[str, float, float]]:
    """The CPU ops of ``events`` as their self intervals ``(name, start_us, end_us)``: each op's
    interval less its children's (``cpu_children``), clipped to it; an op interrupted by children
    gives several pieces."""
    out = []
    for e in _cpu_events(events):
        start, end = e.time_range.start, e.time_range.end
        t = start
        for c in sorted(getattr(e, "cpu_children", []) or [], key=lambda c: c.time_range.start):
            c0, c1 = max(start, c.time_range.start), min(end, c.time_range.end)
            if c0 > t:
                out.append((e.name, t, c0))
            t = max(t, c1)
        if end > t:
            out.append((e.name, t, end))
    return out


def _span(cpu_events, kernels: list[tuple[str, float, float]]) -> tuple[float, float]:
    """The profiled wall span in us: the first start to the last end of the CPU events and kernels."""
    times = [(e.time_range.start, e.time_range.end) for e in cpu_events] + [(s, e) for _, s, e in kernels]
    if not times:
        return 0.0, 0.0
    return min(s for s, _ in times), max(e for _, e in times)


def breakdown_events(
    events, steps: int, device: str, estimate: dict[str, Any] | None = None, micro_batches: int = 1
) -> dict[str, Any]:
    """The breakdown of profiler ``events`` (``prof.events()``, or objects with the same fields:
    ``name``, ``time_range.start/end`` in us, ``device_type``, ...) over ``steps`` profiled steps of
    ``micro_batches`` micro-batches each.

    Returns ``{"device", "basis" ("device kernels" | "cpu ops"), "steps", "micro_batches",
    "wall_ms_per_step", "wall_ms_per_micro_batch",
    "categories": [{"category", "ms_per_step", "share", "kernels" (launches or op calls a step),
    "top": [(name, ms_per_step), ... 5]}, ...] in :data:`CATEGORIES` order, "unclassified":
    [(name, ms_per_step), ...], "estimate"}``; shares are of the wall span and sum to 1.
    Raises ValueError for ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    events = list(events)
    kernels = device_intervals(events)
    basis = "device kernels" if kernels else "cpu ops"
    per_name, busy = attribute(kernels if kernels else cpu_self_intervals(events))
    if not kernels:  # count op calls, not the pieces their children cut them into
        calls = Counter(e.name for e in _cpu_events(events))
        per_name = {name: [per_name.get(name, [0.0])[0], n] for name, n in calls.items()}
    start, end = _span(_cpu_events(events), kernels)
    wall = max(end - start, busy)  # us; busy <= span unless events lie outside it
    bd = summarize(per_name, wall - busy, wall, steps, device, basis, estimate)
    return {**bd, "micro_batches": micro_batches, "wall_ms_per_micro_batch": bd["wall_ms_per_step"] / micro_batches}


def summarize(
    per_name: dict[str, list[float]],
    idle_us: float,
    wall_us: float,
    steps: int,
    device: str,
    basis: str,
    estimate: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Group ``{name: [us, count]}`` by :func:`classify` into the breakdown dict
    (:func:`breakdown_events` documents it); times become ms per step."""
    ms = 1e-3 / steps
    groups: dict[str, list[tuple[str, float, int]]] = {c: [] for c in CATEGORIES}
    for name, (us, count) in per_name.items():
        groups[classify(name)].append((name, us, count))
    rows = []
    for category in CATEGORIES:
        items = sorted(groups[category], key=lambda x: -x[1])
        us = idle_us if category == "idle" else sum(x[1] for x in items)
        rows.append(
            {
                "category": category,
                "ms_per_step": us * ms,
                "share": us / wall_us if wall_us > 0 else 0.0,
                "kernels": sum(x[2] for x in items) / steps,
                "top": [(name[:400], t * ms) for name, t, _ in items[:TOP]],
            }
        )
    unclassified = [(name[:400], t * ms) for name, t, _ in sorted(groups["other"], key=lambda x: -x[1])]
    return {
        "device": device,
        "basis": basis,
        "steps": steps,
        "wall_ms_per_step": wall_us * ms,
        "categories": rows,
        "unclassified": unclassified[:UNCLASSIFIED],
        "estimate": estimate,
    }


def breakdown(
    prof, steps: int, device: str, estimate: dict[str, Any] | None = None, micro_batches: int = 1
) -> dict[str, Any]:
    """:func:`breakdown_events` of a finished :class:`torch.profiler.profile` ``prof``."""
    return breakdown_events(prof.events(), steps, device, estimate, micro_batches)


def _short(name: str, width: int = 60) -> str:
    """A kernel name for a table cell: no ``void``/``at::native::``/anonymous namespace, at most
    ``width`` characters, no ``|`` or backtick."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("at::native::", "")
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[: width - 1] + "…"


def _estimate_cell(estimate: dict[str, Any] | None, category: str) -> str:
    share = estimate["shares"].get(category) if estimate else None
    if share is not None:
        return f"{share:.0%}"
    note = estimate["notes"].get(category, "") if estimate else ""
    return f"({note})" if note.startswith("in ") else "—"


def markdown(bd: dict[str, Any]) -> str:
    """The breakdown ``bd`` (:func:`breakdown_events`) as a Markdown table: category | ms/step |
    share | kernels (or ops) a step | top kernels (ms/step), and the estimate's column where ``bd``
    carries one; a total row (the wall span, 100%); then what fell to ``other``."""
    est = bd.get("estimate")
    unit = "kernels" if bd["basis"] == "device kernels" else "ops"
    head = ["category", "ms/step", "share", f"{unit}/step", f"top {unit} (ms/step)"] + ([est["label"]] if est else [])
    micro = bd.get("micro_batches", 1)
    per_micro = f" of {micro} micro-batches ({bd['wall_ms_per_step'] / micro:.3f} ms each)" if micro > 1 else ""
    lines = [
        f"Where the step's time goes: {bd['device']}, {bd['steps']} profiled step(s), "
        f"{bd['wall_ms_per_step']:.3f} ms a step{per_micro} (the profile's wall span), "
        f"summed from the {bd['basis']}; "
        "idle = no " + ("kernel running" if unit == "kernels" else "op running") + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---:|---:|---:|---|" + ("---:|" if est else ""),
    ]
    for row in bd["categories"]:
        top = "; ".join(f"`{_short(n)}` {t:.3f}" for n, t in row["top"]) or "—"
        cells = [
            row["category"],
            f"{row['ms_per_step']:.3f}",
            f"{row['share']:.1%}",
            f"{row['kernels']:g}" if row["category"] != "idle" else "—",
            top,
        ]
        lines.append("| " + " | ".join(cells + ([_estimate_cell(est, row["category"])] if est else [])) + " |")
    total = sum(r["share"] for r in bd["categories"])
    est_total = [f"{sum(est['shares'].values()):.0%}"] if est else []
    lines.append(
        "| " + " | ".join(["**total**", f"{bd['wall_ms_per_step']:.3f}", f"{total:.1%}", "", ""] + est_total) + " |"
    )
    if bd["unclassified"]:
        lines += [
            "",
            "In `other` (no rule of gptspeed.bench.breakdown.RULES matched): "
            + "; ".join(f"`{_short(n)}` {t:.3f} ms" for n, t in bd["unclassified"][:TOP]),
        ]
    if est:
        notes = "; ".join(f"{k}: {v}" for k, v in est["notes"].items() if not v.startswith("in "))
        lines += ["", f"{est['label']}: {est['setting']} ({est['source']}); {notes}."]
    return "\n".join(lines) + "\n"


def write_breakdown(
    prof, out: Path, name: str, steps: int, device: str, estimate: dict[str, Any] | None = None, micro_batches: int = 1
) -> dict[str, Any]:
    """Write ``profile-NAME-breakdown.json`` (the dict of :func:`breakdown_events`) and
    ``profile-NAME-breakdown.md`` (:func:`markdown`) into ``out`` (a few KB each, whatever the trace's
    size). Returns ``{"breakdown": json path, "breakdown_md": md path, "breakdown_table": the table}``."""
    if device.startswith("cuda"):
        import torch

        device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    bd = breakdown(prof, steps, device, estimate, micro_batches)
    table = markdown(bd)
    out.mkdir(parents=True, exist_ok=True)
    path_json, path_md = out / f"profile-{name}-breakdown.json", out / f"profile-{name}-breakdown.md"
    path_json.write_text(json.dumps(bd, indent=1) + "\n")
    path_md.write_text(table)
    return {"breakdown": str(path_json), "breakdown_md": str(path_md), "breakdown_table": table}
