"""``gptspeed.bench.entry``: the worker process of ``gptspeed bench``: ``python -m gptspeed.bench SPEC.json RESULT.json`` runs one ladder row (:func:`gptspeed.bench.worker.run_stage`) or one verify rung (:func:`gptspeed.bench.verify_worker.verify_stage`) in this fresh process and writes its result."""

from __future__ import annotations

import pytest
import torch

from gptspeed.bench.stages import (
    BASELINE,
    baseline_with,
)

from support.ladder_rows import in_process_worker
from support.shapes import SMALLEST_ROW

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_row_out_of_memory_is_a_failed_row_naming_the_batch(tmp_path, monkeypatch):

    from gptspeed.bench import entry
    from gptspeed.bench.worker import StageSpec

    def oom(spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB")

    monkeypatch.setattr(entry, "run_stage", oom)
    spec = StageSpec(name="baseline", settings=dict(BASELINE), **dict(SMALLEST_ROW, seq_len=1024, batch_size=64))
    result = in_process_worker(spec, tmp_path / "baseline.log")
    assert result["status"] == "failed" and result["oom"] is True
    assert result["reason"] == (
        "out of memory at B=64 (T=1024, 1 micro-batch(es) per step): CUDA out of memory. Tried to allocate 96.00 GiB"
    )


def test_a_combination_gptspeed_refuses_is_a_skipped_rung_with_the_refusal(tmp_path):
    from gptspeed.bench.worker import StageSpec

    spec = StageSpec(name="fp16", settings=baseline_with(dtype="float16"), **SMALLEST_ROW, mode="verify")
    result = in_process_worker(spec, tmp_path / "fp16.log")
    assert result == {
        "status": "skipped",
        "reason": "refused: --dtype float16 is not supported on a CPU: use bfloat16 or float32",
    }
