"""Issues 20 and 30 on a lent GPU machine: the GPU work as phases that each end within one device command.

A lent machine gives a session about 30 minutes of device time, at most 10 per command, and no
network. Each phase runs its parts one after another, each part under a timeout cut to what is left
of the command's budget (``--budget-s``, default 560 s, shared by the phases named in one command),
and after every part packs everything the phase wrote into one file, ``$OUT/<phase>.tgz`` (``--out``);
the benches and the peers write their JSON and Markdown after every row, so a command stopped at
its limit -- or a part stopped at its timeout -- still brings back every finished row;
``summary.json`` in each archive lists the parts, their commands, status and seconds. Run from the
project root, after ``bash ../shared/device/carry.sh liger-kernel==0.8.5 nvidia-cudnn-frontend==1.32.0``
here, as ``source .carry/setup.sh && python3 benchmarks/gpu_session.py PHASE [PHASE ...]``.

The documented commands (:data:`COMMANDS`), in order of value -- the default's speed and the peers
first -- each planned to end within ~8 minutes by :data:`ESTIMATES` (``--plan`` prints them):

==========  ==============================================================================================
command     what it runs (GPT-2 124M, T=1024, on tokens of shakespeare-gutenberg prepared from .carry)
==========  ==============================================================================================
peers       ``benchmarks/vs_peers_gpu.py``: gptspeed's default ``train`` vs nanoGPT (compile) vs llm.c's
            ``train_gpt2cu`` (built for this GPU, cuDNN attention when carried), 2 interleaved rounds,
            65,536 tokens per step
verify      ``gptspeed bench --verify``: the default rung set (the seeds' rungs, fp32 .. fused AdamW:
            ``train``'s default switches one at a time), 2 micro-batches per step
first       the machine (nvidia-smi, gcc, Python.h, versions); ``gptspeed train --preset gpt2`` for 50 steps
            with an eval and a checkpoint every 25; the same run stopped by SIGINT after step 30 and
            ``--resume``-d to 50 (its losses against the uninterrupted run's); ``gptspeed sample``
ladder      ``gptspeed bench --ladder`` of the seeds' rows at B=16: fp32 -> TF32 -> bf16 -> compile ->
            flash -> vocab 50304 -> fused AdamW (a fresh compile cache per row: warm-up = its compile)
cudatests   ``pytest -m cuda`` in three parts: the one-GPU NCCL DDP step first, then every other
            ``cuda`` test but the verify one, then ``bench --verify`` on CUDA at a small shape
profile     ``benchmarks/gpu_loss_paths.py`` (the LM-head loss alone: plain, compiled, gptspeed's fused,
            Liger-Kernel's when carried), then ``gptspeed bench --profile fused-adamw`` (the default)
verify2     ``bench --verify`` of the rungs beyond the default: fused loss, ``--batch-size auto``, FP8, Muon
verify3     the same: per-block compile, fp16, fp16 + fused loss, cuDNN attention
verify4     the same: ``max-autotune-no-cudagraphs`` (inductor's matmul search: the longest compile)
verify5     the same with ``--grad-accum 1``: the CUDA-graph modes ``reduce-overhead`` and ``max-autotune``
            (refused with accumulation)
beyond      ``benchmarks/vs_peers_gpu.py --peers gptspeed`` with one switch each from the default, 2 rounds:
            cuDNN attention, the fused loss
beyond2     the same: the largest micro-batch (``--batch-size auto``), FP8
beyond3     the same: Muon, per-block compile
beyond4     the same: inductor's coordinate-descent tuning, cuDNN attention with the largest micro-batch
==========  ==============================================================================================

One lease holds about three commands (``peers``; ``verify``; ``first``), the next ``ladder``;
``cudatests``; ``profile``, and so on down the list. The minutes are estimates until a GPU has run
them. ``--smoke`` runs a phase on the CPU at the pico shape, for the tests: it checks the
orchestration, not the GPU.
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
import tarfile
import time
from pathlib import Path

from harness import read_lines  # beside this file: reads a pipe line by line up to a deadline

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry"
# bench --verify's rungs in groups that each fit one command (each group also runs its fp32 references):
# (--stages, extra flags, seconds one rung may take). None: verify's own default set (the seeds' rungs).
VERIFY_GROUPS = {
    "verify": (None, [], 240),
    "verify2": ("fused-ce,batch-auto,fp8,muon", [], 240),
    "verify3": ("compile-blocks,fp16,fp16-fused-ce,sdpa-cudnn", [], 240),
    "verify4": ("max-autotune-no-cudagraphs", [], 420),
    "verify5": ("reduce-overhead,max-autotune", ["--grad-accum", "1"], 300),
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
PHASES = ("peers", "verify", "first", "ladder", "cudatests", "profile", *list(VERIFY_GROUPS)[1:], *BEYOND_GROUPS)
# The documented device commands, in order of value for the next lease: each one `gpu_session.py PHASE ...`
# command. verify, first and cudatests ran on an H100 on 2026-11-27 (benchmarks/runs/2026-11-27-h100/): last,
# to run again after a change. peers ran too, but its llm.c row failed to build (CUDA 13): first again.
COMMANDS = (("peers",), ("ladder", "profile"), ("beyond", "beyond2"), ("verify2",), ("verify3",), ("verify4",),
            ("verify5",), ("beyond3", "beyond4"), ("verify",), ("first",), ("cudatests",))
COMMAND_TARGET_S = 480  # each documented command should end within ~8 minutes by the estimates ...
BUDGET_S = 560.0  # ... and within its budget (one device command: at most 600 s) at their upper end

# ------------------------------------------------------------------ the estimates the plan rests on
# For one H100 at GPT-2 124M, T=1024, B=16. "measured" figures come from the first GPU session
# (2026-11-27, H100 80GB HBM3, torch 2.11.0+cu130: benchmarks/runs/2026-11-27-h100/, its summary.json
# and verify.json); the others are still estimates, and say what they rest on.
START = 10  # a fresh Python process: import torch, initialise CUDA, build the model (estimate)
COLD = (30, 45)  # a cold torch.compile of train's graph: measured 19-28 s as verify's first step (compile 27.5,
#                  flash 19.2, vocab-pad 21.6) and ~35 s in the peers' first round; 45 at the upper end
WARM = 5  # the same graph from the FX-graph cache: measured 3.4 s (verify's fused-adamw first step)
BLOCK_COLD = 35  # --compile-mode blocks: one transformer block compiled once (estimate)
AUTOTUNE = 300  # max-autotune(-no-cudagraphs): inductor benchmarks Triton matmul configs for every GEMM (estimate;
#                 the least certain figure here)
PREPARE = 5  # gptspeed prepare shakespeare-gutenberg: 2.6 s on a 2-core CPU (measured); a GPU session carries it
LLMC_BUILD = 90  # nvcc of train_gpt2.cu: seconds without cuDNN, "~a minute" more with it (llm.c's Makefile) (estimate;
#                  it now runs in the background while gptspeed and nanoGPT train)
# ms per micro-batch of 16,384 tokens, measured (verify's median steps / 2): bf16 compiled with SDPA, vocab 50304 and
# fused AdamW 36.2; bf16 eager with manual attention 168.9; TF32 185.3; fp32 eager with manual attention 392.2
MS = {"bf16": 37, "eager": 169, "tf32": 185, "fp32": 392}


def _steps(n: int, micro: int, kind: str) -> float:
    return n * micro * MS[kind] / 1000


def _verify_rung(kind: str, compile_s: float = 0.0, micro: int = 2) -> float:
    """One verify rung: a process, its compile, 15 + 5 steps of ``micro`` micro-batches and a profiled step."""
    return START + compile_s + _steps(21, micro, kind)


def _estimates(cold: float) -> dict[str, tuple[float, str]]:
    fp32, tf32, bf16 = _verify_rung("fp32"), _verify_rung("tf32"), _verify_rung("eager")
    comp, warm = _verify_rung("bf16", cold), _verify_rung("bf16", WARM)
    gpt = START + cold + _steps(28, 4, "bf16")  # a peer row: 8 + 20 steps of 4 micro-batches
    gpt_warm = START + WARM + _steps(28, 4, "bf16")
    llmc = START + _steps(28, 4, "bf16")
    ladder_c = START + cold + _steps(38, 1, "bf16")  # 8 + 30 steps of 1 micro-batch, its own cold cache
    beyond = PREPARE + 3 * gpt + 3 * gpt_warm  # the default and 2 variants, 2 rounds
    return {
        "peers": (PREPARE + LLMC_BUILD + (2 * gpt + llmc) + (PEER_ROUNDS - 1) * (2 * gpt_warm + llmc),
                  "prepare; llm.c's build; round 1 compiles gptspeed and nanoGPT cold, later rounds load them "
                  "from their compile caches; llm.c compiles nothing at run time"),
        "verify": (PREPARE + fp32 + tf32 + bf16 + 3 * comp + warm,
                   "fp32, TF32, bf16 eager; compile, flash, vocab-pad cold; fused-adamw's model is vocab-pad's "
                   "graph, loaded from the shared cache"),
        "first": (5 + PREPARE + (START + cold + 50 * _steps(1, 32, "bf16") + 15)
                  + (START + WARM + 30 * _steps(1, 32, "bf16") + 5) + (START + WARM + 20 * _steps(1, 32, "bf16") + 10)
                  + START + 10,
                  "50 steps of 32 micro-batches (524,288 tokens) with a cold compile, 2 evals and checkpoints; 30 "
                  "steps and 20 resumed steps from the compile cache; a sample"),
        "ladder": (PREPARE + START + _steps(38, 1, "fp32") + START + _steps(38, 1, "tf32") + START
                   + _steps(38, 1, "eager") + 4 * ladder_c,
                   "3 eager rows, then 4 compiled rows each with its own cold cache (the warm-up is the compile)"),
        "cudatests": (15 + 45 + 145,
                      "measured on the H100: the NCCL step 12.5 s, the other cuda tests but verify 41.7 s, verify at "
                      "2 layers x 128 (7 rungs, 3 cold small compiles) 140.6 s"),
        "profile": (PREPARE + 60 + START + cold + _steps(11, 1, "bf16") + 30,
                    "the loss benchmark (~60 s, one small compile); one cold compile, 11 steps, the trace export"),
        "verify2": (PREPARE + 2 * fp32 + comp + (comp + 25) + comp + warm,
                    "2 fp32 references (AdamW, Muon); fused-ce, batch-auto (its probe ~25 s, another B: cold) and "
                    "FP8 cold; Muon's model is fused-ce's graph, loaded from the cache"),
        "verify3": (PREPARE + 2 * fp32 + _verify_rung("bf16", BLOCK_COLD) + bf16 + 2 * comp,
                    "2 fp32 references; per-block compile (one block); fp16 eager; fp16 + fused loss and cuDNN "
                    "attention cold"),
        "verify4": (PREPARE + fp32 + _verify_rung("bf16", AUTOTUNE),
                    "the reference; max-autotune-no-cudagraphs's matmul search"),
        "verify5": (PREPARE + 2 * _verify_rung("fp32", micro=1) + _verify_rung("bf16", cold + 5, micro=1)
                    + _verify_rung("bf16", AUTOTUNE / 2, micro=1),
                    "2 fp32 references at 1 micro-batch; reduce-overhead cold (+5 s of CUDA-graph capture); "
                    "max-autotune on per-block graphs (one block's search: half the whole model's, estimate)"),
        **{name: (beyond, "the default and 2 variants, each cold in round 1 and from its cache in round 2")
           for name in BEYOND_GROUPS},
    }


def estimate(phase: str) -> tuple[float, float, str]:
    """``(seconds planned, seconds at the upper end, what they rest on)`` for ``phase`` on one H100."""
    (mid, why), (high, _) = _estimates(COLD[0])[phase], _estimates(COLD[1])[phase]
    return round(mid), round(high), why


def plan_lines() -> list[str]:
    """The documented commands with their estimates (``--plan``)."""
    out = []
    for cmd in COMMANDS:
        mid, high = (sum(estimate(p)[i] for p in cmd) for i in (0, 1))
        out.append(f"gpu_session.py {' '.join(cmd)}: ~{mid / 60:.1f} min (up to {high / 60:.1f}) -- "
                   + "; ".join(f"{p}: {estimate(p)[2]}" for p in cmd))
    return out


class Session:
    """One phase: its results folder, its budget, the log of what ran, and the packing."""

    def __init__(self, phase: str, out: Path, budget_s: float, smoke: bool):
        self.phase, self.smoke = phase, smoke
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.out = out  # only <phase>.tgz goes here: what is under $OUT comes back (8 files, 16 MiB each)
        self.work = Path(os.environ.get("GPTSPEED_SESSION_WORK", "/tmp/gptspeed-session"))
        self.dir = self.work / f"{phase}-results"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        out.mkdir(parents=True, exist_ok=True)
        self.summary: list[dict] = []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
        if (CARRY / "data").exists():
            env.setdefault("GPTSPEED_DATA_MIRROR", str(CARRY / "data"))
        if (CARRY / "peers").exists():
            env.setdefault("GPTSPEED_PEERS_DIR", str(CARRY / "peers"))
        return env

    def run(self, name: str, cmd: list[str], cap_s: float, on_line=None, expect: int = 0) -> int | None:
        """Run ``cmd`` with its output in ``<name>.log``, for at most ``cap_s`` seconds or what is
        left of the budget (less 15 s for packing). ``on_line(line, proc)`` sees every output line;
        ``expect`` is the exit status that means it went as planned. Returns the exit status, or
        None when it timed out or there was no time left to start it."""
        timeout = min(cap_s, self.left() - 15)
        entry = {"part": name, "command": " ".join(cmd)}
        if timeout < 10:
            entry.update(status="not run: out of time")
            self.summary.append(entry)
            print(f"== {name}: not run, {self.left():.0f} s left", flush=True)
            self.pack()
            return None
        print(f"== {name} (at most {timeout:.0f} s): {' '.join(cmd)}", flush=True)
        t = time.monotonic()
        log = (self.dir / f"{name}.log").open("w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)

        def seen(line: str) -> bool:
            log.write(line + "\n")
            log.flush()
            if on_line is not None:
                on_line(line, proc)
            return False

        deadline = time.perf_counter() + timeout
        timed_out = False
        try:
            read_lines(proc.stdout.fileno(), seen, deadline)
            try:  # the output ended: the process is exiting, or it closed its output and runs on
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            log.close()
        code = proc.returncode
        entry.update(status="timed out" if timed_out else "ok" if code == expect else f"exit {code}",
                     exit=code, seconds=round(time.monotonic() - t, 1))
        self.summary.append(entry)
        tail = (self.dir / f"{name}.log").read_text().splitlines()[-3:]
        print(f"== {name}: {entry['status']} in {entry['seconds']} s | " + " | ".join(tail)[-600:], flush=True)
        self.pack()
        return None if timed_out else code

    def note(self, **fields) -> None:
        self.summary.append(fields)
        print("== note: " + json.dumps(fields), flush=True)
        self.pack()

    def pack(self, largest: int = 4 << 20) -> None:
        """``$OUT/<phase>.tgz``: the results folder, less any file over ``largest`` bytes (a
        profiler trace; its name is listed in summary.json), written to a temporary name first."""
        left_out = sorted(str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if p.is_file()
                          and p.stat().st_size > largest)
        (self.dir / "summary.json").write_text(json.dumps({"phase": self.phase, "parts": self.summary,
                                                           "left_out_over_4MiB": left_out}, indent=1) + "\n")
        tmp = self.out / f".{self.phase}.tgz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.dir, arcname=self.dir.name,
                    filter=lambda info: None if info.isfile() and info.size > largest else info)
        tmp.replace(self.out / f"{self.phase}.tgz")


def gptspeed(*args: str) -> list[str]:
    return [sys.executable, "-m", "gptspeed", *args]


def shape(s: Session) -> list[str]:
    """The model every phase trains: GPT-2 124M at T=1024 (``--smoke``: pico on the CPU)."""
    if s.smoke:
        return ["--preset", "pico", "--device", "cpu", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]
    return ["--preset", "gpt2", "--device", "cuda"]


def data_dir(s: Session) -> Path:
    """shakespeare-gutenberg prepared once per machine (tinyshakespeare with ``--smoke``)."""
    corpus = "tinyshakespeare" if s.smoke else "shakespeare-gutenberg"
    out = Path(os.environ.get("GPTSPEED_SESSION_DATA", "/tmp/gptspeed-session-data")) / corpus
    if not (out / "manifest.json").exists():
        s.run("prepare", gptspeed("prepare", corpus, "--out", str(out), "--no-progress"), 180)
    return out


def machine(s: Session) -> None:
    checks = ("nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit "
              "--format=csv; which gcc cc nvcc; gcc --version | head -1; nvcc --version | tail -2; "
              f"{sys.executable} -c \"import sysconfig, os, sys, torch; inc = sysconfig.get_paths()['include']; "
              "print('python', sys.version.split()[0], '| Python.h', os.path.exists(os.path.join(inc, 'Python.h')), "
              "'| torch', torch.__version__, '| cuda', torch.version.cuda, '| cudnn', torch.backends.cudnn.version())\"; "
              f"{sys.executable} -m pip list 2>/dev/null | grep -i -E '^(torch|triton|torchao|transformers|numpy|tiktoken|liger) '")
    s.run("machine", ["bash", "-c", checks], 60)


def phase_first(s: Session) -> None:
    machine(s)
    data = data_dir(s)
    steps = ["--max-steps", "50", "--eval-every", "25", "--save-every", "25", "--log-every", "5",
             "--eval-tokens", "65536" if not s.smoke else "1024", "--data", str(data)]
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

    s.run("train-interrupted", gptspeed("train", *shape(s), *steps, "--out", str(resumed)), 300, on_line=stop_after_30,
          expect=128 + signal.SIGINT)
    s.run("train-resume", gptspeed("train", "--out", str(resumed), "--resume"), 240)
    s.note(part="resume-check", **compare_losses(ref, resumed), sigint_after_step=stopped.get("sent"))
    for run in (ref, resumed):
        for name in ("metrics.jsonl", "config.json"):
            if (run / name).exists():
                shutil.copy(run / name, s.dir / f"{run.name}-{name}")
    sample_device = ["--device", "cpu"] if s.smoke else ["--device", "cuda"]
    s.run("sample", gptspeed("sample", "--run", str(ref), "--prompt", "ROMEO:", "--max-new-tokens", "64",
                             *sample_device), 120)


NCCL_TEST = "tests/test_verify.py::test_one_process_ddp_step[nccl-cuda]"
CUDA_VERIFY_TEST = "tests/test_verify.py::test_verify_on_cuda_at_a_small_shape_passes"
# pytest -m cuda in parts, the NCCL check first (the only one of NCCL DDP), the verify run last (the longest):
# (part, what it selects, seconds it may take)
CUDA_TEST_PARTS = (("pytest-nccl", [NCCL_TEST], 120),
                   ("pytest-cuda", ["tests", "--deselect", NCCL_TEST, "--deselect", CUDA_VERIFY_TEST], 240),
                   ("pytest-cuda-verify", [CUDA_VERIFY_TEST], 300))


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
    return {"steps_compared": len(common), "last_step_ref": max(a, default=None),
            "last_step_resumed": max(b, default=None), "max_rel_diff": max(diffs, default=None)}


def bench(s: Session, name: str, what: list[str], cap_s: float, *extra: str) -> None:
    data = data_dir(s)
    size = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "2",
            "--device", "cpu", "--compile-backend", "eager"] if s.smoke else ["--preset", "gpt2", "--device", "cuda",
                                                                            "--seq-len", "1024"]
    s.run(name, gptspeed("bench", *what, *size, "--data", str(data), "--out", str(s.dir / name), *extra), cap_s)


def phase_verify(s: Session) -> None:
    stages, extra, rung_s = VERIFY_GROUPS[s.phase]
    steps = ["--steps", "3", "--warmup", "2"] if s.smoke else ["--steps", "15", "--warmup", "5"]
    select = (["--stages", stages] if stages else []) if not s.smoke else ["--stages", "baseline,compile"]
    bench(s, "verify", ["--verify", *select, *extra], 560, *steps, "--stage-timeout", str(rung_s))


def phase_ladder(s: Session) -> None:
    steps = ["--steps", "3", "--warmup", "1"] if s.smoke else ["--steps", "30", "--warmup", "8", "--batch-size", "16"]
    bench(s, "ladder-B16", ["--ladder", "--stages", SEEDS if not s.smoke else "baseline,compile", "--no-peers"], 560,
          *steps, "--stage-timeout", "240")


def peers(s: Session, name: str, rows: str, variants: list[str], rounds: int) -> None:
    data = data_dir(s)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_peers_gpu.py"), "--data", str(data), "--peers", rows,
           "--rounds", str(rounds), "--work", str(s.work / "peers-gpu"), "--json", str(s.dir / f"{name}.json"),
           "--md", str(s.dir / f"{name}.md")]
    if s.smoke:
        cmd += ["--device", "cpu", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
                "--batch-size", "2", "--accum", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    for v in variants:
        cmd += ["--variant", v]
    s.run(name, cmd, 560)


def phase_profile(s: Session) -> None:
    loss = [sys.executable, str(ROOT / "benchmarks" / "gpu_loss_paths.py"), "--json", str(s.dir / "loss.json"),
            "--md", str(s.dir / "loss.md")]
    if s.smoke:
        loss += ["--device", "cpu", "--dtype", "float32", "--tokens", "256", "--vocab", "1024", "--width", "64",
                 "--rounds", "1", "--steps", "1", "--compile-backend", "eager"]
    s.run("loss", loss, 180)
    steps = ["--steps", "2", "--warmup", "1"] if s.smoke else ["--steps", "3", "--warmup", "8"]
    bench(s, "profile", ["--profile", "fused-adamw" if not s.smoke else "baseline"], 400, *steps,
          *(["--batch-size", "16"] if not s.smoke else []))


def run_phase(s: Session) -> None:
    if s.phase == "first":
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
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds all the phases together may take (one device command: at most 600)")
    ap.add_argument("--smoke", action="store_true", help="run the phase on the CPU at the pico shape (tests)")
    ap.add_argument("--plan", action="store_true", help="print the documented commands and their estimates")
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
        mid, high, _ = estimate(phase)
        print(f"== {phase}: {len(s.summary)} parts, {'failed or cut: ' + ', '.join(bad) if bad else 'all ok'}; "
              f"{time.monotonic() - s.t0:.0f} s (estimated on an H100: {mid} s, up to {high}); results in "
              f"{out / (phase + '.tgz')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
