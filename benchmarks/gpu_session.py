"""Issue 20 on a lent GPU machine: every step of the issue as phases that fit 10-minute device commands.

A lent machine gives a session about 30 minutes of device time, at most 10 per command, and no
network. Each phase runs its parts one after another, each part under a timeout cut to what is left
of the command's budget (``--budget-s``, default 560 s, shared by the phases named in one command),
and after every part packs everything the phase wrote into one file, ``$OUT/<phase>.tgz`` (``--out``),
so a command stopped at its limit still brings back what it measured; ``summary.json`` in each archive
lists the parts, their commands, status and seconds. Run from the project root, after ``bash
../shared/device/carry.sh liger-kernel==0.8.5`` here, as ``source .carry/setup.sh && python3
benchmarks/gpu_session.py PHASE [PHASE ...]``:

==========  ==============================================================================================
phase       what it runs (GPT-2 124M, T=1024, on tokens of shakespeare-gutenberg prepared from .carry)
==========  ==============================================================================================
first       the machine (nvidia-smi, gcc, Python.h, versions); ``gptspeed train --preset gpt2`` for 50 steps
            with an eval and a checkpoint every 25; the same run stopped by SIGINT after step 30 and
            ``--resume``-d to 50 (its losses against the uninterrupted run's); ``gptspeed sample`` from
            the checkpoint; then ``python -m pytest -m cuda`` with the time left
cudatests   ``python -m pytest -m cuda`` alone (when ``first`` ran out of time for it)
peers       ``benchmarks/peers_gpu.py``: gptspeed's default ``train`` vs nanoGPT (compile) vs llm.c's
            ``train_gpt2cu``, 3 interleaved rounds, 65,536 tokens per step (~6 min estimated)
ladder      ``gptspeed bench --ladder`` of the seeds' rows at B=16: fp32 -> TF32 -> bf16 -> compile ->
            flash -> vocab 50304 -> fused AdamW
profile     ``benchmarks/loss_gpu.py`` (the LM-head loss alone: plain, compiled, gptspeed's fused,
            Liger-Kernel's when carried), then ``gptspeed bench --profile fused-adamw`` (the default
            configuration): its top kernels
verify      ``gptspeed bench --verify --preset gpt2 --device cuda``: fp32 .. fused AdamW, fp16, cuDNN attention
verify2     the same: fused loss, ``--batch-size auto``, FP8, Muon
verify3     the same: per-block compile, fp16 + fused loss, the CUDA-graph and max-autotune compile modes
beyond      ``benchmarks/peers_gpu.py --peers gptspeed`` with one switch each from the default, 2 rounds:
            cuDNN attention, the fused loss, the largest micro-batch (``--batch-size auto``)
beyond2     the same: FP8, Muon, per-block compile
beyond3     the same: inductor's coordinate-descent tuning, max-autotune (no CUDA graphs), and cuDNN
            attention with the largest micro-batch together
==========  ==============================================================================================

The phases are listed in the order the issue's "Done when" needs them; one lease holds about three
commands (e.g. ``first``; ``peers ladder``; ``profile verify``). The minutes are estimates until a
GPU has run them. ``--smoke`` runs a phase on the CPU at the pico shape, for the tests: it checks
the orchestration, not the GPU.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # gptspeed's own helpers, from this checkout
CARRY = ROOT / ".carry"
# bench --verify's rungs in three groups that each fit one command (each group also runs its fp32 reference)
VERIFY_GROUPS = {
    "verify": "baseline,tf32,bf16,compile,flash,vocab-pad,fused-adamw,fp16,sdpa-cudnn",
    "verify2": "fused-ce,batch-auto,fp8,muon",
    "verify3": "compile-blocks,fp16-fused-ce,reduce-overhead,max-autotune,max-autotune-no-cudagraphs",
}
SEEDS = "baseline,tf32,bf16,compile,flash,vocab-pad,fused-adamw"
# one switch each from gptspeed train's default, interleaved with the default, 65,536 tokens per step
BEYOND_GROUPS = {
    "beyond": ["cudnn: --sdpa-backend cudnn", "fused-ce: --loss fused",
               "B-auto: --batch-size auto --total-batch-tokens 65536"],
    "beyond2": ["fp8: --fp8", "muon: --optimizer muon", "blocks: --compile-mode blocks"],
    # what else might close a gap to llm.c: inductor's own tuning knobs, and the measured wins together
    "beyond3": ["coord-descent: TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1",
                "autotune: --compile-tuning max-autotune-no-cudagraphs",
                "cudnn-B-auto: --sdpa-backend cudnn --batch-size auto --total-batch-tokens 65536"],
}
PHASES = ("first", "cudatests", "peers", "ladder", "profile", *VERIFY_GROUPS, *BEYOND_GROUPS)


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
        from gptspeed.llmc import read_lines  # reads a pipe line by line up to a deadline

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
    cuda_tests(s)


def cuda_tests(s: Session) -> None:
    if s.smoke:
        s.run("pytest-cuda", [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q",
                              "-p", "no:cacheprovider"], 120)
    else:
        s.run("pytest-cuda", [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-rs",
                              "--junitxml", str(s.dir / "pytest-cuda.xml")], 420)


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
    steps = ["--steps", "3", "--warmup", "2"] if s.smoke else ["--steps", "15", "--warmup", "5"]
    stages = VERIFY_GROUPS[s.phase] if not s.smoke else "baseline,compile"
    bench(s, "verify", ["--verify", "--stages", stages], 560, *steps, "--stage-timeout", "150")


def phase_ladder(s: Session) -> None:
    steps = ["--steps", "3", "--warmup", "1"] if s.smoke else ["--steps", "30", "--warmup", "8", "--batch-size", "16"]
    bench(s, "ladder-B16", ["--ladder", "--stages", SEEDS if not s.smoke else "baseline,compile", "--no-peers"], 560,
          *steps, "--stage-timeout", "150")


def peers(s: Session, name: str, rows: str, variants: list[str], rounds: int) -> None:
    data = data_dir(s)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers_gpu.py"), "--data", str(data), "--peers", rows,
           "--rounds", str(rounds), "--work", "/tmp/gptspeed-peers-gpu", "--json", str(s.dir / f"{name}.json"),
           "--md", str(s.dir / f"{name}.md")]
    if s.smoke:
        cmd += ["--device", "cpu", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
                "--batch-size", "2", "--accum", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    for v in variants:
        cmd += ["--variant", v]
    s.run(name, cmd, 560)


def phase_profile(s: Session) -> None:
    loss = [sys.executable, str(ROOT / "benchmarks" / "loss_gpu.py"), "--json", str(s.dir / "loss.json"),
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
        peers(s, "peers", "gptspeed,nanogpt,llmc", [], 3)
    elif s.phase in BEYOND_GROUPS:
        variants = BEYOND_GROUPS[s.phase]
        peers(s, s.phase, "gptspeed", variants if not s.smoke else variants[:1], 2)
    elif s.phase == "profile":
        phase_profile(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="+", choices=PHASES, metavar="PHASE", help=", ".join(PHASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-session-out"), help="where <phase>.tgz goes ($OUT)")
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="seconds all the phases together may take (one device command: at most 600)")
    ap.add_argument("--smoke", action="store_true", help="run the phase on the CPU at the pico shape (tests)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    t0, failed = time.monotonic(), []
    for phase in args.phases:  # one budget for all: each phase gets what the ones before it left
        s = Session(phase, out, args.budget_s - (time.monotonic() - t0), args.smoke)
        run_phase(s)
        s.pack()
        bad = [p["part"] for p in s.summary if p.get("status") not in (None, "ok")]
        failed += [f"{phase}/{b}" for b in bad]
        print(f"== {phase}: {len(s.summary)} parts, {'failed or cut: ' + ', '.join(bad) if bad else 'all ok'}; "
              f"{time.monotonic() - s.t0:.0f} s; results in {out / (phase + '.tgz')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
