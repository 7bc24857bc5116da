"""Running gptspeed from a test: in this process, in a fresh one, in the background; and what a user error looks like."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.paths import SHARED_DATA, SRC


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a gptspeed subprocess: this one's, with ``src`` first on the path (packages
    found through PYTHONPATH, e.g. a GPU machine's carried wheels, stay found) and the shared data as
    the corpus mirror, plus ``extra`` (e.g. ``OMP_NUM_THREADS="1"``)."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "GPTSPEED_DATA_MIRROR": str(SHARED_DATA), **extra}


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c CODE`` in a bare environment with only ``src`` on the path: what a user's first
    ``import gptspeed`` sees (the "imports no torch" probes print ``'torch' in sys.modules``)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )


def run_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m gptspeed ARGS`` in a fresh process, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "gptspeed", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        **kw,
    )


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``gptspeed ARGS`` in this process (``gptspeed.cli.main``: the code ``python -m gptspeed``
    runs, without the seconds of a fresh interpreter importing torch), stdout and stderr captured.
    For what needs a process boundary (signals, imports, a clean environment) use :func:`run_cli`."""
    import contextlib
    import io

    from gptspeed.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["gptspeed", *args], code, out.getvalue(), err.getvalue())


def start_cli(*args: str) -> subprocess.Popen:
    """``python -m gptspeed ARGS`` started in the background, stdout and stderr piped as text."""
    env = child_env()
    return subprocess.Popen(
        [sys.executable, "-m", "gptspeed", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _pump(proc: subprocess.Popen):
    """Threads that read ``proc``'s stdout (into a queue, line by line) and stderr (into a list)."""
    import queue
    import threading

    if not hasattr(proc, "_out"):
        proc._out, proc._seen, proc._err = queue.Queue(), [], []

        def out():
            for line in proc.stdout:
                proc._out.put(line)
            proc._out.put(None)

        def err():
            proc._err.extend(proc.stderr)

        proc._threads = [threading.Thread(target=f, daemon=True) for f in (out, err)]
        for t in proc._threads:
            t.start()
    return proc._out


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 240) -> str:
    """Read ``proc``'s stdout until a line containing ``needle`` and return that line. Fails the
    test (after killing ``proc``) if the process ends or ``timeout`` seconds pass first: the test
    waits for an event, never guesses how long something takes."""
    import queue
    import time

    q = _pump(proc)
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
            proc._ended = line is None  # the sentinel: stdout closed
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            out, err = finish(proc)
            pytest.fail(f"never printed {needle!r}; stdout:\n{out}\nstderr:\n{err[-2000:]}")
        proc._seen.append(line)
        if needle in line:
            return line


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """Wait for ``proc`` to end; its whole stdout and stderr."""
    import queue

    q = _pump(proc)
    proc.wait(timeout=timeout)
    for t in proc._threads:
        t.join(timeout=10)
    while not getattr(proc, "_ended", False):
        try:
            line = q.get(timeout=10)
        except queue.Empty:  # stdout still open: held by a child of proc's that outlived it
            line = "[stdout still open after the process ended: a child of it lives on]\n"
            proc._ended = True
        if line is None:
            proc._ended = True
        else:
            proc._seen.append(line)
    return "".join(proc._seen), "".join(proc._err)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: non-zero exit, exactly one line on stderr, no traceback, mentioning fragments."""
    assert proc.returncode != 0, proc.stdout
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
