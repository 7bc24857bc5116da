"""benchmarks/vs_peers_gpu.py: gptspeed beside nanoGPT and llm.c on one GPU (the rows' plumbing, checked on the CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import vs_peers_gpu as peers_gpu  # noqa: E402

from support.cli import child_env
from support.paths import ROOT

NANOGPT = ROOT.parent / "shared" / "peers" / "nanoGPT"


# train_gpt2.cu's per-step printf, in Python's % notation (the same conversions)
LLMC_FORMAT = "step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)| lr %.2e | %.2f ms | %.1f%% bf16 MFU | %.0f tok/s"


FAKE_LLMC_MAKEFILE = """train_gpt2cu:
\t@if [ "$(USE_CUDNN)" = "1" ]; then echo 'cudnn_att.cpp: error: no member named SDPA_attributes' && false; fi
\tcp fake_train train_gpt2cu && chmod +x train_gpt2cu
clean:
\trm -f train_gpt2cu
"""


# train_gpt2cu's step line for steps 1..12, as its printf writes it (its arguments appended to args.txt)
FAKE_LLMC_TRAIN = (
    '#!/bin/sh\necho "$*" >> args.txt\nfor i in 1 2 3 4 5 6 7 8 9 10 11 12; do\n'
    + "  printf 'step %4d/12 | loss 7.000000 (+nanz)| norm 1.0000 (+nanz)| lr 6.00e-04 | 50.00 ms | 40.0%% bf16 MFU "
    "| 300000 tok/s\\n' $i\ndone\n"
)


def small_shape():
    """The llm.c rows' small shape: GPT-2 124M's width (12 blocks), micro-batches of 2 x 64 tokens, one a step."""
    return peers_gpu.make_shape(
        peers_gpu.argparse.Namespace(seq_len=64, batch_size=2, accum=1, n_layer=12, n_head=12, n_embd=768)
    )


def fake_llmc_clone(tmp_path, monkeypatch, makefile: str, cudnn: str):
    """An llm.c clone whose Makefile is ``makefile`` and whose train_gpt2cu prints FAKE_LLMC_TRAIN's
    lines, as the peers' llm.c; the llm.c row's arguments (``cudnn``) and a small shape."""
    fake = tmp_path / "peers" / "llm.c"
    fake.mkdir(parents=True)
    (fake / "Makefile").write_text(makefile)
    (fake / "fake_train").write_text(FAKE_LLMC_TRAIN)
    monkeypatch.setattr(peers_gpu.pc, "PEERS_DIR", tmp_path / "peers")
    args = peers_gpu.argparse.Namespace(
        device="cuda", warmup=2, steps=3, llmc_make="", llmc_cudnn=cudnn, row_timeout=60
    )
    return args, small_shape()


SLOW_LLMC_MAKEFILE = """train_gpt2cu:
\techo built >> builds.txt
\tsleep 1
\tcp fake_train train_gpt2cu && chmod +x train_gpt2cu
"""


def tiny_cpu_peers(data, work, accum: int, rounds: int) -> list[str]:
    """``benchmarks/vs_peers_gpu.py`` on the CPU at a tiny shape (1 block, micro-batches of 2 x 32 tokens, 2 steps
    after 1 warmup), ``accum`` micro-batches a step, ``rounds`` rounds, its clones and builds in ``work``."""
    shape = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "2"]
    return [
        *(sys.executable, str(ROOT / "benchmarks" / "vs_peers_gpu.py"), "--data", str(data), "--device", "cpu"),
        *shape,
        *("--accum", str(accum), "--rounds", str(rounds), "--steps", "2", "--warmup", "1", "--work", str(work)),
    ]


def test_llmc_step_lines_are_read_as_its_printf_writes_them():
    first = LLMC_FORMAT % (1, 29, 11.009876, math.nan, 15.4321, math.nan, 6e-4, 1234.56, 12.3, 53103)
    later = LLMC_FORMAT % (12, 29, 7.654321, -0.25, 1.2345, 1.5, 6e-4, 141.07, 48.9, 464512)
    assert peers_gpu.parse_llmc_line(first) == (1, 11.009876, 1234.56, 12.3)
    assert peers_gpu.parse_llmc_line(later + "\n") == (12, 7.654321, 141.07, 48.9)
    for other in ("val loss 7.1234", "generating:", "step 3: train loss 4.2", ""):
        assert peers_gpu.parse_llmc_line(other) is None


def test_the_shape_flags_give_every_tool_the_same_tokens_per_step():
    args = peers_gpu.argparse.Namespace(seq_len=1024, batch_size=16, accum=4, n_layer=12, n_head=12, n_embd=768)
    shape = peers_gpu.make_shape(args)
    assert shape.tokens == 16 * 1024 * 4
    assert shape.preset == "gpt2" and shape.preset_flags == (
        "--batch-size",
        "16",
        "--seq-len",
        "1024",
        "--total-batch-tokens",
        "65536",
    )


@pytest.mark.skipif(not NANOGPT.exists(), reason="needs nanoGPT's clone in ../shared/peers")
def test_an_interleaved_cpu_run_writes_every_row(shakespeare_data, tmp_path):
    out = tmp_path / "peers.json"
    cmd = [
        *tiny_cpu_peers(shakespeare_data, tmp_path / "work", accum=2, rounds=2),
        "--json",
        str(out),
        "--md",
        str(tmp_path / "peers.md"),
        "--variant",
        "math: --sdpa-backend math",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["shapes"][0]["rows"]
    assert list(rows) == ["gptspeed", "nanogpt", "llmc", "math"]
    assert "needs a CUDA GPU" in rows["llmc"]["error"]
    runs = result["shapes"][0]["runs"]
    for row in ("gptspeed", "nanogpt", "math"):
        assert len(rows[row]["round_medians_ms"]) == 2, row  # both rounds measured
        assert rows[row]["tokens_per_s"] == pytest.approx(2 * 32 * 2 / rows[row]["median_ms"] * 1000)
        assert all(len(r["step_ms"]) == 2 for r in runs[row])
    assert [r["round"] for r in runs["gptspeed"]] == [0, 1]
    # the variant's flags reached gptspeed train: its command says so, and its start line names the kernel
    assert "--sdpa-backend math" in runs["math"][0]["command"]
    assert "sdpa math" in runs["math"][0]["start_line"]
    # each row started from its own step-0 loss near ln(50304): a fresh model, trained on real tokens
    assert all(abs(rows[r]["first_loss"] - math.log(50304)) < 0.5 for r in ("gptspeed", "nanogpt", "math"))
    assert "x 2 micro-batches (128 tokens/step)" in (tmp_path / "peers.md").read_text()


def test_the_loss_benchmark_compares_every_path_against_fp64(tmp_path):
    """benchmarks/gpu_loss_paths.py at a small shape on the CPU: every runnable path's loss and gradients
    agree with the fp64 reference, the padded rows get no gradient, Liger says why it is skipped."""
    out = tmp_path / "loss.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_loss_paths.py"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--tokens",
        "256",
        "--vocab",
        "1024",
        "--width",
        "64",
        "--rounds",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--compile-backend",
        "eager",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["variants"]
    assert "need a CUDA GPU" in result["liger"]["skipped"]
    for name in ("plain", "plain-compiled", "gptspeed-fused"):
        v = result[name]
        assert v["steps"] == 2 and v["padding_grad_zero"], name
        assert v["loss_rel"] < 1e-6 and v["grad_x_rel"] < 1e-5 and v["grad_w_rel"] < 1e-5, (name, v)


def test_a_variant_gives_its_flags_and_its_environment_to_gptspeed_train(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(
        peers_gpu.pc,
        "run_gptspeed",
        lambda shape, data, run_dir, flags, **kw: (
            seen.update(flags=flags, env=kw["env_extra"], device=kw["device"]) or peers_gpu.pc.Run([1.0])
        ),
    )
    name, flags, env = peers_gpu.pc.parse_variant("cd: --sdpa-backend cudnn TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1")
    args = peers_gpu.argparse.Namespace(device="cuda", warmup=1, steps=1, row_timeout=60)
    shape = peers_gpu.make_shape(
        peers_gpu.argparse.Namespace(seq_len=1024, batch_size=16, accum=4, n_layer=12, n_head=12, n_embd=768)
    )
    peers_gpu.run_row(name, args, shape, tmp_path, tmp_path, {name: (flags, env)})
    assert seen == {
        "flags": ["--sdpa-backend", "cudnn"],
        "env": {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"},
        "device": "cuda",
    }
    peers_gpu.run_row("gptspeed", args, shape, tmp_path, tmp_path, {name: (flags, env)})
    assert seen["flags"] == [] and seen["env"] == {}  # the default row: no flag, no variable


def test_llmc_reads_the_prepared_shards_and_a_failed_build_is_one_row_error(shakespeare_data, tmp_path, monkeypatch):
    import glob

    train, val = peers_gpu.llmc_data(tmp_path, shakespeare_data)
    assert [Path(p).resolve() for p in glob.glob(train)] == [p.resolve() for p in shakespeare_data.glob("train_*.bin")]
    assert len(glob.glob(val)) == 1
    # a build that fails (here: a Makefile with no CUDA) is the row's error, with make's own words
    fake = tmp_path / "peers" / "llm.c"
    fake.mkdir(parents=True)
    (fake / "Makefile").write_text("train_gpt2cu:\n\t@echo 'nvcc: not found' && false\n")
    monkeypatch.setattr(peers_gpu.pc, "PEERS_DIR", tmp_path / "peers")
    args = peers_gpu.argparse.Namespace(device="cuda", warmup=1, steps=1, llmc_make="", row_timeout=60)
    run = peers_gpu.run_row("llmc", args, small_shape(), tmp_path / "work", shakespeare_data, {})
    assert run.step_ms == [] and "llm.c build failed" in run.error and "nvcc: not found" in run.error
    # the next round does not build again (the copy it would build in now has a Makefile that succeeds)
    (tmp_path / "work" / "llm.c" / "Makefile").write_text("train_gpt2cu:\n\ttouch built-again\n")
    again = peers_gpu.run_row("llmc", args, small_shape(), tmp_path / "work", shakespeare_data, {})
    assert again.error == run.error and not (tmp_path / "work" / "llm.c" / "built-again").exists()


def test_the_llmc_row_records_its_build_line_and_falls_back_from_a_failed_cudnn_build(
    shakespeare_data, tmp_path, monkeypatch
):
    """The llm.c row is built for the GPU nvidia-smi reports (GPU_COMPUTE_CAPABILITY=90) with cuDNN
    attention when its headers are carried; when that build fails, it is built again without cuDNN,
    and the row (JSON and Markdown) carries the make line that was used and why cuDNN is off."""
    from support.gpu_tools import fake_cudnn, fake_gpu_tools

    fake_gpu_tools(tmp_path, monkeypatch)
    carry, site = fake_cudnn(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(peers_gpu, "CARRY", carry)
    args, shape = fake_llmc_clone(tmp_path, monkeypatch, FAKE_LLMC_MAKEFILE, "auto")
    run = peers_gpu.run_row("llmc", args, shape, tmp_path / "work", shakespeare_data, {})
    assert run.error is None and run.step_ms == [50.0] * 3
    build = run.info["build"]
    assert "GPU_COMPUTE_CAPABILITY=90" in build["line"] and "USE_CUDNN" not in build["line"]
    assert build["cudnn"] is False and "the USE_CUDNN=1 build failed" in build["cudnn_note"]
    assert "SDPA_attributes" in build["cudnn_note"]
    assert (tmp_path / "work" / "llmc-build-cudnn.log").read_text().startswith("$ make -C ")
    summary = peers_gpu.pc.summarize(
        shape,
        {
            "llmc": [
                {
                    "round": 0,
                    "step_ms": run.step_ms,
                    "losses": run.losses,
                    "peak_rss_bytes": 0,
                    "error": None,
                    "median_ms": 50.0,
                    **run.info,
                }
            ]
        },
    )
    line = peers_gpu.build_lines(summary)
    assert f"llm.c built with `{build['line']}` (GPU_COMPUTE_CAPABILITY 90: nvidia-smi" in line
    assert "cuDNN attention off: cuDNN attention off: the USE_CUDNN=1 build failed" not in line


def test_llmc_built_ahead_in_the_background_is_waited_for_and_built_once(shakespeare_data, tmp_path, monkeypatch):
    """prebuild_llmc starts llm.c's build while other rows run; the llm.c row waits for that build
    instead of starting a second make in the same copy, and a prebuild that failed is the row's error."""
    from support.gpu_tools import fake_gpu_tools

    fake_gpu_tools(tmp_path, monkeypatch)
    args, shape = fake_llmc_clone(tmp_path, monkeypatch, SLOW_LLMC_MAKEFILE, "off")
    fake = tmp_path / "peers" / "llm.c"
    work = tmp_path / "work"
    future = peers_gpu.prebuild_llmc(work, [], "off", 60)
    assert not future.done()  # make sleeps: the row below starts while the build runs
    run = peers_gpu.run_row("llmc", args, shape, work, shakespeare_data, {})
    assert run.error is None and run.step_ms == [50.0] * 3
    assert (work / "llm.c" / "builds.txt").read_text().splitlines() == ["built"]
    # a build that fails ahead is the row's error, with make's words, and is not run again by the row
    (fake / "Makefile").write_text("train_gpt2cu:\n\techo tried >> tries.txt; echo 'nvcc: not found'; false\n")
    work2 = tmp_path / "work2"
    peers_gpu.prebuild_llmc(work2, [], "off", 60)
    failed = peers_gpu.run_row("llmc", args, shape, work2, shakespeare_data, {})
    assert failed.step_ms == [] and "llm.c build failed" in failed.error and "nvcc: not found" in failed.error
    assert (work2 / "llm.c" / "tries.txt").read_text().splitlines() == ["tried"]


def test_peers_killed_mid_row_leave_valid_json_and_markdown_with_the_finished_rows(shakespeare_data, tmp_path):
    """The peers write their JSON and Markdown after every process (atomically): killed while a row
    runs -- a variant whose gptspeed train sleeps -- they keep the rows that finished."""
    from support.cut_short import run_until_true, sleeper_env

    out, md = tmp_path / "peers.json", tmp_path / "peers.md"
    cmd = [
        *tiny_cpu_peers(shakespeare_data, tmp_path / "work", accum=1, rounds=1),
        "--peers",
        "gptspeed,slow",
        "--variant",
        "slow: GPTSPEED_TEST_SLEEP=*",
        "--json",
        str(out),
        "--md",
        str(md),
    ]

    def first_row_written() -> bool:
        return out.exists() and "median_ms" in json.loads(out.read_text())["shapes"][0]["rows"].get("gptspeed", {})

    run_until_true(cmd, sleeper_env(tmp_path, None), first_row_written, timeout=180)
    result = json.loads(out.read_text())
    rows = result["shapes"][0]["rows"]
    assert result["complete"] is False and list(rows) == ["gptspeed", "slow"]
    assert rows["gptspeed"]["median_ms"] > 0 and rows["slow"] == {"error": "not run"}
    text = md.read_text()
    assert "| gptspeed | " in text and "**Incomplete**" in text


def test_llmc_rows_pass_their_own_train_gpt2cu_flags_through(shakespeare_data, tmp_path, monkeypatch):
    """--llmc-flags reach train_gpt2cu after the row's own flags (llm.c reads argv left to right: they
    win), an llm.c variant adds its own after them, the row records them; the flags the row sets from
    its shape, steps and data are refused in one line before anything runs."""
    import shlex

    from support.gpu_tools import fake_gpu_tools

    fake_gpu_tools(tmp_path, monkeypatch)
    args, shape = fake_llmc_clone(tmp_path, monkeypatch, SLOW_LLMC_MAKEFILE, "off")
    args.llmc_flags = "-r 0"
    variants = {"llmc-B4": (["llmc", "-b", "4"], {})}
    work = tmp_path / "work"
    plain = peers_gpu.run_row("llmc", args, shape, work, shakespeare_data, variants)
    b4 = peers_gpu.run_row("llmc-B4", args, shape, work, shakespeare_data, variants)
    assert plain.error is None and b4.error is None and b4.step_ms == [50.0] * 3
    ran = [shlex.split(line) for line in (work / "llm.c" / "args.txt").read_text().splitlines()]
    assert ran[0][:12] == ["-e", "d12", "-i", ran[0][3], "-j", ran[0][5], "-b", "2", "-t", "64", "-d", "128"]
    assert ran[0][-2:] == ["-r", "0"] and ran[1][-4:] == ["-r", "0", "-b", "4"]
    assert plain.info["llmc_flags"] == ["-r", "0"] and b4.info["command"].endswith("-r 0 -b 4")
    assert (work / "llm.c" / "builds.txt").read_text().splitlines() == ["built"]  # one build for both rows
    for bad, says in (("-d 524288", "use --batch-size x --accum"), ("-r", "pairs"), ("--r 0", "not a train_gpt2cu")):
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "vs_peers_gpu.py"),
                "--data",
                str(shakespeare_data),
                f"--llmc-flags={bad}",
                "--work",
                str(tmp_path / "w2"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert proc.returncode == 2 and says in proc.stderr, (bad, proc.stderr)
        assert not (tmp_path / "w2" / "llm.c").exists()
