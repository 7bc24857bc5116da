"""A command cut at its limit, for the tests of what it leaves behind (a GPU command killed
at 10 minutes must keep every finished row). A ``sitecustomize`` module on the children's path makes
the bench row, verify rung or ``gptspeed train`` process named by ``GPTSPEED_TEST_SLEEP`` sleep
instead of running, and :func:`run_until_line` kills the whole command -- its process group, as a
device command's time limit and ``gpu_session.py``'s part timeout do -- once it prints a given line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from support.cli import child_env

SLEEPER = """
import os
_name = os.environ.get("GPTSPEED_TEST_SLEEP")
if _name:  # written by tests/support/cut_short.py: the row, rung or train process named here never finishes
    import time
    if _name == "*":  # this whole process (a peer row's gptspeed train, through its variant's environment)
        time.sleep(600)
    import gptspeed.bench.verify_worker as _verify_worker
    import gptspeed.bench.worker as _worker
    def _wrap(real):
        def build_row(spec, rt, *rest):
            if spec.name == _name:
                print("sleeping instead of building", spec.name, flush=True)
                time.sleep(600)
            return real(spec, rt, *rest)
        return build_row
    _worker.build_row = _wrap(_worker.build_row)
    _verify_worker.build_row = _wrap(_verify_worker.build_row)
"""


def sleeper_env(tmp_path: Path, name: str | None, **extra: str) -> dict[str, str]:
    """A subprocess environment (:func:`conftest.child_env`) whose processes load :data:`SLEEPER`;
    ``name``: the row that sleeps (``"*"``: every process that sets ``GPTSPEED_TEST_SLEEP=*`` itself)."""
    d = tmp_path / "sleeper"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(SLEEPER)
    env = child_env(OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(d), env["PYTHONPATH"]])
    env.pop("GPTSPEED_TEST_SLEEP", None)
    if name:
        env["GPTSPEED_TEST_SLEEP"] = name
    return env


def reap(env: dict) -> None:
    """SIGKILL what a killed command leaves behind: a benchmark starts each row in a session of its
    own (so it can kill the row's whole group), which the command's group kill does not reach. Every
    process whose environment holds this test's sleeper folder (:func:`sleeper_env`) goes."""
    marker = env.get("PYTHONPATH", "").split(os.pathsep)[0]
    if not marker.endswith("sleeper"):
        return
    needle = marker.encode()  # a row's PYTHONPATH may have more in front (the harness adds src/)
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if any(v.startswith(b"PYTHONPATH=") and needle in v for v in f.read().split(b"\0")):
                    os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already, or not ours
            pass


def run_until_line(cmd: list[str], env: dict, pattern: str, timeout: float = 300, cwd: Path | None = None) -> list[str]:
    """Run ``cmd`` (stdout and stderr together) in its own process group and SIGKILL the group at
    the first line matching ``pattern`` (a regular expression). Returns the lines read. AssertionError
    if the command ends, or ``timeout`` passes, before such a line."""
    import time

    from harness import read_lines

    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        lines = read_lines(
            proc.stdout.fileno(), lambda line: bool(re.search(pattern, line)), time.perf_counter() + timeout
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        reap(env)
    assert lines and re.search(pattern, lines[-1]), "\n".join(lines[-30:])
    return lines


def run_until_true(cmd: list[str], env: dict, check, timeout: float = 300, cwd: Path | None = None) -> None:
    """Run ``cmd`` in its own process group and SIGKILL the group once ``check()`` is true (polled
    every 0.2 s). AssertionError, with its output, if the command ends or ``timeout`` passes first."""
    import tempfile
    import time

    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, ok = time.monotonic() + timeout, False
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if check():
                    ok = True
                    break
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reap(env)
        log.seek(0)
        assert ok, log.read().decode(errors="replace")[-3000:]
