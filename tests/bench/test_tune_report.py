"""``gptspeed.bench.tune_report``: ``bench tune``'s report as Markdown (``tune.md``): the environment, your run, one row per candidate in the order tried, the configuration kept and the command that trains it."""

from __future__ import annotations

import json

import pytest

from gptspeed.bench.tune_report import VERDICTS

from support.cli import run_cli


@pytest.mark.cuda
def test_tune_on_a_gpu_tries_the_cuda_knobs_and_every_row_ends_with_a_verdict(tmp_path):
    """``bench tune`` on CUDA at a small shape: your row runs, the micro-batch is raised, every CUDA
    knob gives a row (FP8 ones are "not applicable" below compute capability 8.9 or without torchao),
    and the tuned configuration trains."""
    out = tmp_path / "tune"
    proc = run_cli(
        "bench",
        "tune",
        "--device",
        "cuda",
        "--synthetic",
        "--out",
        str(out),
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "128",
        "--seq-len",
        "128",
        "--batch-size",
        "8",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--budget-s",
        "240",
        "--flags",
        "--total-batch-tokens 4096",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "tune.json").read_text())
    verdicts = {r["name"]: r["verdict"] for r in res["rows"]}
    assert verdicts["yours"] == "yours" and "micro-batch=16" in verdicts
    assert {r["knob"] for r in res["rows"][1:]} >= {"micro-batch", "fp8-lm-head", "residual-dtype", "sdpa-backend"}
    for r in res["rows"]:  # everything but a failure or a candidate that trains differently
        assert r["verdict"] in set(VERDICTS) - {"failed", "fails verification"}, r
    trained = run_cli(
        "train",
        "--config",
        str(out / "tuned.yaml"),
        "--max-steps",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--eval-every",
        "0",
        "--eval-tokens",
        "4096",
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
