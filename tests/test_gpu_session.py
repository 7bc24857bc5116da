"""benchmarks/gpu_session.py: issue 20's GPU work as phases that each fit one device command. The GPU
is lent rarely and by the minute, so the orchestration is proven here: a phase runs on the CPU at the
pico shape (``--smoke``) and brings back one archive with every part's log, the resume check and no
checkpoint; a phase out of budget says which parts it did not run."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time

from conftest import ROOT, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_session  # noqa: E402


def test_the_first_phase_trains_resumes_samples_and_packs_one_archive(tmp_path):
    out = tmp_path / "OUT"
    env = child_env(OMP_NUM_THREADS="1", GPTSPEED_SESSION_WORK=str(tmp_path / "work"),
                    GPTSPEED_SESSION_DATA=str(tmp_path / "data"), GPTSPEED_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "first", "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [p.name for p in out.iterdir()] == ["first.tgz"]  # the one file that comes back from $OUT
    with tarfile.open(out / "first.tgz") as tar:
        names = tar.getnames()
        summary = json.load(tar.extractfile("first-results/summary.json"))
        sample = tar.extractfile("first-results/sample.log").read().decode()
    assert not [n for n in names if n.endswith(".pt")]  # checkpoints stay on the machine
    parts = {p["part"]: p for p in summary["parts"]}
    assert [p for p in parts if p != "resume-check"] == ["machine", "prepare", "train", "train-interrupted",
                                                         "train-resume", "sample", "pytest-cuda"]
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
    s.budget_s = time.monotonic() - s.t0 + 15 + 12  # 12 s left for the part (15 s are kept for packing)
    code = s.run("sleeper", [sys.executable, "-c", "import time; print('start', flush=True); time.sleep(120)"], 60)
    assert code is None and s.summary[-1]["status"] == "timed out" and s.summary[-1]["seconds"] < 30
