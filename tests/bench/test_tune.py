"""``gptspeed.bench.tune``: ``gptspeed bench tune``: the fastest configuration of *your* run that trains the same, found on this device, and written as a ``--config`` file."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from gptspeed import cli
from gptspeed.bench import knobs as knobs_mod
from gptspeed.bench import tune as tune_mod
from gptspeed.bench.tune import measured_sequences
from gptspeed.bench.tune_report import VERDICTS
from gptspeed.config import preset
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_cli
from support.tune_fakes import FakeWorker, knob, rows, tune
from support.verify_rows import TINY_RUNG


def test_greedy_keeps_each_larger_batch_that_gains_and_stops_at_the_first_that_does_not_fit(tmp_path, monkeypatch):
    # pico: B=8; a global batch of 8 micro-batches lets the measured step hold 2 of them on a CPU (16 sequences)
    worker = FakeWorker(
        {("batch_size", 16): 0.8, ("loss", "plain"): 0.5, ("compile", True): 0.95}, oom_at=32, off=[("loss", "plain")]
    )
    knobs = (
        knob("micro-batch", knobs_mod._micro_batch, sizes=True),
        knob("loss", [{"loss": "plain"}]),
        knob("compile", [{"compile": True}, {"compile": False}]),
    )
    res = tune(tmp_path, monkeypatch, worker, knobs, flags="--total-batch-tokens 4096")
    r = rows(res)
    assert list(r) == ["yours", "micro-batch=16", "loss=plain", "compile=True", "compile=False"]
    assert r["micro-batch=16"]["verdict"] == "verified" and r["micro-batch=16"]["kept"]
    # twice as fast, but it trains differently: not kept
    assert r["loss=plain"]["verdict"] == "fails verification" and not r["loss=plain"]["kept"]
    assert "loss" in r["loss=plain"]["reason"]
    assert r["compile=True"]["kept"] and not r["compile=False"]["kept"]
    assert res["best"] == {"batch_size": 16, "compile": True}
    assert r["compile=True"]["from"] == "--batch-size 16"  # tried from the best so far
    assert r["compile=True"]["vs_yours"] == pytest.approx(1 / (0.8 * 0.95))
    tuned = yaml.safe_load((tmp_path / "tune" / "tuned.yaml").read_text())
    assert tuned["train"]["batch_size"] == 16 and tuned["runtime"]["compile"] is True
    assert tuned["train"]["total_batch_tokens"] == 4096  # your global batch is kept
    assert worker.calls[1].batch_size == 16 and worker.calls[1].grad_accum == 1  # the same 16 sequences, regrouped
    assert worker.calls[0].extra == {"read_micro_batch": 8} and worker.calls[0].grad_accum == 2
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["complete"] and saved["tuned_yaml"].endswith("tuned.yaml")
    assert "**Kept: `--batch-size 16 --compile`" in (tmp_path / "tune" / "tune.md").read_text()


def test_a_larger_batch_that_does_not_fit_is_a_row_and_the_search_goes_on(tmp_path, monkeypatch):
    worker = FakeWorker({("compile", True): 0.9}, oom_at=16)
    knobs = (knob("micro-batch", knobs_mod._micro_batch, sizes=True), knob("compile", [{"compile": True}]))
    res = tune(tmp_path, monkeypatch, worker, knobs, flags="--total-batch-tokens 4096")
    r = rows(res)
    assert r["micro-batch=16"]["verdict"] == "does not fit" and "out of memory" in r["micro-batch=16"]["reason"]
    # a saving after the batch stopped at memory: the larger batch is tried once more (the seeds' habit)
    assert [x["name"] for x in res["rows"]].count("micro-batch=16") == 2
    assert r["compile=True"]["kept"] and res["best"] == {"compile": True}


def test_refusals_are_rows_not_crashes_and_the_worker_never_runs_a_rule_refused_candidate(tmp_path, monkeypatch):
    worker = FakeWorker(refuse=[("loss", "plain")])
    knobs = (
        knob("fp8", [{"fp8": True}]),  # at pico width no layer would convert: gptspeed's own rule
        knob("cuda-graphs", [{"compile_tuning": "reduce-overhead"}]),
        knob("loss", [{"loss": "plain"}]),
        knob("nothing", "why there is nothing to try"),
    )
    res = tune(tmp_path, monkeypatch, worker, knobs, flags="--total-batch-tokens 1024")  # 2 micro-steps
    r = rows(res)
    assert r["fp8=True"]["verdict"] == "not applicable" and "--fp8 would convert no layer" in r["fp8=True"]["reason"]
    assert r["cuda-graphs=reduce-overhead"]["verdict"] == "not applicable"
    assert "cannot accumulate gradients over 2 micro-steps" in r["cuda-graphs=reduce-overhead"]["reason"]
    assert r["loss=plain"]["verdict"] == "not applicable" and r["loss=plain"]["reason"] == "a device rule"
    assert r["nothing"]["verdict"] == "not applicable" and r["nothing"]["reason"] == "why there is nothing to try"
    assert len(worker.calls) == 2  # yours and loss=plain: the rule-refused ones never started
    assert res["best"] == {}


def test_the_budget_leaves_untried_rows_listed_and_a_cut_row_keeps_the_rows_before_it(tmp_path, monkeypatch):
    worker = FakeWorker({("compile", True): 0.5}, cost=40)
    knobs = (
        knob("compile", [{"compile": True}]),
        knob("loss", [{"loss": "plain"}]),
        knob("x", [{"attention": "manual"}]),
    )
    res = tune(tmp_path, monkeypatch, worker, knobs, budget_s=90)
    r = rows(res)
    assert r["compile=True"]["kept"]
    assert r["loss=plain"]["verdict"] == "not tried" and "--budget-s" in r["loss=plain"]["reason"]
    assert r["x=manual"]["verdict"] == "not tried" and len(worker.calls) == 2
    assert "Not tried (budget): loss=plain, x=manual." in (tmp_path / "tune" / "tune.md").read_text()
    assert yaml.safe_load((tmp_path / "tune" / "tuned.yaml").read_text())["runtime"]["compile"] is True

    worker = FakeWorker(cost=60)
    res = tune(tmp_path / "b", monkeypatch, worker, (knob("loss", [{"loss": "plain"}]),), budget_s=100)
    assert rows(res)["loss=plain"]["verdict"] == "cut by --budget-s"
    assert rows(res)["yours"]["verdict"] == "yours"


def test_your_configuration_failing_is_one_line_with_the_report_written(tmp_path, monkeypatch):
    with pytest.raises(
        GptspeedError, match=r"your configuration did not run here \(does not fit: out of memory at B=8"
    ):
        tune(tmp_path, monkeypatch, FakeWorker(oom_at=8), ())
    assert json.loads((tmp_path / "tune" / "tune.json").read_text())["rows"][0]["verdict"] == "does not fit"


def test_measured_step_divides_your_global_batch():
    run = preset("gpt2").override({"total_batch_tokens": 3 * 16 * 1024})
    assert measured_sequences(run, "cuda") == 48 and measured_sequences(run, "cpu") == 16
    assert measured_sequences(preset("pico"), "cuda") == 8


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--preset", "pico", "--device", "cpu"], "bench tune needs --data DIR"),
        (
            ["--preset", "pico", "--synthetic", "--flags=--no-such-flag"],
            "'--no-such-flag' are not gptspeed train flags",
        ),
        (["--preset", "pico", "--synthetic", "--stages", "all"], "unrecognized arguments: --stages all"),
        (
            ["--preset", "pico", "--synthetic", "--seed", "3", "--no-peers"],
            "unrecognized arguments: --seed 3 --no-peers",
        ),
        (["--preset", "pico", "--synthetic", "--budget-s", "0"], "--budget-s must be a positive finite number"),
        (["--preset", "pico", "--synthetic", "--budget-s", "inf"], "--budget-s must be a positive finite number"),
        (["--preset", "pico", "--synthetic", "--budget-s", "nan"], "--budget-s must be a positive finite number"),
        (["--preset", "pico", "--synthetic", "--budget-s=-5"], "--budget-s must be a positive finite number"),
        (["--preset", "pico", "--synthetic", '--flags="--unclosed'], "--flags: No closing quotation"),
        (["--preset", "pico", "--synthetic", "--flags=--resume"], "--flags: --resume is not a setting of the run"),
        (["--preset", "pico", "--synthetic", "--flags=--print-config"], "--flags: --print-config"),
        (["--preset", "pico", "--synthetic", "--flags=--out x"], "--flags: --out"),
        (["--preset", "pico", "--device", "cpu", "--flags=--device cuda"], "--flags: --device cuda"),
    ],
)
def test_tune_bad_flags_are_one_line(tmp_path, args, fragment):
    assert_user_error(run_cli("bench", "tune", "--out", str(tmp_path / "t"), *args), fragment)


def test_tune_refuses_a_run_folder_and_the_ladder_refuses_tune_flags(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    argv = ["bench", "tune", "--out", str(run), "--preset", "pico", "--synthetic", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", ["gptspeed", *argv])
    assert cli.main(argv) == 2
    assert "is a run folder: bench never writes into one" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "ladder", "--out", str(tmp_path / "l"), "--flags", "--lr 1"])
    assert e.value.code == 2 and "unrecognized arguments: --flags --lr 1" in capsys.readouterr().err


def test_tune_on_the_cpu_end_to_end_and_its_tuned_yaml_trains(tmp_path):
    """Every CPU knob's row in a real worker process, at a tiny shape (B=2 x T=16, one block of width 32:
    the rows' time is their processes', not the model's), and the tuned.yaml it writes trains."""
    out = tmp_path / "tune"
    proc = run_cli(
        "bench",
        "tune",
        "--preset",
        "pico",
        *("--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--batch-size", "2"),
        "--device",
        "cpu",
        "--synthetic",
        "--out",
        str(out),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--compile-backend",
        "eager",
        "--flags",
        "--dtype float32",
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "tune.json").read_text())
    r = rows(res)
    assert r["yours"]["verdict"] == "yours" and r["yours"]["dtype"] == "float32"
    assert {x["knob"] for x in res["rows"]} >= {"dtype", "compile", "loss", "threads", "coordinate-descent"}
    for x in res["rows"][1:]:  # every CPU knob gave a row with a verdict; the ones that ran were compared with yours
        assert x["verdict"] in ("verified", "not applicable", "duplicate") and x["verdict"] in VERDICTS, x
        if x["verdict"] == "verified":
            assert x["loss_check"]["steps_compared"] == 3 and x["loss_check"]["ok"]
    assert r["loss=plain"]["verdict"] == "verified"  # the CPU's auto is fused: plain is the other path
    assert r["loss=fused"]["verdict"] == "duplicate"  # ... and fused itself is not run again
    assert r["coordinate-descent"]["verdict"] == "not applicable" and "Triton" in r["coordinate-descent"]["reason"]
    assert res["config"]["resolved"]["sdpa_backend"] == "flash"  # auto resolved from your row's profile
    assert "Your run, resolved here:" in (out / "tune.md").read_text()
    assert f"train it: gptspeed train --config {out}/tuned.yaml --data DATA_DIR --out RUN_DIR" in proc.stdout
    # the file trains as gptspeed train --config reads it (in this process: two more would each import torch)
    import torch

    from gptspeed.api import train
    from gptspeed.configure import config_from_flags

    cfg = config_from_flags(
        [
            "--config",
            str(out / "tuned.yaml"),
            "--max-steps",
            "2",
            "--out",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--eval-every",
            "0",
            "--eval-tokens",
            "1024",
        ],
        "test",
    )
    assert {k: cfg.runtime.__dict__.get(k, cfg.model.__dict__.get(k)) for k in res["best"]} == res["best"]
    threads = torch.get_num_threads()
    try:
        assert train(cfg, echo=False)["step"] == 2
    finally:
        torch.set_num_threads(threads)  # a kept --threads is the test process's too
    assert (tmp_path / "run" / "config.json").exists()


def test_a_one_process_fsdp_candidate_runs_in_the_verify_worker_and_trains_as_yours(tmp_path):
    """``--cast-weights-once``'s candidate (``--parallel fsdp`` in the worker's one process, its gloo group
    of one on a CPU) runs as a real worker process, with your row's losses (the same bf16 numbers); compiled
    per block (``--compile-mode blocks``), dynamo compiles it with no graph break or recompile (under
    whole-model compile it breaks at FSDP2's hooks: the knob says "not applicable" there)."""
    import dataclasses

    from gptspeed.bench.ladder import run_worker
    from gptspeed.bench.worker import StageSpec

    settings = {"dtype": "bfloat16", "compile": False}
    base = StageSpec(name="yours", settings=settings, **TINY_RUNG, grad_accum=2)
    yours = run_worker(base, tmp_path / "yours.log")
    once = run_worker(
        dataclasses.replace(
            base,
            name="once",
            settings={
                **settings,
                "parallel": "fsdp",
                "cast_weights_once": True,
                "compile": True,
                "compile_mode": "blocks",
            },
            compile_backend="eager",
        ),
        tmp_path / "once.log",
    )
    assert yours["status"] == once["status"] == "ok", (tmp_path / "once.log").read_text()[-2000:]
    assert once["losses"] == pytest.approx(yours["losses"], rel=1e-2)
    assert once["compile"]["graph_breaks"] == 0 and once["compile"]["recompiles"] == 0, once["compile"]


def test_each_candidate_is_judged_against_your_row_not_the_best_so_far(tmp_path, monkeypatch):
    """Losses near bf16's 1e-2 after a kept row: ``a`` (+0.8% from yours) is kept; ``b`` from it sits 1.6% from
    yours but 0.8% from ``a`` (kept rows must not drift away from your run step by step: it fails), and ``c``
    from it sits 0.3% from yours but 1.2% from ``a`` (it trains as yours: verified and kept)."""
    worker = FakeWorker(
        {("compile", True): 0.9, ("loss", "plain"): 0.9, ("threads", 1): 0.9},
        offsets={("compile", True): 0.008, ("loss", "plain"): 0.008, ("threads", 1): -0.011},
    )
    knobs = (
        knob("a", [{"compile": True}]),
        knob("b", [{"loss": "plain"}]),
        knob("c", [{"threads": 1}]),
    )
    res = tune(tmp_path, monkeypatch, worker, knobs, flags="--dtype bfloat16")
    r = rows(res)
    assert r["a=True"]["verdict"] == "verified" and r["a=True"]["kept"]
    assert r["a=True"]["loss_check"]["rtol"] == pytest.approx(1e-2)
    assert r["b=plain"]["verdict"] == "fails verification" and not r["b=plain"]["kept"]
    assert r["b=plain"]["loss_check"]["max_rel_diff"] == pytest.approx(0.016)  # from yours, not from a's
    assert "vs yours's" in r["b=plain"]["reason"]
    assert r["c=1"]["verdict"] == "verified" and r["c=1"]["kept"]
    assert r["c=1"]["loss_check"]["max_rel_diff"] == pytest.approx(0.003)
    assert res["best"] == {"compile": True, "threads": 1}


@pytest.mark.parametrize(
    "yours, candidate, rtol",
    [
        ("--dtype bfloat16", {"fp8_lm_head": True, "loss": "plain"}, 2e-2),  # a bf16 run, an FP8 head: fp8's 2e-2
        ("--dtype bfloat16 --fp8-lm-head --loss plain", {"fp8_lm_head": False}, 2e-2),  # and the other way round
        ("--dtype float32", {"dtype": "bfloat16"}, 1e-2),  # an fp32 run (1e-4), a bf16 candidate: bf16's 1e-2
    ],
)
def test_a_candidate_is_judged_at_the_looser_of_the_two_rows_tolerances(tmp_path, monkeypatch, yours, candidate, rtol):
    """After a kept row, a candidate in another format whose losses sit at 0.75 of the looser tolerance is
    verified (the tighter one would reject it: FP8 judged at bf16's 1e-2), and one at 1.25 of it fails."""
    key = next(iter(candidate.items()))
    worker = FakeWorker(
        {("compile", True): 0.9, key: 0.8, ("attention", "manual"): 0.8},
        offsets={key: 0.75 * rtol, ("attention", "manual"): 0.5 * rtol},
    )
    knobs = (
        knob("kept", [{"compile": True}]),
        knob("near", [candidate]),
        knob("far", [{**candidate, "attention": "manual"}]),  # 0.75 + 0.5 = 1.25 of the tolerance
    )
    res = tune(tmp_path, monkeypatch, worker, knobs, flags=yours)
    got = {x["knob"]: x for x in res["rows"]}
    assert got["kept"]["kept"]
    assert got["near"]["loss_check"]["rtol"] == pytest.approx(rtol)
    assert got["near"]["verdict"] == "verified" and got["near"]["kept"], got["near"]["reason"]
    assert got["far"]["loss_check"]["rtol"] == pytest.approx(rtol)
    assert got["far"]["verdict"] == "fails verification" and not got["far"]["kept"]


def test_sdpa_auto_is_resolved_from_your_rows_profile_and_its_kernel_is_a_duplicate_not_a_row_run(
    tmp_path, monkeypatch
):
    worker = FakeWorker({("sdpa_backend", "flash"): 0.9}, sdpa="cudnn")  # auto runs cuDNN's kernel here
    knobs = (knob("sdpa-backend", knobs_mod._choices("sdpa_backend", ("cudnn", "flash", "efficient"))),)
    res = tune(tmp_path, monkeypatch, worker, knobs)
    r = rows(res)
    assert res["config"]["resolved"]["sdpa_backend"] == "cudnn"
    assert (
        r["sdpa-backend=cudnn"]["verdict"] == "duplicate"
        and "already ran cudnn's kernel" in r["sdpa-backend=cudnn"]["reason"]
    )
    assert [c.settings.get("sdpa_backend") for c in worker.calls] == ["auto", "flash", "efficient"]  # cudnn never ran
    assert r["sdpa-backend=flash"]["kept"] and res["best"] == {"sdpa_backend": "flash"}
    md = (tmp_path / "tune" / "tune.md").read_text()
    assert "SDPA kernel (its profile) cudnn" in md and "| duplicate |" in md


def test_the_micro_batch_compares_every_size_that_fits_not_only_the_first_that_gains(tmp_path, monkeypatch):
    """B=8 gains 5% over yours (B=4), B=16 another 0.5% over B=8 (under the 1% gate from B=8): the fastest of
    the sizes that fit is kept; B=32 does not fit and ends the knob."""
    monkeypatch.setattr(tune_mod, "STEP_FACTOR", {"cpu": 8})  # a measured step of 8 micro-batches of yours
    worker = FakeWorker({("batch_size", 8): 0.95, ("batch_size", 16): 0.945}, oom_at=32)
    knobs = (knob("micro-batch", knobs_mod._micro_batch, sizes=True),)
    res = tune(tmp_path, monkeypatch, worker, knobs, flags="--batch-size 4 --total-batch-tokens 4096")
    r = rows(res)
    assert list(r) == ["yours", "micro-batch=8", "micro-batch=16", "micro-batch=32"]
    assert r["micro-batch=16"]["kept"] and not r["micro-batch=8"]["kept"]
    assert r["micro-batch=16"]["from"] == "(your configuration)"  # every size from the same best
    assert r["micro-batch=32"]["verdict"] == "does not fit" and res["best"] == {"batch_size": 16}


def test_every_row_compiles_into_one_shared_cache(tmp_path, monkeypatch):
    worker = FakeWorker({("compile", True): 0.9})
    knobs = (knob("compile", [{"compile": True}]), knob("loss", [{"loss": "plain"}]))
    tune(tmp_path, monkeypatch, worker, knobs)
    assert len(worker.caches) == 3 and worker.caches[0] is not None and len(set(worker.caches)) == 1
    assert not worker.caches[0].exists()  # removed at the end


def test_tuned_yaml_records_the_data_and_the_device_the_tune_measured(tmp_path, monkeypatch):
    """tuned.yaml said ``data: ''`` (its train command trained on the shipped tiny Shakespeare) and the device
    of your flags (``auto``, or a cuda it was not tuned on): now the data and device the rows ran on."""
    from gptspeed.configure import config_from_flags

    worker = FakeWorker()
    monkeypatch.setattr(tune_mod, "run_worker", worker)
    monkeypatch.setattr(tune_mod, "monotonic", worker.clock)
    monkeypatch.setattr(tune_mod, "knobs_for", lambda device: ())
    data = tmp_path / "data"
    run = config_from_flags(["--preset", "pico"], "test")
    cfg = tune_mod.TuneConfig(out=str(tmp_path / "t"), run=run, device="cpu", data=str(data), steps=3, warmup=1)
    res = tune_mod.run_tune(cfg)
    tuned = yaml.safe_load((tmp_path / "t" / "tuned.yaml").read_text())
    assert tuned["train"]["data"] == str(data) and tuned["runtime"]["device"] == "cpu"
    assert worker.calls[0].data == str(data)
    assert res["train_command"] == f"gptspeed train --config {tmp_path / 't' / 'tuned.yaml'} --out RUN_DIR"


def test_your_run_takes_the_device_and_data_of_your_flags_when_bench_names_none():
    values = dict(flags="--device cpu --data /d", device="auto", data=None, synthetic=False, preset="pico")
    run, data, device = tune_mod.your_run(values)
    assert (data, device) == ("/d", "cpu")
    with pytest.raises(GptspeedError, match="--flags: --data /d differs from bench's --data /e"):
        tune_mod.your_run({**values, "data": "/e"})
    with pytest.raises(GptspeedError, match="--synthetic measures random phrases"):
        tune_mod.your_run({**values, "synthetic": True})


def test_an_earlier_tune_is_replaced_only_with_force_and_files_it_did_not_write_never(tmp_path, monkeypatch):
    """``bench tune --out`` wrote over an earlier tune's tune.md / tune.json / tuned.yaml and over a user's
    files of those names, and refused --force. Now an earlier tune (recognised by tune.json's record of what it
    wrote) is replaced only with --force; a file of those names it did not write is one line, untouched."""
    knobs = (knob("compile", [{"compile": True}]),)
    tune(tmp_path, monkeypatch, FakeWorker(), knobs)
    out = tmp_path / "tune"
    before = {n: (out / n).read_bytes() for n in ("tune.md", "tune.json", "tuned.yaml")}
    with pytest.raises(
        GptspeedError, match=r"holds an earlier tune \(tune\.md, tuned\.yaml, tune\.json\): pass --force"
    ):
        tune(tmp_path, monkeypatch, FakeWorker(), knobs)
    assert {n: (out / n).read_bytes() for n in before} == before
    monkeypatch.setattr(tune_mod, "run_worker", FakeWorker())
    run = tune_mod.TuneConfig(
        out=str(out), run=preset("pico"), device="cpu", steps=3, warmup=1, force=True, budget_s=1000.0
    )
    assert tune_mod.run_tune(run)["complete"]  # replaced
    (out / "tuned.yaml").write_text("# my own edits\n" + (out / "tuned.yaml").read_text())
    with pytest.raises(GptspeedError, match="holds tuned.yaml, which no earlier tune wrote .* even with --force"):
        tune_mod.run_tune(run)
    assert (out / "tuned.yaml").read_text().startswith("# my own edits")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tune.md").write_text("my notes")
    with pytest.raises(GptspeedError, match="holds tune.md, which no earlier tune wrote"):
        tune_mod.run_tune(
            tune_mod.TuneConfig(out=str(mine), run=preset("pico"), device="cpu", steps=3, warmup=1, force=True)
        )
    assert (mine / "tune.md").read_text() == "my notes"


def test_two_tunes_on_one_out_the_second_is_refused_naming_the_first(tmp_path):
    from gptspeed.checkpoint import run_lock

    out = tmp_path / "t"
    out.mkdir()
    held = run_lock(out).acquire()  # as a first tune holds it
    try:
        with pytest.raises(GptspeedError, match=r"is in use by pid \d+ .*another `gptspeed bench tune`"):
            tune_mod.open_tune_folder(out, force=True)
    finally:
        held.release()


def test_a_stop_signal_ends_the_running_row_and_keeps_the_rows_so_far_marked_interrupted(tmp_path, monkeypatch):
    """Ctrl-C as a terminal sends it (SIGINT to the process group) did not stop `bench tune`: rows went on until
    a SIGKILL. Now the running row's worker is ended, the rows so far are written marked interrupted, no
    tuned.yaml, and the command exits 128 + the signal with one line."""
    import os
    import signal

    worker = FakeWorker()

    def stopped_in_the_second_row(spec, log_path, timeout=None, cache_dir=None, stop=None):
        if len(worker.calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C, during the row
            assert stop()  # the flag run_worker polls
            return {"status": "stopped", "reason": "stopped by a signal before it finished"}
        return worker(spec, log_path, timeout, cache_dir)

    stopped_in_the_second_row.clock = worker.clock
    knobs = (knob("compile", [{"compile": True}]), knob("loss", [{"loss": "plain"}]))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(tune_mod.TuneStopped, match="tune stopped by SIGINT; .*tune.json and tune.md hold the 2 rows"):
        tune(tmp_path, monkeypatch, stopped_in_the_second_row, knobs)
    assert signal.getsignal(signal.SIGINT) is handler  # the tune's handlers are gone again
    out = tmp_path / "tune"
    res = json.loads((out / "tune.json").read_text())
    assert [(r["name"], r["verdict"]) for r in res["rows"]] == [("yours", "yours"), ("compile=True", "interrupted")]
    assert res["interrupted"] == "SIGINT" and not res["complete"] and not (out / "tuned.yaml").exists()
    assert "interrupted by SIGINT" in (out / "tune.md").read_text()
