"""How fast is `gptspeed train`'s default step on one GPU beside nanoGPT and llm.c?

The same model (GPT-2 124M: 12 layers, 12 heads, 768 wide, vocabulary 50304 in every tool), the
same micro-batch (``--batch-size``, default 16) and sequence length (``--seq-len``, 1024), the same
tokens per optimizer step (B x T x ``--accum``, default 4: 65,536 tokens) and the same tokens
(one prepared gptspeed data folder, ``--data``; nanoGPT gets them as its raw uint16 ``train.bin``,
llm.c reads the shards as they are: gptspeed writes llm.c's format). Every row is a fresh process
per round, in the harness's interleaved rounds (the order rotating by one row each round: A B C, B C
A, C A B), so a warm GPU or a cache filled by the row before favours no row. Each process runs ``--warmup`` untimed steps (the
compile), then ``--steps`` timed ones, and is stopped there.

Rows (``--peers``, in run order):

- ``gptspeed``: ``gptspeed train --preset gpt2`` with no speed flag (what a user gets: bf16,
  torch.compile, SDPA, vocabulary 50304, fused AdamW, the plain loss; the start line is recorded)
  and ``--batch-size/--seq-len/--total-batch-tokens`` for the shape. Step time = wall time between
  consecutive ``metrics.jsonl`` records (``--log-every 1``: one host read per step).
- ``nanogpt``: nanoGPT's ``train.py`` as its README runs it on a GPU (``--compile=True
  --dtype=bfloat16``; its model.py uses SDPA and, on CUDA, fused AdamW), ``--bias=True`` (GPT-2's
  biases, as gptspeed and llm.c have them); step time = its printed ``time X ms`` per iteration
  (wall time, ``loss.item()`` included at ``--log_interval=1``).
- ``llmc``: llm.c's ``train_gpt2cu`` built here from the clone for the GPU it runs on
  (:func:`llmc.llmc_cuda_make`: ``make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1
  GPU_COMPUTE_CAPABILITY=90`` on an H100, the capability read from ``nvidia-smi``: llm.c's own
  detection is dead -- its Makefile writes ``$(nvidia-smi ...)``, a make variable, not
  ``$(shell ...)`` -- so without it nvcc builds for its default architecture), with cuDNN attention
  (``USE_CUDNN=1``, what llm.c's reported 468k tokens/s per H100 runs, linked with ``-lnvrtc``: the
  frontend's NVRTC engine needs it) when cuDNN frontend's headers are carried and NVRTC is found (``bash ../shared/device/carry.sh nvidia-cudnn-frontend==1.32.0``; ``--llmc-cudnn
  auto|on|off``) -- if that build fails, again without it, and the row says so. The make line is
  recorded with the row (``build`` in the JSON, under the tables in the Markdown). ``-e d12`` (a
  fresh GPT-2 124M), the shape's ``-b -t -d``, its defaults otherwise (bf16, GeLU recompute ``-r 1``)
  unless ``--llmc-flags`` passes its own flags through, e.g. ``--llmc-flags "-r 0"`` (no recompute, as
  llm.c's GPT-2 124M record runs: ``-b 64 -t 1024 -d 524288 -r 0``; added last, so they win; the
  flags the row sets itself from the shape, ``--steps`` and ``--data`` -- ``-i -j -e -t -d -x`` -- are
  refused: :func:`llmc.check_llmc_flags`); step time = its printed ``X ms`` per step (CUDA events
  around the step). The command line is in the JSON (``command``).
- ``--variant 'NAME: FLAGS ENV=VALUE'``: more gptspeed rows, e.g. ``'cudnn: --sdpa-backend cudnn'``,
  ``'fused-ce: --loss fused'``, ``'fp8: --fp8'``, ``'muon: --optimizer muon'``, ``'B32: --batch-size 32
  --total-batch-tokens 65536'`` (flags after the shape's, so they override it); ``NAME=VALUE`` tokens
  set environment variables instead, e.g. ``'cd: TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1'``.
- ``--variant 'NAME: llmc FLAGS'``: another llm.c row with train_gpt2cu flags of its own after
  ``--llmc-flags``, e.g. ``'llmc-B64: llmc -b 64'`` (llm.c's micro-batch 64 at the shape's tokens per
  step); it shares the ``llmc`` row's build.

Reported per row: median ms/step (the median of the per-round medians), each round's median, the
min-max step, tokens/s (tokens per step / median), and the speed against the first row, round by
round. What each tool's time includes differs a little (above); ``wall_s`` (process start to the
last timed step) is in the JSON. ``--json`` and ``--md`` are rewritten after every process, each
atomically (``complete`` false until the last), so a command cut at its limit keeps every finished row.

    python benchmarks/vs_peers_gpu.py --data DATA_DIR [--rounds 3] [--steps 20] [--warmup 8]
        [--batch-size 16] [--seq-len 1024] [--accum 4] [--peers gptspeed,nanogpt,llmc]
        [--variant 'NAME: FLAGS'] [--llmc-flags '-r 0'] [--json OUT.json] [--md OUT.md] [--work DIR]
        [--row-timeout 420]

llm.c's build alone, ahead of its rows (``benchmarks/gpu_session.py`` starts it first, in the
background): ``--build-llmc --work DIR [--timeout S]`` (:func:`build_main`); later runs with the same
``--work`` use it. llm.c at the settings of its record, alone, 10 timed steps: ``--peers llmc --batch-size 64 --accum 8
--llmc-flags '-r 0' --rounds 1 --warmup 2 --steps 10`` (``-b 64 -t 1024 -d 524288 -r 0``).

``--device cpu`` with a small shape (``--n-layer 2 --n-embd 64 --n-head 2 --seq-len 64``) runs the
gptspeed and nanoGPT rows on a CPU (fp32, no compile): the CI test of this script, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import harness
import vs_peers_cpu as pc  # the peers' shared machinery: processes, the gptspeed adapter, the tables

GPU_PEERS = ("gptspeed", "nanogpt", "llmc")
# llm.c's per-step line (train_gpt2.cu, main()): "step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)|
# lr %.2e | %.2f ms | %.1f%% bf16 MFU | %.0f tok/s"
LLMC_STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([-+\w.]+) .*\| ([\d.]+) ms \| ([-\d.]+)% bf16 MFU")


def parse_llmc_line(line: str) -> tuple[int, float, float, float] | None:
    """``(step, loss, ms, mfu %)`` from one of train_gpt2cu's per-step lines, else None."""
    m = LLMC_STEP.match(line.strip())
    if not m:
        return None
    return int(m.group(1)), float(m.group(3)), float(m.group(4)), float(m.group(5))


CARRY = Path(__file__).resolve().parents[1] / ".carry"


def llmc_cuda_binary(
    work: Path, make_flags: list[str], cudnn: str = "auto", timeout_s: float | None = None
) -> tuple[Path, dict]:
    """llm.c's ``train_gpt2cu``, built once in a scratch copy of the clone (its Makefile writes
    next to the sources) with :func:`gptspeed.llmc.llmc_cuda_make`'s line; returns ``(binary, build)``
    where ``build`` (also ``llmc-build.json``) holds the make line, the compute capability and where
    it came from, whether cuDNN attention is on and why, and the seconds. When a cuDNN build fails
    under ``cudnn="auto"`` it builds again without cuDNN (``build["cudnn_note"]`` says why).
    RuntimeError with make's output if the build fails -- then, and in every later call on the same
    ``work`` folder, without building again."""
    from llmc import llmc_cuda_make

    src = work / "llm.c"
    if not src.exists():
        shutil.copytree(pc.PEERS_DIR / "llm.c", src)
    binary = src / "train_gpt2cu"
    failed, record = work / "llmc-build-failed.txt", work / "llmc-build.json"
    if failed.exists():  # built and failed in an earlier round: not again
        raise RuntimeError(failed.read_text())
    if binary.exists() and record.exists():
        return binary, json.loads(record.read_text())
    build = llmc_cuda_make(src, work, make_flags, cudnn=cudnn, carry=CARRY)
    t0 = time.time()
    done = _make(build, work / "llmc-build.log", timeout_s)
    if (
        (done.returncode != 0 or not binary.exists())
        and build["cudnn"]
        and cudnn == "auto"
        and "USE_CUDNN=" not in " ".join(make_flags)
    ):
        why = f"the USE_CUDNN=1 build failed ({_tail(done, 300)}; llmc-build-cudnn.log)"
        (work / "llmc-build.log").rename(work / "llmc-build-cudnn.log")
        subprocess.run(["make", "-C", str(src), "clean"], capture_output=True, text=True)
        build = {**llmc_cuda_make(src, work, make_flags, cudnn="off", carry=CARRY), "cudnn_note": why}
        done = _make(build, work / "llmc-build.log", timeout_s)
    if done.returncode != 0 or not binary.exists():
        failed.write_text(
            f"llm.c build failed ({build['line']}; cuDNN attention {'on' if build['cudnn'] else 'off'}: "
            f"{build['cudnn_note']}): {_tail(done, 600)}"
        )
        raise RuntimeError(failed.read_text())
    build["seconds"] = round(time.time() - t0, 1)
    record.write_text(json.dumps(build, indent=1) + "\n")
    print(
        f"built {binary} in {build['seconds']:.0f} s: {build['line']} (GPU_COMPUTE_CAPABILITY "
        f"{build['compute_capability']} from {build['capability_source']}; cuDNN "
        f"{'on' if build['cudnn'] else 'off'}: {build['cudnn_note']})",
        flush=True,
    )
    return binary, build


def _make(build: dict, log: Path, timeout_s: float | None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(build["command"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        done = subprocess.CompletedProcess(build["command"], 124, out, f"make timed out after {timeout_s:g} s")
    log.write_text(f"$ {build['line']}\n" + done.stdout + done.stderr)
    return done


def _tail(done: subprocess.CompletedProcess, n: int) -> str:
    """make's last output, on one line (its "Entering/Leaving directory" lines left out)."""
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip() and "ing directory" not in ln]
    return " | ".join(lines)[-n:]


def llmc_data(work: Path, data: Path) -> tuple[str, str]:
    """Glob patterns for train_gpt2cu's ``-i``/``-j``: the data folder's shards, linked under
    names llm.c's loader globs for (gptspeed's shards already carry llm.c's header)."""
    from gptspeed.data import find_shards

    d = work / "llmc-data"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        for i, p in enumerate(find_shards(data, split)):
            link = d / f"gptspeed_{split}_{i:06d}.bin"
            if not link.exists():
                link.symlink_to(Path(p).resolve())
    return str(d / "gptspeed_train_*.bin"), str(d / "gptspeed_val_*.bin")


_PREBUILDS: dict[Path, Future] = {}  # work folder -> llm.c's build started ahead by prebuild_llmc


def prebuild_llmc(work: Path, make_flags: list[str], cudnn: str = "auto", timeout_s: float | None = None) -> Future:
    """Start :func:`llmc_cuda_binary` in a background thread, so that nvcc (minutes with cuDNN
    attention, on the CPU) runs while the first rows train on the GPU instead of holding the GPU idle;
    the llm.c row (:func:`run_llmc_cuda` on the same ``work``) waits for it. Its CPU load can slow
    the processes beside it a little: the rows are interleaved and the later rounds run without it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmc-build")
    future = pool.submit(llmc_cuda_binary, work, make_flags, cudnn, timeout_s)
    pool.shutdown(wait=False)
    _PREBUILDS[Path(work)] = future
    return future


def run_llmc_cuda(
    shape: pc.Shape,
    work: Path,
    data: Path,
    *,
    warmup: int,
    steps: int,
    make_flags: list[str],
    timeout_s: float,
    cudnn: str = "auto",
    llmc_flags: list[str] | tuple[str, ...] = (),
    env_extra: dict | None = None,
) -> pc.Run:
    """One llm.c row: ``train_gpt2cu`` (built by :func:`llmc_cuda_binary`, or waited for when
    :func:`prebuild_llmc` started it) at ``shape`` with ``llmc_flags`` last
    (:func:`llmc.llmc_cuda_train_command`), stopped after ``warmup + steps`` step lines; the timed
    steps' ms as llm.c prints them, its MFU per step, the command line and the build in ``info``."""
    from llmc import llmc_cuda_train_command

    ahead = _PREBUILDS.pop(Path(work), None)
    if ahead is not None:  # its result (or its failure) is on disk now: the call below reads it
        ahead.exception()
    try:
        binary, build = llmc_cuda_binary(work, make_flags, cudnn, timeout_s)
    except RuntimeError as e:  # no nvcc, no cuBLAS headers, ...: the row says so, the other rows run
        return pc.Run([], error=str(e))
    train, val = llmc_data(work, data)
    need = warmup + steps
    cmd = llmc_cuda_train_command(
        binary,
        train,
        val,
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        tokens=shape.tokens,
        steps=need + 1,
        extra=llmc_flags,
    )
    got: list[tuple[int, float, float, float]] = []
    t_start, t_warm = time.perf_counter(), {}

    def on_line(line: str) -> bool:
        parsed = parse_llmc_line(line)
        if parsed:
            got.append(parsed)
            if len(got) == warmup:
                t_warm["t"] = time.perf_counter() - t_start
        return len(got) >= need

    status, rss, wall, lines = pc.run_until(
        cmd,
        cwd=binary.parent,
        env={**os.environ, **build["env"], **(env_extra or {})},
        on_line=on_line,
        timeout_s=timeout_s,
    )
    info = {
        "command": f"cd {binary.parent} && " + shlex.join(cmd),
        "start_to_warm_s": t_warm.get("t"),
        "build": build,
        "llmc_flags": list(llmc_flags),
    }
    if len(got) < need:
        return pc.Run([], error="llm.c stopped early: " + " | ".join(lines[-4:]), info=info)
    info["mfu_percent"] = [m for _, _, _, m in got[warmup:need]]
    return pc.Run([ms for _, _, ms, _ in got[warmup:need]], [loss for _, loss, _, _ in got], rss, wall, info=info)


def make_shape(args) -> pc.Shape:
    T, B = args.seq_len, args.batch_size
    flags = ("--batch-size", str(B), "--seq-len", str(T), "--total-batch-tokens", str(B * T * args.accum))
    if (args.n_layer, args.n_head, args.n_embd) != (12, 12, 768):
        flags += ("--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd))
    return pc.Shape(
        f"L{args.n_layer}-C{args.n_embd}-B{B}-T{T}-x{args.accum}",
        args.n_layer,
        args.n_head,
        args.n_embd,
        B,
        T,
        "gpt2",
        flags,
        accum=args.accum,
    )


def is_llmc(row: str, variants: dict) -> bool:
    """An llm.c row: ``llmc``, or a ``--variant 'NAME: llmc FLAGS'``."""
    return row == "llmc" or variants.get(row, ([], {}))[0][:1] == ["llmc"]


def llmc_flags(args, row: str, variants: dict) -> list[str]:
    """train_gpt2cu flags of an llm.c row: ``--llmc-flags``, then its variant's own."""
    own = variants[row][0][1:] if row in variants else []
    return [*shlex.split(getattr(args, "llmc_flags", "") or ""), *own]


def run_row(row: str, args, shape: pc.Shape, work: Path, data: Path, variants: dict) -> pc.Run:
    kw = dict(warmup=args.warmup, steps=args.steps)
    cpu = args.device == "cpu"
    if is_llmc(row, variants):
        if cpu:
            return pc.Run(
                [], error="skipped: train_gpt2cu needs a CUDA GPU (benchmarks/vs_peers_cpu.py runs llm.c's CPU trainer)"
            )
        return run_llmc_cuda(
            shape,
            work,
            data,
            make_flags=shlex.split(args.llmc_make),
            timeout_s=args.row_timeout,
            cudnn=getattr(args, "llmc_cudnn", "auto"),
            llmc_flags=llmc_flags(args, row, variants),
            env_extra=variants.get(row, ([], {}))[1],
            **kw,
        )
    if row == "gptspeed" or row in variants:
        extra, env = variants.get(row, ([], {}))
        flags = (["--dtype", "float32", "--no-compile"] if cpu else []) + extra
        return pc.run_gptspeed(
            shape,
            data,
            work / "runs" / row,
            flags,
            threads=os.cpu_count() or 1,
            device=args.device,
            timeout_s=args.row_timeout,
            env_extra=env,
            **kw,
        )
    if row == "nanogpt":
        return pc.run_nanogpt(
            shape,
            work,
            data,
            not cpu,
            threads=os.cpu_count() or 1,
            device=args.device,
            dtype="float32" if cpu else "bfloat16",
            timeout_s=args.row_timeout,
            **kw,
        )
    raise SystemExit(f"unknown row {row!r}: choose from {', '.join(GPU_PEERS)} or a --variant name")


def measure(args, shape: pc.Shape, work: Path, data: Path, rows: list[str], variants: dict, after_each=None) -> dict:
    """Every row, interleaved (:func:`vs_peers_cpu.interleave`); a peer that fails to build or start
    is that row's error. ``after_each(summary)`` gets the summary so far after every process."""

    def run_one(row: str, rnd: int) -> pc.Run:
        try:
            return run_row(row, args, shape, work, data, variants)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return pc.Run([], error=f"{type(e).__name__}: {str(e)[:600]}")

    if any(is_llmc(r, variants) for r in rows) and args.device == "cuda":  # nvcc on the CPU while the first rows train
        prebuild_llmc(work, shlex.split(args.llmc_make), getattr(args, "llmc_cudnn", "auto"), args.row_timeout)

    def save_partial(per_row: dict) -> None:  # what is measured so far survives a command cut off at its limit
        if after_each is not None:
            after_each(pc.summarize(shape, per_row))

    return pc.summarize(shape, pc.interleave(rows, args.rounds, run_one, shape.name, save_partial))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a prepared gptspeed data folder (train and val shards)")
    ap.add_argument(
        "--peers",
        default=",".join(GPU_PEERS),
        help="comma list of rows, in run order: " + ", ".join(GPU_PEERS) + " and --variant names",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="'NAME: FLAGS ENV=VALUE': an extra gptspeed train row (flags, environment variables)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps per run (compile; >= 1)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--llmc-make", default="", help="extra make variables for train_gpt2cu, e.g. 'PRECISION=FP16'")
    ap.add_argument(
        "--llmc-flags",
        default="",
        metavar="'FLAGS'",
        help="train_gpt2cu flags for the llm.c rows, added last, e.g. '-r 0' (no GELU recompute) or "
        "'-r 0 -b 64'; -i -j -e -t -d -x come from --data, --seq-len, --batch-size x --accum, --steps",
    )
    ap.add_argument(
        "--llmc-cudnn",
        default="auto",
        choices=("auto", "on", "off"),
        help="llm.c's cuDNN attention: auto (on when cuDNN frontend's headers are carried), on, off",
    )
    ap.add_argument("--row-timeout", type=float, default=420.0, help="seconds one process may take")
    ap.add_argument("--work", default="/tmp/gptspeed-peers-gpu", help="scratch folder (peer copies, runs, builds)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv[1:])
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step compiles)")
    work = Path(args.work)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    variants = {}
    for v in args.variant:
        name, flags, env = pc.parse_variant(v)
        variants[name] = (flags, env)
    from llmc import check_llmc_flags

    from gptspeed.errors import GptspeedError

    try:  # a typo in llm.c's flags: one line now, not a failed row minutes later
        for row in ["llmc", *variants]:
            if is_llmc(row, variants):
                check_llmc_flags(llmc_flags(args, row, variants))
    except GptspeedError as e:
        ap.error(str(e))
    rows = args.peers.split(",")
    rows += [v for v in variants if v not in rows]
    shape = make_shape(args)
    env = harness.environment(args.device, argv)
    head = f"{shape.tokens:,} tokens per step · " + harness.header(env)

    def report(summary: dict, complete: bool) -> tuple[str, dict]:
        result = {"environment": env, "settings": vars(args), "complete": complete, "shapes": [summary]}
        return head + pc.markdown(result) + build_lines(summary) + ("" if complete else INCOMPLETE), result

    def partial(summary: dict) -> None:
        harness.write_outputs(*report(summary, False), args.md, args.json)

    harness.emit(
        *report(measure(args, shape, work, Path(args.data), rows, variants, partial), True), args.md, args.json
    )
    return 0


INCOMPLETE = "\n**Incomplete**: written after each process; the rounds still to run are missing.\n"


def build_lines(summary: dict) -> str:
    """Under the tables: the make line each llm.c build used (from the rows' ``build`` records) and
    each llm.c row's train_gpt2cu command (its first run's)."""
    builds = {
        json.dumps(e["build"], sort_keys=True): e["build"]
        for entries in summary["runs"].values()
        for e in entries
        if e.get("build")
    }
    runs = {
        row: e["command"]
        for row, entries in summary["runs"].items()
        for e in entries[:1]
        if e.get("build") and e.get("command")
    }
    return "".join(
        f"\nllm.c built with `{b['line']}` (GPU_COMPUTE_CAPABILITY {b['compute_capability'] or 'not set'}: "
        f"{b['capability_source']}; cuDNN attention {'on' if b['cudnn'] else 'off'}: {b['cudnn_note']})\n"
        for b in builds.values()
    ) + "".join(f"\n{row} ran `{cmd}`\n" for row, cmd in runs.items())


def build_main(argv: list[str]) -> int:
    """``vs_peers_gpu.py --build-llmc --work DIR [--timeout S] [--llmc-cudnn auto|on|off] [--llmc-make
    VARS] [--device cpu]``: llm.c's build alone (:func:`llmc_cuda_binary`), ahead of its rows --
    ``benchmarks/gpu_session.py`` starts it first, in the background -- so that every later run with
    the same ``--work`` uses it. Prints the build record (``llmc-build.json`` in ``--work``: the make
    line, cuDNN on or off and why, the seconds); exit 0 when built, with or without cuDNN, 1 when not
    (``llmc-build-failed.txt`` says why). ``--device cpu``: says it is skipped (no GPU) and exits 0."""
    ap = argparse.ArgumentParser(description="llm.c's train_gpt2cu built ahead of its rows")
    ap.add_argument("--build-llmc", action="store_true", required=True)
    ap.add_argument("--work", default="/tmp/gptspeed-peers-gpu")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one make may take (cuDNN, then without)")
    ap.add_argument("--llmc-cudnn", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--llmc-make", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    if args.device == "cpu":
        print("llm.c's build skipped: train_gpt2cu needs a CUDA GPU", flush=True)
        return 0
    Path(args.work).mkdir(parents=True, exist_ok=True)
    try:
        _, build = llmc_cuda_binary(Path(args.work), shlex.split(args.llmc_make), args.llmc_cudnn, args.timeout)
    except RuntimeError as e:
        print(f"llm.c not built: {e}", flush=True)
        return 1
    print(json.dumps(build, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(build_main(sys.argv[1:]) if "--build-llmc" in sys.argv else main())
