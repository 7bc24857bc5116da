"""Reference runs: tiny trainings that were never stopped, made once per test session and shared by every test that
compares with them or checks what they log (the ``reference_run`` fixture, tests/conftest.py).

A reference is named by its settings (``gptspeed.make_config`` names, trained as ``gptspeed train --preset pico``
with them as flags) and a setup (a registered optimizer, the "eager" compile backend); its data by name
(:data:`SHAKESPEARE`, :data:`STREAM`), so that under pytest-xdist the first worker to need a reference makes it in
the session's folder (a file lock, as the ``dist_runs`` fixture does) and the others read it. Read-only: a test
that changes a run copies it first. Every setting is given, ``threads`` included (:data:`THREADS`): MKL's and
PyTorch's CPU reductions split by the thread count, and the bit-identical comparisons hold for one count."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from support.cli import run_main

#: The data of a reference, by name: tinyshakespeare prepared (the ``shakespeare_data`` fixture) ...
SHAKESPEARE = "tinyshakespeare"
#: ... or a jsonl file streamed (``--data jsonl:FILE``) without preparing: 200 documents of known text.
STREAM = "jsonl-stream"


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


#: ``--threads`` of the shared runs: PyTorch's count in this process as the tests are collected (before a fixture
#: changes it): one per physical core, or one under pytest-xdist (tests/conftest.py). A run in this process and
#: one in a child then split their reductions alike, whichever test trained the reference first.
THREADS = _default_threads()


def session_folder(tmp_path_factory) -> Path:
    """The folder of this test session: under pytest-xdist the workers' common one."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent  # every worker's basetemp lies in the session's folder
    return session


def made_once(folder: Path, make: Callable[[Path], None]) -> Path:
    """``folder``, made by ``make(folder)`` unless a process of this session made it already."""
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        done = folder.with_name(folder.name + ".made")
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a making that failed
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder


def train_flags(settings: dict) -> list[str]:
    """``settings`` as ``gptspeed train --preset pico`` flags (``--x`` / ``--no-x`` for a switch)."""
    from gptspeed.config import setting_flag

    out = ["--preset", "pico"]
    for k, v in settings.items():
        flag = setting_flag(k)
        out += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return out


def build_sgd(model, cfg, device_type):
    """Plain SGD at --lr (momentum 0.9): a registered optimizer of the tests' own."""
    import torch

    opt = torch.optim.SGD(list(model.parameters()), lr=cfg.lr, momentum=0.9)
    for g in opt.param_groups:
        g["lr_mult"] = 1.0
    return opt, False


@contextlib.contextmanager
def toy_sgd() -> Iterator[None]:
    """``--optimizer toy-sgd`` registered (:func:`gptspeed.optim.register_optimizer`) while inside."""
    import pytest

    from gptspeed import optim
    from gptspeed.config import OPTIMIZERS as CHOICES

    before = list(CHOICES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optim, "OPTIMIZERS", dict(optim.OPTIMIZERS))
        mp.setattr(optim, "CONFIG_OPTIMIZERS", CHOICES)
        try:
            optim.register_optimizer(optim.OptimizerSpec("toy-sgd", build_sgd, grad_scaler=False, doc="SGD"))
            yield
        finally:
            CHOICES[:] = before


@contextlib.contextmanager
def eager_compile() -> Iterator[None]:
    """torch.compile with the "eager" backend while inside: dynamo traces, no inductor code generation (seconds,
    not minutes, on a CPU); as the ``eager_compile`` fixture."""
    import pytest
    import torch

    import gptspeed.parallelize as parallelize
    import gptspeed.step as step

    real = parallelize.parallelize
    eager = lambda *a, **k: real(*a, **{**k, "backend": "eager"})  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallelize, "parallelize", eager)
        mp.setattr(step, "parallelize", eager)
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


SETUPS: dict[str | None, Callable[[], contextlib.AbstractContextManager]] = {
    None: contextlib.nullcontext,
    "toy-sgd": toy_sgd,
    "eager-compile": eager_compile,
}


class References:
    """``references(settings, setup=None)``: the folder of the run of ``settings`` never stopped, trained at the
    first call of the session. ``data`` maps a data name to a function making (once) the ``--data`` it stands for."""

    def __init__(self, root: Path, data: dict[str, Callable[[], str]]):
        self.root, self._data, self._made = root, data, {}

    def data(self, name: str) -> str:
        """The ``--data`` of data name ``name``."""
        if name not in self._made:
            self._made[name] = self._data[name]()
        return self._made[name]

    def resolved(self, settings: dict) -> dict:
        """``settings`` with its data name replaced by the ``--data`` it stands for."""
        return dict(settings, data=self.data(settings["data"]))

    def __call__(self, settings: dict, setup: str | None = None) -> Path:
        key = json.dumps([settings, setup], sort_keys=True)
        folder = self.root / f"ref-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        flags = train_flags(self.resolved(settings))
        made_once(folder, lambda f: train(flags, f / "run", setup))
        return folder / "run"


def train(flags: list[str], out: Path, setup: str | None = None) -> None:
    """``gptspeed train FLAGS --out OUT`` in this process under ``setup``; torch's thread count left as it was."""
    import torch

    threads = torch.get_num_threads()
    try:
        with SETUPS[setup]():
            res = run_main("train", *flags, "--out", str(out))
    finally:
        torch.set_num_threads(threads)
    assert res.returncode == 0, res.stderr[-3000:]
