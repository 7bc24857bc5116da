"""A lent GPU's 15-minute window: everything it should measure, in two prepared device commands.

GPU time comes in windows of 15 minutes of device time a session (the machine's start, 1-2 minutes,
included; at most 10 minutes a command; the machine goes back after 30 s idle), and only some sessions
get one. So the window runs two commands back to back, each under a ``timeout_s`` of :data:`RUN_TIMEOUT_S`,
so that the start, both commands and a rerun of either fit the 15 minutes (:func:`window_total`);
``--plan`` prints them with their estimates (the constants below, each saying what it rests on) and the total:

==========  ==============================================================================================
command     what it runs, in this order (GPT-2 124M, T=1024, on tokens of shakespeare-gutenberg)
==========  ==============================================================================================
window1     llm.c's build with cuDNN attention (``vs_peers_gpu.py --build-llmc``), started first, in the
            background, under :data:`LLMC_BUILD_TIMEOUT` a make; ``gptspeed bench profile fused-adamw``
            (the default step, B=16: its time by category); ``gptspeed train``'s default at 524,288 tokens a
            step; the build waited for and its result noted; llm.c alone at its record's settings (``-b 64
            -t 1024 -d 524288 -r 0``); then the default, llm.c and the default at B=64 interleaved at 524,288
            tokens a step, as many of 2 rounds as the budget leaves
window2     ``gptspeed bench tune --preset gpt2``: the fastest configuration of the default run that trains
            the same, found on this GPU, one change at a time (``--budget-s`` cut to what is left)
==========  ==============================================================================================

Each phase runs its parts one after another, each part under a timeout cut to what is left of the
command's budget (``--budget-s``, default :data:`BUDGET_S`, shared by the phases named in one
command), and after every part packs everything the phase wrote into one file, ``$OUT/<phase>.tgz``
(``--out``); the benches and the peers write their JSON and Markdown after every row, so a command
stopped at its limit -- or a part stopped at its timeout -- still brings back every finished row;
``summary.json`` in each archive lists the parts, their commands, status and seconds. A file too big
for the archive (a profiler trace, over :attr:`Session.in_archive_max`) comes back beside it,
gzipped, when that fits the device's limit on a returned file, and is listed as left out when not.
Run from the project root, after ``bash ../shared/device/carry.sh liger-kernel==0.8.5 pooch==1.9.0 platformdirs==4.14.8
nvidia-cudnn-frontend==1.32.0`` here, as ``source .carry/setup.sh && python3 benchmarks/gpu_session.py
window1`` (then ``window2``): :data:`COMMANDS`, docs/gpus.md.

The older phases (``peers verify first ladder cudatests profile verify2..6 beyond..beyond4``, each
planned for ~8 minutes of a 30-minute lease) stay available with ``--budget-s`` up to 565; the
plan no longer lists them. ``--smoke`` runs a phase on the CPU at the pico shape, for the tests: it
checks the orchestration, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_phase import CARRY, ROOT, Session  # beside this file: a phase's parts, budget and packing
from gpu_plan import (  # beside this file: the window's commands, their estimates and its total
    BUDGET_S,
    LLMC_BUILD_TIMEOUT,
    LLMC_FLAGS,
    LLMC_RECORD,
    ROUND_ROWS,
    ROUND_STEPS,
    TUNE_MARGIN_S,
    WINDOW,
    estimate,
    plan_lines,
    tune_budget,
)

# bench verify's rungs in groups that each fit one command (each group also runs its fp32 references):
# (--stages, extra flags, seconds one rung may take). None: verify's own default set (the seeds' rungs).
VERIFY_GROUPS = {
    "verify": (None, [], 240),
    "verify2": ("fused-ce,batch-auto,fp8,muon", [], 240),
    "verify3": ("compile-blocks,fp16,fp16-fused-ce,sdpa-cudnn", [], 240),
    "verify4": ("max-autotune-no-cudagraphs", [], 420),
    "verify5": ("reduce-overhead,max-autotune", ["--grad-accum", "1"], 300),
    "verify6": ("rest", [], 240),  # every rung no other group names: a new rung has a GPU command from the start
}
SEEDS = "baseline,tf32,bf16,compile,flash,vocab-pad,fused-adamw"
# one switch each from gptspeed train's default, interleaved with the default, 65,536 tokens per step
BEYOND_GROUPS = {
    # auto ran cuDNN's attention on the H100 (2026-11-27): flash is the alternative to measure
    "beyond": ["flash: --sdpa-backend flash", "fused-ce: --loss fused"],
    "beyond2": ["B-auto: --batch-size auto --total-batch-tokens 65536", "fp8: --fp8"],
    "beyond3": ["muon: --optimizer muon", "blocks: --compile-mode blocks"],
    # what else might close a gap to llm.c: inductor's own tuning knob, and the measured wins together
    # (max-autotune-no-cudagraphs's speed: verify4's tokens/s; its compile alone is ~5 minutes)
    "beyond4": ["coord-descent: TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1", "liger: --loss liger"],
}
PEER_ROUNDS = 2
PHASES = (
    *WINDOW,
    "peers",
    "verify",
    "first",
    "ladder",
    "cudatests",
    "profile",
    *list(VERIFY_GROUPS)[1:],
    *BEYOND_GROUPS,
)


def gptspeed(*args: str) -> list[str]:
    return [sys.executable, "-m", "gptspeed", *args]


def bench_cmd(mode: str, *args: str) -> list[str]:
    """``gptspeed bench MODE ARGS``: the one place this script spells a bench subcommand (``tune``,
    ``profile``, ``verify``, ``ladder``)."""
    return gptspeed("bench", mode, *args)


def shape(s: Session) -> list[str]:
    """The model every phase trains: GPT-2 124M at T=1024 (``--smoke``: pico on the CPU)."""
    if s.smoke:
        return ["--preset", "pico", "--device", "cpu", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]
    return ["--preset", "gpt2", "--device", "cuda"]


def data_dir(s: Session) -> Path:
    """shakespeare-gutenberg prepared once per machine (tinyshakespeare with ``--smoke``), in
    ``$GPTSPEED_SESSION_DATA/<corpus>``; without it, the one carried prepared in
    ``.carry/prepared/<corpus>`` when there is one, else ``/tmp/gptspeed-session-data/<corpus>``."""
    corpus = "tinyshakespeare" if s.smoke else "shakespeare-gutenberg"
    if "GPTSPEED_SESSION_DATA" not in os.environ and (CARRY / "prepared" / corpus / "manifest.json").exists():
        return CARRY / "prepared" / corpus
    out = Path(os.environ.get("GPTSPEED_SESSION_DATA", "/tmp/gptspeed-session-data")) / corpus
    if not (out / "manifest.json").exists():
        s.run("prepare", gptspeed("prepare", corpus, "--out", str(out), "--no-progress"), 180)
    return out


def machine(s: Session) -> None:
    checks = (
        "nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit "
        "--format=csv; which gcc cc nvcc; gcc --version | head -1; nvcc --version | tail -2; "
        f"{sys.executable} -c \"import sysconfig, os, sys, torch; inc = sysconfig.get_paths()['include']; "
        "print('python', sys.version.split()[0], '| Python.h', os.path.exists(os.path.join(inc, 'Python.h')), "
        "'| torch', torch.__version__, '| cuda', torch.version.cuda, '| cudnn', torch.backends.cudnn.version())\"; "
        f"{sys.executable} -m pip list 2>/dev/null | grep -i -E '^(torch|triton|torchao|transformers|numpy|tiktoken|liger) '"
    )
    s.run("machine", ["bash", "-c", checks], 60)


def phase_first(s: Session) -> None:
    machine(s)
    data = data_dir(s)
    steps = [
        "--max-steps",
        "50",
        "--eval-every",
        "25",
        "--save-every",
        "25",
        "--log-every",
        "5",
        "--eval-tokens",
        "65536" if not s.smoke else "1024",
        "--data",
        str(data),
    ]
    if s.smoke:
        steps += ["--batch-size", "4"]
    runs = s.work / "runs"  # checkpoints stay here (1.5 GB at 124M); their metrics are copied into the results
    shutil.rmtree(runs, ignore_errors=True)
    ref, resumed = runs / "run-ref", runs / "run-resumed"
    s.run("train", gptspeed("train", *shape(s), *steps, "--out", str(ref)), 300)
    stopped = {}

    def stop_after_30(line: str, proc: subprocess.Popen) -> None:
        m = re.match(r"^step\s+(\d+)/", line)
        if m and int(m.group(1)) >= 30 and "sent" not in stopped:
            proc.send_signal(signal.SIGINT)
            stopped["sent"] = int(m.group(1))

    s.run(
        "train-interrupted",
        gptspeed("train", *shape(s), *steps, "--out", str(resumed)),
        300,
        on_line=stop_after_30,
        expect=128 + signal.SIGINT,
    )
    s.run("train-resume", gptspeed("train", "--out", str(resumed), "--resume"), 240)
    s.note(part="resume-check", **compare_losses(ref, resumed), sigint_after_step=stopped.get("sent"))
    for run in (ref, resumed):
        for name in ("metrics.jsonl", "config.json"):
            if (run / name).exists():
                shutil.copy(run / name, s.dir / f"{run.name}-{name}")
    sample_device = ["--device", "cpu"] if s.smoke else ["--device", "cuda"]
    s.run(
        "sample",
        gptspeed("sample", "--run", str(ref), "--prompt", "ROMEO:", "--max-new-tokens", "64", *sample_device),
        120,
    )


NCCL_TEST = "tests/bench/test_worker.py::test_one_process_ddp_step[nccl-cuda]"
CUDA_VERIFY_TEST = "tests/bench/test_verify.py::test_verify_on_cuda_at_a_small_shape_passes"
# pytest -m cuda in parts, the NCCL check first (the only one of NCCL DDP), the verify run last (the longest):
# (part, what it selects, seconds it may take)
CUDA_TEST_PARTS = (
    ("pytest-nccl", [NCCL_TEST], 120),
    ("pytest-cuda", ["tests", "--deselect", NCCL_TEST, "--deselect", CUDA_VERIFY_TEST], 240),
    ("pytest-cuda-verify", [CUDA_VERIFY_TEST], 300),
)


def cuda_tests(s: Session) -> None:
    """``pytest -m cuda`` in :data:`CUDA_TEST_PARTS`, each with its own timeout and junit file (with
    ``--smoke``: each part's selection collected, not run)."""
    for name, select, cap in CUDA_TEST_PARTS:
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *select]
        if s.smoke:
            s.run(name, [*cmd, "--collect-only"], 120)
        else:
            s.run(name, [*cmd, "-rs", "--durations=0", "--junitxml", str(s.dir / f"{name}.xml")], cap)


def compare_losses(ref: Path, resumed: Path) -> dict:
    """The resumed run's train losses against the uninterrupted run's, step by step."""

    def losses(run: Path) -> dict[int, float]:
        path = run / "metrics.jsonl"
        if not path.exists():
            return {}
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {r["step"]: r["train_loss"] for r in recs if "train_loss" in r}

    a, b = losses(ref), losses(resumed)
    common = sorted(set(a) & set(b))
    diffs = [abs(a[k] - b[k]) / abs(a[k]) for k in common]
    return {
        "steps_compared": len(common),
        "last_step_ref": max(a, default=None),
        "last_step_resumed": max(b, default=None),
        "max_rel_diff": max(diffs, default=None),
    }


def bench(s: Session, name: str, what: list[str], cap_s: float, *extra: str) -> None:
    data = data_dir(s)
    size = (
        [
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--compile-backend",
            "eager",
        ]
        if s.smoke
        else ["--preset", "gpt2", "--device", "cuda", "--seq-len", "1024"]
    )
    mode = what[0].removeprefix("--")
    s.run(name, bench_cmd(mode, *what[1:], *size, "--data", str(data), "--out", str(s.dir / name), *extra), cap_s)


def verify_stages(phase: str) -> str | None:
    """``bench verify --stages`` of a verify group (None: verify's default set); ``verify6``'s "rest" is
    every rung of this gptspeed that neither the default set nor another group names."""
    stages = VERIFY_GROUPS[phase][0]
    if stages != "rest":
        return stages
    from gptspeed.bench.stages import STAGE_NAMES, VERIFY_EXTRA_NAMES
    from gptspeed.bench.verify import DEFAULT_RUNGS

    named = {r for st, _, _ in VERIFY_GROUPS.values() if st not in (None, "rest") for r in st.split(",")}
    return ",".join(r for r in (*STAGE_NAMES, *VERIFY_EXTRA_NAMES) if r not in named and r not in DEFAULT_RUNGS)


def phase_verify(s: Session) -> None:
    _, extra, rung_s = VERIFY_GROUPS[s.phase]
    stages = verify_stages(s.phase)
    if stages == "":
        s.note(part="verify", skipped="every rung is in another group")
        return
    steps = ["--steps", "3", "--warmup", "2"] if s.smoke else ["--steps", "15", "--warmup", "5"]
    select = (["--stages", stages] if stages else []) if not s.smoke else ["--stages", "baseline,compile"]
    bench(s, "verify", ["--verify", *select, *extra], 560, *steps, "--stage-timeout", str(rung_s))


def phase_ladder(s: Session) -> None:
    steps = ["--steps", "3", "--warmup", "1"] if s.smoke else ["--steps", "30", "--warmup", "8", "--batch-size", "16"]
    bench(
        s,
        "ladder-B16",
        ["--ladder", "--stages", SEEDS if not s.smoke else "baseline,compile", "--no-peers"],
        560,
        *steps,
        "--stage-timeout",
        "240",
    )


# --smoke's shape for the peers: B=2, T=32, 2 micro-batches (128 tokens a step)
SMOKE_PEERS = (
    "--device",
    "cpu",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--accum",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--rounds",
    "1",
)


def peers(
    s: Session, name: str, rows: str, variants: list[str], rounds: int, extra: tuple[str, ...] = (), cap_s: float = 560
) -> None:
    """``benchmarks/vs_peers_gpu.py`` as part ``name``: ``rows`` interleaved for ``rounds`` rounds, with
    ``variants`` and ``extra`` flags, in the llm.c build folder every part of the session shares."""
    data = data_dir(s)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "vs_peers_gpu.py"),
        "--data",
        str(data),
        "--peers",
        rows,
        "--rounds",
        str(rounds),
        "--work",
        str(s.work / "peers-gpu"),
        "--json",
        str(s.dir / f"{name}.json"),
        "--md",
        str(s.dir / f"{name}.md"),
        *extra,
    ]
    if s.smoke:
        cmd += SMOKE_PEERS
    for v in variants:
        cmd += ["--variant", v]
    s.run(name, cmd, cap_s)
    copy_build_logs(s)


def copy_build_logs(s: Session) -> None:
    """llm.c's make output, whole, and its build record (``llmc-build*``) into the results."""
    for log in sorted((s.work / "peers-gpu").glob("llmc-build*")):
        shutil.copy(log, s.dir / log.name)


def phase_profile(s: Session) -> None:
    loss = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_loss_paths.py"),
        "--json",
        str(s.dir / "loss.json"),
        "--md",
        str(s.dir / "loss.md"),
    ]
    if s.smoke:
        loss += [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tokens",
            "256",
            "--vocab",
            "1024",
            "--width",
            "64",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--compile-backend",
            "eager",
        ]
    s.run("loss", loss, 180)
    steps = ["--steps", "2", "--warmup", "1"] if s.smoke else ["--steps", "3", "--warmup", "8"]
    bench(
        s,
        "profile",
        ["--profile", "fused-adamw" if not s.smoke else "baseline"],
        400,
        *steps,
        *(["--batch-size", "16"] if not s.smoke else []),
    )


def phase_window1(s: Session) -> None:
    """llm.c's build first, in the background; gptspeed's default step profiled by category; llm.c alone at
    its record's settings; then the interleaved rounds at 524,288 tokens a step (module docstring)."""
    data_dir(s)
    work = s.work / "peers-gpu"
    build = [sys.executable, str(ROOT / "benchmarks" / "vs_peers_gpu.py"), "--build-llmc", "--work", str(work)]
    build += ["--timeout", str(LLMC_BUILD_TIMEOUT), *(["--device", "cpu"] if s.smoke else [])]
    building = s.start("llmc-build", build, 2 * LLMC_BUILD_TIMEOUT)
    steps = ["--steps", "2", "--warmup", "1"] if s.smoke else ["--steps", "3", "--warmup", "8", "--batch-size", "16"]
    bench(s, "profile", ["--profile", "fused-adamw" if not s.smoke else "baseline"], 180, *steps)
    shape = ("--batch-size", "2" if s.smoke else "16", "--accum", "2" if s.smoke else "32")
    steps = ("--warmup", str(ROUND_STEPS[0]), "--steps", str(ROUND_STEPS[1]))
    peers(s, "default", "gptspeed", [], 1, ("--row-timeout", "120", *shape, *steps), 150)
    built = s.wait(building)
    if built is None:  # stopped at its limit: the llm.c rows say so instead of building again
        (work / "llmc-build-failed.txt").write_text(
            f"llm.c's build was stopped at its limit ({s.summary[-1]['seconds']} s)"
        )
    copy_build_logs(s)
    record = json.loads((work / "llmc-build.json").read_text()) if (work / "llmc-build.json").exists() else {}
    failed = (work / "llmc-build-failed.txt").read_text() if (work / "llmc-build-failed.txt").exists() else None
    log = s.dir / "llmc-build.log"  # what it said, where it left no record (skipped without a GPU)
    failed = failed or next(iter(log.read_text().strip().splitlines()[-1:] if log.exists() else []), None)
    s.note(
        part="llmc-build-result",
        built=bool(record),
        cudnn=record.get("cudnn"),
        why=record.get("cudnn_note") or failed,
        seconds=record.get("seconds"),
    )
    rb, raccum, rwarm, rsteps = LLMC_RECORD
    record_shape = ("--batch-size", str(rb), "--accum", str(raccum), "--warmup", str(rwarm), "--steps", str(rsteps))
    peers(s, "llmc-record", "llmc", [], 1, (f"--llmc-flags={LLMC_FLAGS}", "--row-timeout", "120", *record_shape), 150)
    b, accum, wide = (2, 2, 4) if s.smoke else (16, 32, 64)  # 524,288 tokens a step on the GPU (shape, above)
    rows = ROUND_ROWS.replace("B64", f"B{wide}")
    variant = f"B{wide}: --batch-size {wide} --total-batch-tokens {b * accum * (32 if s.smoke else 1024)}"
    flags = (f"--llmc-flags={LLMC_FLAGS} -b {wide}", "--row-timeout", "120", *shape, *steps)
    peers(s, "rounds", rows, [variant], 2, flags, BUDGET_S)


def phase_window2(s: Session) -> None:
    """``gptspeed bench tune`` of the default run (``--preset gpt2``), its budget cut to what is left."""
    data = data_dir(s)
    budget = tune_budget(s.left())
    if s.smoke:
        size = ["--preset", "pico", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32"]
        size += ["--batch-size", "2", "--device", "cpu", "--compile-backend", "eager", "--steps", "2", "--warmup", "1"]
        budget = min(budget, 45.0)
    else:
        size = ["--preset", "gpt2", "--device", "cuda"]
    if budget < 30:
        s.note(part="tune", status="not run: out of time", seconds_left=round(s.left()))
        return
    tune = bench_cmd("tune", *size, "--data", str(data), "--budget-s", f"{budget:.0f}", "--out", str(s.dir / "tune"))
    s.run("tune", tune, budget + TUNE_MARGIN_S)


def run_phase(s: Session) -> None:
    if s.phase == "window1":
        phase_window1(s)
    elif s.phase == "window2":
        phase_window2(s)
    elif s.phase == "first":
        phase_first(s)
    elif s.phase == "cudatests":
        cuda_tests(s)
    elif s.phase in VERIFY_GROUPS:
        phase_verify(s)
    elif s.phase == "ladder":
        phase_ladder(s)
    elif s.phase == "peers":
        peers(s, "peers", "gptspeed,nanogpt,llmc", [], PEER_ROUNDS)
    elif s.phase in BEYOND_GROUPS:
        variants = BEYOND_GROUPS[s.phase]
        peers(s, s.phase, "gptspeed", variants if not s.smoke else variants[:1], PEER_ROUNDS)
    elif s.phase == "profile":
        phase_profile(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="*", metavar="PHASE", help=", ".join(PHASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-session-out"), help="where <phase>.tgz goes ($OUT)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="seconds all the phases together may take (one device command: at most 600)",
    )
    ap.add_argument("--smoke", action="store_true", help="run the phase on the CPU at the pico shape (tests)")
    ap.add_argument("--plan", action="store_true", help="print the window's two commands and their estimates")
    args = ap.parse_args(argv)
    if args.plan:
        print("\n".join(plan_lines()))
        return 0
    if not args.phases or set(args.phases) - set(PHASES):
        ap.error(f"name PHASEs from {', '.join(PHASES)} (or --plan); got {' '.join(args.phases) or 'none'}")
    out = Path(args.out)
    t0, failed = time.monotonic(), []
    for phase in args.phases:  # one budget for all: each phase gets what the ones before it left
        s = Session(phase, out, args.budget_s - (time.monotonic() - t0), args.smoke)
        run_phase(s)
        s.pack()
        bad = [p["part"] for p in s.summary if p.get("status") not in (None, "ok")]
        failed += [f"{phase}/{b}" for b in bad]
        est = estimate(phase)
        print(
            f"== {phase}: {len(s.summary)} parts, {'failed or cut: ' + ', '.join(bad) if bad else 'all ok'}; "
            f"{time.monotonic() - s.t0:.0f} s"
            + (f" (estimated on an H100: {est[0]} s, up to {est[1]})" if est else "")
            + f"; results in {out / (phase + '.tgz')}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
