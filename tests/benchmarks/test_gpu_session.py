"""benchmarks/gpu_session.py: a lent GPU's 15-minute window as three prepared device commands (checked on the CPU)."""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import gpu_plan
import gpu_session

from support.cli import child_env
from support.packages import fake_packages
from support.paths import ROOT


def _session_env(tmp_path, shakespeare_data, **extra):
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "tinyshakespeare").exists():
        (data / "tinyshakespeare").symlink_to(shakespeare_data)  # prepared once per test session
    return child_env(
        OMP_NUM_THREADS="1",
        GPTSPEED_SESSION_WORK=str(tmp_path / "work"),
        GPTSPEED_SESSION_DATA=str(data),
        GPTSPEED_CACHE=str(tmp_path / "cache"),
        **extra,
    )


def _smoke(phase: str, root, shakespeare_data) -> tuple[subprocess.CompletedProcess, float, object]:
    """``gpu_session.py PHASE --smoke`` in a folder of its own (work, cache, $OUT): ``(process, seconds, $OUT)``."""
    out, t0 = root / phase / "OUT", time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), phase, "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        env=_session_env(root / phase, shakespeare_data),
    )
    return proc, time.monotonic() - t0, out


def gpu_session_peers_variant(text):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_peers_cpu

    return vs_peers_cpu.parse_variant(text)


def peers_variant_config(flags) -> int:
    """``gptspeed train --print-config`` at the peers' gpt2 shape (16 x 1024 tokens a micro-batch, 65,536 a step)
    with a peers variant's ``flags`` after the shape flags, as vs_peers_gpu.py adds them: its exit status."""
    from gptspeed import cli

    shape = ["--preset", "gpt2", "--batch-size", "16", "--seq-len", "1024", "--total-batch-tokens", "65536"]
    return cli.main(["train", *shape, *flags, "--data", "d", "--out", "o", "--print-config"])


def test_the_first_phase_trains_resumes_samples_and_packs_one_archive(tmp_path):
    out = tmp_path / "OUT"
    env = child_env(
        OMP_NUM_THREADS="1",
        GPTSPEED_SESSION_WORK=str(tmp_path / "work"),
        GPTSPEED_SESSION_DATA=str(tmp_path / "data"),
        GPTSPEED_CACHE=str(tmp_path / "cache"),
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "first", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [p.name for p in out.iterdir()] == ["first.tgz"]  # the one file that comes back from $OUT
    with tarfile.open(out / "first.tgz") as tar:
        names = tar.getnames()
        summary = json.load(tar.extractfile("first-results/summary.json"))
        sample = tar.extractfile("first-results/sample.log").read().decode()
    assert not [n for n in names if n.endswith(".pt")]  # checkpoints stay on the machine
    parts = {p["part"]: p for p in summary["parts"]}
    assert [p for p in parts if p != "resume-check"] == [
        "machine",
        "prepare",
        "train",
        "train-interrupted",
        "train-resume",
        "sample",
    ]  # the cuda tests: their own phase
    assert all(p["status"] == "ok" for p in summary["parts"] if "status" in p), summary
    assert parts["train-interrupted"]["exit"] == 130  # stopped by SIGINT, as planned
    check = parts["resume-check"]
    assert check["sigint_after_step"] >= 30 and check["last_step_resumed"] == check["last_step_ref"] == 50
    assert check["steps_compared"] == 11 and check["max_rel_diff"] == 0.0  # log steps 0, 5, ..., 50: equal losses
    assert sample.startswith("ROMEO:")
    assert "first-results/run-resumed-metrics.jsonl" in names


def test_a_part_with_no_budget_left_is_recorded_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    s = gpu_session.Session("ladder", tmp_path / "OUT", budget_s=60, smoke=True)
    assert s.run("quick", [sys.executable, "-c", "print('hi')"], 60) == 0
    s.budget_s = 0
    assert s.run("too-late", [sys.executable, "-c", "print('x')"], 60) is None
    with tarfile.open(tmp_path / "OUT" / "ladder.tgz") as tar:
        summary = json.load(tar.extractfile("ladder-results/summary.json"))
    statuses = {p["part"]: p["status"] for p in summary["parts"]}
    assert statuses["quick"] == "ok" and statuses["too-late"] == "not run: out of time"


def test_a_part_past_its_time_is_killed_and_said_so(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    s = gpu_session.Session("profile", tmp_path / "OUT", budget_s=60, smoke=True)
    monkeypatch.setattr(s, "min_part_s", 1)
    s.budget_s = time.monotonic() - s.t0 + 15 + 3  # 3 s left for the part (15 s are kept for packing)
    code = s.run("sleeper", [sys.executable, "-c", "import time; print('start', flush=True); time.sleep(120)"], 60)
    assert code is None and s.summary[-1]["status"] == "timed out" and 2 < s.summary[-1]["seconds"] < 30


def test_a_background_part_runs_beside_the_next_and_is_recorded_when_waited_for(tmp_path, monkeypatch):
    """llm.c's build runs in the background (Session.start) while the next parts run; waiting for it
    records it as a part -- its status, exit and seconds, its output in its log -- and one past its
    limit is killed (its whole process group) and recorded as timed out."""
    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    s = gpu_session.Session("window1", tmp_path / "OUT", budget_s=120, smoke=True)
    quick = s.start("builder", [sys.executable, "-c", "print('built', flush=True)"], 60)
    assert s.run("beside", [sys.executable, "-c", "print('ran')"], 60) == 0
    assert s.wait(quick) == 0
    slow = s.start("slow", [sys.executable, "-c", "import time; time.sleep(120)"], 2)
    t0 = time.monotonic()
    assert s.wait(slow) is None and time.monotonic() - t0 < 30 and slow.returncode == -signal.SIGKILL
    parts = {p["part"]: p for p in s.summary}
    assert list(parts) == ["beside", "builder", "slow"]
    assert parts["builder"]["status"] == "ok" and parts["builder"]["exit"] == 0
    assert parts["slow"]["status"] == "timed out" and parts["slow"]["seconds"] < 30
    assert (s.dir / "builder.log").read_text() == "built\n"
    with tarfile.open(tmp_path / "OUT" / "window1.tgz") as tar:  # packed when waited for
        assert [p["part"] for p in json.load(tar.extractfile("window1-results/summary.json"))["parts"]][-1] == "slow"


def test_the_window_fits_15_minutes_with_window3_in_the_reruns_slot_and_the_plan_says_so():
    """The 15-minute window: the machine's start (2 minutes at most), three commands each at most its run
    timeout and the gaps between calls fit 15 minutes, and a fourth would not: window3 runs in the slot a
    rerun of window1 or window2 would take, and ``--plan`` says so; each command's upper estimate stays
    within its timeout and the budget, and every part but the last (which takes what is left) fits the
    budget at the upper end -- window3's pytest -m cuda keeping 30 s; ``--plan`` prints exactly these
    commands, as typed on the device, and the window's total; docs/gpus.md gives each with the run tool's
    carry and timeout."""
    g = gpu_plan
    assert g.COMMANDS == (("window1",), ("window2",), ("window3",)) and g.RERUN == g.COMMANDS[-1][0]
    assert g.window_total()[1] == g.MACHINE_START[1] + 3 * g.RUN_TIMEOUT_S + 2 * g.GAP + g.GIVE_BACK <= g.WINDOW_S
    assert g.MACHINE_START[1] + 4 * g.RUN_TIMEOUT_S + 3 * g.GAP + g.GIVE_BACK > g.WINDOW_S == 900 and g.GAP <= 30
    docs = (ROOT / "docs" / "gpus.md").read_text()
    for cmd in g.COMMANDS:
        planned, upper = g.command_estimate(cmd)
        assert planned <= upper < g.RUN_TIMEOUT_S, (cmd, planned, upper)
        assert upper - g.SETUP <= g.BUDGET_S, cmd
        assert all(g.estimate(p)[2] for p in cmd)  # says what it rests on
        line = g.COMMAND_LINE.format(" ".join(cmd))
        assert f'"{line}"' in docs, line  # the run tool's command string, exactly
    high = g.window_parts("window1", 1)
    assert [p for p, _, _ in high] == ["prepare", "llmc-build", "profile", "default", "llmc-record", "rounds"]
    assert sum(sec for _, sec, _ in high[:-1]) <= g.BUDGET_S - 15
    high = g.window_parts("window3", 1)
    assert [p for p, _, _ in high][1:] == [
        *("train-ref", "train-stopped", "train-resume", "train-ref-wait", "pytest-nccl", "pytest-cuda")
    ]
    assert sum(sec for _, sec, _ in high[:-1]) <= g.BUDGET_S - 15 - 30
    assert g.LLMC_BUILD[1] <= g.LLMC_BUILD_TIMEOUT < g.BUDGET_S - 15 - 40  # and a build without cuDNN after it
    assert '"carry": [".carry"]' in docs and f'"timeout_s": {g.RUN_TIMEOUT_S}' in docs
    assert "nvidia-cudnn-frontend==1.32.0" in docs
    plan = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--plan"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert plan.returncode == 0 and plan.stdout.count("gpu_session.py ") == len(g.COMMANDS)
    minutes = [float(m) for m in re.findall(r"up to (\d+\.\d)", plan.stdout)]
    assert len(minutes) == 3 and max(minutes) * 60 < g.RUN_TIMEOUT_S, plan.stdout
    total = re.search(r"window total: ~(\d+\.\d) min planned; at most (\d+\.\d) min of 15", plan.stdout)
    assert total and float(total.group(1)) < float(total.group(2)) <= 15, plan.stdout
    assert "window3 runs in the slot of a rerun" in plan.stdout


def test_on_a_gpu_the_window_runs_the_rows_the_docs_name(tmp_path, monkeypatch):
    """What the CPU smoke cannot run, read off the commands window1 and window2 would start on a GPU: llm.c's
    build started first, in the background, with its timeout; the default step profiled; the default at
    524,288 tokens a step; llm.c alone at its record's settings (-b 64 x 8 micro-steps = -d 524,288, -r 0);
    then the default, llm.c (-b 64 -r 0) and the B=64 form interleaved at 524,288 tokens; bench tune of
    the gpt2 preset with what is left of the budget; every flag one its tool accepts."""
    import shlex

    from llmc import check_llmc_flags

    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPTSPEED_SESSION_DATA", str(tmp_path / "data"))
    (tmp_path / "data" / "shakespeare-gutenberg").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare-gutenberg" / "manifest.json").write_text("{}")
    ran = {}
    for phase in ("window1", "window2"):
        s = gpu_session.Session(phase, tmp_path / "OUT", budget_s=gpu_plan.BUDGET_S, smoke=False)
        monkeypatch.setattr(s, "run", lambda name, cmd, cap_s, **kw: ran.update({name: (cmd, cap_s)}))
        monkeypatch.setattr(s, "start", lambda name, cmd, cap_s: ran.update({name: (cmd, cap_s)}) or "proc")
        monkeypatch.setattr(s, "wait", lambda proc: 0)
        gpu_session.run_phase(s)
    assert list(ran) == ["llmc-build", "profile", "default", "llmc-record", "rounds", "tune"]

    def flags(part):
        cmd = ran[part][0]
        return {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}

    build = ran["llmc-build"][0]
    assert build[1].endswith("vs_peers_gpu.py") and "--build-llmc" in build
    assert flags("llmc-build")["--timeout"] == str(gpu_plan.LLMC_BUILD_TIMEOUT)
    assert ran["profile"][0][3:8] == ["bench", "profile", "fused-adamw", "--preset", "gpt2"]
    assert flags("profile")["--device"] == "cuda" and flags("profile")["--batch-size"] == "16"
    default, record, rounds = flags("default"), flags("llmc-record"), flags("rounds")
    assert default["--peers"] == "gptspeed" and int(default["--batch-size"]) * int(default["--accum"]) == 512
    assert record["--peers"] == "llmc" and int(record["--batch-size"]) * int(record["--accum"]) * 1024 == 524288
    assert "--llmc-flags=-r 0" in ran["llmc-record"][0] and record["--steps"] == "5"
    assert rounds["--peers"] == "gptspeed,llmc,B64" and rounds["--rounds"] == "2"
    assert rounds["--variant"] == "B64: --batch-size 64 --total-batch-tokens 524288"
    assert int(rounds["--batch-size"]) * int(rounds["--accum"]) * 1024 == 524288
    assert "--llmc-flags=-r 0 -b 64" in ran["rounds"][0]
    assert check_llmc_flags(shlex.split(gpu_plan.LLMC_FLAGS + " -b 64")) == ["-r", "0", "-b", "64"]
    work = {flags(p)["--work"] for p in ("default", "llmc-record", "rounds")} | {flags("llmc-build")["--work"]}
    assert len(work) == 1  # llm.c built once, ahead, for every llm.c row
    tune = flags("tune")
    assert ran["tune"][0][3:5] == ["bench", "tune"] and tune["--preset"] == "gpt2" and tune["--device"] == "cuda"
    assert float(tune["--budget-s"]) == gpu_plan.tune_budget(gpu_plan.BUDGET_S) > 150
    assert ran["tune"][1] <= gpu_plan.BUDGET_S - 15  # the part's timeout leaves the packing its time
    variant = rounds["--variant"].split(":", 1)[1].split()  # after the peers' shape flags, as vs_peers_gpu.py adds it
    assert peers_variant_config(variant) == 0


def test_a_file_too_big_for_the_archive_comes_back_gzipped_beside_it_or_is_listed(tmp_path, monkeypatch):
    """A profiler trace over the archive's per-file limit comes back as $OUT/<phase>-<path>.gz when that
    is within the device's limit for a returned file, once however often the phase packs; one that does
    not compress enough is listed as left out, with why, and nothing half-written stays in $OUT."""
    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    s = gpu_session.Session("window1", tmp_path / "OUT", budget_s=60, smoke=True)
    monkeypatch.setattr(s, "in_archive_max", 100_000)
    monkeypatch.setattr(s, "return_max", 200_000)
    (s.dir / "profile").mkdir()
    (s.dir / "profile" / "trace-fused-adamw.json").write_text('{"ph": "X", "name": "sm90_xmma_gemm"}\n' * 20_000)
    (s.dir / "profile" / "profile-fused-adamw-breakdown.md").write_text("| matmul | 52% |\n")
    (s.dir / "noise.bin").write_bytes(os.urandom(300_000))
    s.pack()
    s.pack()
    assert sorted(p.name for p in (tmp_path / "OUT").iterdir()) == [
        "window1-profile-trace-fused-adamw.json.gz",
        "window1.tgz",
    ]
    with gzip.open(tmp_path / "OUT" / "window1-profile-trace-fused-adamw.json.gz", "rt") as f:
        assert f.read() == (s.dir / "profile" / "trace-fused-adamw.json").read_text()
    with tarfile.open(tmp_path / "OUT" / "window1.tgz") as tar:
        names = tar.getnames()
        large = json.load(tar.extractfile("window1-results/summary.json"))["large_files"]
    assert "window1-results/profile/profile-fused-adamw-breakdown.md" in names  # the small files: in the archive
    assert not [n for n in names if n.endswith(("trace-fused-adamw.json", "noise.bin"))]
    assert large["profile/trace-fused-adamw.json"]["returned_as"] == "window1-profile-trace-fused-adamw.json.gz"
    assert large["noise.bin"]["left_out"].startswith("over 0.2 MiB gzipped")


def test_the_windows_commands_run_on_the_cpu_within_their_budget(tmp_path, shakespeare_data):
    """``--smoke``: the first two commands of the window run on the CPU at the pico shape, every part as planned,
    none cut by the command's budget (every part "ok": the script, not the test, times them), each bringing
    back its one archive: window1 llm.c's build (skipped on a CPU), the
    profile's breakdown, the default's row, llm.c's record row, the interleaved rounds (the default, llm.c
    skipped on a CPU, the wide form); window2 the tune's report and tuned.yaml. The two run side by side (the CPU machine has two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    phases = ["window1", "window2"]  # window3: its own test
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(phases, pool.map(lambda phase: _smoke(phase, tmp_path, shakespeare_data), phases)))
    for phase, (proc, _seconds, out) in runs.items():
        assert proc.returncode == 0, (phase, proc.stdout[-3000:] + proc.stderr[-2000:])
        assert [p.name for p in out.iterdir()] == [f"{phase}.tgz"]
        with tarfile.open(out / f"{phase}.tgz") as tar:
            summary = json.load(tar.extractfile(f"{phase}-results/summary.json"))
        assert summary["parts"] and all(p["status"] == "ok" for p in summary["parts"] if "status" in p), summary
    with tarfile.open(runs["window1"][2] / "window1.tgz") as tar:
        summary_parts = json.load(tar.extractfile("window1-results/summary.json"))["parts"]
        parts = [p["part"] for p in summary_parts]
        peers = json.load(tar.extractfile("window1-results/rounds.json"))
        default = json.load(tar.extractfile("window1-results/default.json"))
        build_log = tar.extractfile("window1-results/llmc-build.log").read().decode()
        record = json.load(tar.extractfile("window1-results/llmc-record.json"))
        breakdown = json.load(tar.extractfile("window1-results/profile/profile-baseline-breakdown.json"))
        names = tar.getnames()
    # the corpus: prepared once per test session; llm.c's build started first, recorded when waited for
    assert parts == ["profile", "default", "llmc-build", "llmc-build-result", "llmc-record", "rounds"]
    assert build_log.startswith("llm.c's build skipped: train_gpt2cu needs a CUDA GPU")
    result = next(p for p in summary_parts if p["part"] == "llmc-build-result")
    assert result["built"] is False and result["why"] == "llm.c's build skipped: train_gpt2cu needs a CUDA GPU"
    rows = peers["shapes"][0]["rows"]
    assert list(rows) == ["gptspeed", "llmc", "B4"] and peers["complete"]
    assert peers["settings"]["llmc_flags"] == "-r 0 -b 4"
    assert rows["B4"]["tokens_per_s"] > 0 and "needs a CUDA GPU" in rows["llmc"]["error"]
    assert "--batch-size 4 --total-batch-tokens 128" in peers["shapes"][0]["runs"]["B4"][0]["command"]
    assert list(default["shapes"][0]["rows"]) == ["gptspeed"] and default["complete"]
    assert record["complete"] and list(record["shapes"][0]["rows"]) == ["llmc"]
    assert breakdown and "window1-results/profile/profile-baseline-breakdown.md" in names
    with tarfile.open(runs["window2"][2] / "window2.tgz") as tar:
        tune = json.load(tar.extractfile("window2-results/tune/tune.json"))
        assert tar.extractfile("window2-results/tune/tuned.yaml").read()
    assert tune["complete"] and tune["rows"][0]["name"] == "yours" and tune["config"]["budget_s"] <= 45


def test_window3_on_the_cpu_stops_a_run_by_sigterm_and_resumes_it_to_the_same_losses(tmp_path, shakespeare_data):
    """``--smoke``: window3 runs on the CPU at the pico shape (2 layers, T=256) with every switch it brings
    to CUDA: the run uninterrupted in the background, the same run stopped by SIGTERM (exit 143) after step
    10 and resumed from the step it saved, every logged train loss, val loss and val bits per byte equal to
    the uninterrupted run's (a CPU resume is bit-identical: docs/reliability.md), the batch-size warm-up's
    first and last steps and the bits per byte recorded; then each pytest part collected, its junit file
    packed; one archive back."""
    proc, _seconds, out = _smoke("window3", tmp_path, shakespeare_data)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [p.name for p in out.iterdir()] == ["window3.tgz"]
    with tarfile.open(out / "window3.tgz") as tar:
        summary = json.load(tar.extractfile("window3-results/summary.json"))
        names = tar.getnames()
    parts = {p["part"]: p for p in summary["parts"]}
    assert list(parts) == [
        *("train-stopped", "train-resume", "train-ref", "resume-check", "pytest-nccl", "pytest-cuda")
    ]  # the reference recorded when waited for, after the resume; the corpus prepared once per test session
    assert all(p["status"] == "ok" for p in summary["parts"] if "status" in p), summary
    assert parts["train-stopped"]["exit"] == 143 and parts["train-ref"]["exit"] == 0
    check = parts["resume-check"]
    assert check["bit_identical"] and check["max_abs_diff"] == check["max_rel_diff"] == 0.0
    assert check["steps_compared"] == check["last_step_ref"] == check["last_step_resumed"] == 16
    assert 10 <= check["sigterm_after_step"] <= check["resumed_from_step"] < 16
    assert check["val_steps_compared"] == 3 and check["val_loss_max_abs_diff"] == check["val_bpb_max_abs_diff"] == 0.0
    assert check["tokens_first_step"] == 256 and check["tokens_last_step"] == 512  # the batch-size warm-up
    assert sorted(check["val_bpb"], key=int) == ["0", "8", "16"] and "not promised on a GPU" in check["promise"]
    for name in ("run-ref-metrics.jsonl", "run-resumed-config.json", "pytest-nccl.xml", "pytest-cuda.xml"):
        assert f"window3-results/{name}" in names, name


def test_on_a_gpu_window3_trains_what_never_ran_on_cuda_and_stops_it_by_sigterm(tmp_path, monkeypatch):
    """What the CPU smoke cannot run, read off the commands window3 would start on a GPU: GPT-2 124M at
    T=1024 with every switch never run on CUDA -- the speedrun recipe, batches aligned to documents, the
    document mask, the sliding window, the batch-size warm-up, val bits per byte, the tail average -- flags
    ``gptspeed train`` accepts; uninterrupted in the background, the same run sent SIGTERM once (after step
    22, exit 143 planned), its resume; then pytest -m cuda under ``timeout``'s SIGINT within each part's
    timeout, every test it leaves out one that exists and is marked cuda."""
    from gptspeed import cli

    monkeypatch.setenv("GPTSPEED_SESSION_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPTSPEED_SESSION_DATA", str(tmp_path / "data"))
    (tmp_path / "data" / "shakespeare-gutenberg").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare-gutenberg" / "manifest.json").write_text("{}")
    s = gpu_session.Session("window3", tmp_path / "OUT", budget_s=gpu_plan.BUDGET_S, smoke=False)
    ran = {}
    monkeypatch.setattr(s, "run", lambda name, cmd, cap_s, **kw: ran.update({name: (cmd, cap_s, kw)}))
    monkeypatch.setattr(s, "start", lambda name, cmd, cap_s: ran.update({name: (cmd, cap_s, {})}) or "proc")
    monkeypatch.setattr(s, "wait", lambda proc: 0)
    gpu_session.run_phase(s)
    assert list(ran) == ["train-ref", "train-stopped", "train-resume", "pytest-nccl", "pytest-cuda"]
    (ref, _, _), (stopped, _, kw), (resume, _, _) = ran["train-ref"], ran["train-stopped"], ran["train-resume"]
    flags = ref[ref.index("train") + 1 : ref.index("--data")]
    assert flags == stopped[stopped.index("train") + 1 : stopped.index("--data")] and ref[-1] != stopped[-1]
    assert flags[:4] == ["--preset", "gpt2", "--device", "cuda"] and "--seq-len" not in flags  # gpt2's T=1024
    for switch in ("--recipe", "--align-to-docs", "--doc-mask", "--attn-window", "--batch-warmup-steps", "--eval-bpb"):
        assert switch in flags, switch
    assert {"--ema-tail-ratio", "--ema-horizon", "--ema-blend", "--save-every", "--eval-every"} <= set(flags)
    assert cli.main(["train", *flags, "--data", "d", "--out", "o", "--print-config"]) == 0
    assert resume[resume.index("train") :] == ["train", "--out", stopped[-1], "--resume"]
    sent = []
    proc = type("Proc", (), {"send_signal": lambda self, sig: sent.append(sig)})()
    for line in ("step  0/40 | val 10.9", "step 21/40 | loss 7.1", "step 22/40 | loss 7.0", "step 23/40 | loss 6.9"):
        kw["on_line"](line, proc)
    assert sent == [signal.SIGTERM] and kw["expect"] == 128 + signal.SIGTERM
    for name in ("pytest-nccl", "pytest-cuda"):
        cmd, cap, _ = ran[name]
        assert cmd[:4] == ["timeout", "-s", "INT", "-k"] and float(cmd[5]) + gpu_session.PYTEST_STOP_S <= cap
        assert cmd[cmd.index("pytest") + 1 : cmd.index("pytest") + 3] == ["-m", "cuda"] and "--junitxml" in cmd
    cuda = ran["pytest-cuda"][0]
    left_out = [cuda[i + 1] for i, a in enumerate(cuda) if a == "--deselect"]
    assert "tests" in cuda and len(left_out) == 3
    for test in left_out:
        path, func = test.split("::")
        before = (ROOT / path).read_text().split(f"def {func.split('[')[0]}(")[0]
        assert "pytest.mark.cuda" in before[-400:], test


def test_every_verify_group_and_beyond_variant_runs_what_it_names(monkeypatch, capsys):
    """What the smoke run does not exercise: on an H100 (as the plan sees it) every rung a verify group
    names runs -- none refused, none unknown (verify5's CUDA-graph modes run at --grad-accum 1) -- and
    together with the default set they cover every rung (verify6 takes whatever no group names); every
    beyond variant's flags are ones ``gptspeed train`` accepts at the session's shape."""
    import torch

    from gptspeed.bench.stages import STAGE_NAMES, VERIFY_EXTRA_NAMES
    from gptspeed.bench.verify import DEFAULT_RUNGS, plan_verify, select_rungs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    fake_packages(monkeypatch, triton=True, torchao=True)
    covered = set(DEFAULT_RUNGS)
    for phase, (_, extra, _) in gpu_session.VERIFY_GROUPS.items():
        stages = gpu_session.verify_stages(phase)
        if stages == "":  # verify6, the rest: nothing left over
            continue
        selected, why = select_rungs(stages)
        accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 2
        plan = {r.name: r for r in plan_verify(torch.device("cuda"), selected, "inductor", accum, why)}
        for name in selected:
            assert plan[name].skip_reason is None, (phase, name, plan[name].skip_reason)
        covered |= set(selected)
    assert covered == set(STAGE_NAMES) | set(VERIFY_EXTRA_NAMES)
    for phase, variants in gpu_session.BEYOND_GROUPS.items():
        for v in variants:
            name, flags, env = gpu_session_peers_variant(v)
            code = peers_variant_config(flags)
            assert code == 0, (phase, v, capsys.readouterr().err)
            assert all(k.startswith("TORCHINDUCTOR_") for k in env), v


def test_a_phase_killed_mid_row_returns_its_finished_rows(tmp_path, shakespeare_data, monkeypatch):
    """A verify part killed while a rung runs (as a part's timeout or the command's limit kills it:
    the whole process group) still packs verify.json with the rungs that finished."""
    from support.cut_short import sleeper_env

    env = _session_env(tmp_path, shakespeare_data)
    sleeping = sleeper_env(tmp_path, "flash")
    for key in ("PYTHONPATH", "GPTSPEED_TEST_SLEEP"):
        monkeypatch.setenv(key, sleeping[key])
    for key in ("GPTSPEED_SESSION_WORK", "GPTSPEED_SESSION_DATA", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, env[key])
    s = gpu_session.Session("verify", tmp_path / "OUT", budget_s=300, smoke=True)

    def kill_when_flash_starts(line, proc):
        if line.startswith("[3/3] flash:"):
            os.killpg(proc.pid, signal.SIGKILL)

    monkeypatch.setattr(s, "run", functools.partial(s.run, on_line=kill_when_flash_starts))
    gpu_session.bench(
        s, "verify", ["--verify", "--stages", "baseline,compile,flash"], 200, "--steps", "2", "--warmup", "1"
    )
    assert s.summary[-1]["status"].startswith("exit -9")
    with tarfile.open(tmp_path / "OUT" / "verify.tgz") as tar:
        result = json.load(tar.extractfile("verify-results/verify/verify.json"))
        parts = json.load(tar.extractfile("verify-results/summary.json"))["parts"]
    rungs = {r["name"]: r for r in result["rungs"]}
    assert result["complete"] is False and result["verdict"] == "incomplete"
    assert rungs["compile"]["verdict"] == "verified" and rungs["baseline"]["status"] == "ok"
    assert rungs["flash"]["status"] == "pending"
    assert parts[-1]["part"] == "verify" and parts[-1]["exit"] == -9
