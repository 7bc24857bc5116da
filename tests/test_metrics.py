"""``gptspeed.metrics``: measurement: device peaks and MFU, memory, environment, and the run log (console + JSONL)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gptspeed.errors import GptspeedError
from gptspeed.metrics import (
    DEVICE_NAMES,
    PEAK_TFLOPS,
    FirstPace,
    Throughput,
    first_step_pace,
    format_duration,
    format_record,
    peak_flops_for_name,
)

from support.strategies import HealthCheck, given, json_values, settings, st

pytestmark = pytest.mark.usefixtures("one_thread")


metrics_lines = st.one_of(
    st.builds(lambda step, loss: json.dumps({"step": step, "train_loss": loss}), st.integers(-5, 50), st.floats()),
    json_values.map(json.dumps),  # any JSON: lists, strings, objects whose step is not an integer
    st.text(max_size=30).filter(lambda t: "\n" not in t),  # not JSON, or a torn line (U+2028, \r... included)
)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# ------------------------------------------------------------------------------- metrics.jsonl
def test_truncate_after_drops_junk_lines_and_never_raises(tmp_path, capsys):
    """A junk line ({"step": "ten"}, a non-JSON line, a JSON list, a line nested 100k deep, a
    record cut short by a crash) made --resume raise in truncate_after. Records up to the step
    are kept in order; everything else goes, and one line says how many."""
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": i, "train_loss": 1.0}) for i in range(6)]
    junk = [
        '{"step": "ten"}',
        "not json at all",
        "[1, 2, 3]",
        '{"step": true}',
        '{"step": 2.0}',
        "[" * 100_000,
        '{"no_step": 1}',
    ]
    path.write_text("\n".join([good[0], *junk[:4], *good[1:4], *junk[4:], "", *good[4:]]) + '\n{"step": 7, "tra')
    log = RunLog(path)
    assert log.truncate_after(3) == len(junk) + 1
    assert path.read_text() == "".join(g + "\n" for g in good[:4])
    assert "dropped 8 line(s) that were not metrics records (the first was line 2)" in capsys.readouterr().out
    assert log.truncate_after(3) == 0 and path.read_text() == "".join(g + "\n" for g in good[:4])  # nothing to do
    log.truncate_after(-1)  # a new run: the log starts afresh
    assert path.read_text() == ""


@pytest.mark.parametrize("kind", ["folder", "fifo", "latin1"])
def test_a_metrics_log_that_is_not_a_utf8_file_is_one_line(tmp_path, kind):
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b'{"step": 1, "note": "caf\xe9"}\n')
    with pytest.raises(GptspeedError, match=f"metrics log {path} is ") as e:
        RunLog(path, echo=False).truncate_after(5)
    assert "\n" not in str(e.value)


def test_a_failed_metrics_append_is_one_line_and_leaves_no_half_record(tmp_path, monkeypatch):
    """Disk full on a metrics append was a raw OSError traceback; a partly written line would be
    left looking like a record cut short. Now the file is cut back and the error is one line."""
    from gptspeed import metrics
    from gptspeed.metrics import RunLog

    with pytest.raises(
        GptspeedError,
        match="cannot append to the metrics log /dev/full at step 3: No space left "
        "on device; the newest checkpoint is intact: free some space, then "
        "continue with --resume",
    ):
        RunLog(Path("/dev/full"), echo=False).write({"step": 3})
    path = tmp_path / "metrics.jsonl"
    log = RunLog(path, echo=False)
    log.write({"step": 1, "train_loss": 2.0})
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 8:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(GptspeedError, match="at step 2: No space left on device"):
        log.write({"step": 2, "train_loss": 1.5})
    assert path.read_bytes() == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(metrics_lines, max_size=12), step=st.integers(-1, 40), end=st.sampled_from(["\n", ""]))
def test_fuzz_metrics_truncate_after(tmp_path_factory, lines, step, end):
    """Whatever metrics.jsonl holds, --resume's truncate_after never raises: it keeps exactly the
    records (objects with an integer step) up to ``step``, in order, each a whole line."""
    from gptspeed.metrics import RunLog

    path = tmp_path_factory.mktemp("log") / "metrics.jsonl"
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    expected = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and type(r.get("step")) is int and r["step"] <= step:
            expected.append(line)
    RunLog(path, echo=False).truncate_after(step)
    assert path.read_text(encoding="utf-8") == "".join(e + "\n" for e in expected)
    assert all(isinstance(json.loads(x)["step"], int) for x in expected)


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


def test_throughput_mfu_weighs_each_step_by_its_own_flops_per_token():
    """Steps at another sequence length (--seq-len-warmup-steps) pass their own FLOPs per token: the interval's
    MFU is its FLOPs over its seconds, not the constructor's FLOPs per token times its tokens."""
    clock = Clock()
    tp = Throughput(
        tokens_per_step=1000, flops_per_token=8.0, peak_flops=100.0, world_size=1, max_steps=10, clock=clock
    )
    for fpt in (6.0, 7.0, None):  # two short steps, then one at the full length (the constructor's 8)
        clock.t += 1.0
        tp.step_done(1000, fpt)
    assert tp.measure(step=3)["mfu"] == pytest.approx((6.0 + 7.0 + 8.0) * 1000 / 3.0 / 100.0)
    tp.restart()
    clock.t += 1.0
    tp.step_done(1000, 6.0)
    assert tp.measure(step=4)["mfu"] == pytest.approx(6.0 * 1000 / 100.0)  # the restart forgot the earlier steps


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


def test_console_line_shows_a_mixtures_figures_per_source_after_the_mixed_one():
    rec = {"step": 4, "max_steps": 4, "val_loss": 3.5, "val_loss/web": 3.25, "val_loss/code": 4.25, "tokens": 10}
    rec.update({"val_bpb": 1.5, "val_bpb/web": 1.25, "val_bpb/code": 2.25, "documents": 12, "documents/web": 9})
    line = format_record(dict(rec, **{"documents/code": 3}))
    assert "val 3.5000 (web 3.2500, code 4.2500) | bpb 1.5000 (web 1.2500, code 2.2500)" in line
    assert "docs 12 (web 9, code 3)" in line


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5),  # SXM
        ("NVIDIA H100 SXM5 94GB", "bfloat16", 989.5),
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "bfloat16", 835.5),  # used to get the SXM peak (a substring match on "H100")
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("NVIDIA A800-SXM4-80GB", "tf32", 156.0),
        ("Tesla V100-PCIE-16GB", "float16", 112.0),
        ("NVIDIA H200", "bfloat16", 989.5),
        ("NVIDIA H200 NVL", "bfloat16", 835.5),
        ("NVIDIA H200 NVL", "float32", 60.0),
        ("NVIDIA H800", "bfloat16", 989.5),
        ("NVIDIA H800 PCIe", "bfloat16", 756.5),
        ("NVIDIA GH200 480GB", "bfloat16", 989.5),
        ("NVIDIA B200", "bfloat16", 2250.0),
        ("NVIDIA B200", "tf32", 1100.0),
        ("NVIDIA L40S", "bfloat16", 362.05),
        ("NVIDIA L40S", "tf32", 183.0),
        ("NVIDIA L40", "bfloat16", 181.05),
        ("NVIDIA RTX A6000", "bfloat16", 154.8),
        ("NVIDIA A40", "bfloat16", 149.7),
        ("NVIDIA RTX 6000 Ada Generation", "bfloat16", 364.2),
        ("NVIDIA GeForce RTX 5090", "bfloat16", 209.5),
        ("NVIDIA GeForce RTX 5090", "float32", 104.8),
        ("AMD Instinct MI300X", "bfloat16", 1307.4),
        ("AMD Instinct MI300X VF", "tf32", 653.7),  # a virtual function: the same card, partitioned by a hypervisor
        ("AMD Instinct MI325X", "bfloat16", 1307.4),
        ("AMD Instinct MI250X/MI250", "bfloat16", 383.0),
        ("nvidia h100 pcie", "bfloat16", 756.5),  # case-blind
    ],
)
def test_peaks_match_the_device_name_of_each_listed_card(name, dtype, tflops):
    peak, source = peak_flops_for_name(name, dtype)
    assert peak == pytest.approx(tflops * 1e12) and "datasheet" in source


# Every card's figures as its datasheet (or whitepaper appendix) prints them, TFLOPS, and whether the printed
# figure is "with sparsity" (2:4 structured sparsity doubles a tensor-core figure; MFU needs the dense one).
# bf16: the bf16 (or, on V100 / T4, fp16) tensor-core figure with FP32 accumulation; tf32: TF32 tensor cores
# (a card without them: its fp32 rate); fp32: plain FP32 (AMD: the FP32 matrix rate).
SPARSE, DENSE = True, False
DATASHEETS = {
    # NVIDIA A100 Tensor Core GPU datasheet: "BF16 Tensor Core 312 | 624*", "TF32 156 | 312*", FP32 19.5
    "A100": {"bf16": (312.0, DENSE), "tf32": (156.0, DENSE), "fp32": (19.5, DENSE)},
    # NVIDIA H100 Tensor Core GPU datasheet (SXM / PCIe / NVL columns): "BF16 Tensor Core 1,979* / 1,513* /
    # 1,671*", "TF32 989* / 756* / 835*" (* with sparsity), FP32 67 / 51 / 60
    "H100 SXM": {"bf16": (1979.0, SPARSE), "tf32": (989.0, SPARSE), "fp32": (67.0, DENSE)},
    "H100 PCIe": {"bf16": (1513.0, SPARSE), "tf32": (756.0, SPARSE), "fp32": (51.0, DENSE)},
    "H100 NVL": {"bf16": (1671.0, SPARSE), "tf32": (835.0, SPARSE), "fp32": (60.0, DENSE)},
    # NVIDIA H200 Tensor Core GPU datasheet (SXM / NVL): "BF16 1,979* / 1,671*", "TF32 989* / 835*", 67 / 60
    "H200 SXM": {"bf16": (1979.0, SPARSE), "tf32": (989.0, SPARSE), "fp32": (67.0, DENSE)},
    "H200 NVL": {"bf16": (1671.0, SPARSE), "tf32": (835.0, SPARSE), "fp32": (60.0, DENSE)},
    # NVIDIA HGX B200 datasheet, per GPU: "FP16/BF16 4.5 PFLOPS*", "TF32 2.2 PFLOPS*", FP32 75 TFLOPS
    "B200": {"bf16": (4500.0, SPARSE), "tf32": (2200.0, SPARSE), "fp32": (75.0, DENSE)},
    # NVIDIA L40S datasheet: "BF16 Tensor Core 362.05 | 733*", "TF32 183 | 366*", FP32 91.6
    "L40S": {"bf16": (362.05, DENSE), "tf32": (183.0, DENSE), "fp32": (91.6, DENSE)},
    # NVIDIA L40 datasheet: "BF16 Tensor Core 181.05 | 362.1*", "TF32 90.5 | 181*", FP32 90.5
    "L40": {"bf16": (181.05, DENSE), "tf32": (90.5, DENSE), "fp32": (90.5, DENSE)},
    # NVIDIA Ampere GA102 whitepaper, appendix, RTX A6000: "BF16 Tensor TFLOPS with FP32 Accumulate
    # 154.8/309.7", "TF32 77.4/154.8", FP32 38.7
    "RTX A6000": {"bf16": (154.8, DENSE), "tf32": (77.4, DENSE), "fp32": (38.7, DENSE)},
    # NVIDIA A40 datasheet: "BF16 Tensor TFLOPS with FP32 Accumulate 149.7 | 299.4*", "TF32 74.8 | 149.6*", 37.4
    "A40": {"bf16": (149.7, DENSE), "tf32": (74.8, DENSE), "fp32": (37.4, DENSE)},
    # NVIDIA Ada Lovelace whitepaper, appendix, RTX 6000 Ada: "BF16 with FP32 Accumulate 364.2/728.5",
    # "TF32 182.1/364.2", FP32 91.1
    "RTX 6000 Ada": {"bf16": (364.2, DENSE), "tf32": (182.1, DENSE), "fp32": (91.1, DENSE)},
    # NVIDIA RTX Blackwell GPU architecture whitepaper, appendix, RTX 5090: "FP16/BF16 Tensor with FP32
    # Accumulate 209.5/419", "TF32 104.8/209.5", FP32 104.8
    "RTX 5090": {"bf16": (209.5, DENSE), "tf32": (104.8, DENSE), "fp32": (104.8, DENSE)},
    # AMD Instinct MI300X datasheet (MI325X: the same compute): "BF16 1307.4 TFLOPs" (2614.9 with sparsity),
    # "TF32 653.7", "FP32 Matrix 163.4"
    "MI300X": {"bf16": (1307.4, DENSE), "tf32": (653.7, DENSE), "fp32": (163.4, DENSE)},
    # AMD Instinct MI250X datasheet: "Peak bfloat16 383 TFLOPs", "Peak FP32 Matrix 95.7" (no TF32)
    "MI250X": {"bf16": (383.0, DENSE), "tf32": (95.7, DENSE), "fp32": (95.7, DENSE)},
    # Baseten, "NVIDIA A10 vs A10G for ML model inference" (no NVIDIA A10G datasheet): 70 BF16 tensor,
    # 35 TF32, 35 FP32 -- not the A10's datasheet (125 | 250*, 62.5 | 125*, 31.2)
    "A10G": {"bf16": (70.0, DENSE), "tf32": (35.0, DENSE), "fp32": (35.0, DENSE)},
    # NVIDIA L4 datasheet: "BF16 Tensor Core 242*", "TF32 Tensor Core 120*", FP32 30.3
    "L4": {"bf16": (242.0, SPARSE), "tf32": (120.0, SPARSE), "fp32": (30.3, DENSE)},
    # NVIDIA Ada Lovelace whitepaper, appendix, RTX 4090: "BF16 with FP32 Accumulate 165.2/330.4",
    # "TF32 82.6/165.2", FP32 82.6
    "RTX 4090": {"bf16": (165.2, DENSE), "tf32": (82.6, DENSE), "fp32": (82.6, DENSE)},
    # NVIDIA Ampere GA102 whitepaper, appendix, RTX 3090: "BF16 with FP32 Accumulate 71/142", "TF32 35.6/71",
    # FP32 35.6
    "RTX 3090": {"bf16": (71.0, DENSE), "tf32": (35.6, DENSE), "fp32": (35.6, DENSE)},
    # NVIDIA V100 datasheet (SXM2 / PCIe): "Tensor Performance 125 / 112" (fp16; Volta has no sparsity),
    # "Single-Precision 15.7 / 14" (no TF32 cores: the fp32 rate in the tf32 column)
    "V100 SXM2": {"bf16": (125.0, DENSE), "tf32": (15.7, DENSE), "fp32": (15.7, DENSE)},
    "V100 PCIe": {"bf16": (112.0, DENSE), "tf32": (14.0, DENSE), "fp32": (14.0, DENSE)},
    # NVIDIA T4 datasheet: "Mixed Precision (FP16/FP32) 65 TFLOPS", "Single-Precision 8.1 TFLOPS" (no TF32)
    "T4": {"bf16": (65.0, DENSE), "tf32": (8.1, DENSE), "fp32": (8.1, DENSE)},
}


def test_every_peak_is_its_datasheets_dense_figure():
    """Each card and column of the peak table against its datasheet's figure, halved where the datasheet
    prints it with sparsity: a with-sparsity figure in the table would halve MFU there unnoticed."""
    assert set(PEAK_TFLOPS) == set(DATASHEETS)  # a new card comes with its datasheet's figures
    for card, columns in DATASHEETS.items():
        assert set(PEAK_TFLOPS[card]) == set(columns) == {"bf16", "tf32", "fp32"}, card
        for column, (printed, sparse) in columns.items():
            dense = printed / 2 if sparse else printed
            assert PEAK_TFLOPS[card][column] == pytest.approx(dense), (card, column)
    # every card the device names lead to is in the table
    assert set(DEVICE_NAMES.values()) <= set(PEAK_TFLOPS)


def test_unknown_device_gets_no_mfu_rather_than_a_neighbours_peak():
    # a family gptspeed has no datasheet figure for, and unknown variants of listed families
    for name in ("NVIDIA H20", "NVIDIA GeForce RTX 4080", "NVIDIA H100 XYZ", "NVIDIA L40S-8Q", "AMD Instinct MI210"):
        peak, source = peak_flops_for_name(name, "bfloat16")
        assert peak is None and "--peak-tflops" in source


def test_first_pace_says_nothing_for_a_fast_start_and_once_from_the_second_unit_for_a_slow_one():
    said, now = [], [0.0]
    pace = FirstPace(said.append, 32, lambda unit, total: f"{unit:.1f} {total:.1f}", min_s=10.0, clock=lambda: now[0])
    for gap in (100.0, 0.25, 0.25, 0.25):  # a slow first unit (warm-up, compilation) is not the pace
        pace.tick()
        now[0] += gap
    assert said == []  # 32 x 0.25 s: under 10 s
    said, now[0] = [], 0.0
    pace = FirstPace(said.append, 32, lambda unit, total: f"{unit:.1f} {total:.1f}", min_s=10.0, clock=lambda: now[0])
    for gap in (100.0, 12.0, 12.0, 12.0, 12.0):
        pace.tick()
        now[0] += gap
    assert said == ["12.0 384.0"]  # the second unit's time, times the units; said once


def test_the_first_step_line_gives_the_step_the_run_and_on_a_cpu_the_quick_preset():
    from gptspeed.config import preset

    cfg = preset("gpt2")
    said, now = [], [0.0]
    pace = first_step_pace(said.append, cfg, step=0, accum=32, cpu=True)
    pace.clock = lambda: now[0]
    for _ in range(3):
        pace.tick()
        now[0] += 12.3
    steps = cfg.train.max_steps
    assert said == [
        f"step 1: a micro-step of {cfg.train.batch_size} x 1024 tokens takes 12.3 s here, so a step (32 micro-steps) "
        f"about 6m34s and the run's {steps:,} steps about {format_duration(12.3 * 32 * steps)}; for a quick run on a "
        "CPU: --preset nano (a 10M-parameter model, minutes)"
    ]
    assert format_duration(12.3 * 32 * steps).endswith("h") and "d" in format_duration(12.3 * 32 * steps)
    said.clear()
    pace = first_step_pace(said.append, cfg, step=0, accum=32, cpu=False)  # a slow GPU: no CPU preset named
    pace.clock = lambda: now[0]
    for _ in range(3):
        pace.tick()
        now[0] += 12.3
    assert len(said) == 1 and "--preset nano" not in said[0]
