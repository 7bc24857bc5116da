"""One ladder row, measured in this process: ``python -m gptspeed.bench SPEC.json RESULT.json``.

The parent (:mod:`gptspeed.bench.ladder`) starts one fresh process per row, so no compile cache,
allocator state or warmed-up kernel carries from one row to the next. Every row builds the same
initial weights (same seed) and reads the same batches, and takes the same training step as
``gptspeed train``: load a batch, forward under autocast, backward, clip the gradient norm at 1.0,
AdamW step, zero the gradients.

Timing: an untimed warm-up (the first step compiles and allocates), then the timed steps. On CUDA
each timed step is bracketed by CUDA events, read after one synchronisation at the end, so the
harness adds no synchronisation inside or between steps; on a CPU (synchronous) by
``time.perf_counter``; on MPS by a synchronisation after each step.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptspeed.config import AUTO_BATCH_SIZE, GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, GPTConfig, RunConfig, check_settings
from gptspeed.data.loader import to_device
from gptspeed.metrics import memory_stats, peak_flops
from gptspeed.model import GPT
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.step import TrainStep, auto_batch_size

GRAD_CLIP = 1.0  # as gptspeed train's default
PEER_KIND = "hf"


@dataclass
class StageSpec:
    """Everything a worker needs to run one row; JSON-serialisable. ``kind`` is ``"gptspeed"``
    (our GPT) or ``"hf"`` (transformers' GPT2LMHeadModel, attn_implementation="sdpa")."""

    name: str
    settings: dict[str, Any]
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    batch_size: int
    steps: int
    warmup: int
    device: str = "auto"
    seed: int = 1337
    lr: float = 6e-4
    data: str | None = None  # prepared data folder, or None for synthetic tokens
    kind: str = "gptspeed"
    compile_backend: str = "inductor"
    peak_tflops: float | None = None
    profile_dir: str | None = None  # set: trace the timed steps with torch.profiler into this folder
    mode: str = "time"  # time (a ladder row) | verify (a bench verify rung: gptspeed.bench.verify_worker)
    grad_accum: int = 1  # micro-batches per optimizer step
    synthetic: str = "uniform"  # without data: uniform | phrases (see SyntheticLoader)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SyntheticLoader:
    """Synthetic token ids from ``numpy.random.default_rng(seed)``, read like
    :class:`gptspeed.data.loader.TokenLoader`: ``next_batch() -> (x, y)``, each ``(B, T)`` int64 on
    ``device``, ``y`` = ``x`` shifted by one; after ``n_batches`` it starts again. Same seed, same
    batches in every process.

    ``kind="uniform"``: ids uniform in ``[0, 50257)`` -- nothing to learn, so the loss stays near
    ln(50257) = 10.8 (the ladder times steps; it needs no learning). ``kind="phrases"``: a stream of
    phrases drawn at random from a fixed table of 1024 phrases of 16 ids, over 512 ids picked from
    the vocabulary: learnable (unigram, then which phrase continues), so the loss falls and two
    rungs that train differently end on different losses (``bench verify``).
    """

    def __init__(
        self, batch_size: int, seq_len: int, n_batches: int, seed: int, device: torch.device, kind: str = "uniform"
    ):
        self.B, self.T, self.device = batch_size, seq_len, device
        rng = np.random.default_rng(seed)
        n = n_batches * batch_size * seq_len + 1
        if kind == "uniform":
            self.tokens = rng.integers(0, GPT2_VOCAB_SIZE, size=n, dtype=np.uint16)
        elif kind == "phrases":
            ids = rng.choice(GPT2_VOCAB_SIZE, size=512, replace=False).astype(np.uint16)
            table = ids[rng.integers(0, len(ids), size=(1024, 16))]  # (phrases, ids per phrase)
            self.tokens = table[rng.integers(0, len(table), size=-(-n // 16))].ravel()[:n]
        else:
            raise ValueError(f"unknown synthetic data kind {kind!r}: uniform or phrases")
        self.n_batches, self.i = n_batches, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.B * self.T
        start = (self.i % self.n_batches) * n
        self.i += 1
        t = to_device(self.tokens[start : start + n + 1].astype(np.int64), self.device)
        return t[:-1].view(self.B, self.T), t[1:].view(self.B, self.T)


def make_loader(spec: StageSpec, device: torch.device, n_batches: int | None = None):
    """The batches of every row: a prepared folder's train shards (read under the folder's shared lock,
    :func:`gptspeed.data.folder.data_folder_lock`: a ``prepare`` of it meanwhile is one line), or
    :class:`SyntheticLoader` (``spec.synthetic``) holding ``n_batches`` (default: one per warm-up and
    timed micro-step)."""
    if spec.data is None:
        n = n_batches or (spec.warmup + spec.steps) * spec.grad_accum
        return SyntheticLoader(spec.batch_size, spec.seq_len, n, spec.seed, device, spec.synthetic)
    from gptspeed.data import find_shards
    from gptspeed.data.folder import data_folder_lock
    from gptspeed.data.loader import TokenLoader

    # a shared lock on the folder for this worker process's life, as train holds one: no prepare rewrites it meanwhile
    _HELD.append(data_folder_lock(spec.data).acquire())
    return TokenLoader(find_shards(spec.data, "train"), spec.batch_size, spec.seq_len, device=device)


_HELD: list = []  # the data folders' read locks of this worker process (released when it ends)


def init_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """Our GPT with the same initial function for either vocabulary size.

    The weights are drawn (``torch.manual_seed(seed)``) for the padded 50304-row model; a
    50257-row model takes its first 50257 embedding rows. Padded rows are never predicted, so both
    models compute the same loss at step 0 -- which the ladder's correctness guard checks.
    """
    torch.manual_seed(seed)
    ref = GPT(dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, PADDED_VOCAB_SIZE)))
    if ref.config.vocab_size == cfg.vocab_size:
        return ref
    model = GPT(cfg)
    state = ref.state_dict()
    for key in ("transformer.wte.weight", "lm_head.weight"):
        state[key] = state[key][: cfg.vocab_size]
    model.load_state_dict(state)
    return model


def build_hf_gpt2(cfg: GPTConfig, seed: int) -> torch.nn.Module:
    """transformers' ``GPT2LMHeadModel`` (``attn_implementation="sdpa"``, no dropout, vocab 50257)
    built from a ``GPT2Config`` (nothing downloaded), holding :func:`init_gpt`'s weights.

    Raises ImportError if transformers is not installed.
    """
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    hf_cfg = GPT2Config(
        vocab_size=GPT2_VOCAB_SIZE,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(hf_cfg)
    ours = init_gpt(dataclasses.replace(cfg, vocab_size=GPT2_VOCAB_SIZE), seed).state_dict()
    from gptspeed.hf.load import CONV1D  # HF GPT-2's Conv1D weights are [in, out]; ours are nn.Linear, [out, in]

    state = {k: v.t().contiguous() if k.endswith(CONV1D) else v for k, v in ours.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:  # a transformers layout we do not know: a bug to report, not a user error
        raise RuntimeError(f"GPT2LMHeadModel layout changed: missing {missing}, unexpected {unexpected}")
    return model


class _HFForward(torch.nn.Module):
    """transformers' GPT2LMHeadModel behind gptspeed's ``forward(x, y) -> (None, loss)``, with its
    own loss path (logits.float(), F.cross_entropy; labels pre-shifted)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf
        self.transformer = hf.transformer

    def forward(self, x, y):
        return None, self.hf(input_ids=x, labels=y, shift_labels=y).loss


def run_config(spec: StageSpec) -> RunConfig:
    """The :class:`~gptspeed.config.RunConfig` of a row: what ``gptspeed train`` would be given for
    it -- the rung's settings (``spec.settings``, by name: ``--dtype``, ``--compile``,
    ``--attention``, ...) on the row's shape, a global batch of ``grad_accum`` micro-batches and
    gradient clipping at 1.0 -- checked as ``train`` checks a configuration (the settings'
    names, types and choices, then :meth:`RunConfig.validate`). The bench differs from ``train``
    only in these settings. GptspeedError for a combination gptspeed refuses."""
    cfg = RunConfig(preset="bench").override(
        {
            "block_size": spec.seq_len,
            "n_layer": spec.n_layer,
            "n_head": spec.n_head,
            "n_embd": spec.n_embd,
            "lr": spec.lr,
            "grad_clip": GRAD_CLIP,
            "batch_size": spec.batch_size,
            "total_batch_tokens": spec.batch_size * spec.seq_len * spec.grad_accum,
            "device": spec.device,
            "seed": spec.seed,
            "peak_tflops": spec.peak_tflops,
            **check_settings(spec.settings, f"bench rung {spec.name}"),
        }
    )
    cfg.validate()
    return cfg


def data_token_ids(spec: StageSpec, loader) -> np.ndarray:
    """The token ids a row's data holds (sorted int64), for ``--softmax data`` as ``train`` sets them: a
    prepared folder's train and val shards (:meth:`gptspeed.data.train_data.TrainData.token_ids`), or
    the ids of the synthetic ``loader``."""
    if spec.data is not None:
        from gptspeed.data.train_data import find_train_data

        return find_train_data(spec.data).token_ids()
    return np.unique(loader.tokens).astype(np.int64)


def build_row(spec: StageSpec, rt: Runtime, loader=None) -> tuple[TrainStep, int]:
    """A row's training step -- a :class:`gptspeed.step.TrainStep` built from :func:`run_config`, as
    ``gptspeed train`` builds it, every rule checked -- and its model FLOPs per token. Every row
    starts from the same initial weights (:func:`init_gpt`); the peer row trains transformers'
    GPT-2 holding them (:func:`build_hf_gpt2`). With ``--softmax data`` the head covers the ids of
    the row's data (:func:`data_token_ids`; ``loader`` is the row's, for synthetic data)."""
    cfg = run_config(spec)
    if spec.kind == PEER_KIND:
        model = _HFForward(build_hf_gpt2(cfg.model, spec.seed))
        fpt = init_gpt(dataclasses.replace(cfg.model, vocab_size=GPT2_VOCAB_SIZE), spec.seed).flops_per_token(
            spec.seq_len
        )
    else:
        model = init_gpt(cfg.model, spec.seed)
        if cfg.model.softmax == "data":
            model.set_softmax_ids(data_token_ids(spec, loader))
        fpt = model.flops_per_token(spec.seq_len)
    return TrainStep(cfg, rt, model=model, backend=spec.compile_backend), fpt


def bench_step(step: TrainStep, next_batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step as the bench records it: ``(loss, skipped)``, 0-dim device tensors (not
    read here: no host-device sync added). ``skipped`` is True when the step was not applied -- a
    non-finite loss or gradient, or a float16 overflow the GradScaler skipped (its gradient norm,
    taken after unscaling, is then not finite)."""
    loss, grad_norm, bad = step(next_batch)
    return loss, bad | ~torch.isfinite(grad_norm)


def resolve_batch(spec: StageSpec, rt: Runtime, keep_global: bool = False) -> StageSpec:
    """``spec`` with its micro-batch resolved: for a row with ``--batch-size auto`` the one
    adapter of ``train`` (:func:`gptspeed.step.auto_batch_size`) picks it (the spec then holds it,
    and its settings no longer say ``auto``); other rows keep theirs. ``keep_global`` False (the ladder): no global batch to divide, one micro-batch per step.
    True (``bench verify``): the global batch stays ``batch_size x grad_accum`` sequences, as
    ``train`` keeps ``--total-batch-tokens`` -- the micro-batch is the largest that fits and divides
    it, and ``grad_accum`` becomes the sequences per step over it."""
    if spec.settings.get("batch_size") != AUTO_BATCH_SIZE:
        return spec
    cfg = run_config(spec)
    if not keep_global:
        cfg.train.total_batch_tokens = None
    b = auto_batch_size(cfg, rt, say=lambda m: print(m, file=sys.stderr))
    fixed = {k: v for k, v in spec.settings.items() if k != "batch_size"}
    if not keep_global:
        return dataclasses.replace(spec, batch_size=b, settings=fixed)
    return dataclasses.replace(spec, batch_size=b, grad_accum=spec.batch_size * spec.grad_accum // b, settings=fixed)


def timed_steps(step: Callable[[], torch.Tensor], n: int, rt: Runtime) -> tuple[list[float], float, list[torch.Tensor]]:
    """Run ``n`` steps; returns ``(ms per step, wall seconds for all, losses)``."""
    losses: list[torch.Tensor] = []
    rt.synchronize()
    t0 = time.perf_counter()
    if rt.device_type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        torch.cuda.synchronize(rt.device)
        ms = [start.elapsed_time(end) for start, end in events]
    else:
        ms = []
        for _ in range(n):
            t = time.perf_counter()
            losses.append(step())
            rt.synchronize()  # no-op on CPU, which runs synchronously
            ms.append(1000 * (time.perf_counter() - t))
    rt.synchronize()
    return ms, time.perf_counter() - t0, losses


def run_stage(spec: StageSpec) -> dict[str, Any]:
    """Build, warm up, time (or profile) one row. Returns its figures:

    ``ms_median``/``ms_min``/``ms_max``/``ms_q25``/``ms_q75`` (ms per timed step: median, extremes,
    quartiles; :func:`quartiles`), ``ms_steps`` (every timed step), ``ms_mean_wall`` (wall time of all
    timed steps / steps), ``tokens_per_s`` (B*T / median), ``mfu`` (None without a peak),
    ``first_step_s`` (the first warm-up step: compile + allocation), ``warmup_s`` (all warm-up
    steps), ``loss_step0``, ``loss_last`` (last timed step), ``peak_mem_bytes``, ``mem_total_bytes``,
    ``params``, ``fused_adamw``, ``peak_flops_source``; with ``profile_dir`` also ``trace``,
    ``profile_table`` and ``breakdown``/``breakdown_md``/``breakdown_table`` (:func:`_write_profile`).
    """
    r = run_config(spec).runtime
    rt = resolve_runtime(r.device, r.dtype, r.compile)
    spec = resolve_batch(spec, rt)
    loader = make_loader(spec, rt.device)
    train, fpt = build_row(spec, rt, loader)
    model, fused = train.model, train.skips_on_device

    def step() -> torch.Tensor:
        return train(loader.next_batch)[0]

    t0 = time.perf_counter()
    loss0 = step().item()  # one sync, untimed
    first_step_s = time.perf_counter() - t0
    for _ in range(spec.warmup - 1):
        step()
    rt.synchronize()
    warmup_s = time.perf_counter() - t0

    result: dict[str, Any] = {}
    if spec.profile_dir is not None:
        ms, wall, losses, prof = _profiled_steps(step, spec.steps, rt)
        result.update(_write_profile(prof, Path(spec.profile_dir), spec.name, rt, spec.steps, spec.grad_accum))
    else:
        ms, wall, losses = timed_steps(step, spec.steps, rt)
    tokens = spec.batch_size * spec.seq_len * spec.grad_accum
    median = statistics.median(ms)
    peak, peak_source = peak_flops(rt.device, rt.dtype, spec.peak_tflops)
    mem_peak, mem_total = memory_stats(rt.device)
    tps = tokens / (median / 1000)
    q25, q75 = quartiles(ms)
    result.update(
        ms_median=median,
        ms_min=min(ms),
        ms_max=max(ms),
        ms_q25=q25,
        ms_q75=q75,
        ms_steps=ms,
        ms_mean_wall=1000 * wall / spec.steps,
        tokens_per_step=tokens,
        tokens_per_s=tps,
        flops_per_token=fpt,
        mfu=fpt * tps / peak if peak else None,
        peak_flops=peak,
        peak_flops_source=peak_source,
        first_step_s=first_step_s,
        warmup_s=warmup_s,
        loss_step0=loss0,
        loss_last=losses[-1].item(),
        peak_mem_bytes=mem_peak,
        mem_total_bytes=mem_total,
        params=sum(p.numel() for p in model.parameters()),
        fused_adamw=fused,
        batch_size=spec.batch_size,
        dtype=rt.dtype,
        compile=rt.compile,
        device=str(rt.device),
        threads=torch.get_num_threads(),
    )
    return result


def quartiles(ms: list[float]) -> tuple[float, float]:
    """First and third quartile of the step times (``statistics.quantiles``, inclusive method);
    with one step, that step twice (no spread measured)."""
    if len(ms) < 2:
        return ms[0], ms[0]
    q = statistics.quantiles(ms, n=4, method="inclusive")
    return q[0], q[2]


def oom_reason(e: BaseException, spec: StageSpec) -> str:
    """One line for a row that ran out of device memory, naming the micro-batch."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"out of memory at B={spec.batch_size} (T={spec.seq_len}, {spec.grad_accum} micro-batch(es) per step): "
        f"{first[:200]}"
    )


def free_device_memory() -> None:
    """Drop what can be dropped after an out-of-memory error (garbage, CUDA's cached blocks)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profiled_steps(step, n: int, rt: Runtime):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        ms, wall, losses = timed_steps(step, n, rt)
    return ms, wall, losses, prof


def _write_profile(prof, out: Path, name: str, rt: Runtime, steps: int, micro_batches: int) -> dict[str, Any]:
    """Chrome trace (open in chrome://tracing or ui.perfetto.dev), the top ops by self time, and the
    time of the ``steps`` profiled steps (``micro_batches`` each) by category
    (:func:`gptspeed.bench.breakdown.write_breakdown`)."""
    from gptspeed.bench.breakdown import estimate_for, write_breakdown

    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace-{name}.json"
    prof.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if rt.device_type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=20)
    (out / f"profile-{name}.txt").write_text(table + "\n")
    return {
        "trace": str(trace),
        "profile_table": table,
        **write_breakdown(prof, out, name, steps, str(rt.device), estimate_for(rt.device_type), micro_batches),
    }
