"""`pytest -m cuda` on a GPU machine that has only gptspeed's runtime dependencies and pytest: every test module is collected."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from support.paths import ROOT, SRC

# the packages of gptspeed's extras (test, hf, data, plot, fp8, trackers): absent on a bare GPU machine
OPTIONAL = (
    "torchao",
    "hypothesis",
    "transformers",
    "safetensors",
    "huggingface_hub",
    "matplotlib",
    "pyarrow",
    "datasets",
    "zstandard",
    "tensorboard",
    "wandb",
)


BLOCK = f"""
import importlib.util, sys
ABSENT = {OPTIONAL!r}
class _Absent:  # "import X" fails as for a package that is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by a test)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (None if name.split(".")[0] in ABSENT
                                                       else _find_spec(name, package))
"""


def cuda_tests_in_sources() -> set[str]:
    """The test functions marked ``cuda`` (decorator, or ``marks=pytest.mark.cuda`` on a parameter)."""
    names = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        for m in re.finditer(r"@pytest\.mark\.cuda\n(?:@.*\n)*def (\w+)", text):
            names.add(m.group(1))
        for m in re.finditer(r"marks=pytest\.mark\.cuda.*\n(?:@.*\n)*def (\w+)", text):
            names.add(m.group(1))
    return names


def test_every_gpu_test_collects_without_the_optional_packages(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "-o",
            "addopts=",  # no plugin a bare machine lacks; node ids listed
            "--import-mode=importlib",
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().split("collected")[-1], proc.stdout[-3000:]
    collected = {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    expected = cuda_tests_in_sources()
    assert len(expected) >= 6 and expected <= collected, expected - collected
