"""How fast is `gptspeed train`'s default step on this CPU beside nanoGPT, HF transformers and llm.c?

Every row is a fresh process per round, in the harness's interleaved rounds (:func:`harness.interleave`:
the order rotating by one row each round), so drift and the other jobs on a shared machine hit every
row alike; each process runs ``--warmup`` untimed steps (compilation, first-touch allocation) and then
``--steps`` timed steps. This module is also the peers' shared machinery (the process runner, the
gptspeed adapter, the nanoGPT row, the summary and tables), which ``vs_peers_gpu.py`` imports. Rows
(``--peers``):

- ``gptspeed``: ``gptspeed train`` with no speed flags (what a user gets on a CPU; the start line
  says what ``dtype``/``compile`` resolved to), through :func:`run_gptspeed`, the one adapter that
  knows gptspeed's training interface (the CLI flags and ``metrics.jsonl``). Step time = the wall
  time between consecutive records of ``metrics.jsonl`` (``--log-every 1``: ``time_s`` deltas,
  logging included). ``planned`` steps = the preset's ``max_steps`` (a real run's length, which
  ``compile`` auto may depend on); the process is stopped once the timed steps are logged.
- ``gptspeed-eager``: the same with ``--dtype float32 --no-compile`` (gptspeed's own fp32 baseline).
- ``nanogpt`` / ``nanogpt-compile``: nanoGPT's own ``train.py`` (its model.py GPT, its
  ``configure_optimizers``, its loop), run from a scratch copy of the clone as its README says,
  ``--device=cpu --dtype=float32 --compile=False|True --bias=True`` at the same shape; time = its
  printed ``iter N: ... time X ms``.
- ``hf`` / ``hf-compile``: transformers' ``GPT2LMHeadModel`` (sdpa attention, vocab 50257) with
  ``torch.optim.AdamW`` (lr 6e-4, betas (0.9, 0.95), wd 0.1), ``model(input_ids=x, labels=x)``,
  clip 1.0, ``zero_grad(set_to_none=True)``; eager or ``torch.compile``-d; timed per step around
  the whole step including ``loss.item()``.
- ``llmc``: llm.c's ``train_gpt2`` (built from the clone with its Makefile's flags: ``-Ofast
  -march=native -fopenmp -DOMP``), from gptspeed's own initial weights (exported with
  :mod:`llmc`, beside this file); time = its printed ``took X ms``. Only at B=4, T=64, which its
  ``main()`` hardcodes.

All rows are fp32 (gptspeed's default may resolve otherwise: it is reported), train on the same
tinyshakespeare tokens (gptspeed's tokenizer; prepared with ``gptspeed prepare`` unless ``--data``),
use ``--threads`` (``OMP_NUM_THREADS``) threads, and report median ms/step, the spread of the
per-round medians, tokens/s and peak RSS (``wait4``'s ``ru_maxrss``, whole process). Ratios are
taken within each round. ``/proc/loadavg`` is recorded before each run.

    python benchmarks/vs_peers_cpu.py [--shapes 124m,small] [--rounds 3] [--steps 5] [--warmup 2]
        [--peers gptspeed,gptspeed-eager,nanogpt,nanogpt-compile,hf,hf-compile,llmc]
        [--variant 'NAME: FLAGS AND ENV=VALUES'] [--json OUT.json] [--md OUT.md] [--work DIR]
    python benchmarks/vs_peers_cpu.py --cross-check [--shapes 124m] [--json OUT.json]   # losses vs llm.c

``--variant 'bf16: --dtype bfloat16 --no-compile'`` adds a gptspeed row with those flags;
``NAME=VALUE`` tokens set environment variables instead (``'jemalloc:
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2'``); ``{round}``, ``{shape}`` and ``{work}``
and ``{run}`` (this invocation's start time) in them are filled in
(``TORCHINDUCTOR_CACHE_DIR={work}/cache-{run}-{shape}-{round}``: a cold compile cache per round,
warm for the next row that names the same folder). ``start_to_warm_s`` in the
JSON is the time from process start to the end of the warm-up steps (imports, data, model,
compile): the difference between a compiled and an eager row is the compile cost. ``--cross-check``: llm.c's optimizer
settings through gptspeed's flags, one batch (a train shard of B*T+1 tokens), 20 steps, both from
the same weights; prints the per-step losses and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import harness
from harness import loadavg

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("GPTSPEED_PEERS_DIR", ROOT.parent / "shared" / "peers"))
SHARED_DATA = Path(os.environ.get("GPTSPEED_DATA_MIRROR", ROOT.parent / "shared" / "data"))
LLMC_OPTIM_FLAGS = [
    "--lr",
    "1e-4",
    "--beta1",
    "0.9",
    "--beta2",
    "0.999",
    "--eps",
    "1e-8",
    "--weight-decay",
    "0",
    "--grad-clip",
    "0",
    "--warmup-steps",
    "0",
    "--min-lr-ratio",
    "1",
]
ALL_PEERS = ("gptspeed", "gptspeed-eager", "nanogpt", "nanogpt-compile", "hf", "hf-compile", "llmc")
PEER_ROWS = ("nanogpt", "nanogpt-compile", "hf", "hf-compile", "llmc")  # the others are gptspeed's
SEED = 1337
RUN_ID = time.strftime("%Y%m%d-%H%M%S")  # this invocation, for --variant's {run}


@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    batch_size: int
    seq_len: int
    preset: str  # the gptspeed preset a user would start from
    preset_flags: tuple[str, ...]  # what turns that preset into this shape (no speed flags)
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation)

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step: B * T * accum."""
        return self.batch_size * self.seq_len * self.accum


SHAPES = {
    "124m": Shape(
        "124m", 12, 12, 768, 4, 64, "gpt2", ("--batch-size", "4", "--seq-len", "64", "--total-batch-tokens", "256")
    ),
    "small": Shape("small", 4, 4, 128, 16, 128, "nano", ()),  # the nano preset is exactly this shape
    # the pico preset (tests, smoke runs): where a fixed per-step cost (logging) weighs most
    "pico": Shape("pico", 2, 2, 64, 8, 64, "pico", ()),
    # cpu_step_vs_plain.py's shape (issue 2's figure): nano with 2 layers
    "cpu-step": Shape("cpu-step", 2, 4, 128, 16, 128, "nano", ("--n-layer", "2")),
}


@dataclass
class Run:
    """One process's result: per-step wall times (ms) of the timed steps, losses, peak RSS."""

    step_ms: list[float]
    losses: list[float] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    wall_s: float = 0.0
    info: dict = field(default_factory=dict)
    error: str | None = None


# ----------------------------------------------------------------------------------------- helpers
def run_until(
    cmd: list[str], *, cwd: Path, env: dict, on_line: Callable[[str], bool], timeout_s: float
) -> tuple[int, int, float, list[str]]:
    """Run ``cmd``; feed each output line (stdout+stderr) to ``on_line``; kill the process (and its
    process group: compile workers) as soon as it returns True. Returns ``(exit status, peak RSS
    bytes, wall s from start to that line (or to the end), lines)``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        lines = harness.read_lines(proc.stdout.fileno(), on_line, t0 + timeout_s)
        wall = time.perf_counter() - t0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: compile workers die with it
        except ProcessLookupError:
            pass
        _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = status
        proc.stdout.close()
    return status, rusage.ru_maxrss * 1024, wall, lines


def child_env(threads: int, extra: dict | None = None) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "GPTSPEED_DATA_MIRROR": str(SHARED_DATA),
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**env, **(extra or {})}


# ----------------------------------------------------------------------------- gptspeed (adapter)
def run_gptspeed(
    shape: Shape,
    data: Path,
    run_dir: Path,
    flags: list[str],
    *,
    warmup: int,
    steps: int,
    threads: int,
    env_extra: dict | None = None,
    planned_steps: int | None = None,
    timeout_s: float = 7200.0,
    device: str = "cpu",
) -> Run:
    """THE adapter to gptspeed's training: ``gptspeed train`` in a subprocess, read back through its
    ``metrics.jsonl``. Everything this benchmark knows about gptspeed's trainer is here: the CLI
    (preset, shape flags, ``--log-every 1``, ``--eval-every 0``, ``--eval-tokens`` one batch,
    ``--save-every 0``) and the record fields (``step``, ``time_s``, ``train_loss``,
    ``includes_warmup``). ``flags`` are added last (speed switches, or the cross-check's optimizer).

    Step time = ``time_s`` difference of consecutive records (wall clock, logging included),
    in ms. The first ``warmup`` steps (compile, first allocations) are dropped. The process is
    killed once ``warmup + steps`` steps are logged (or ends by itself at ``planned_steps``)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "gptspeed",
        "train",
        "--data",
        str(data),
        "--out",
        str(run_dir),
        "--preset",
        shape.preset,
        *shape.preset_flags,
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-tokens",
        str(shape.tokens),
        "--save-every",
        "0",
        "--device",
        device,
        "--seed",
        str(SEED),
    ]
    if planned_steps is not None:
        cmd += ["--max-steps", str(planned_steps)]
    cmd += flags
    metrics = run_dir / "metrics.jsonl"
    need = warmup + steps
    start_line, t_start, t_warm = {}, time.perf_counter(), {}

    def on_line(line: str) -> bool:
        if line.startswith("gptspeed: "):
            start_line["line"] = line
        elif line.startswith("why: ") and "line" in start_line:  # why dtype / compile resolved so
            start_line["line"] += " / " + line
        if not line.startswith("step ") or not metrics.exists():
            return False
        logged = [json.loads(r)["step"] for r in metrics.read_text().splitlines() if '"step_ms"' in r]
        if logged and logged[-1] >= warmup and "t" not in t_warm:
            t_warm["t"] = time.perf_counter() - t_start
        return bool(logged) and logged[-1] >= need

    status, rss, wall, lines = run_until(
        cmd, cwd=run_dir.parent, env=child_env(threads, env_extra), on_line=on_line, timeout_s=timeout_s
    )
    records = [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if r["step"] > 0 and "step_ms" in r]
    info = {"command": shlex.join(cmd), "start_line": start_line.get("line")}
    if not train or train[-1]["step"] < need:
        return Run([], error=f"gptspeed train stopped before step {need}: " + " | ".join(lines[-4:]), info=info)
    ms, prev = [], records[0]
    for r in train:  # one entry per step: the record interval's wall time / its steps
        per_step = 1000 * (r["time_s"] - prev["time_s"]) / (r["step"] - prev["step"])
        ms += [per_step] * sum(1 for s in range(prev["step"] + 1, r["step"] + 1) if warmup < s <= need)
        prev = r
    losses = [r["train_loss"] for r in train if r["step"] <= need]
    info.update(
        step_ms_field=[r["step_ms"] for r in train if warmup < r["step"] <= need], start_to_warm_s=t_warm.get("t")
    )
    return Run(ms, losses, rss, wall, info=info)


# ------------------------------------------------------------------------------------------ peers
def prepare_data(work: Path, data_arg: str | None) -> Path:
    if data_arg:
        return Path(data_arg)
    out = work / "data" / "tinyshakespeare"
    if not (out / "manifest.json").exists():
        subprocess.run(
            [sys.executable, "-m", "gptspeed", "prepare", "tinyshakespeare", "--out", str(out), "--no-progress"],
            check=True,
            env=child_env(os.cpu_count() or 1),
        )
    return out


def train_tokens(data: Path):
    import numpy as np

    from gptspeed.data import find_shards
    from gptspeed.data.shards import read_shard

    return np.concatenate([read_shard(p) for p in find_shards(data, "train")]), np.concatenate(
        [read_shard(p) for p in find_shards(data, "val")]
    )


def nanogpt_dir(work: Path, data: Path) -> Path:
    """A scratch copy of the nanoGPT clone (its train.py reads ``configurator.py`` and
    ``data/<dataset>/{train,val}.bin`` -- raw uint16, no header -- from the working directory),
    with gptspeed's tinyshakespeare tokens as the dataset ``gptspeed_tinyshakespeare``."""
    d = work / "nanoGPT"
    if not d.exists():
        shutil.copytree(PEERS_DIR / "nanoGPT", d)
        for p in d.rglob("*"):
            p.chmod(p.stat().st_mode | 0o200)
        (d / "data" / "gptspeed_tinyshakespeare").mkdir(parents=True)
        tr, va = train_tokens(data)
        tr.astype("<u2").tofile(d / "data" / "gptspeed_tinyshakespeare" / "train.bin")
        va.astype("<u2").tofile(d / "data" / "gptspeed_tinyshakespeare" / "val.bin")
    return d


def run_nanogpt(
    shape: Shape,
    work: Path,
    data: Path,
    compile: bool,
    *,
    warmup: int,
    steps: int,
    threads: int,
    timeout_s: float = 7200.0,
    device: str = "cpu",
    dtype: str = "float32",
) -> Run:
    """nanoGPT's own train.py at ``shape`` (its ``--gradient_accumulation_steps`` = ``shape.accum``);
    step time = its printed ``iter N: ... time X ms`` (wall time per iteration, ``loss.item()``
    included: ``--log_interval=1``)."""
    d = nanogpt_dir(work, data)
    cmd = [
        sys.executable,
        "train.py",
        f"--device={device}",
        f"--dtype={dtype}",
        f"--compile={compile}",
        f"--batch_size={shape.batch_size}",
        f"--block_size={shape.seq_len}",
        f"--n_layer={shape.n_layer}",
        f"--n_head={shape.n_head}",
        f"--n_embd={shape.n_embd}",
        "--bias=True",
        "--dropout=0.0",
        f"--gradient_accumulation_steps={shape.accum}",
        "--max_iters=1000000",
        "--eval_interval=1000000",
        "--eval_iters=1",
        "--log_interval=1",
        "--dataset=gptspeed_tinyshakespeare",
        "--always_save_checkpoint=False",
        f"--out_dir={work / 'nanogpt-out'}",
    ]
    it = re.compile(r"^iter (\d+): loss ([\d.naif]+), time ([\d.]+)ms")
    got: list[tuple[int, float, float]] = []
    t_start, t_warm = time.perf_counter(), {}

    def on_line(line: str) -> bool:
        m = it.match(line)
        if m:
            got.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
            if len(got) == warmup:
                t_warm["t"] = time.perf_counter() - t_start
        return len(got) >= warmup + steps

    env = child_env(threads)
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")  # nanoGPT imports its own model.py from its folder
    status, rss, wall, lines = run_until(cmd, cwd=d, env=env, on_line=on_line, timeout_s=timeout_s)
    if len(got) < warmup + steps:
        return Run([], error="nanoGPT stopped early: " + " | ".join(lines[-4:]), info={"command": shlex.join(cmd)})
    return Run(
        [ms for i, _, ms in got if i >= warmup][:steps],
        [loss for _, loss, _ in got],
        rss,
        wall,
        info={"command": f"cd {d} && " + shlex.join(cmd), "start_to_warm_s": t_warm.get("t")},
    )


def run_hf(
    shape: Shape, data: Path, compile: bool, *, warmup: int, steps: int, threads: int, timeout_s: float = 7200.0
) -> Run:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker-hf",
        json.dumps({"shape": shape.name, "data": str(data), "compile": compile, "steps": warmup + steps}),
    ]
    got: list[tuple[float, float]] = []
    t_start, t_warm = time.perf_counter(), {}

    def on_line(line: str) -> bool:
        if line.startswith("hf-step "):
            _, ms, loss = line.split()
            got.append((float(ms), float(loss)))
            if len(got) == warmup:
                t_warm["t"] = time.perf_counter() - t_start
        return len(got) >= warmup + steps

    status, rss, wall, lines = run_until(cmd, cwd=ROOT, env=child_env(threads), on_line=on_line, timeout_s=timeout_s)
    if len(got) < warmup + steps:
        return Run([], error="hf worker stopped early: " + " | ".join(lines[-4:]))
    return Run(
        [ms for ms, _ in got[warmup:]],
        [loss for _, loss in got],
        rss,
        wall,
        info={"command": shlex.join(cmd), "start_to_warm_s": t_warm.get("t")},
    )


def hf_worker(spec: dict) -> int:
    """The Hugging Face row, in its own process: prints ``hf-step MS LOSS`` per step."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = SHAPES[spec["shape"]]
    tokens, _ = train_tokens(Path(spec["data"]))
    torch.manual_seed(SEED)
    config = GPT2Config(
        vocab_size=50257,
        n_positions=shape.seq_len,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step_fn = torch.compile(model) if spec["compile"] else model
    n = shape.tokens
    for i in range(spec["steps"]):
        t0 = time.perf_counter()
        off = (i * n) % (len(tokens) - n)
        x = torch.from_numpy(tokens[off : off + n].astype(np.int64)).view(shape.batch_size, shape.seq_len)
        loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lossf = loss.item()
        print(f"hf-step {1000 * (time.perf_counter() - t0):.3f} {lossf:.6f}", flush=True)
    return 0


def llmc_binary(work: Path, cflags: tuple[str, ...] | None = None) -> Path:
    """llm.c's train_gpt2 built once per set of compiler flags (default: its Makefile's)."""
    import hashlib

    from llmc import MAKEFILE_CFLAGS, build_train_gpt2

    flags = tuple(cflags) if cflags else tuple(MAKEFILE_CFLAGS)
    folder = (
        "llmc-bin"
        if flags == tuple(MAKEFILE_CFLAGS)
        else "llmc-bin-" + hashlib.sha1(" ".join(flags).encode()).hexdigest()[:8]
    )
    binary = work / folder / "train_gpt2"
    if not binary.exists():
        build_train_gpt2(PEERS_DIR / "llm.c", binary.parent, flags)
    return binary


def initial_model(shape: Shape):
    """gptspeed's initial weights for ``shape``, built as ``gptspeed train`` builds them
    (``torch.manual_seed(seed); GPT(config)``; the cross-check's equal step-0 losses confirm it)."""
    import torch

    from gptspeed.model import GPT, GPTConfig

    torch.manual_seed(SEED)
    return GPT(GPTConfig(n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd, block_size=shape.seq_len))


def llmc_dir(work: Path, shape: Shape, data: Path, one_batch: bool) -> Path:
    from llmc import prepare_llmc_dir

    d = work / f"llmc-{shape.name}{'-1batch' if one_batch else ''}"
    if not (d / "gpt2_124M.bin").exists():
        tr, va = train_tokens(data)
        n = shape.tokens + 1
        if one_batch:
            tr, va = tr[:n], tr[n : 2 * n]
        prepare_llmc_dir(d, initial_model(shape), tr, va)
    return d


def run_llmc(shape: Shape, work: Path, data: Path, *, warmup: int, steps: int, threads: int) -> Run:
    from llmc import LLMC_B, LLMC_T, run_train_gpt2

    if (shape.batch_size, shape.seq_len) != (LLMC_B, LLMC_T):
        return Run([], error=f"skipped: llm.c's train_gpt2.c hardcodes B={LLMC_B}, T={LLMC_T}")
    r = run_train_gpt2(llmc_binary(work), llmc_dir(work, shape, data, one_batch=False), warmup + steps, threads=threads)
    return Run(
        r["step_ms"][warmup:],
        r["losses"],
        r["peak_rss_bytes"],
        r["wall_s"],
        info={
            "command": f"cd {llmc_dir(work, shape, data, False)} && OMP_NUM_THREADS={threads} {llmc_binary(work)}",
            "first_step_ms": r["step_ms"][0],
        },
    )


# ---------------------------------------------------------------------------------------- driver
def parse_variant(text: str) -> tuple[str, list[str], dict]:
    name, _, rest = text.partition(":")
    flags, env = [], {}
    for tok in shlex.split(rest):
        m = re.match(r"^([A-Z_][A-Z0-9_]*)=(.*)$", tok)
        if m:
            env[m.group(1)] = m.group(2)
        else:
            flags.append(tok)
    return name.strip(), flags, env


def interleave(
    rows: list[str],
    rounds: int,
    run_one: Callable[[str, int], Run],
    label: str,
    after_each: Callable[[dict], None] | None = None,
) -> dict[str, list[dict]]:
    """Every row's process in each of ``rounds`` rounds, in :func:`harness.interleave`'s order (rotated
    by one row a round: a fixed order gave two identical gptspeed rows a steady 0.88-0.98x gap),
    ``run_one(row, round)`` giving each process's :class:`Run`. A row whose error starts with
    "skipped" (it cannot run here) is dropped from the later rounds. Returns each row's entries
    (round, load average before it, step times, losses, peak RSS, wall and process seconds, error,
    the run's info, median); ``after_each(per_row)`` runs after every entry."""

    def entry(row: str, rnd: int) -> dict:
        t0, load = time.time(), loadavg()
        run = run_one(row, rnd)
        e = {
            "round": rnd,
            "loadavg": load,
            "step_ms": run.step_ms,
            "losses": run.losses,
            "peak_rss_bytes": run.peak_rss_bytes,
            "wall_s": run.wall_s,
            "error": run.error,
            "process_s": time.time() - t0,
            **run.info,
        }
        if run.step_ms:
            e["median_ms"] = statistics.median(run.step_ms)
        med = f"{e['median_ms']:.1f} ms/step" if run.step_ms else run.error
        print(f"[{label} round {rnd + 1}/{rounds}] {row}: {med} (load {load}; {e['process_s']:.0f} s)", flush=True)
        return e

    return harness.interleave(
        rows, rounds, entry, drop=lambda e: (e["error"] or "").startswith("skipped"), after_each=after_each
    )


def measure(args, shape: Shape, work: Path, data: Path, rows: list[str], variants: dict, after_each=None) -> dict:
    """All rows of one shape, interleaved (:func:`interleave`); ``after_each(summary)`` gets the
    summary so far (:func:`summarize`) after every process."""

    def run_one(row: str, rnd: int) -> Run:
        kw = dict(warmup=args.warmup, steps=args.steps, threads=args.threads)
        if row == "gptspeed":
            return run_gptspeed(shape, data, work / "runs" / row, [], planned_steps=args.planned_steps, **kw)
        if row == "gptspeed-eager":
            return run_gptspeed(
                shape,
                data,
                work / "runs" / row,
                ["--dtype", "float32", "--no-compile"],
                planned_steps=args.planned_steps,
                **kw,
            )
        if row in variants:
            flags, env = variants[row]
            fill = dict(round=rnd, shape=shape.name, work=work, run=RUN_ID)
            flags = [f.format(**fill) for f in flags]
            env = {k: v.format(**fill) for k, v in env.items()}
            return run_gptspeed(
                shape, data, work / "runs" / row, flags, env_extra=env, planned_steps=args.planned_steps, **kw
            )
        if row in ("nanogpt", "nanogpt-compile"):
            return run_nanogpt(shape, work, data, row.endswith("compile"), **kw)
        if row in ("hf", "hf-compile"):
            return run_hf(shape, data, row.endswith("compile"), **kw)
        if row == "llmc":
            return run_llmc(shape, work, data, **kw)
        raise SystemExit(f"unknown row {row!r}")

    partial = None if after_each is None else (lambda per_row: after_each(summarize(shape, per_row)))
    return summarize(shape, interleave(rows, args.rounds, run_one, shape.name, partial))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _round_steps(entries: list[dict], rnd: int) -> list[float] | None:
    e = [x for x in entries if x["round"] == rnd and "median_ms" in x]
    return e[0]["step_ms"] if e else None


def summarize(shape: Shape, per_row: dict[str, list[dict]]) -> dict:
    """Each row's figures (the median of its per-round medians, each round's, the min-max step
    (:func:`harness.spread`), tokens/s, peak RSS, start-to-warm seconds, step-0 loss, and its speed
    against the first row round by round, :func:`harness.ratios`), and per round the default's
    speed against the fastest peer and against its own eager fp32 row."""
    summary = {}
    for row, entries in per_row.items():
        meds = [e["median_ms"] for e in entries if "median_ms" in e]
        if not meds:
            summary[row] = {"error": entries[0]["error"] if entries else "not run"}
            continue
        steps = harness.spread(m for e in entries for m in e["step_ms"])
        rss = [e["peak_rss_bytes"] for e in entries if e["peak_rss_bytes"]]
        summary[row] = {
            "median_ms": statistics.median(meds),
            "round_medians_ms": meds,
            "min_ms": steps["min"],
            "mean_ms": statistics.fmean(m for e in entries for m in e["step_ms"]),
            "max_ms": steps["max"],
            "tokens_per_s": shape.tokens / statistics.median(meds) * 1000,
            "peak_rss_bytes": max(rss) if rss else None,
            "start_to_warm_s": _median([e.get("start_to_warm_s") for e in entries]),
            "first_loss": entries[0]["losses"][0] if entries[0]["losses"] else None,
        }
    peers = [r for r in per_row if r in PEER_ROWS and "median_ms" in summary.get(r, {})]
    n_rounds = max((len(v) for v in per_row.values()), default=0)
    ref = next(iter(per_row), None)  # every row against the first, round by round
    for row in summary:
        both = [(_round_steps(per_row[ref], k), _round_steps(per_row[row], k)) for k in range(n_rounds)]
        speed = harness.ratios([a for a, b in both if a and b], [b for a, b in both if a and b])
        if speed["per_round"] and "error" not in summary[row]:
            summary[row].update(
                vs=ref, speed_vs_first_row=speed["median"], speed_vs_first_row_per_round=speed["per_round"]
            )
    per_round = []
    for rnd in range(n_rounds):
        med = {row: statistics.median(ms) for row in per_row if (ms := _round_steps(per_row[row], rnd))}
        ours, eager = med.get("gptspeed"), med.get("gptspeed-eager")
        fastest = min((p for p in peers if p in med), key=med.get, default=None)
        per_round.append(
            {
                "round": rnd,
                "fastest_peer": fastest,
                "speedup_vs_fastest_peer": med[fastest] / ours if ours and fastest else None,
                "speedup_vs_own_eager_fp32": eager / ours if ours and eager else None,
            }
        )
    return {"shape": shape.__dict__, "rows": summary, "runs": per_row, "per_round": per_round}


def markdown(result: dict) -> str:
    out = []
    for s in result["shapes"]:
        sh = s["shape"]
        accum = sh.get("accum", 1)
        out.append(
            f"\n**{sh['name']}**: n_layer {sh['n_layer']}, n_head {sh['n_head']}, n_embd {sh['n_embd']}, "
            f"B={sh['batch_size']}, T={sh['seq_len']}{f' x {accum} micro-batches' if accum > 1 else ''} "
            f"({sh['batch_size'] * sh['seq_len'] * accum:,} tokens/step)\n"
        )
        first = next(iter(s["rows"]), "")
        out.append(
            "| row | median ms/step | round medians (ms) | min–max step ms | tokens/s | peak RSS | "
            f"start→warm s | loss step 0 | speed vs {first} (median of per-round ratios) |"
        )
        out.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        for row, r in s["rows"].items():
            if "error" in r:
                out.append(f"| {row} | {r['error']} | | | | | | | |")
                continue
            rss = f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" if r["peak_rss_bytes"] else "?"
            loss = f"{r['first_loss']:.4f}" if r["first_loss"] is not None else ""
            warm = f"{r['start_to_warm_s']:.1f}" if r.get("start_to_warm_s") is not None else ""
            out.append(
                f"| {row} | {r['median_ms']:,.1f} | {', '.join(f'{m:,.0f}' for m in r['round_medians_ms'])} | "
                f"{r['min_ms']:,.0f}–{r['max_ms']:,.0f} | {r['tokens_per_s']:,.0f} | {rss} | {warm} | {loss} | "
                f"{r.get('speed_vs_first_row', float('nan')):.3f}× |"
            )
        out.append("")
        out.append(
            f"| round | load (1/5/15 min) before {first} | fastest peer | gptspeed default vs fastest peer "
            "| vs own eager fp32 |"
        )
        out.append("|--:|---|---|--:|--:|")
        for r in s["per_round"]:
            load = next((e["loadavg"] for e in s["runs"].get(first, []) if e["round"] == r["round"]), "")
            f = lambda x: f"{x:.2f}×" if x else "—"  # noqa: E731
            out.append(
                f"| {r['round'] + 1} | {load} | {r['fastest_peer'] or '—'} | {f(r['speedup_vs_fastest_peer'])} "
                f"| {f(r['speedup_vs_own_eager_fp32'])} |"
            )
        starts = {e.get("start_line") for e in s["runs"].get("gptspeed", []) if e.get("start_line")}
        for line in starts:
            out.append(f"\ngptspeed default's start line: `{line}`")
    return "\n".join(out) + "\n"


def cross_check(args, shape: Shape, work: Path, data: Path, steps: int = 20) -> dict:
    """gptspeed's per-step losses vs llm.c's from the same weights on one batch, llm.c's AdamW."""
    from llmc import run_train_gpt2

    d = llmc_dir(work, shape, data, one_batch=True)
    one = work / f"data-1batch-{shape.name}"
    one.mkdir(parents=True, exist_ok=True)
    shutil.copy(d / "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", one / "train_000000.bin")
    shutil.copy(d / "dev/data/tinyshakespeare/tiny_shakespeare_val.bin", one / "val_000000.bin")
    flags = [
        "--dtype",
        "float32",
        "--no-compile",
        "--max-steps",
        str(steps),
        *LLMC_OPTIM_FLAGS,
        *args.cross_check_flags,
    ]
    t0 = time.time()
    ours = run_gptspeed(shape, one, work / "runs" / "cross-check", flags, warmup=0, steps=steps, threads=args.threads)
    t1 = time.time()
    theirs = run_train_gpt2(llmc_binary(work, tuple(args.llmc_cflags.split()) or None), d, steps, threads=args.threads)
    diffs = [abs(a - b) for a, b in zip(ours.losses, theirs["losses"])]
    return {
        "shape": shape.__dict__,
        "steps": steps,
        "gptspeed_losses": ours.losses,
        "llmc_losses": theirs["losses"],
        "max_abs_diff": max(diffs) if diffs else None,
        "gptspeed_command": ours.info.get("command"),
        "gptspeed_error": ours.error,
        "gptspeed_s": t1 - t0,
        "llmc_s": time.time() - t1,
        "llmc_val_loss_step0": theirs["val_losses"][:1],
        "llmc_cflags": args.llmc_cflags or "the Makefile's",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="124m,small", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument(
        "--peers",
        default="gptspeed,gptspeed-eager,nanogpt,nanogpt-compile,hf,hf-compile,llmc",
        help="comma list of rows, in run order: " + ", ".join(ALL_PEERS) + " and --variant names",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="'NAME: FLAGS ENV=VALUE ...': an extra gptspeed train row (add NAME to --peers "
        "to choose its place; else it runs last)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (>= 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP_NUM_THREADS for every row")
    ap.add_argument(
        "--planned-steps",
        type=int,
        default=None,
        help="gptspeed rows: --max-steps (default: the preset's, a real run's length)",
    )
    ap.add_argument("--data", default=None, help="a prepared gptspeed data folder (default: tinyshakespeare)")
    ap.add_argument("--work", default="/tmp/gptspeed-peers", help="scratch folder (peer copies, runs, llm.c build)")
    ap.add_argument("--json", default=None, help="write everything here")
    ap.add_argument("--md", default=None, help="write the tables here")
    ap.add_argument("--cross-check", action="store_true", help="only the loss cross-check against llm.c")
    ap.add_argument("--cross-check-flags", default="", help="extra gptspeed flags for the cross-check")
    ap.add_argument(
        "--llmc-cflags",
        default="",
        help="compiler flags for llm.c's train_gpt2 in the cross-check "
        "(default: its Makefile's, -Ofast ...; e.g. '-O3 -march=native -fopenmp -DOMP' without fast-math)",
    )
    ap.add_argument("--worker-hf", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv[1:])
    if args.worker_hf:
        return hf_worker(json.loads(args.worker_hf))
    args.cross_check_flags = shlex.split(args.cross_check_flags)
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step compiles / allocates)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "runs").mkdir(exist_ok=True)
    os.environ.setdefault("GPTSPEED_DATA_MIRROR", str(SHARED_DATA))
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    data = prepare_data(work, args.data)
    env = {
        **harness.environment("cpu", argv),
        **{f"{name}_source": str(PEERS_DIR / name) for name in ("nanoGPT", "llm.c")},
    }
    result = {"environment": env, "settings": {k: v for k, v in vars(args).items() if k != "worker_hf"}}
    if args.cross_check:
        result["cross_check"] = [cross_check(args, s, work, data) for s in shapes]
        for c in result["cross_check"]:
            print(
                f"cross-check {c['shape']['name']}: max |gptspeed - llm.c| over {c['steps']} steps = "
                f"{c['max_abs_diff']}"
            )
            for i, (a, b) in enumerate(zip(c["gptspeed_losses"], c["llmc_losses"])):
                print(f"  step {i:2d}  gptspeed {a:.6f}  llm.c {b:.6f}  diff {a - b:+.2e}")
    else:
        variants = {}
        for v in args.variant:
            name, flags, env = parse_variant(v)
            variants[name] = (flags, env)
        rows = args.peers.split(",")
        rows += [v for v in variants if v not in rows]
        head = harness.header({**env, "threads": args.threads})
        done: list[dict] = []

        def partial(summary: dict) -> None:  # after every process: a command cut short keeps its rows
            part = {**result, "complete": False, "shapes": [*done, summary]}
            harness.write_outputs(
                head + markdown(part) + "\n**Incomplete**: written after each process.\n", part, args.md, args.json
            )

        for s in shapes:
            done.append(measure(args, s, work, data, rows, variants, partial))
        result.update(complete=True, shapes=done)
        result["environment"]["loadavg_end"] = loadavg()
        print(head + markdown(result))
        harness.write_outputs(head + markdown(result), None, args.md, None)
    harness.write_outputs(None, result, None, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
