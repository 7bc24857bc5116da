"""The bench's fixtures: every bench worker process on one OpenMP thread (its rows are tiny)."""

import pytest
import torch

from support.packages import fake_packages


@pytest.fixture(autouse=True)
def _one_thread_workers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def h100(monkeypatch):
    """An H100 as the plan sees it (no GPU is used: only the capability queries are answered)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    fake_packages(monkeypatch, triton=True, torchao=True)
