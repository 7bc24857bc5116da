"""torchrun from a test: 2 CPU ranks (gloo) launched as gptspeed's users launch them, in a session of their own so that
a hang or a failure never leaves a worker behind; and the runs of the ``dist_runs`` fixture (tests/conftest.py): one
process and 2 ranks with DDP and FSDP2, and tests/support/dist_scenarios.py, made once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import child_env
from support.paths import SRC
from support.shapes import DIST_RUNS_FIXTURE
from support.training import flags


def torchrun_cmd(args, nproc):
    env = child_env(OMP_NUM_THREADS="1")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "gptspeed",
        *args,
    ], env


def launch(cmd, env) -> subprocess.Popen:
    """``cmd`` started in a session of its own (torchrun and its workers: one process group to kill),
    stdout and stderr piped as text."""
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s whole process group (the launcher and every worker: killing torchrun alone
    leaves its workers running, holding the pipes open)."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def collect(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc``'s stdout and stderr once it ends; a hang fails the test after ``timeout`` seconds
    (the group killed, what it printed so far in the message), never waits for ever."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"{' '.join(proc.args[-8:])} still running after {timeout:g} s; stderr:\n{err[-3000:]}")
    finally:
        kill_group(proc)  # a worker left behind by a launcher that ended


def torchrun(*args, nproc=2, timeout=120):
    cmd, env = torchrun_cmd(args, nproc)
    proc = launch(cmd, env)
    out, err = collect(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def losses(run):
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r.get("train_loss"), r.get("val_loss")) for r in recs}


def assert_same(a, b, steps):
    for s in steps:
        for x, y in zip(a[s], b[s]):
            assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-5), (s, a[s], b[s])


HELLASWAG = [
    {"ctx": "The cat sat on the", "endings": ["mat.", "moon quickly.", "idea of it.", "table"], "label": 0}
] * 4


def make_dist_runs(shakespeare_data: Path, root: Path) -> dict:
    """The runs of the ``dist_runs`` fixture, made in ``root``: JSON-ready (paths as strings)."""
    from gptspeed.trainer import build_train_config, fit

    root.mkdir()
    base = dict(DIST_RUNS_FIXTURE, data=str(shakespeare_data))
    procs = {}
    hellaswag = root / "hellaswag.jsonl"
    hellaswag.write_text("".join(json.dumps(r) + "\n" for r in HELLASWAG))
    (root / "scenarios").mkdir()
    env = child_env(OMP_NUM_THREADS="1")
    procs["scenarios"] = launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SRC.parent / "tests" / "support" / "dist_scenarios.py"),
            str(shakespeare_data),
            str(root / "scenarios"),
            str(hellaswag),
        ],
        env,
    )
    for mode in ("ddp", "fsdp"):  # both launches at once: most of their time is importing torch
        cmd, env = torchrun_cmd(
            ["train", "--preset", "pico", *flags(base), "--parallel", mode, "--out", str(root / mode)], 2
        )
        procs[mode] = launch(cmd, env)
    bad = flags(dict(base, total_batch_tokens=384))  # 384 % (4*32*2) != 0
    cmd, env = torchrun_cmd(["train", "--preset", "pico", *bad, "--out", str(root / "bad")], 2)
    procs["bad"] = launch(cmd, env)
    try:
        fit(build_train_config("pico", dict(base, out=str(root / "single"))), echo=False)
        out = {
            "single": str(root / "single"),
            "data": str(shakespeare_data),
            "root": str(root),
            "hellaswag": str(hellaswag),
        }
        for mode, proc in procs.items():
            _, err = collect(proc, 300)
            if mode == "bad":
                out[mode] = (proc.returncode, err)
                continue
            assert proc.returncode == 0, f"{mode}: {err[-3000:]}"
            if mode == "scenarios":
                out[mode] = [json.loads((root / "scenarios" / f"rank{r}.json").read_text()) for r in (0, 1)]
            else:
                out[mode] = str(root / mode)
    finally:  # a failure above leaves no launch running
        for proc in procs.values():
            kill_group(proc)
    return out


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` (a child of the launcher with RANK=rank), or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(entry)
    return None
