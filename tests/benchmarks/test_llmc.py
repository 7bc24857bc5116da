"""benchmarks/llmc.py, llm.c beside gptspeed: the checkpoint exporter, and gptspeed's losses against llm.c's C trainer."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from llmc import (  # noqa: E402
    CUDA13_COMPAT,
    LLMC_B,
    LLMC_T,
    MAKEFILE_CFLAGS,
    build_train_gpt2,
    find_c_compiler,
    llmc_cuda_make,
    llmc_cuda_train_command,
    llmc_tensors,
    prepare_llmc_dir,
    read_llmc_checkpoint,
    run_train_gpt2,
    write_llmc_checkpoint,
)

from gptspeed.data.shards import write_shard
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig

from support.cli import run_cli
from support.gpu_tools import fake_cudnn, fake_gpu_tools
from support.paths import ROOT

LLMC_DIR = Path(os.environ.get("GPTSPEED_LLMC_DIR", ROOT.parent / "shared" / "peers" / "llm.c"))


#: The model both gptspeed and llm.c's train_gpt2 train: two blocks 16 wide at llm.c's sequence length (this
#: file's alone: it needs benchmarks/llmc.py on the path).
LLMC_MODEL = dict(n_layer=2, n_head=2, n_embd=16, block_size=LLMC_T)


SEED = 1337


STEPS = 20


# llm.c's main(): gpt2_update(&model, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, step+1), no clipping, no schedule
LLMC_OPTIM_FLAGS = [
    "--lr",
    "1e-4",
    "--beta1",
    "0.9",
    "--beta2",
    "0.999",
    "--eps",
    "1e-8",
    "--weight-decay",
    "0",
    "--grad-clip",
    "0",
    "--warmup-steps",
    "0",
    "--min-lr-ratio",
    "1",
]


@pytest.fixture(scope="session")
def llmc_binary(tmp_path_factory) -> Path:
    """llm.c's train_gpt2, compiled once per session from its unmodified source (the Makefile's
    optimisation flags without OpenMP: one thread; -O2 if the compiler refuses -march=native)."""
    if find_c_compiler() is None:
        pytest.skip("no C compiler (cc/gcc/clang, or $CC) to build llm.c's train_gpt2")
    if not (LLMC_DIR / "train_gpt2.c").is_file():
        pytest.skip(f"llm.c's source not found at {LLMC_DIR} (set GPTSPEED_LLMC_DIR to a clone of karpathy/llm.c)")
    out = tmp_path_factory.mktemp("llmc-bin")
    flags = tuple(f for f in MAKEFILE_CFLAGS if f not in ("-fopenmp", "-DOMP"))
    try:
        return build_train_gpt2(LLMC_DIR, out, flags)
    except GptspeedError:
        return build_train_gpt2(LLMC_DIR, out, ("-O2",))


def _tokens() -> np.ndarray:
    """The first 514 GPT-2 tokens of tiny Shakespeare: one train batch and one val batch."""
    from gptspeed.data.corpora import corpus_files
    from gptspeed.tokenizer import encode

    text = corpus_files("tinyshakespeare", progress=False)[0].read_text()[:4000]  # the mirror, or the embedded copy
    ids = np.array(encode(text), dtype=np.int64)
    n = LLMC_B * LLMC_T + 1
    assert ids.size >= 2 * n
    return ids[: 2 * n]


def dry_run(build: dict) -> str:
    """What llm.c's own Makefile would run for this make line (``make -n``, the fake nvcc found)."""
    import subprocess

    cmd = build["command"]
    proc = subprocess.run([cmd[0], "-n", *cmd[1:]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _real_nvcc_version() -> tuple[str, int] | None:
    """``(nvcc path, CUDA major version)`` of a real nvcc on PATH, else None."""
    import re
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.", out)
    return (nvcc, int(m.group(1))) if m else None


def test_checkpoint_layout_round_trips(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=8, block_size=16))
    path = write_llmc_checkpoint(model, tmp_path / "m.bin")
    c = model.config
    L, C, Vp, T = c.n_layer, c.n_embd, c.vocab_size, c.block_size
    assert path.stat().st_size == 1024 + 4 * (Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C)
    header = np.fromfile(path, dtype="<i4", count=8)
    assert header.tolist() == [20240326, 3, T, 50257, L, 2, C, Vp]
    config, tensors = read_llmc_checkpoint(path)
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == (L, 2, C, T)
    assert (config.vocab_size, config.valid_vocab_size) == (Vp, 50257)
    sd = model.state_dict()
    assert torch.equal(tensors["wte"], sd["transformer.wte.weight"])
    assert torch.equal(tensors["lnfb"], sd["transformer.ln_f.bias"])
    # per-layer tensors stacked on a leading L axis, nn.Linear's (out, in) layout kept
    assert tensors["qkvw"].shape == (L, 3 * C, C)
    assert torch.equal(tensors["qkvw"][2], sd["transformer.h.2.attn.c_attn.weight"])
    assert torch.equal(tensors["fcprojw"][1], sd["transformer.h.1.mlp.c_proj.weight"])
    assert [n for n, _ in llmc_tensors(model)][:4] == ["wte", "wpe", "ln1w", "ln1b"]


def test_reader_rejects_other_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(np.zeros(256, dtype="<i4").tobytes())
    with pytest.raises(GptspeedError, match="not an llm.c"):
        read_llmc_checkpoint(tmp_path / "x.bin")


def test_losses_agree_with_llmc_over_20_steps(tmp_path, llmc_binary, monkeypatch):
    ids = _tokens()
    n = LLMC_B * LLMC_T + 1
    train, val = ids[:n], ids[n:]
    # gptspeed train builds its model as torch.manual_seed(seed); GPT(config): the same weights here
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**LLMC_MODEL))
    prepare_llmc_dir(tmp_path / "llmc", model, train, val)
    result: dict = {}

    def run_llmc():
        try:
            result.update(run_train_gpt2(llmc_binary, tmp_path / "llmc", STEPS, threads=1, timeout_s=600))
        except GptspeedError as e:
            result["error"] = str(e)

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # gptspeed's process: one core each
    llmc = threading.Thread(target=run_llmc)
    llmc.start()  # in parallel with gptspeed
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train_000000.bin", train)  # one batch: every step reads it, as llm.c does
    write_shard(data / "val_000000.bin", val)
    proc = run_cli(
        "train",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
        "--preset",
        "pico",
        "--n-layer",
        str(LLMC_MODEL["n_layer"]),
        "--n-head",
        str(LLMC_MODEL["n_head"]),
        "--n-embd",
        str(LLMC_MODEL["n_embd"]),
        "--seq-len",
        str(LLMC_T),
        "--batch-size",
        str(LLMC_B),
        "--total-batch-tokens",
        str(LLMC_B * LLMC_T),
        "--max-steps",
        str(STEPS),
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-tokens",
        str(LLMC_B * LLMC_T),
        "--save-every",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-compile",
        "--seed",
        str(SEED),
        *LLMC_OPTIM_FLAGS,
    )
    llmc.join()
    assert proc.returncode == 0, proc.stderr
    assert "error" not in result, result.get("error")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = {r["step"]: r["train_loss"] for r in records if r.get("train_loss") is not None}
    # gptspeed's record of step s holds the loss computed before update s; llm.c's "step s-1" line
    assert sorted(ours) == list(range(1, STEPS + 1))
    ours_list = [ours[s] for s in range(1, STEPS + 1)]
    theirs = result["losses"]
    assert len(theirs) == STEPS
    diffs = np.abs(np.array(ours_list) - np.array(theirs))
    assert diffs.max() <= 1e-4, list(zip(ours_list, theirs))
    # the losses moved 100x the tolerance: the agreement is of a trajectory, not of a constant
    assert theirs[0] - theirs[-1] > 100 * 1e-4
    # the initial weights are the same: the val loss before any step agrees too (llm.c evaluates
    # its one-batch val shard 5 times and averages; gptspeed evaluates the same batch once)
    assert abs(records[0]["val_loss"] - result["val_losses"][0]) <= 1e-4


@pytest.mark.skipif(
    not (LLMC_DIR / "Makefile").exists() or not __import__("shutil").which("make"),
    reason="needs llm.c's clone in ../shared/peers and make",
)
@pytest.mark.parametrize("capability, arch", [("9.0", "90"), ("9.0 8.0", "80")])
def test_llmc_is_built_for_the_gpu_it_runs_on(tmp_path, monkeypatch, capability, arch):
    """The make line names GPU_COMPUTE_CAPABILITY from nvidia-smi (the lowest of the GPUs), and llm.c's
    Makefile then compiles for that architecture; its own detection, ``$(nvidia-smi ...)`` as a make
    variable, finds nothing: without the flag the nvcc line names no architecture."""
    import shutil

    fake_gpu_tools(tmp_path, monkeypatch, capability)
    src = tmp_path / "llm.c"
    shutil.copytree(LLMC_DIR, src)
    build = llmc_cuda_make(src, tmp_path / "work", search=[])
    assert build["command"][:7] == [
        "make",
        "-C",
        str(src),
        "train_gpt2cu",
        "NO_MULTI_GPU=1",
        "NO_USE_MPI=1",
        f"GPU_COMPUTE_CAPABILITY={arch}",
    ]
    assert build["compute_capability"] == arch and "nvidia-smi" in build["capability_source"]
    assert build["cudnn"] is False and "nvidia-cudnn-frontend" in build["cudnn_note"]
    nvcc = [line for line in dry_run(build).splitlines() if "fake" not in line and "train_gpt2.cu" in line]
    assert len(nvcc) == 1 and f"--generate-code arch=compute_{arch},code=[compute_{arch},sm_{arch}]" in nvcc[0]
    assert "ENABLE_CUDNN" not in nvcc[0] and f"-include {CUDA13_COMPAT}" in nvcc[0]
    bare = dry_run({"command": build["command"][:6]})  # what vs_peers_gpu.py ran before: no architecture at all
    assert "--generate-code" not in bare and "train_gpt2.cu" in bare


@pytest.mark.skipif(
    not (LLMC_DIR / "Makefile").exists() or not __import__("shutil").which("make"),
    reason="needs llm.c's clone in ../shared/peers and make",
)
def test_llmc_with_carried_cudnn_frontend_headers_builds_cudnn_attention(tmp_path, monkeypatch):
    """With cuDNN frontend's headers carried (the wheel in .carry/whl) and cuDNN's wheel installed,
    the line turns on USE_CUDNN=1 and names both include folders, the library folder (a bare
    libcudnn.so link beside the wheel's .so.9) with an rpath; llm.c's Makefile accepts it (its
    check for ./cudnn-frontend/include passes) and compiles cudnn_att.cpp into the binary."""
    import shutil

    from gptspeed.errors import GptspeedError

    fake_gpu_tools(tmp_path, monkeypatch)
    carry, site = fake_cudnn(tmp_path)
    src, work = tmp_path / "llm.c", tmp_path / "work"
    shutil.copytree(LLMC_DIR, src)
    build = llmc_cuda_make(src, work, carry=carry, search=[str(site)])
    headers, lib = work / "cudnn-frontend" / "include", site / "nvidia" / "cudnn" / "lib"
    assert (headers / "cudnn_frontend.h").exists()  # unpacked from the carried wheel
    nvrtc = site / "nvidia" / "cu13"
    assert build["cudnn"] is True and "nvidia_cudnn_frontend-1.32.0" in build["cudnn_note"]
    assert "NVRTC from the cu13 wheel" in build["cudnn_note"]
    assert build["command"][6:] == [
        "GPU_COMPUTE_CAPABILITY=90",
        "USE_CUDNN=1",
        f"CUDNN_FRONTEND_PATH={headers.resolve()}",
        f"NVCC_INCLUDES=-I{headers.resolve()} -I{site / 'nvidia' / 'cudnn' / 'include'} -I{work / 'nvrtc-include'} "
        f"-include {CUDA13_COMPAT}",
        f"NVCC_LDLIBS=-L{work / 'cudnn-lib'} -lnvrtc -Xlinker -rpath={lib} -Xlinker -rpath={nvrtc / 'lib'}",
    ]
    assert (work / "cudnn-lib" / "libcudnn.so").resolve() == (lib / "libcudnn.so.9").resolve()
    assert (work / "cudnn-lib" / "libnvrtc.so").resolve() == (nvrtc / "lib" / "libnvrtc.so.13").resolve()
    assert os.listdir(work / "nvrtc-include") == ["nvrtc.h"]  # nvrtc.h alone: the wheel's other headers stay out
    assert build["env"]["LD_LIBRARY_PATH"].split(os.pathsep)[:2] == [str(lib), str(nvrtc / "lib")]
    out = dry_run(build)
    assert "cuDNN found" in out
    compiled = [line for line in out.splitlines() if "cudnn_att.cpp" in line or "train_gpt2.cu" in line]
    assert len(compiled) == 2 and all(
        "-DENABLE_CUDNN" in line and "arch=compute_90" in line and f"-include {CUDA13_COMPAT}" in line
        for line in compiled
    )
    assert f"-I{headers.resolve()}" in compiled[0] and "build/cudnn_att.o" in compiled[1]
    assert "-lcudnn" in compiled[1] and f"-L{work / 'cudnn-lib'}" in compiled[1] and "-lnvrtc" in compiled[1]
    # asked for explicitly without the headers: one line saying what to carry
    with pytest.raises(GptspeedError, match="carry.sh nvidia-cudnn-frontend"):
        llmc_cuda_make(src, work / "other", cudnn="on", search=[])
    off = llmc_cuda_make(src, work, cudnn="off", carry=carry, search=[str(site)])
    assert off["cudnn"] is False and not any(c.startswith("USE_CUDNN") for c in off["command"])


@pytest.mark.skipif(
    not (LLMC_DIR / "Makefile").exists() or not __import__("shutil").which("make"),
    reason="needs llm.c's clone in ../shared/peers and make",
)
def test_the_cudnn_link_line_names_every_library_cudnn_att_needs(tmp_path, monkeypatch):
    """cudnn_att.o's undefined symbols, as ``llmc.py --check-link`` recorded them (a real CUDA 13 nvcc,
    cuDNN frontend 1.32.0): the frontend's NVRTC engine needs seven nvrtc* symbols beside cuDNN's.
    The link line llm.c's Makefile writes from the make line names a library for each of them --
    ``-lnvrtc`` with a folder holding ``libnvrtc.so`` -- where llm.c's own line (-lcudnn alone) leaves
    NVRTC out, so the H100's cuDNN build could not have linked."""
    import shutil

    from llmc import LINK_RECORD, libraries_needed, link_line, read_symbols, unlinked

    head = [line for line in LINK_RECORD.read_text().splitlines() if line.startswith("#")]
    assert any("--check-link" in line for line in head) and any("nvcc: Cuda compilation tools" in h for h in head)
    symbols = read_symbols(LINK_RECORD)
    needed = libraries_needed(symbols)
    assert set(needed) == {"cudnn", "nvrtc"} and len(needed["nvrtc"]) == 7 and "nvrtcGetCUBIN" in needed["nvrtc"]
    fake_gpu_tools(tmp_path, monkeypatch)
    carry, site = fake_cudnn(tmp_path)
    src, work = tmp_path / "llm.c", tmp_path / "work"
    shutil.copytree(LLMC_DIR, src)
    build = llmc_cuda_make(src, work, carry=carry, search=[str(site)])
    line = link_line(build)
    assert unlinked(symbols, line) == {}
    assert (work / "cudnn-lib" / "libnvrtc.so").exists() and f"-L{work / 'cudnn-lib'}" in line
    llmc_own = [c for c in build["command"] if not c.startswith("NVCC_LDLIBS=")]  # llm.c's Makefile alone
    assert unlinked(symbols, link_line({**build, "command": llmc_own})) == {"nvrtc": needed["nvrtc"]}


def test_cudnn_attention_needs_nvrtc_and_takes_it_from_nvccs_toolkit_first(tmp_path, monkeypatch):
    """Without NVRTC (no nvrtc.h and libnvrtc beside nvcc, on the system or in a wheel) the cuDNN
    build could not link: ``auto`` builds without cuDNN and says why, ``on`` is one line. With NVRTC in
    nvcc's own toolkit (its --dryrun INCLUDES and LIBRARIES) the line adds -lnvrtc and no folder to search,
    only an rpath (the toolkit's lib64 need not be on the loader's path)."""
    fake_gpu_tools(tmp_path, monkeypatch)
    carry, site = fake_cudnn(tmp_path)
    for f in (site / "nvidia" / "cu13").rglob("*"):
        if f.is_file():
            f.unlink()
    src, work = tmp_path / "llm.c", tmp_path / "work"
    src.mkdir()
    off = llmc_cuda_make(src, work, carry=carry, search=[str(site)])
    assert off["cudnn"] is False and off["cudnn_note"].startswith("libnvrtc.so not found")
    with pytest.raises(GptspeedError, match="libnvrtc.so not found"):
        llmc_cuda_make(src, work, cudnn="on", carry=carry, search=[str(site)])
    kit = tmp_path / "cuda" / "targets" / "x86_64-linux"
    for d, f in (("include", "nvrtc.h"), ("lib", "libnvrtc.so")):
        (kit / d).mkdir(parents=True, exist_ok=True)
        (kit / d / f).write_text("")
    (tmp_path / "bin" / "nvcc").write_text(
        f'#!/bin/sh\necho \'#$ INCLUDES="-I{kit}/include"\'\necho \'#$ LIBRARIES=  "-L{kit}/lib/stubs" "-L{kit}/lib"\'\n'
    )
    on = llmc_cuda_make(src, work, carry=carry, search=[str(site)])
    assert on["cudnn"] is True and f"NVRTC from {kit / 'lib'}" in on["cudnn_note"]
    ldlibs = next(c for c in on["command"] if c.startswith("NVCC_LDLIBS="))
    cudnn_lib = site / "nvidia" / "cudnn" / "lib"
    assert (
        ldlibs
        == f"NVCC_LDLIBS=-L{work / 'cudnn-lib'} -lnvrtc -Xlinker -rpath={cudnn_lib} -Xlinker -rpath={kit / 'lib'}"
    )
    assert "nvrtc-include" not in " ".join(on["command"])


def test_llmc_record_settings_reach_train_gpt2cu_after_the_rows_own_flags():
    """llm.c's GPT-2 124M record settings (-b 64 -t 1024 -d 524288 -r 0): the shape gives -b/-t/-d and
    the passed flags come last, so -r 0 (and a -b of llm.c's own) win; each flag is one that llm.c's
    main() parses (one dash, one or two letters, a value); those the row sets itself are refused."""
    cmd = llmc_cuda_train_command(
        "bin/train_gpt2cu",
        "d/train_*.bin",
        "d/val_*.bin",
        batch_size=64,
        seq_len=1024,
        tokens=524288,
        steps=13,
        extra=["-r", "0", "-ge", "2"],
    )
    assert cmd[:15] == [
        "bin/train_gpt2cu",
        "-e",
        "d12",
        "-i",
        "d/train_*.bin",
        "-j",
        "d/val_*.bin",
        "-b",
        "64",
        "-t",
        "1024",
        "-d",
        "524288",
        "-x",
        "13",
    ]
    assert cmd[-4:] == ["-r", "0", "-ge", "2"]
    main = (LLMC_DIR / "train_gpt2.cu").read_text() if (LLMC_DIR / "train_gpt2.cu").exists() else ""
    for flag in ("r", "b", "t", "d", "x", "e", "i", "j", "v", "m", "s", "n"):  # what main() parses
        assert not main or f"argv[i][1] == '{flag}'" in main, flag
    for bad, says in (
        (["-t", "2048"], "--seq-len"),
        (["-x", "5"], "--steps"),
        (["-i", "x"], "--data"),
        (["-r"], "pairs"),
        (["r", "0"], "not a train_gpt2cu flag"),
        (["-rrr", "0"], "not a"),
    ):
        with pytest.raises(GptspeedError, match=says):
            llmc_cuda_train_command("b", "t", "v", batch_size=16, seq_len=1024, tokens=65536, steps=3, extra=bad)


@pytest.mark.skipif(
    not (LLMC_DIR / "llmc" / "cuda_utils.cuh").exists(), reason="needs llm.c's clone in ../shared/peers"
)
def test_the_cuda13_header_lets_llmc_cuda_utils_compile_against_cuda_13(tmp_path):
    """llm.c's cuda_utils.cuh passes an int to cudaMemAdvise, which CUDA 13 takes as a cudaMemLocation
    (the H100 build of 2026-11-27 failed there). Compiled by a real nvcc of CUDA 13 or newer: it fails
    without CUDA13_COMPAT and compiles with it forced in, as llm.c's make line forces it."""
    import subprocess

    found = _real_nvcc_version()
    if found is None or found[1] < 13:
        pytest.skip(f"needs nvcc of CUDA 13 or newer (found: {found})")
    nvcc = found[0]
    unit = tmp_path / "unit.cu"
    unit.write_text(
        '#include <assert.h>\n#include "llmc/cuda_utils.cuh"\nint main() { void* p; return '
        "cudaMallocConditionallyManaged(&p, 16); }\n"
    )
    base = [nvcc, "-std=c++17", "-O0", "-I", str(LLMC_DIR), "-c", str(unit), "-o", str(tmp_path / "unit.o")]
    bare = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "cudaMemLocation" in bare.stdout + bare.stderr
    fixed = subprocess.run([*base, "-include", str(CUDA13_COMPAT)], capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert (tmp_path / "unit.o").stat().st_size > 0
