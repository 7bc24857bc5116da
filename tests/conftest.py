"""Shared fixtures: the real text in ../shared/data (read through GPTSPEED_DATA_MIRROR, so no
network is ever used), a prepared tinyshakespeare folder, and a CLI runner."""

from __future__ import annotations

import os

# Intel MKL's Conditional Numerical Reproducibility, before torch (and MKL) load, inherited by every
# training subprocess: the bit-identical-resume tests check the promise under the condition
# docs/reliability.md states (without it MKL may vary a last bit run to run under heavy CPU load).
# AUTO, not AUTO,STRICT: the same results for the same thread count and 64-byte-aligned buffers
# (PyTorch's CPU allocator aligns to 64), without STRICT's slow small-matrix paths (7x on this CPU).
os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: N workers share the cores, so each (and every process it starts) uses one
    # thread -- OpenMP threads spinning against another busy process make tiny steps ~100x slower.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the corpora: ../shared/data beside the checkout, or where GPTSPEED_DATA_MIRROR already points (a GPU
# machine has no ../shared: its .carry/setup.sh points the mirror at .carry/data)
SHARED_DATA = Path(os.environ.get("GPTSPEED_DATA_MIRROR") or ROOT.parent / "shared" / "data")
SRC = ROOT / "src"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped, with the reason, where PyTorch sees no CUDA GPU (torch is
    imported only when such a test was collected)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread while a module runs (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny shapes gain nothing from threads, and OpenMP threads spinning against other processes on
    a shared 2-core machine make them ~100x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _mirror(monkeypatch):
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(SHARED_DATA))


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> Path:
    """tinyshakespeare prepared once per session (train 304,223 / val 33,803 tokens)."""
    from gptspeed.data.prepare import prepare

    os.environ.setdefault("GPTSPEED_DATA_MIRROR", str(SHARED_DATA))
    out = tmp_path_factory.mktemp("data") / "tinyshakespeare"
    prepare("tinyshakespeare", out, progress=False)
    return out


def make_step(model_kw: dict, optim_kw: dict | None = None, rt=None, train_kw: dict | None = None, **runtime_kw):
    """The training step of ``gptspeed train`` (:class:`gptspeed.step.TrainStep`, every rule checked)
    for a model shape (GPTConfig fields), optimizer and train settings, on the CPU in fp32 unless
    ``rt`` is given."""
    from gptspeed.config import GPTConfig, OptimConfig, RunConfig, RuntimeConfig, TrainConfig
    from gptspeed.runtime import resolve_runtime
    from gptspeed.step import TrainStep

    cfg = RunConfig(
        model=GPTConfig(**model_kw),
        optim=OptimConfig(**(optim_kw or {})),
        train=TrainConfig(**(train_kw or {})),
        runtime=RuntimeConfig(**runtime_kw),
    )
    cfg.validate()
    return TrainStep(cfg, rt or resolve_runtime("cpu", "float32", False))


def one_step(step, x, y):
    """One optimizer step of a :class:`gptspeed.step.TrainStep` on the micro-batch ``(x, y)`` (its
    one micro-batch per step): ``(loss, grad_norm, bad)``."""
    return step(lambda: (x, y))


#: The one tiny model of the tests (each test states what it changes): seconds on a CPU.
TINY_MODEL = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)


def flags(settings: dict) -> list[str]:
    """Settings (RunConfig field names) as ``gptspeed train`` / ``bench`` flags."""
    out = []
    for k, v in settings.items():
        out += [f"--{'seq-len' if k == 'block_size' else k.replace('_', '-')}", str(v)]
    return out


def records(run_dir: Path) -> list[dict]:
    """Every record of a run's ``metrics.jsonl``, in order."""
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """``{step: train_loss}`` of a run's ``metrics.jsonl``."""
    return {r["step"]: r["train_loss"] for r in records(run_dir) if "train_loss" in r}


def fake_packages(monkeypatch, **installed: bool) -> None:
    """``importlib.util.find_spec`` answers as if each named package were installed (True) or not
    (False); every other name as this machine does. Only the lookup is faked: nothing is imported."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: (object() if installed[name] else None) if name in installed else real(name, *a, **k),
    )


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
