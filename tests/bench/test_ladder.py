"""``gptspeed.bench.ladder``: ``gptspeed bench``: run the ladder (or profile one row), each row in a fresh process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptspeed import cli
from gptspeed.bench import ladder as ladder_mod
from gptspeed.bench.ladder import PEER_NAME, check_rows
from gptspeed.bench.report import markdown
from gptspeed.bench.stages import baseline_with, plan_ladder, record

from support.shapes import LADDER_FLAGS

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _gptspeed(*args: str, extra_path: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "gptspeed", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _row(name, ms, loss0, settings: dict, kind="stage", q=(None, None)):
    """A row as a worker returns it, built here: no timing involved."""
    return {
        "name": name,
        "kind": kind,
        "status": "ok",
        "ms_median": ms,
        "ms_min": ms,
        "ms_max": ms,
        "ms_q25": q[0],
        "ms_q75": q[1],
        "loss_step0": loss0,
        "dtype": settings["dtype"],
        "settings": record(settings),
    }


FP32 = baseline_with()


BF16 = baseline_with(dtype="bfloat16")


COMPILE = baseline_with(dtype="bfloat16", compile=True)


VOCAB = baseline_with(dtype="bfloat16", compile=True, attention="sdpa", vocab_size=50304)


def _fake_result(spec, loss0: float) -> dict:
    """What a worker returns, without running one."""
    return {
        "status": "ok",
        "ms_median": 10.0,
        "ms_min": 9.0,
        "ms_max": 11.0,
        "ms_mean_wall": 10.0,
        "tokens_per_s": 100.0,
        "mfu": None,
        "peak_flops_source": "none",
        "warmup_s": 1.0,
        "first_step_s": 0.5,
        "loss_step0": loss0,
        "loss_last": 10.0,
        "peak_mem_bytes": 2**20,
        "params": 1000,
        "dtype": spec.settings["dtype"],
        "compile": spec.settings["compile"],
    }


def test_every_row_of_the_default_ladder_trains_here_the_peer_row_too():
    """Every row the default ladder plans on this CPU, and the peer row after it, built and stepped
    in this process as its worker would (tiny shape, eager compile backend, 1 + 1 steps): the peer
    row used to take Muon's settings, and Muon found no matrices in transformers' module names."""
    import torch

    from gptspeed.bench.ladder import base_spec, peer_settings
    from gptspeed.bench.worker import PEER_KIND, run_stage

    cfg = ladder_mod.BenchConfig(
        out="unused",
        n_layer=1,
        n_head=2,
        n_embd=32,
        seq_len=32,
        batch_size=2,
        steps=1,
        warmup=1,
        synthetic=True,
        device="cpu",
        compile_backend="eager",
    )
    spec0 = base_spec(cfg)
    plan = [p for p in plan_ladder(torch.device("cpu"), None, "eager") if p.settings is not None]
    assert {"baseline", "compile", "fused-ce", "muon", "compile-blocks"} <= {p.stage.name for p in plan}
    specs = [spec0.__class__(**{**spec0.to_dict(), "name": p.stage.name, "settings": p.settings}) for p in plan]
    specs.append(
        spec0.__class__(
            **{**spec0.to_dict(), "name": PEER_NAME, "kind": PEER_KIND, "settings": peer_settings(plan[-1].settings)}
        )
    )
    for spec in specs:
        torch._dynamo.reset()
        result = run_stage(spec)
        assert math.isfinite(result["loss_last"]) and abs(result["loss_step0"] - math.log(50257)) < 0.5, spec.name


def test_peer_row_skipped_without_transformers(tmp_path, monkeypatch, capsys):
    # The stage rows are stubbed; the peer row runs for real in a worker process that cannot
    # import transformers (a package on PYTHONPATH that raises ImportError hides the real one).
    hide = tmp_path / "hide"
    (hide / "transformers").mkdir(parents=True)
    (hide / "transformers" / "__init__.py").write_text(
        "raise ImportError('No module named transformers (hidden by a test)')\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p))
    real_worker = ladder_mod.run_worker

    def worker(spec, log_path, timeout=None):
        return real_worker(spec, log_path, timeout) if spec.kind == "hf" else _fake_result(spec, 10.8)

    monkeypatch.setattr(ladder_mod, "run_worker", worker)
    out = tmp_path / "ladder"
    code = cli.main(["bench", "ladder", "--out", str(out), "--stages", "baseline", *LADDER_FLAGS])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "ladder.json").read_text())
    peer = result["rows"][-1]
    assert peer["name"] == PEER_NAME and peer["status"] == "skipped"
    assert "transformers is not installed" in peer["reason"]
    assert f"| {PEER_NAME} (peer) |" in (out / "ladder.md").read_text()


def test_profile_one_stage(tmp_path, capsys):
    assert cli.main(["bench", "profile", "baseline", "--out", str(tmp_path), *LADDER_FLAGS]) == 0
    out = capsys.readouterr().out
    trace = tmp_path / "trace-baseline.json"
    assert json.loads(trace.read_text())["traceEvents"]
    assert "Self CPU" in out and "aten::" in out
    assert (tmp_path / "profile-baseline.txt").exists()


# ------------------------------------------------------------------------------------ bad flags
@pytest.mark.parametrize(
    "args, message",
    [
        (["ladder", "--stages", "baseline,warp-drive"], "unknown stage"),
        (["ladder", "--steps", "0"], "--steps must be at least 1"),
        (["ladder", "--warmup", "0"], "--warmup must be at least 1"),
        (["ladder", "--n-head", "3"], "divisible by n_head"),
        (["ladder", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["ladder", "--stages", "tf32"], "none of the selected stages runs on cpu"),
        (["profile", "warp-drive"], "unknown stage to profile"),
        (["profile", "tf32"], "does not apply on cpu"),
    ],
)
def test_bad_flags_one_line(tmp_path, capsys, args, message):
    base = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--synthetic", "--device", "cpu"]
    code = cli.main(["bench", args[0], "--out", str(tmp_path / "o"), *base, *args[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and err.startswith("gptspeed bench: error:")


@pytest.mark.parametrize(
    "args",
    [
        ["--ladder", "--profile", "baseline", "--synthetic"],  # two modes, old spelling
        ["--synthetic"],  # no subcommand
        ["ladder", "--synthetic", "--data", "somewhere"],  # two data sources
        ["ladder", "--synthetic", "--steps", "many"],
        ["profile", "baseline", "--synthetic", "--stages", "baseline"],  # the ladder's rows: not profile's
        ["ladder", "--synthetic", "--seeds", "5", "--force"],  # the race's
    ],
)
def test_bad_flag_combinations_argparse(tmp_path, capsys, args):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_bad_flags_subprocess_one_line_no_traceback(tmp_path):
    proc = _gptspeed("bench", "ladder", "--out", str(tmp_path), "--data", str(tmp_path / "missing"), "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "does not exist" in proc.stderr


def test_guard_flags_a_disagreeing_stage():
    rows = [
        _row("baseline", 100.0, 10.0, FP32),
        {"name": "tf32", "status": "skipped"},
        _row("bf16", 50.0, 10.05, BF16),
        _row("compile", 25.0, 10.2, COMPILE),
        _row("flash", 20.0, 10.001, VOCAB),
    ]
    check_rows(rows)
    # bf16 rows: 1e-2 relative; 10.2 is 2e-2 off
    assert [r.get("loss_check", {}).get("ok") for r in rows] == [True, None, True, False, True]
    bad = [_row("baseline", 100.0, 10.0, FP32), _row("compile", 50.0, 10.01, baseline_with(compile=True))]
    check_rows(bad)  # fp32: 1e-3 > 1e-4
    assert not bad[1]["loss_check"]["ok"]


def test_rows_state_their_switches_and_a_speedup_is_credited_to_one_switch_only():
    # vocab-pad run after a deselected flash row: it differs from compile by two switches
    rows = [
        _row("baseline", 100.0, 10.8, FP32),
        _row("bf16", 50.0, 10.8, BF16),
        _row("compile", 25.0, 10.8, COMPILE),
        {"name": "flash", "kind": "stage", "status": "skipped", "reason": "not selected (--stages)", "description": ""},
        _row("vocab-pad", 20.0, 10.8, VOCAB),
    ]
    check_rows(rows)
    assert [r.get("switches") for r in rows] == ["fp32", "bf16", "bf16+compile", None, "bf16+compile+sdpa+vocab50304"]
    assert rows[1]["speedup_prev"] == 2.0 and rows[1]["credited_to"] == "dtype"
    assert rows[2]["speedup_prev"] == 2.0 and rows[2]["credited_to"] == "compile"
    assert rows[4]["speedup_prev"] is None and rows[4]["credited_to"] is None
    assert rows[4]["speedup_prev_na"] == "n/a (differs from the previous row by: attention, vocab-size)"
    assert rows[4]["speedup_baseline"] == 5.0  # all of its switches together, against the first row

    md = markdown(
        {
            "environment": {
                "device": "cpu",
                "device_type": "cpu",
                "torch": "x",
                "gptspeed": "x",
                "git_commit": None,
                "date": "d",
                "command": "c",
            },
            "config": {
                "preset": "pico",
                "n_layer": 1,
                "n_head": 1,
                "n_embd": 8,
                "batch_size": 1,
                "seq_len": 8,
                "data": None,
                "warmup": 1,
                "steps": 1,
                "compile_backend": "eager",
            },
            "rows": [
                {
                    **r,
                    "description": "",
                    "mfu": None,
                    "tokens_per_s": 1.0,
                    "peak_mem_bytes": None,
                    "warmup_s": 0.0,
                    "loss_last": 1.0,
                    "peak_flops_source": "none",
                    "params": 1000,
                }
                if r["status"] == "ok"
                else r
                for r in rows
            ],
            "problems": [],
        }
    )
    assert "| vocab-pad | bf16+compile+sdpa+vocab50304 |" in md
    assert "n/a (differs from the previous row by: attention, vocab-size)" in md
    assert "| 2.00× (compile) |" in md


def test_a_spread_wider_than_the_gap_is_flagged_as_noise():
    # compile 98 ms vs bf16 100 ms, but its steps spread over 10 ms (IQR): the 2 ms gap is noise
    rows = [_row("bf16", 100.0, 10.8, BF16, q=(99.0, 101.0)), _row("compile", 98.0, 10.8, COMPILE, q=(92.0, 102.0))]
    check_rows(rows)
    assert rows[1]["credited_to"] == "compile"
    assert rows[1]["noise"] == {"gap_ms": 2.0, "spread_ms": 10.0}
    clear = [_row("bf16", 100.0, 10.8, BF16, q=(99.0, 101.0)), _row("compile", 50.0, 10.8, COMPILE, q=(45.0, 55.0))]
    check_rows(clear)
    assert clear[1]["noise"] is None and clear[1]["speedup_prev"] == 2.0
    from gptspeed.bench.report import vs_prev

    assert vs_prev(rows[1]) == "1.02× (compile; *noise*: gap 2.00 ms < IQR 10.0 ms)"
    assert vs_prev(clear[1]) == "2.00× (compile)"


def test_flagged_stage_makes_exit_status_nonzero(tmp_path, monkeypatch, capsys):
    fake = {"baseline": 10.8, "bf16": 10.81, "compile": 9.0}  # compile computes something else

    def fake_worker(spec, log_path, timeout=None):
        if spec.kind != "gptspeed":
            return {"status": "skipped", "reason": "not in this test"}
        return _fake_result(spec, fake[spec.name])

    monkeypatch.setattr(ladder_mod, "run_worker", fake_worker)
    code = cli.main(
        [
            "bench",
            "ladder",
            "--out",
            str(tmp_path),
            "--stages",
            "baseline,bf16,compile",
            "--synthetic",
            "--device",
            "cpu",
            "--preset",
            "pico",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1
    last = err.strip().splitlines()[-1]  # the lines before it are progress
    assert last.startswith("gptspeed bench: 1 problem(s): compile: step-0 loss")
    assert "**FLAGGED**" in out
    result = json.loads((tmp_path / "ladder.json").read_text())
    assert result["ok"] is False and len(result["problems"]) == 1


# ------------------------------------------------------------------------------------ cut short
@pytest.mark.parametrize("mode, file, key", [("ladder", "ladder", "rows")])
def test_a_bench_killed_mid_row_leaves_valid_json_with_its_finished_rows(tmp_path, mode, file, key):
    """A GPU command is killed at its limit. The ladder (and verify: tests/test_gpu_session.py)
    writes its JSON and Markdown after every row (atomically), so killing the command while a row runs
    -- here one that sleeps -- leaves a valid JSON with every finished row, the row in progress pending."""
    from support.cut_short import run_until_line, sleeper_env

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "gptspeed",
        "bench",
        mode,
        "--out",
        str(out),
        "--stages",
        "baseline,compile,flash",
        *LADDER_FLAGS,
        *(["--no-peers"] if mode == "ladder" else []),
    ]
    # killed once the sleeping row has started (its worker's output goes to its log)
    run_until_line(cmd, sleeper_env(tmp_path, "flash"), r"^\[3/3\] flash: ", timeout=120)
    result = json.loads((out / f"{file}.json").read_text())
    rows = {r["name"]: r for r in result[key]}
    assert result["complete"] is False
    assert rows["baseline"]["status"] == rows["compile"]["status"] == "ok"
    assert len(rows["compile"]["losses" if mode == "verify" else "ms_steps"]) >= 2
    assert rows["flash"]["status"] == "pending"
    assert rows["tf32"]["status"] == "skipped"  # the plan is all there: what did not apply says why
    md = (out / f"{file}.md").read_text()
    assert "| compile |" in md and ("pending" in md)
    if mode == "verify":
        assert result["verdict"] == "incomplete" and rows["compile"]["verdict"] == "verified"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


@pytest.mark.parametrize(
    "mode", [["ladder"], ["verify"], ["profile", "baseline"], ["tune"], ["race", "--arm", "a=--lr 1e-3"]]
)
def test_no_bench_mode_writes_into_a_run_or_data_folder_or_over_a_file(mode, tmp_path, capsys):
    """Every bench --out goes through one check (report.check_out_dir) before any work: a run folder
    (a later resume would meet files it did not write), a data folder, a new folder inside either,
    or a file is one line, nothing written."""
    run, data, a_file = tmp_path / "run", tmp_path / "data", tmp_path / "notes.txt"
    run.mkdir()
    (run / "ckpt_00000001.pt").write_bytes(b"weights")
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    a_file.write_text("notes")
    before = sorted(tmp_path.rglob("*"))
    shape = (
        []
        if "race" in mode
        else ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--synthetic"]
    )
    for out, fragment in [
        (run, "is a run folder"),
        (data, "is a data folder"),
        (data / "sub", "would be created inside"),
        (a_file, "is a file"),
        (tmp_path / "nothere" / ".." / "run", "is a run folder"),  # checked as the folder it names, not as missing
    ]:
        code = cli.main(["bench", *mode, "--out", str(out), "--preset", "pico", "--device", "cpu", *shape])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert sorted(tmp_path.rglob("*")) == before and (run / "ckpt_00000001.pt").read_bytes() == b"weights"
