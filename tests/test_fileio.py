"""``gptspeed.fileio``: small file helpers every writer in gptspeed shares: hashing, and atomic writes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_metrics_lines_are_strict_json(tmp_path):
    """A NaN loss (a step skipped by --on-nan skip) was written as NaN: not JSON for any reader but
    Python's. It is null now; the console line still shows nan."""
    from gptspeed.fileio import parse_json
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    RunLog(path, echo=False).write({"step": 1, "train_loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    assert parse_json(path.read_text(), "line") == {"step": 1, "train_loss": None, "grad_norm": None, "lr": 1e-3}
