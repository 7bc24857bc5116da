"""The fixtures every test may use, each defined once: the real text in ../shared/data (read through
GPTSPEED_DATA_MIRROR, so no network is ever used), a prepared tinyshakespeare folder, one torch thread,
no network, Hugging Face offline. Helpers that are not fixtures live in tests/support/."""

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
from pathlib import Path

import pytest

from support.paths import SHARED_DATA


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


@pytest.fixture(scope="module")
def emulated_fp8_matmul():
    """PyTorch's own emulation for the CPU's ``torch._scaled_mm`` while a module runs: the FP8
    operands dequantized to fp32 and one fp32 matmul (``_scaled_mm_out_cpu_emulated``, PyTorch's
    aten/src/ATen/native/Blas.cpp). With oneDNN enabled, ``_scaled_mm_out_cpu`` hands the call
    instead to oneDNN's FP8 matmul on a CPU with AMX-INT8 (Intel Xeon, Sapphire Rapids on): on such
    a Xeon three bf16 steps through an FP8 LM head ran past pytest's 300 s timeout, alone and idle,
    where an AMD EPYC (no AMX: it always emulates) takes ~2 s. What the FP8 tests prove (CUDA's
    rules, the conversion, losses close to bf16) does not depend on the CPU kernel that multiplies;
    CUDA's kernel is tested on a GPU (``pytest -m cuda``)."""
    import torch

    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before


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


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Any download fails (``urllib.request.urlopen`` and requests' transport raise), and gptspeed's cache is an empty
    folder of this test's: a file is read from the mirror or the package, or the test fails."""
    import urllib.request

    def refuse(*args, **kwargs):
        raise OSError("the network must not be used in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    try:  # downloads go through pooch, which uses requests
        import requests.adapters

        monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", refuse)
    except ImportError:
        pass
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def hf_offline(monkeypatch):
    """Hugging Face's libraries offline: a model or file not already on disk is an error, not a download."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile with the "eager" backend: dynamo traces (graph breaks and recompiles are
    real), no inductor code generation (seconds, not minutes, on a CPU)."""
    import torch

    import gptspeed.parallelize as parallelize

    real = parallelize.parallelize
    monkeypatch.setattr(parallelize, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    import gptspeed.step as step

    monkeypatch.setattr(step, "parallelize", parallelize.parallelize)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def reference_run(request, tmp_path_factory):
    """``reference_run(settings, setup=None)``: the folder of a tiny run never stopped, trained once per session and
    shared (tests/support/references.py): the run an exact-resume case must equal, and the run whose logs other
    tests check. Read-only: a test that changes a run copies it first."""
    from support.references import SHAKESPEARE, STREAM, References, made_once, session_folder

    root = session_folder(tmp_path_factory) / "references"

    def stream() -> str:
        from support.documents import DOCS, write_jsonl

        folder = made_once(root / "stream", lambda f: write_jsonl(f / "d.jsonl", DOCS * 5))
        return f"jsonl:{folder / 'd.jsonl'}"

    shakespeare = lambda: str(request.getfixturevalue("shakespeare_data"))  # noqa: E731  (prepared when first used)
    return References(root, {SHAKESPEARE: shakespeare, STREAM: stream})


@pytest.fixture(scope="session")
def dist_runs(shakespeare_data, tmp_path_factory):
    """One process x 2 micro-steps (in-process), and 2 ranks x 1 micro-step with DDP and FSDP2; and,
    launched at the same time, tests/support/dist_scenarios.py: the GPU-path cases on 2 ranks
    (tests/support/torchrun.py).

    Made once per test session: under pytest-xdist the first worker to need them makes them in the
    session's folder (a file lock, as xdist's documentation shows) and the others read them, instead
    of every worker making its own (the launches are the slowest part of the tests using them). Read-only:
    a test that changes a run copies it first."""
    import json

    from filelock import FileLock

    from support.references import session_folder
    from support.torchrun import make_dist_runs

    session = session_folder(tmp_path_factory)
    made = session / "dist_runs.json"
    with FileLock(str(made) + ".lock"):
        if made.is_file():
            out = json.loads(made.read_text())
        else:
            out = make_dist_runs(shakespeare_data, session / "dist")
            made.with_suffix(".tmp").write_text(json.dumps(out))
            made.with_suffix(".tmp").replace(made)
    return {k: (tuple(v) if k == "bad" else v if k == "scenarios" else Path(v)) for k, v in out.items()}
