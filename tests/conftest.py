"""Shared fixtures: the real text in ../shared/data (read through GPTSPEED_DATA_MIRROR, so no
network is ever used), a prepared tinyshakespeare folder, and a CLI runner."""

from __future__ import annotations

import os

# Intel MKL's Conditional Numerical Reproducibility, before torch (and MKL) load, inherited by every
# training subprocess: the bit-identical-resume tests check the promise under the condition
# docs/reliability.md states (without it MKL may vary a last bit run to run under heavy CPU load).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
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


def run_cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m gptspeed ARGS`` in a fresh process, output captured as text."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPTSPEED_DATA_MIRROR": str(SHARED_DATA)}
    return subprocess.run([sys.executable, "-m", "gptspeed", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: non-zero exit, exactly one line on stderr, no traceback, mentioning fragments."""
    assert proc.returncode != 0, proc.stdout
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
