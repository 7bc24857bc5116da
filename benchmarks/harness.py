"""The one harness of benchmarks/: interleaved rounds, median and spread, the environment record, the outputs.

Every timing script here measures the same way (benchmarks/README.md, "How everything is measured"):

- **Interleaved rounds** (:func:`interleave`): every variant once per round, the order rotated by one
  each round (A B C, B C A, C A B, ...), so that drift, a warm cache or another job's load hits every
  variant alike and none always runs first, or always right after the heaviest one (a fixed order
  gave two identical rows a steady 0.88-0.98x gap: LOG.md, issue 14). A variant is a process (the
  peers) or a callable timed here (:func:`time_rounds`: ``steps`` calls a round after ``warmup``
  untimed ones, CUDA events on a GPU and ``perf_counter`` elsewhere, the process's CPU time beside).
- **Median and spread** (:func:`spread`): the median, the quartiles and the extremes; a ratio between
  two variants is taken round by round, then its median and range (:func:`ratios`) -- the figure a
  slow spell of a shared machine moves least.
- **The environment record** (:func:`environment`): gptspeed's own
  (:func:`gptspeed.bench.report.environment`: gptspeed and library versions, the commit, the device,
  the CPU, threads, command and date; the driver on CUDA) and what a benchmark adds: the CPU's flags,
  the load average, whether the checkout has uncommitted changes, the GPU as nvidia-smi reports it.
- **Outputs** (:func:`write_outputs`, :func:`emit`): the Markdown printed, it and the JSON written
  atomically (a temporary file, then a rename) -- after every variant where a command may be cut
  short, so a reader sees the previous version or this one, never a part.

Run a script as ``python benchmarks/NAME.py``: Python puts this folder on ``sys.path``, so the
scripts import this module and each other by name; ``gptspeed`` is the installed package
(``pip install -e .``). Nothing here imports torch until a function needs it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------- the order
def interleave(
    names: Iterable[str],
    rounds: int,
    run_one: Callable[[str, int], Any],
    *,
    drop: Callable[[Any], bool] | None = None,
    after_each: Callable[[dict[str, list]], None] | None = None,
) -> dict[str, list]:
    """``run_one(name, round)`` for every name in each of ``rounds`` rounds, the order rotated by
    one name each round (A B C, B C A, C A B, ...). Returns each name's results, in round order.
    ``drop(result)`` true: that name leaves the later rounds (it cannot run here);
    ``after_each(results)`` is called after every run (a script writes what it has so far)."""
    names = list(names)
    results: dict[str, list] = {n: [] for n in names}
    active = list(names)
    for rnd in range(rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            if name not in active:
                continue
            result = run_one(name, rnd)
            results[name].append(result)
            if drop is not None and drop(result):
                active.remove(name)
            if after_each is not None:
                after_each(results)
    return results


def time_calls(fn: Callable[[], Any], n: int, device_type: str = "cpu") -> tuple[list[float], list[float]]:
    """``n`` calls of ``fn``, each timed: ``(wall ms, CPU ms of this process)`` per call. On CUDA
    the wall time is CUDA events around the call (read after it synchronises); elsewhere
    ``perf_counter`` (a CPU is synchronous; on MPS the caller's ``fn`` synchronises)."""
    wall, cpu = [], []
    for _ in range(n):
        c0 = time.process_time()
        if device_type == "cuda":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            wall.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            wall.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
    return wall, cpu


def time_rounds(
    variants: dict[str, Callable[[], Any]],
    rounds: int,
    *,
    steps: int = 1,
    warmup: int = 0,
    device_type: str = "cpu",
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, dict[str, list[list[float]]]]:
    """Time in-process variants in interleaved rounds: each takes ``warmup`` untimed calls (in
    order), then in every round ``steps`` timed calls of each, in :func:`interleave`'s order (each
    call :func:`time_calls`). ``before(name)`` / ``after(name)`` run, untimed, around a variant's
    calls in a round (its threads, a peak-memory reset); ``say`` gets a line after every round.
    Returns ``{"wall": {name: [[ms of each call] per round]}, "cpu": {...}}``."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)

    def run_one(name: str, rnd: int) -> tuple[list[float], list[float]]:
        if before is not None:
            before(name)
        times = time_calls(variants[name], steps, device_type)
        if after is not None:
            after(name)
        return times

    def round_done(results: dict[str, list]) -> None:
        done = [len(r) for r in results.values()]
        if say is not None and len(set(done)) == 1:
            say(
                f"[round {done[0]}/{rounds}] "
                + ", ".join(f"{n} {statistics.median(results[n][-1][0]):.1f}" for n in names)
                + f" ms (load {loadavg()})"
            )

    results = interleave(names, rounds, run_one, after_each=round_done)
    return {
        "wall": {n: [w for w, _ in results[n]] for n in names},
        "cpu": {n: [c for _, c in results[n]] for n in names},
    }


# --------------------------------------------------------------------------- median and spread
def spread(values: Iterable[float]) -> dict[str, float]:
    """``{"median", "q25", "q75", "min", "max", "n"}`` of ``values`` (quartiles by
    ``statistics.quantiles``' inclusive method; with one value, that value for all)."""
    xs = [v for v in values if v is not None]
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q25": q[0], "q75": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def ratios(ref_rounds: list[list[float]], rounds: list[list[float]]) -> dict[str, Any]:
    """The speed of a variant against a reference, round by round: per round, the reference's
    median time over this one's (above 1: faster); ``{"median", "min", "max", "per_round"}``."""
    per_round = [statistics.median(r) / statistics.median(x) for r, x in zip(ref_rounds, rounds) if r and x]
    if not per_round:
        return {"median": None, "min": None, "max": None, "per_round": []}
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "per_round": per_round,
    }


# ----------------------------------------------------------------------------- the environment
def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as ``/proc/loadavg`` gives them ("?" without it)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def cpu_flags() -> dict[str, bool]:
    """The /proc/cpuinfo flags that decide CPU matmul speed for fp32 / bf16."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")}


def _nvidia_smi() -> str | None:
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    q = subprocess.run(
        [smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return q.stdout.strip() or q.stderr.strip()


def environment(device: str = "cpu", argv: list[str] | None = None) -> dict[str, Any]:
    """The record every benchmark output carries: :func:`gptspeed.bench.report.environment` for
    ``device`` (versions, commit, device, CPU, threads, date; the command is ``argv``, default this
    process's) plus ``nproc``, ``cpu_flags``, ``loadavg_start``, ``git_dirty`` (uncommitted changes
    to tracked files) and, with CUDA, ``capability`` and ``nvidia_smi``."""
    import torch

    from gptspeed.bench.report import environment as bench_environment

    dev = torch.device(device)
    env = bench_environment(dev, " ".join(["python", *(sys.argv if argv is None else argv)]))
    env.update(
        nproc=os.cpu_count(),
        cpu_flags=cpu_flags(),
        loadavg_start=loadavg(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        env["git_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        env["git_dirty"] = None
    if dev.type == "cuda" and torch.cuda.is_available():
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        env["nvidia_smi"] = _nvidia_smi()
    return env


def header(env: dict[str, Any]) -> str:
    """One line naming the machine, versions, commit and date of ``env``, then the command."""
    dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
    gpu = f" ({env['nvidia_smi']})" if env.get("nvidia_smi") else ""
    cuda = f", CUDA {env['cuda']}" if env.get("cuda") else ""
    device = "" if env.get("device_type") == "cpu" else f"{env['device']}{gpu} · "
    return (
        f"{device}{env.get('cpu')} ({env.get('nproc')} CPUs) · torch {env['torch']}{cuda} · "
        f"{env.get('threads')} threads · commit {(env.get('git_commit') or '?')[:12]}{dirty} · {env['date']} · "
        f"load {env.get('loadavg_start')}\n`{env['command']}`\n"
    )


# ----------------------------------------------------------------------------------- processes
def read_lines(fd: int, on_line: Callable[[str], bool], deadline: float) -> list[str]:
    """Read text lines from the file descriptor ``fd`` (a pipe or a pseudo-terminal's master side)
    as they arrive, handing each (decoded, without its line end) to ``on_line``; stop when it
    returns True, at end of file (or EIO: a terminal's child exited) or at ``time.perf_counter()``
    ``deadline``. Returns every line read."""
    import select

    lines: list[str] = []
    pending = b""
    while time.perf_counter() < deadline:
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal (exited)
            break
        if not chunk:
            break
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace").rstrip("\r")
            lines.append(line)
            if on_line(line):
                return lines
    return lines


# ------------------------------------------------------------------------------------- outputs
def write_outputs(
    md: str | None, result: Any | None, md_path: str | os.PathLike | None, json_path: str | os.PathLike | None
) -> None:
    """``md`` to ``md_path`` and ``result`` as JSON to ``json_path``, where given, each atomically
    (:func:`gptspeed.fileio.write_text_atomic`: a reader sees the previous version or this one)."""
    from gptspeed.fileio import write_text_atomic

    if md_path and md is not None:
        write_text_atomic(md_path, md)
    if json_path and result is not None:
        write_text_atomic(json_path, json.dumps(result, indent=1) + "\n")


def emit(
    md: str, result: Any, md_path: str | os.PathLike | None = None, json_path: str | os.PathLike | None = None
) -> None:
    """Print ``md``, then :func:`write_outputs`."""
    print(md, flush=True)
    write_outputs(md, result, md_path, json_path)
