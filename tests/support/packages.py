"""Optional packages, as if installed or not."""

from __future__ import annotations


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
