"""``gptspeed.batchsize``: ``--batch-size auto``: the largest micro-batch that fits, found by a short probe on CUDA."""

from __future__ import annotations

import pytest
import torch

from gptspeed.errors import GptspeedError
from gptspeed.runtime import resolve_runtime

from support.cli import assert_user_error, run_cli
from support.padded_model import CPU
from support.runs import train_args


# ---------------------------------------------------------------------------- --batch-size auto
def test_probe_finds_the_largest_fitting_batch():
    from gptspeed.batchsize import largest_fitting

    for limit_true in (1, 2, 3, 7, 8, 13, 64, 100, 1000):
        calls = []

        def fits(b):
            calls.append(b)
            return b <= limit_true

        assert largest_fitting(fits, limit=1024) == limit_true
        assert len(calls) <= 2 * 11
    assert largest_fitting(lambda b: False) == 0
    assert largest_fitting(lambda b: True, limit=48) == 48


def test_pick_micro_batch_is_a_power_of_two_dividing_the_global_batch():
    from gptspeed.batchsize import pick_micro_batch

    assert pick_micro_batch(100, 512) == 64  # 90 after the margin -> 64
    assert pick_micro_batch(40, 512) == 32
    assert pick_micro_batch(40, 24) == 8  # must divide 24 sequences
    assert pick_micro_batch(1, 512) == 1
    assert pick_micro_batch(100, None) == 64
    with pytest.raises(GptspeedError, match="not even one sequence"):
        pick_micro_batch(0, 512)


def test_auto_batch_cache_and_cpu_refusal(tmp_path, monkeypatch):
    from gptspeed import batchsize

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    key = batchsize.cache_key("NVIDIA H100", {"n_layer": 12})
    assert key != batchsize.cache_key("NVIDIA H100", {"n_layer": 24})
    assert batchsize.cached_fit(key) is None
    batchsize.store_fit(key, 37)
    assert batchsize.cached_fit(key) == 37
    assert batchsize.cache_path() == tmp_path / "cache" / "batch_size.json"
    with pytest.raises(GptspeedError, match="needs CUDA"):
        batchsize.resolve_auto_batch(torch.device("cpu"), {}, 512, lambda b: None)
    from gptspeed.config import AUTO_BATCH_SIZE, parse_batch_size

    assert parse_batch_size("auto") == AUTO_BATCH_SIZE and parse_batch_size("8") == 8


def test_batch_size_auto_on_cpu_is_a_one_line_error(shakespeare_data, tmp_path):
    proc = run_cli(
        *train_args(
            shakespeare_data, tmp_path / "r", "--batch-size", "auto", "--total-batch-tokens", "4096", max_steps=None
        ),
        timeout=120,
    )
    assert_user_error(proc, "--batch-size auto", "CUDA")


def test_auto_batch_cache_key_names_world_size_and_parallel_mode(monkeypatch):
    """The fit for 8 FSDP ranks is not the fit for 1 process: the cache key says which."""
    import dataclasses

    from gptspeed import batchsize
    from gptspeed.config import preset
    from gptspeed.step import auto_batch_size

    seen = []
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda device, settings, *a, **k: seen.append(settings) or 8)
    cfg = preset("pico").override(dict(batch_size=0, total_batch_tokens=64 * 64))
    for world, parallel in ((1, "none"), (8, "fsdp"), (8, "ddp")):
        rt = dataclasses.replace(CPU, world_size=world, parallel=parallel)
        assert auto_batch_size(cfg, rt, say=lambda m: None) == 8
    assert [(s["world_size"], s["parallel"]) for s in seen] == [(1, "none"), (8, "fsdp"), (8, "ddp")]
    assert len({batchsize.cache_key("NVIDIA H100 80GB HBM3", s) for s in seen}) == 3


@pytest.mark.cuda
def test_cuda_probe_finds_a_batch(tmp_path, monkeypatch):
    from gptspeed.config import preset
    from gptspeed.step import auto_batch_size

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path))
    cfg = preset("pico").override(dict(batch_size=0, total_batch_tokens=64 * 64, compile=False))
    rt = resolve_runtime("cuda", "auto", False)
    b = auto_batch_size(cfg, rt, say=lambda m: None)
    assert b >= 1 and 64 % b == 0 and (b & (b - 1)) == 0
