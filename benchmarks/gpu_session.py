"""A lent GPU's 15-minute window: everything it should measure, in three prepared device commands.

GPU time comes in windows of 15 minutes of device time a session (the machine's start, 1-2 minutes,
included; at most 10 minutes a command; the machine goes back after 30 s idle), and only some sessions
get one. So the window runs three commands back to back, each under a ``timeout_s`` of
``gpu_plan.RUN_TIMEOUT_S`` (250 s): the start at its upper end, the three commands, the gaps and the
give-back come to 14.9 minutes (``gpu_plan.window_total``), so there is no room for a fourth -- window3
runs in the slot a rerun would take: when window1 or window2 must be rerun, rerun it instead and leave
window3 to the next window. ``--plan`` prints the commands with their estimates (``benchmarks/gpu_plan.py``,
each figure saying what it rests on) and the total:

==========  ==============================================================================================
command     what it runs, in this order (GPT-2 124M, T=1024, on tokens of shakespeare-gutenberg)
==========  ==============================================================================================
window1     llm.c's build with cuDNN attention (``vs_peers_gpu.py --build-llmc``), started first, in the
            background, under ``LLMC_BUILD_TIMEOUT`` a make; ``gptspeed bench profile fused-adamw``
            (the default step, B=16: its time by category); ``gptspeed train``'s default at 524,288 tokens a
            step; the build waited for and its result noted; llm.c alone at its record's settings (``-b 64
            -t 1024 -d 524288 -r 0``); then the default, llm.c and the default at B=64 interleaved at 524,288
            tokens a step, as many of 2 rounds as the budget leaves
window2     ``gptspeed bench tune --preset gpt2``: the fastest configuration of the default run that trains
            the same, found on this GPU, one change at a time (``--budget-s`` cut to what is left)
window3     what has never run on CUDA: ``gptspeed train`` with ``RESUME_RUN``'s flags (the speedrun recipe,
            ``--align-to-docs --doc-mask``, ``--attn-window 512``, the batch-size warm-up, ``--eval-bpb``, the
            tail average), 40 steps, uninterrupted in the background beside the same run stopped by SIGTERM
            after step 22 and ``--resume``'d, the losses compared step by step (``resume-check``); then
            ``pytest -m cuda`` (the NCCL test, then the rest but the verify and tune tests) with what is left,
            each part stopped by SIGINT before its end so that its junit file is written
==========  ==============================================================================================

Each phase runs its parts one after another (one may run in the background: ``Session.start``), each
part under a timeout cut to what is left of the command's budget (``--budget-s``, default
``gpu_plan.BUDGET_S``, shared by the phases named in one command), and after every part packs
everything the phase wrote into one file, ``$OUT/<phase>.tgz`` (``--out``; ``benchmarks/gpu_phase.py``);
the benches and the peers write their JSON and Markdown after every row, so a command stopped at its
limit -- or a part stopped at its timeout -- still brings back every finished row; ``summary.json`` in
each archive lists the parts, their commands, status and seconds. A file too big for the archive (a
profiler trace, over ``Session.in_archive_max``) comes back beside it, gzipped, when that fits the
device's limit on a returned file, and is listed as left out when not. Run from the project root, after
``bash ../shared/device/carry.sh liger-kernel==0.8.5 pooch==1.9.0 platformdirs==4.14.8
nvidia-cudnn-frontend==1.32.0`` here, as ``source .carry/setup.sh && python3 benchmarks/gpu_session.py
window1`` (then ``window2``, then ``window3``): ``gpu_plan.COMMANDS``, docs/gpus.md.

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
    RESUME_RUN,
    ROUND_ROWS,
    ROUND_STEPS,
    STOP_AFTER,
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
    s.run(
        "train-interrupted",
        gptspeed("train", *shape(s), *steps, "--out", str(resumed)),
        300,
        on_line=stop_after(30, signal.SIGINT, stopped),
        expect=128 + signal.SIGINT,
    )
    s.run("train-resume", gptspeed("train", "--out", str(resumed), "--resume"), 240)
    s.note(part="resume-check", **compare_losses(ref, resumed), sigint_after_step=stopped.get("sent"))
    copy_run_records(s, ref, resumed)
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


def stop_after(step: int, sig: signal.Signals, seen: dict):
    """An ``on_line`` for :meth:`Session.run`: sends ``sig`` to ``gptspeed train`` once it logs step ``step``
    or a later one, once, and keeps that step in ``seen["sent"]``."""

    def on_line(line: str, proc: subprocess.Popen) -> None:
        m = re.match(r"^step\s+(\d+)/", line)
        if m and int(m.group(1)) >= step and "sent" not in seen:
            proc.send_signal(sig)
            seen["sent"] = int(m.group(1))

    return on_line


def copy_run_records(s: Session, *runs: Path) -> None:
    """Each run's ``metrics.jsonl`` and ``config.json`` into the results, as ``<run>-<file>`` (the
    checkpoints stay on the machine: 1.5 GB and more at 124M)."""
    for run in runs:
        for name in ("metrics.jsonl", "config.json"):
            if (run / name).exists():
                shutil.copy(run / name, s.dir / f"{run.name}-{name}")


def read_metrics(run: Path) -> dict[int, dict]:
    """A run's ``metrics.jsonl`` by step (a later record of a step replaces an earlier one); {} without one."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs}


def compare_losses(ref: Path, resumed: Path, stop_step: int | None = None) -> dict:
    """The resumed run's logged losses against the uninterrupted run's, step by step: the train losses'
    largest relative and absolute differences (with ``stop_step``: apart for the steps up to it, which no
    resume touched -- on a GPU, the size of its run-to-run differences -- and those after it), and where both
    runs evaluated, the val loss's and the val bits per byte's (``val_bpb``, from ``--eval-bpb``)."""
    a, b = read_metrics(ref), read_metrics(resumed)

    def diffs(key: str, keep=lambda step: True) -> list[tuple[float, float]]:
        common = [k for k in sorted(set(a) & set(b)) if key in a[k] and key in b[k] and keep(k)]
        return [(abs(a[k][key] - b[k][key]), abs(a[k][key] - b[k][key]) / abs(a[k][key])) for k in common]

    train, val, bpb = diffs("train_loss"), diffs("val_loss"), diffs("val_bpb")
    out = {
        "steps_compared": len(train),
        "last_step_ref": max((k for k in a if "train_loss" in a[k]), default=None),
        "last_step_resumed": max((k for k in b if "train_loss" in b[k]), default=None),
        "max_rel_diff": max((r for _, r in train), default=None),
        "max_abs_diff": max((d for d, _ in train), default=None),
    }
    if stop_step is not None:
        before, after = diffs("train_loss", lambda k: k <= stop_step), diffs("train_loss", lambda k: k > stop_step)
        out["max_abs_diff_up_to_the_stop"] = max((d for d, _ in before), default=None)
        out["max_abs_diff_after_the_stop"] = max((d for d, _ in after), default=None)
        out["val_steps_compared"] = len(val)
        out["val_loss_max_abs_diff"] = max((d for d, _ in val), default=None)
        out["val_bpb_max_abs_diff"] = max((d for d, _ in bpb), default=None)
        out["bit_identical"] = bool(train) and not any(d for d, _ in train + val + bpb)
    return out


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


CUDA_TUNE_TEST = (
    "tests/bench/test_tune_report.py::test_tune_on_a_gpu_tries_the_cuda_knobs_and_every_row_ends_with_a_verdict"
)
# window3's pytest -m cuda: the NCCL check first (12.5 s on the H100), then every other CUDA test but the two that take
# minutes and have a GPU run of their own: bench verify's (140.6 s, passed on the H100 on 2026-11-27) and bench tune's
# (a 240 s budget; window2 runs bench tune itself at GPT-2 124M): (part, what it selects, seconds it may take)
WINDOW3_TEST_PARTS = (
    ("pytest-nccl", [NCCL_TEST], 60),
    (
        "pytest-cuda",
        ["tests", *(a for t in (NCCL_TEST, CUDA_VERIFY_TEST, CUDA_TUNE_TEST) for a in ("--deselect", t))],
        300,
    ),
)
PYTEST_STOP_S = 10  # a pytest cut by the budget gets SIGINT this long before its part's end: it writes its junit file
SMOKE_TESTS = "tests/bench/test_checks.py"  # --smoke collects this file's CUDA test for "tests" (the whole suite's
#                                            collection alone takes ~15 s on the CPU machine)
# --smoke's form of window3's run: pico with 2 layers (value embeddings need n_layer >= 2) at T=256 (the window grows
# from 128), 256-token micro-batches, 16 steps, stopped after step 10 (inside the tail average, from step 8)
SMOKE_RESUME_SHAPE = ("--preset", "pico", "--device", "cpu", "--n-layer", "2", "--n-embd", "32", "--seq-len", "256")
SMOKE_RESUME = {
    **{"--batch-size": "1", "--total-batch-tokens": "512", "--batch-start-tokens": "256", "--batch-warmup-steps": "4"},
    **{"--attn-window": "256", "--max-steps": "16", "--eval-every": "8", "--save-every": "8", "--eval-tokens": "1024"},
}
SMOKE_STOP_AFTER = 10
# what docs/reliability.md promises of a resume, recorded beside the comparison
RESUME_PROMISE = (
    "bit-identical on a CPU (docs/reliability.md, under MKL_CBWR=AUTO MKL_DYNAMIC=FALSE and the same thread count); "
    "not promised on a GPU (cuBLAS and attention kernels are not bit-deterministic run to run): the H100's stopped "
    "and resumed default run differed by 4.5e-5 at most, and by 1.9e-6 already at step 5, before the stop (2026-11-27)"
)


def resume_run(s: Session) -> tuple[list[str], int]:
    """window3's ``gptspeed train`` flags (:data:`RESUME_RUN` at GPT-2 124M on CUDA; ``--smoke``: at
    :data:`SMOKE_RESUME_SHAPE` with :data:`SMOKE_RESUME`'s values) and the step after which SIGTERM is sent."""
    if not s.smoke:
        return [*shape(s), *RESUME_RUN], STOP_AFTER
    flags = list(RESUME_RUN)
    for i, flag in enumerate(flags[:-1]):
        flags[i + 1] = SMOKE_RESUME.get(flag, flags[i + 1])
    return [*SMOKE_RESUME_SHAPE, *flags], SMOKE_STOP_AFTER


def phase_window3(s: Session) -> None:
    """What has never run on CUDA (issue 52, item 4): window3's run uninterrupted, in the background, beside
    the same run stopped by SIGTERM and resumed; their losses compared step by step; then ``pytest -m cuda``."""
    data = data_dir(s)
    runs = s.work / "runs-window3"  # checkpoints stay here (GBs at 124M); their metrics are copied into the results
    shutil.rmtree(runs, ignore_errors=True)
    ref, resumed = runs / "run-ref", runs / "run-resumed"
    flags, stop_step = resume_run(s)
    train = [*flags, "--data", str(data)]
    background = s.start("train-ref", gptspeed("train", *train, "--out", str(ref)), 200)
    seen: dict = {}
    stop = stop_after(stop_step, signal.SIGTERM, seen)
    s.run(
        "train-stopped",
        gptspeed("train", *train, "--out", str(resumed)),
        170,
        on_line=stop,
        expect=128 + signal.SIGTERM,
    )

    def resumed_from(line: str, proc: subprocess.Popen) -> None:
        if m := re.match(r"^resumed from step (\d+)", line):
            seen["resumed_from"] = int(m.group(1))

    s.run("train-resume", gptspeed("train", "--out", str(resumed), "--resume"), 100, on_line=resumed_from)
    s.wait(background)
    check = compare_losses(ref, resumed, seen.get("sent"))
    facts = {"sigterm_after_step": seen.get("sent"), "resumed_from_step": seen.get("resumed_from")}
    s.note(part="resume-check", **check, **facts, **run_facts(ref), promise=RESUME_PROMISE)
    copy_run_records(s, ref, resumed)
    window3_tests(s)


def run_facts(run: Path) -> dict:
    """What the uninterrupted run's records show its switches did: the tokens of its first and last steps
    (the batch-size warm-up) and the val bits per byte of each evaluation (``--eval-bpb``)."""
    recs = read_metrics(run)
    tokens = {k: r["tokens"] for k, r in recs.items() if "train_loss" in r}
    steps = sorted(tokens)
    first = tokens[steps[0]] - recs.get(steps[0] - 1, {"tokens": 0})["tokens"] if steps else None
    last = tokens[steps[-1]] - tokens[steps[-2]] if len(steps) > 1 else None
    return {
        "tokens_first_step": first,
        "tokens_last_step": last,
        "val_bpb": {k: r["val_bpb"] for k, r in recs.items() if "val_bpb" in r},
    }


def window3_tests(s: Session) -> None:
    """``pytest -m cuda`` in :data:`WINDOW3_TEST_PARTS`, each under a timeout cut to what is left, sent SIGINT
    :data:`PYTEST_STOP_S` before its end (``timeout -s INT``) so that a part cut short still writes its junit file
    of the tests that ran (``-v``: each test's result in its log as it ends); ``--smoke``: each selection collected
    (:data:`SMOKE_TESTS` for the whole suite)."""
    for name, select, cap in WINDOW3_TEST_PARTS:
        select = [SMOKE_TESTS if s.smoke and a == "tests" else a for a in select]
        soft = min(cap, s.left() - 15) - PYTEST_STOP_S
        if soft < s.min_part_s:
            s.note(part=name, status="not run: out of time", seconds_left=round(s.left()))
            continue
        pytest = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *select]
        pytest += ["--collect-only", "-q"] if s.smoke else ["-v", "-rs", "--durations=0"]
        pytest += ["--junitxml", str(s.dir / f"{name}.xml")]
        code = s.run(name, ["timeout", "-s", "INT", "-k", "5", str(int(soft)), *pytest], soft + PYTEST_STOP_S)
        if code == 124:  # timeout's own status: stopped at its time
            s.note(part=f"{name}-cut", why=f"stopped by SIGINT after {soft:.0f} s: {name}.xml has the tests that ended")


def run_phase(s: Session) -> None:
    if s.phase == "window1":
        phase_window1(s)
    elif s.phase == "window2":
        phase_window2(s)
    elif s.phase == "window3":
        phase_window3(s)
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
    ap.add_argument("--plan", action="store_true", help="print the window's three commands and their estimates")
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
