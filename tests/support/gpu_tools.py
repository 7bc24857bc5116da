"""A GPU machine's tools faked on the CPU: ``nvidia-smi`` answering a compute capability, ``nvcc`` that records its flags, cuDNN frontend headers."""

from __future__ import annotations

import os
from pathlib import Path


def fake_gpu_tools(tmp_path, monkeypatch, capability="9.0"):
    """A fake ``nvidia-smi`` (answering ``capability``) and ``nvcc`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '%s\\n' {capability}\n")  # one line per GPU
    (bin_dir / "nvcc").write_text(FAKE_NVCC)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDNN_FRONTEND_PATH", raising=False)


def fake_cudnn(tmp_path) -> tuple[Path, Path]:
    """A carried cuDNN-frontend wheel (its include/ folder), a cuDNN wheel's folder as PyTorch's
    nvidia-cudnn-cu13 lays it out (libcudnn.so.9 only, no bare libcudnn.so), and NVRTC's as
    nvidia-cuda-nvrtc 13 lays it out (nvidia/cu13: nvrtc.h, libnvrtc.so.13 only)."""
    import zipfile

    carry, site = tmp_path / "carry", tmp_path / "site"
    (carry / "whl").mkdir(parents=True)
    with zipfile.ZipFile(
        carry / "whl" / "nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_28_x86_64.whl", "w"
    ) as z:
        z.writestr("include/cudnn_frontend.h", "// header-only\n")
        z.writestr("cudnn/__init__.py", "")
    for pkg, d, f in (
        ("cudnn", "include", "cudnn.h"),
        ("cudnn", "lib", "libcudnn.so.9"),
        ("cu13", "include", "nvrtc.h"),
        ("cu13", "lib", "libnvrtc.so.13"),
    ):
        (site / "nvidia" / pkg / d).mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / pkg / d / f).write_text("")
    return carry, site


# ------------------------------------------------------------------- llm.c's GPU build line
FAKE_NVCC = '#!/bin/sh\necho "fake nvcc $*"\n'
