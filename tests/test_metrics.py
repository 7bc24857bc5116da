"""Throughput, MFU and ETA as a unit on a fake clock; the console line; the GPU peak table."""

import pytest

from gptspeed.metrics import Throughput, format_record, peak_flops_for_name


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_throughput_mfu_and_eta_over_the_interval_since_restart():
    clock = Clock()
    tp = Throughput(
        tokens_per_step=4096, flops_per_token=1e9, peak_flops=1e13, world_size=2, max_steps=100, clock=clock
    )
    tp.restart(wait_s=1.0)
    for _ in range(4):
        clock.t += 0.5  # 0.5 s per optimizer step
        tp.step_done()
    f = tp.measure(step=10, epoch_tokens_left=None, wait_s=1.2)
    assert f["step_ms"] == pytest.approx(500.0)
    assert f["tokens_per_s"] == pytest.approx(8192.0) and f["tokens_per_s_per_device"] == pytest.approx(4096.0)
    assert f["mfu"] == pytest.approx(1e9 * 8192 / (1e13 * 2))  # over the sum of the devices' peaks
    assert f["eta_s"] == pytest.approx(90 * 0.5)
    assert f["data_wait_ms"] == pytest.approx(50.0)  # 0.2 s waited over 4 steps
    assert f["includes_warmup"] is True and f["epoch_eta_s"] is None
    tp.restart(wait_s=1.2)  # the next interval: evaluation time between records is not counted
    clock.t += 30.0  # (an evaluation)
    tp.restart(wait_s=1.2)
    clock.t += 1.0
    tp.step_done()
    f = tp.measure(step=11, epoch_tokens_left=4096 * 20, wait_s=1.2)
    assert f["step_ms"] == pytest.approx(1000.0) and f["includes_warmup"] is False
    assert f["epoch_eta_s"] == pytest.approx(20.0)  # 20 steps' worth of tokens at 4096 tokens/s
    assert f["mfu"] == pytest.approx(1e9 * 4096 / 2e13)


def test_epoch_eta_only_when_the_epoch_ends_before_the_run():
    clock = Clock()
    tp = Throughput(1000, 1.0, None, 1, max_steps=50, clock=clock)
    clock.t += 1.0
    tp.step_done()
    assert tp.measure(step=40, epoch_tokens_left=11_000)["epoch_eta_s"] is None  # 10 steps left, 11 in the epoch
    assert tp.measure(step=40, epoch_tokens_left=9_000)["epoch_eta_s"] == pytest.approx(9.0)
    assert tp.measure(step=40)["mfu"] is None  # no peak known


def test_console_line_shows_epoch_eta_and_documents_only_when_they_inform():
    rec = dict(step=5, max_steps=10, train_loss=3.0, tokens=5000, documents=1, eta_s=60.0, epoch_eta_s=None)
    line = format_record(rec, show_documents=False)
    assert "ETA 1m00s" in line and "epoch" not in line and "docs" not in line
    line = format_record(dict(rec, epoch_eta_s=30.0, documents=12), show_documents=True)
    assert "(epoch ends in 30s)" in line and "docs 12" in line


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5),  # SXM
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "bfloat16", 835.5),  # used to get the SXM peak (a substring match on "H100")
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("Tesla V100-PCIE-16GB", "float16", 112.0),
    ],
)
def test_peaks_match_the_exact_device_name(name, dtype, tflops):
    peak, source = peak_flops_for_name(name, dtype)
    assert peak == pytest.approx(tflops * 1e12) and "datasheet" in source


def test_unknown_device_gets_no_mfu_rather_than_a_neighbours_peak():
    for name in ("NVIDIA H100 SXM5 94GB", "NVIDIA H800", "NVIDIA GeForce RTX 5090"):
        peak, source = peak_flops_for_name(name, "bfloat16")
        assert peak is None and "--peak-tflops" in source
