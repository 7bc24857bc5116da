"""llm.c beside gptspeed, for the benchmarks (the llm.c peer rows, the loss cross-check) and
tests/benchmarks/test_llmc.py: a gptspeed GPT written in llm.c's checkpoint format so llm.c's ``train_gpt2``
trains it, llm.c's CPU trainer built and run, its GPU trainer's make line and command line.

llm.c (github.com/karpathy/llm.c, ``train_gpt2.c``: ``gpt2_build_from_checkpoint`` and
``fill_in_parameter_sizes``) reads a file of

- a header of 256 little-endian int32: ``[0]`` magic 20240326, ``[1]`` version 3 (fp32 weights),
  ``[2]`` maxT (positions), ``[3]`` V (vocabulary the tokenizer emits, 50257), ``[4]`` L
  (layers), ``[5]`` NH (heads), ``[6]`` C (channels), ``[7]`` Vp (padded vocabulary, 50304); the
  rest 0;
- then every parameter as little-endian fp32, as 16 tensors in this order, each the layers'
  tensors stacked on a leading L axis: wte ``(Vp, C)``, wpe ``(maxT, C)``, ln1w ``(L, C)``, ln1b
  ``(L, C)``, qkvw ``(L, 3C, C)``, qkvb ``(L, 3C)``, attprojw ``(L, C, C)``, attprojb ``(L, C)``,
  ln2w ``(L, C)``, ln2b ``(L, C)``, fcw ``(L, 4C, C)``, fcb ``(L, 4C)``, fcprojw ``(L, C, 4C)``,
  fcprojb ``(L, C)``, lnfw ``(C,)``, lnfb ``(C,)``.

Matmul weights are ``(out, in)`` (llm.c's ``matmul_forward`` computes
``out[o] = bias[o] + sum_i inp[i] * weight[o * C + i]``), which is ``nn.Linear``'s layout, so
nothing is transposed. The LM head is the token embedding (tied), as in gptspeed's GPT. The data
files llm.c reads are gptspeed's shard format (:mod:`gptspeed.data.shards`) unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from harness import read_lines  # beside this file (benchmarks/)

from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_atomic
from gptspeed.model import GPT, GPTConfig

LLMC_MAGIC = 20240326
LLMC_VERSION = 3  # fp32 parameters
HEADER_INTS = 256

#: llm.c's 16 parameter tensors in file order: (llm.c name, gptspeed name inside block ``h.{i}``
#: or at the top level when it has no ``{i}``).
_ORDER = (
    ("wte", "transformer.wte.weight"),
    ("wpe", "transformer.wpe.weight"),
    ("ln1w", "transformer.h.{i}.ln_1.weight"),
    ("ln1b", "transformer.h.{i}.ln_1.bias"),
    ("qkvw", "transformer.h.{i}.attn.c_attn.weight"),
    ("qkvb", "transformer.h.{i}.attn.c_attn.bias"),
    ("attprojw", "transformer.h.{i}.attn.c_proj.weight"),
    ("attprojb", "transformer.h.{i}.attn.c_proj.bias"),
    ("ln2w", "transformer.h.{i}.ln_2.weight"),
    ("ln2b", "transformer.h.{i}.ln_2.bias"),
    ("fcw", "transformer.h.{i}.mlp.c_fc.weight"),
    ("fcb", "transformer.h.{i}.mlp.c_fc.bias"),
    ("fcprojw", "transformer.h.{i}.mlp.c_proj.weight"),
    ("fcprojb", "transformer.h.{i}.mlp.c_proj.bias"),
    ("lnfw", "transformer.ln_f.weight"),
    ("lnfb", "transformer.ln_f.bias"),
)


def llmc_header(config: GPTConfig) -> np.ndarray:
    """The 256-int32 header for a model of shape ``config`` (maxT = ``block_size``, V =
    ``valid_vocab_size``, Vp = ``vocab_size``)."""
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:8] = [
        LLMC_MAGIC,
        LLMC_VERSION,
        config.block_size,
        config.valid_vocab_size,
        config.n_layer,
        config.n_head,
        config.n_embd,
        config.vocab_size,
    ]
    return h


def llmc_tensors(model: GPT) -> list[tuple[str, torch.Tensor]]:
    """``[(llm.c name, fp32 CPU tensor)]`` in llm.c's file order, per-layer tensors stacked on a
    leading ``L`` axis (shapes in the module docstring)."""
    sd = model.state_dict()
    out = []
    for name, key in _ORDER:
        if "{i}" in key:
            t = torch.stack([sd[key.format(i=i)] for i in range(model.config.n_layer)])
        else:
            t = sd[key]
        out.append((name, t.detach().to("cpu", torch.float32).contiguous()))
    return out


def write_llmc_checkpoint(model: GPT, path: str | os.PathLike) -> Path:
    """Write ``model``'s weights as an llm.c ``train_gpt2`` checkpoint at ``path`` (atomically;
    ``(Vp*C + maxT*C + L*(12*C*C + 13*C) + 2*C) * 4 + 1024`` bytes: 497,759,232 for GPT-2 124M at
    maxT 1024). Returns the path.

    Raises GptspeedError if the model is not one llm.c can represent (vocabulary padding below
    the tokenizer's size).
    """
    c = model.config
    if c.vocab_size < c.valid_vocab_size:
        raise GptspeedError(f"llm.c needs vocab_size >= valid_vocab_size, got {c.vocab_size} < {c.valid_vocab_size}")
    header = llmc_header(c)
    tensors = llmc_tensors(model)

    def write(f) -> None:
        f.write(header.tobytes())
        for _, t in tensors:
            f.write(t.numpy().astype("<f4", copy=False).tobytes())

    write_atomic(path, write)
    return Path(path)


def read_llmc_checkpoint(path: str | os.PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read an llm.c fp32 checkpoint: ``(shape, {llm.c name: tensor})`` with the shapes of the
    module docstring. GptspeedError for a wrong magic/version or a file of the wrong size."""
    raw = Path(path).read_bytes()
    header = np.frombuffer(raw[: HEADER_INTS * 4], dtype="<i4")
    if len(header) < HEADER_INTS or header[0] != LLMC_MAGIC or header[1] != LLMC_VERSION:
        raise GptspeedError(f"{path} is not an llm.c fp32 checkpoint (magic {LLMC_MAGIC}, version {LLMC_VERSION})")
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    config = GPTConfig(block_size=maxT, vocab_size=Vp, valid_vocab_size=V, n_layer=L, n_head=NH, n_embd=C)
    shapes = {
        "wte": (Vp, C),
        "wpe": (maxT, C),
        "ln1w": (L, C),
        "ln1b": (L, C),
        "qkvw": (L, 3 * C, C),
        "qkvb": (L, 3 * C),
        "attprojw": (L, C, C),
        "attprojb": (L, C),
        "ln2w": (L, C),
        "ln2b": (L, C),
        "fcw": (L, 4 * C, C),
        "fcb": (L, 4 * C),
        "fcprojw": (L, C, 4 * C),
        "fcprojb": (L, C),
        "lnfw": (C,),
        "lnfb": (C,),
    }
    values = np.frombuffer(raw, dtype="<f4", offset=HEADER_INTS * 4)
    need = sum(int(np.prod(s)) for s in shapes.values())
    if values.size != need:
        raise GptspeedError(f"{path}: {values.size} parameters after the header, the header's shape needs {need}")
    out, pos = {}, 0
    for name, _ in _ORDER:
        n = int(np.prod(shapes[name]))
        out[name] = torch.from_numpy(values[pos : pos + n].copy()).view(shapes[name])
        pos += n
    return config, out


# ------------------------------------------------------------------------- running llm.c's trainer
#: where ``train_gpt2.c``'s ``main()`` looks for its files, relative to its working directory
LLMC_CHECKPOINT = "gpt2_124M.bin"
LLMC_TRAIN = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
LLMC_VAL = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin"
LLMC_B, LLMC_T = 4, 64  # hardcoded in train_gpt2.c's main()
#: the flags llm.c's Makefile builds ``train_gpt2`` with on Linux when OpenMP is found
#: (``make train_gpt2 CC=gcc`` prints: -Ofast ... -march=native -fopenmp -DOMP ... -lm -lgomp)
MAKEFILE_CFLAGS = ("-Ofast", "-march=native", "-fopenmp", "-DOMP")


def find_c_compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on PATH; None if there is none."""
    import shutil

    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_train_gpt2(
    llmc_dir: str | os.PathLike, out_dir: str | os.PathLike, cflags: tuple[str, ...] = ("-O2",), cc: str | None = None
) -> Path:
    """Compile llm.c's CPU trainer ``llmc_dir/train_gpt2.c`` (its own source, unmodified) into
    ``out_dir/train_gpt2`` and return that path. ``cflags``: e.g. :data:`MAKEFILE_CFLAGS` for the
    build llm.c's Makefile makes (OpenMP, ``-Ofast``), or the default ``-O2`` (IEEE float, one
    thread). GptspeedError if there is no C compiler or the compile fails."""
    import subprocess

    cc = cc or find_c_compiler()
    if cc is None:
        raise GptspeedError("no C compiler found (set CC, or install gcc/clang) to build llm.c's train_gpt2")
    src = Path(llmc_dir) / "train_gpt2.c"
    if not src.is_file():
        raise GptspeedError(f"{src} not found: point at a clone of github.com/karpathy/llm.c")
    out = Path(out_dir) / "train_gpt2"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    cmd = [cc, *cflags, str(src), "-lm", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GptspeedError(f"compiling llm.c failed ({' '.join(cmd)}): {proc.stderr.strip()[:500]}")
    return out


def prepare_llmc_dir(work_dir: str | os.PathLike, model: GPT, train_tokens: np.ndarray, val_tokens: np.ndarray) -> Path:
    """Lay out ``work_dir`` as ``train_gpt2`` expects to find it: :data:`LLMC_CHECKPOINT` from
    ``model``'s weights, and the tinyshakespeare train/val shards (gptspeed's shard format) holding
    ``train_tokens`` / ``val_tokens`` (1-D uint16-range ids, each at least ``B*T+1 = 257``).

    llm.c shuffles its train batches (a seeded permutation of the shard's ``B*T`` windows); a
    train shard of exactly ``B*T+1`` tokens has one window, so every step reads the same batch --
    the one gptspeed's loader reads from the same shard -- whatever the shuffle."""
    from gptspeed.data.shards import write_shard

    work = Path(work_dir)
    (work / LLMC_TRAIN).parent.mkdir(parents=True, exist_ok=True)
    write_llmc_checkpoint(model, work / LLMC_CHECKPOINT)
    write_shard(work / LLMC_TRAIN, np.asarray(train_tokens))
    write_shard(work / LLMC_VAL, np.asarray(val_tokens))
    return work


def run_train_gpt2(
    binary: str | os.PathLike,
    work_dir: str | os.PathLike,
    steps: int,
    *,
    threads: int | None = None,
    timeout_s: float = 3600.0,
    env: dict | None = None,
) -> dict:
    """Run llm.c's ``train_gpt2`` in ``work_dir`` (see :func:`prepare_llmc_dir`) until it has
    printed ``steps`` training steps (its ``main()`` runs 41; it is then killed: the remaining steps,
    evaluations and sampling are not needed), with ``OMP_NUM_THREADS=threads`` if given.

    Returns ``{"losses": [step 0 ...] (train loss before each update, nats), "step_ms": [...]
    (llm.c's own clock around forward+backward+update), "val_losses": [...], "peak_rss_bytes",
    "wall_s", "stdout"}``. GptspeedError if it exits or times out before printing ``steps`` steps.
    """
    import pty
    import re
    import subprocess
    import time

    env = {**os.environ, **(env or {})}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    step_re = re.compile(r"^step (\d+): train loss (\S+) \(took ([\d.]+) ms\)")
    losses, step_ms, val_losses = [], [], []

    def on_line(line: str) -> bool:
        if line.startswith("val loss "):
            val_losses.append(float(line.split()[2]))
        m = step_re.match(line)
        if m:
            losses.append(float(m.group(2)))
            step_ms.append(float(m.group(3)))
        return len(losses) >= steps

    # a pseudo-terminal, so that C stdio flushes each line (to a pipe it would buffer 4 KB, and the
    # step lines of a slow model would arrive only when the process ends)
    master, slave = pty.openpty()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(binary)], cwd=work_dir, env=env, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, close_fds=True
    )
    os.close(slave)
    try:
        lines = read_lines(master, on_line, t0 + timeout_s)
    finally:
        try:
            proc.kill()  # not polled before: the exit status and rusage are wait4's to collect
        except ProcessLookupError:
            pass
        _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = status
        os.close(master)
    if len(losses) < steps:
        raise GptspeedError(
            f"llm.c's train_gpt2 stopped after {len(losses)} of {steps} steps: " + " | ".join(lines[-5:]).strip()
        )
    return {
        "losses": losses,
        "step_ms": step_ms,
        "val_losses": val_losses,
        "peak_rss_bytes": rusage.ru_maxrss * 1024,
        "wall_s": time.perf_counter() - t0,
        "stdout": "\n".join(lines),
    }


# --------------------------------------------------------------------- running llm.c's GPU trainer
#: train_gpt2cu's flags an llm.c row sets itself, from the row's shape, its steps and its data (llm.c's
#: ``main()`` reads argv left to right, a later value winning: one of these passed through would silently
#: change what the row reads or the tokens per step its tokens/s are computed with), and where to set them
LLMC_ROW_FLAGS = {
    "-i": "--data",
    "-j": "--data",
    "-e": "(a fresh GPT-2 124M, d12)",
    "-t": "--seq-len",
    "-d": "--batch-size x --accum",
    "-x": "--warmup + --steps",
}


def check_llmc_flags(flags: list[str] | tuple[str, ...]) -> list[str]:
    """``flags`` as ``train_gpt2cu`` parses them (``main()`` in llm.c's ``train_gpt2.cu``: pairs of a flag
    of one dash and one or two letters, then its value, e.g. ``-r 0 -b 64 -ge 2``), returned as a list;
    GptspeedError (one line) for a malformed list or a flag the row sets itself (:data:`LLMC_ROW_FLAGS`).
    ``-b`` passes: a micro-batch of llm.c's own at the row's tokens per step (``-d``), which llm.c needs
    to be a multiple of ``B*T``."""
    flags = list(flags)
    if len(flags) % 2:
        raise GptspeedError(f"llm.c flags come in pairs (-flag value), got {' '.join(flags)!r}")
    for flag in flags[::2]:
        if not (flag.startswith("-") and len(flag) in (2, 3) and flag[1:].isalpha()):
            raise GptspeedError(f"{flag!r} is not a train_gpt2cu flag (one dash, one or two letters: -r, -ge, ...)")
        if flag in LLMC_ROW_FLAGS:
            raise GptspeedError(f"train_gpt2cu's {flag} is set by the llm.c row itself: use {LLMC_ROW_FLAGS[flag]}")
    return flags


def llmc_cuda_train_command(
    binary: str | os.PathLike,
    train: str,
    val: str,
    *,
    batch_size: int,
    seq_len: int,
    tokens: int,
    steps: int,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The ``train_gpt2cu`` command line of an llm.c row (flags of llm.c's ``train_gpt2.cu`` ``main()``):
    a fresh GPT-2 124M (``-e d12``) on the shards ``train``/``val`` (glob patterns), micro-batch
    ``batch_size`` (``-b``), ``seq_len`` (``-t``), ``tokens`` per optimizer step (``-d``), ``steps``
    steps (``-x``); validation once on one batch (``-v 1000000 -m 1``: llm.c evaluates at step 0), no
    sampling or checkpoints (``-s 0 -n 0``); then ``extra`` (:func:`check_llmc_flags`), last, so that
    its ``-b`` or ``-r`` wins over the defaults: e.g. ``-r 0`` (no GELU recompute) and ``-b 64``, the
    settings of llm.c's GPT-2 124M record (``-b 64 -t 1024 -d 524288 -r 0``: 140 ms a step on 8xH100)."""
    return [
        str(binary),
        "-e",
        "d12",
        "-i",
        train,
        "-j",
        val,
        "-b",
        str(batch_size),
        "-t",
        str(seq_len),
        "-d",
        str(tokens),
        "-x",
        str(steps),
        "-v",
        "1000000",
        "-m",
        "1",
        "-s",
        "0",
        "-n",
        "0",
        *check_llmc_flags(extra),
    ]


# ------------------------------------------------------------------- building llm.c's GPU trainer
#: what ``make -C llm.c train_gpt2cu`` is always given here: one GPU, no MPI
LLMC_CUDA_BASE = ("train_gpt2cu", "NO_MULTI_GPU=1", "NO_USE_MPI=1")
CUDNN_CHOICES = ("auto", "on", "off")
#: where a system-wide cuDNN puts its header and library (no -I / -L needed for these)
_SYSTEM_INCLUDES = ("/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/local/cuda/include")
_SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64")
#: forced into every llm.c build (nvcc -include): CUDA 13's cudaMemAdvise takes a cudaMemLocation
#: where llm.c passes an int (a no-op before CUDA 13; the header says why)
CUDA13_COMPAT = Path(__file__).resolve().with_name("llmc_cuda13_compat.h")


def gpu_compute_capability(smi: str = "nvidia-smi") -> tuple[str | None, str]:
    """The compute capability to build llm.c for, as its Makefile writes it (``"90"`` on an H100):
    ``(value or None, where it came from)``. From ``nvidia-smi --query-gpu=compute_cap
    --format=csv,noheader`` -- the lowest over the GPUs, which is what llm.c's Makefile means to do
    (its ``$(nvidia-smi ...)`` is a make variable reference, not ``$(shell ...)``, so on its own it
    finds nothing) -- else PyTorch's ``torch.cuda.get_device_capability()``, else None."""
    import shutil
    import subprocess

    exe = shutil.which(smi)
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            caps = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            values = sorted(int(c.replace(".", "")) for c in caps if c.replace(".", "").isdigit())
            if out.returncode == 0 and values:
                return str(values[0]), f"{smi} --query-gpu=compute_cap ({', '.join(caps)})"
        except (OSError, subprocess.SubprocessError):
            pass
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"{major}{minor}", "torch.cuda.get_device_capability()"
    return None, "no nvidia-smi answered and PyTorch sees no CUDA GPU"


def _search_paths(search: list[str] | None) -> list[Path]:
    import sys

    return [Path(p) for p in (search if search is not None else sys.path) if p and Path(p).is_dir()]


def find_cudnn_frontend(
    work: str | os.PathLike, carry: str | os.PathLike | None = None, search: list[str] | None = None
) -> tuple[Path | None, str]:
    """The folder holding cuDNN frontend's headers (``cudnn_frontend.h``; a header-only C++
    library llm.c's ``USE_CUDNN=1`` build needs), and where it was found; ``(None, why)`` if
    nowhere. Looked for in ``$CUDNN_FRONTEND_PATH``; ``<carry>/cudnn-frontend/include``; the
    carried wheel ``<carry>/whl/nvidia_cudnn_frontend-*.whl`` (its ``include/`` unpacked into
    ``<work>/cudnn-frontend/include``; ``bash ../shared/device/carry.sh nvidia-cudnn-frontend==1.32.0``
    packs it); ``<p>/include`` for each ``p`` of ``search`` (default ``sys.path``: ``.carry/setup.sh``
    installs the carried wheels into ``/tmp/site``, which is on it); ``~/cudnn-frontend/include``
    (llm.c's README)."""
    import zipfile

    def has(d: Path) -> bool:
        return (d / "cudnn_frontend.h").is_file()

    env = os.environ.get("CUDNN_FRONTEND_PATH")
    if env and has(Path(env)):
        return Path(env), "$CUDNN_FRONTEND_PATH"
    if carry is not None:
        carry = Path(carry)
        if has(carry / "cudnn-frontend" / "include"):
            return carry / "cudnn-frontend" / "include", str(carry / "cudnn-frontend" / "include")
        wheels = sorted((carry / "whl").glob("nvidia_cudnn_frontend-*.whl"))
        if wheels:
            dest = Path(work) / "cudnn-frontend"
            with zipfile.ZipFile(wheels[-1]) as z:
                names = [n for n in z.namelist() if n.startswith("include/") and not n.endswith("/")]
                z.extractall(dest, names)
            if has(dest / "include"):
                return dest / "include", f"the carried wheel {wheels[-1].name}"
    for p in _search_paths(search):
        if has(p / "include"):
            return p / "include", f"{p / 'include'} (an installed nvidia-cudnn-frontend wheel)"
    home = Path.home() / "cudnn-frontend" / "include"
    if has(home):
        return home, str(home)
    return None, (
        "cuDNN frontend's headers not found: carry them with `bash ../shared/device/carry.sh "
        "nvidia-cudnn-frontend==1.32.0` (or set CUDNN_FRONTEND_PATH)"
    )


def find_cudnn(search: list[str] | None = None) -> tuple[Path | None, Path | None, str]:
    """cuDNN itself for llm.c's ``USE_CUDNN=1`` build: ``(folder of cudnn.h, folder of libcudnn.so*,
    where)``, or ``(None, None, why)``. Looked for in the ``nvidia-cudnn-cu1x`` wheel PyTorch
    depends on (``nvidia/<name>/include/cudnn.h`` and ``nvidia/<name>/lib/libcudnn.so*`` under each
    ``p`` of ``search``, default ``sys.path``), then the system's folders."""
    for p in _search_paths(search):
        for inc in sorted((p / "nvidia").glob("*/include/cudnn.h")):
            libs = sorted(inc.parent.parent.glob("lib/libcudnn.so*"))
            if libs:
                return inc.parent, libs[0].parent, f"the {inc.parent.parent.name} wheel in {p}"
    inc = next((Path(d) for d in _SYSTEM_INCLUDES if (Path(d) / "cudnn.h").is_file()), None)
    lib = next((Path(d) for d in _SYSTEM_LIBS if list(Path(d).glob("libcudnn.so*"))), None)
    if inc and lib:
        return inc, lib, "the system's cuDNN"
    return None, None, "cuDNN (cudnn.h and libcudnn.so) not found"


def nvcc_dirs(nvcc: str = "nvcc") -> tuple[list[Path], list[Path]]:
    """The include and library folders ``nvcc`` passes by itself (its ``INCLUDES`` and ``LIBRARIES``,
    read off ``nvcc --dryrun``: the toolkit's ``targets/<arch>/include``, ``lib`` and ``lib/stubs``);
    ``([], [])`` when there is no nvcc or it prints none. A header or library there needs no flag."""
    import re
    import shutil
    import subprocess

    exe = shutil.which(nvcc)
    if not exe:
        return [], []
    try:
        out = subprocess.run([exe, "--dryrun", "-o", "x", "x.o"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return [], []
    text = out.stdout + out.stderr
    found = {k: [] for k in ("INCLUDES", "LIBRARIES")}
    for key, flag in (("INCLUDES", "-I"), ("LIBRARIES", "-L")):
        for line in re.findall(rf"^#\$ {key}=(.*)$", text, re.M):
            found[key] += [Path(m).resolve() for m in re.findall(rf'"{flag}([^"]+)"', line)]
    return found["INCLUDES"], found["LIBRARIES"]


def find_cuda_library(
    name: str, header: str | None, search: list[str] | None = None, nvcc: str = "nvcc"
) -> tuple[Path | None, Path | None, str]:
    """A CUDA library the link needs (``lib<name>.so*``) and its ``header``: ``(folder of the header
    or None, folder of the library or None, where)``. Looked for in nvcc's own folders
    (:func:`nvcc_dirs`), then the system's, then the CUDA wheels under each ``p`` of ``search``
    (default ``sys.path``): ``nvidia/<name>/lib`` with ``nvidia/<name>/include`` beside it (CUDA 13's
    wheels share ``nvidia/cu13``; ``nvidia-cuda-nvrtc`` ships ``libnvrtc.so.13`` and ``nvrtc.h``)."""
    incs, libs = nvcc_dirs(nvcc)
    inc = next((i for i in (*incs, *map(Path, _SYSTEM_INCLUDES)) if header and (i / header).is_file()), None)
    for d in (*libs, *map(Path, _SYSTEM_LIBS)):
        if d.is_dir() and list(d.glob(f"lib{name}.so*")) and (inc is not None or not header):
            return inc, d, f"{d} (nvcc's toolkit or the system)"
    for p in _search_paths(search):
        for lib in sorted((p / "nvidia").glob(f"*/lib/lib{name}.so*")):
            inc = lib.parent.parent / "include"
            return (
                (inc if header and (inc / header).is_file() else None),
                lib.parent,
                f"the {lib.parent.parent.name} wheel in {p}",
            )
    return None, None, f"lib{name}.so not found (nvcc's toolkit, the system, the nvidia/*/lib wheels)"


def _bare_name(lib: Path, name: str, work: Path) -> Path:
    """The folder to give ``-L`` for ``-l<name>``: ``lib`` when it holds ``lib<name>.so``, else
    ``<work>/cudnn-lib`` with that name linked to the versioned file (the wheels ship ``.so.9`` /
    ``.so.13`` only, and the linker looks for the bare name)."""
    if (lib / f"lib{name}.so").exists():
        return lib
    versioned = sorted(lib.glob(f"lib{name}.so.*"))[0]
    out = work / "cudnn-lib"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"lib{name}.so").unlink(missing_ok=True)
    (out / f"lib{name}.so").symlink_to(versioned)
    return out


def _make_var(flags: list[str], name: str) -> str | None:
    for f in flags:
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return None


#: why train_gpt2cu's link line names ``-lnvrtc`` (llm.c's Makefile adds only ``-lcudnn`` for cuDNN)
LINK_REASON = (
    "cuDNN frontend 1.32's OSS RMSNorm-SiLU engine (cudnn_frontend/experimental/nvrtc_shim.h, reached "
    "from plans.h) calls NVRTC directly unless NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING is defined, so "
    "cudnn_att.o needs nvrtcCreateProgram and six more at link time (benchmarks/llmc_cudnn_att.nm-u.txt)"
)


def _cudnn_make_vars(
    src: Path, work: Path, headers: Path, cudnn: tuple[Path, Path], nvrtc: tuple[Path, Path], nvcc: str = "nvcc"
) -> tuple[list[str], dict[str, str]]:
    """``USE_CUDNN=1``'s make variables and the run-time environment, for the frontend's ``headers``,
    cuDNN's ``(include, lib)`` folders and NVRTC's. llm.c's Makefile accepts the frontend only at
    ``$HOME/cudnn-frontend/include`` or ``./cudnn-frontend/include``: ``src/cudnn-frontend/include`` is
    linked to it. ``NVCC_INCLUDES`` names the frontend, cudnn.h's folder and -- when nvcc does not see
    it itself -- a folder holding only a link to ``nvrtc.h`` (the wheel's ``nvidia/cu13/include`` holds
    every CUDA wheel's headers, which must not shadow nvcc's own); ``NVCC_LDLIBS`` names ``-lnvrtc``
    (:data:`LINK_REASON`), the library folders nvcc does not search itself (a bare-name link made in
    ``work/cudnn-lib`` where a wheel ships only ``.so.9`` / ``.so.13``: :func:`_bare_name`) and an
    rpath to each library's folder (nvcc's toolkit's too); ``LD_LIBRARY_PATH`` the same folders."""
    (inc, lib), (n_inc, n_lib) = cudnn, nvrtc
    link = src / "cudnn-frontend"
    link.mkdir(exist_ok=True)
    if (link / "include").is_symlink() or (link / "include").exists():
        (link / "include").unlink()
    (link / "include").symlink_to(headers.resolve(), target_is_directory=True)
    own_incs, own_libs = nvcc_dirs(nvcc)
    includes = [f"-I{headers.resolve()}"] + ([] if str(inc) in _SYSTEM_INCLUDES else [f"-I{inc}"])
    if n_inc.resolve() not in own_incs and str(n_inc) not in _SYSTEM_INCLUDES:
        only = work / "nvrtc-include"
        only.mkdir(parents=True, exist_ok=True)
        (only / "nvrtc.h").unlink(missing_ok=True)
        (only / "nvrtc.h").symlink_to(n_inc / "nvrtc.h")
        includes.append(f"-I{only}")
    dirs, rpaths = [], []
    for name, d in (("cudnn", lib), ("nvrtc", n_lib)):
        if str(d) in _SYSTEM_LIBS:
            continue
        rpaths += [d] if d not in rpaths else []  # nvcc's toolkit too: its lib64 need not be on the loader's path
        if d.resolve() in own_libs:
            continue
        bare = _bare_name(d, name, work)
        dirs += [bare] if bare not in dirs else []
    ldlibs = [*(f"-L{d}" for d in dirs), "-lnvrtc", *(f"-Xlinker -rpath={r}" for r in rpaths)]
    make_vars = [
        "USE_CUDNN=1",
        f"CUDNN_FRONTEND_PATH={headers.resolve()}",
        "NVCC_INCLUDES=" + " ".join([*includes, "-include", str(CUDA13_COMPAT)]),
        "NVCC_LDLIBS=" + " ".join(ldlibs),
    ]
    env = {}
    if rpaths:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(map(str, filter(None, [*rpaths, os.environ.get("LD_LIBRARY_PATH")])))
    return make_vars, env


def llmc_cuda_make(
    src: str | os.PathLike,
    work: str | os.PathLike,
    extra: list[str] | tuple[str, ...] = (),
    cudnn: str = "auto",
    carry: str | os.PathLike | None = None,
    search: list[str] | None = None,
    smi: str = "nvidia-smi",
    nvcc: str = "nvcc",
) -> dict:
    """The ``make`` command that builds llm.c's ``train_gpt2cu`` in ``src`` (a scratch copy of the
    clone) for the GPU it will run on, and what it rests on. Returns ``{"command": [...],
    "line": shell line, "env": variables the binary needs at run time, "compute_capability",
    "capability_source", "cudnn": bool, "cudnn_note"}``.

    - ``GPU_COMPUTE_CAPABILITY`` from the device (:func:`gpu_compute_capability`; ``90`` on an
      H100) unless ``extra`` sets it: llm.c's Makefile then adds ``--generate-code
      arch=compute_90,code=[compute_90,sm_90]``. Without it nvcc builds for its default architecture
      (llm.c's slow ``__CUDA_ARCH__ < 800`` paths and a PTX JIT at start, or errors).
    - cuDNN attention (``USE_CUDNN=1``) with ``cudnn="on"``, or ``"auto"`` when cuDNN frontend's
      headers (:func:`find_cudnn_frontend`), cuDNN (:func:`find_cudnn`) and NVRTC (``nvrtc.h`` and
      ``libnvrtc.so*``: :func:`find_cuda_library`) are all found; ``"off"`` or ``USE_CUDNN=`` in
      ``extra``: as given. The make variables: :func:`_cudnn_make_vars` (``-lnvrtc`` among them:
      :data:`LINK_REASON`).
    - :data:`CUDA13_COMPAT` forced in with ``nvcc -include`` (in ``NVCC_INCLUDES``): llm.c's
      ``cuda_utils.cuh`` does not compile against CUDA 13's ``cudaMemAdvise`` (an H100 with CUDA
      13.0, 2026-11-27: "no suitable constructor exists to convert from int to cudaMemLocation");
      the header adds the old form, forwarding to the new, and does nothing before CUDA 13.

    GptspeedError for ``cudnn="on"`` when cuDNN, its frontend or NVRTC is missing, or an unknown ``cudnn``."""
    if cudnn not in CUDNN_CHOICES:
        raise GptspeedError(f"llm.c cuDNN must be one of {', '.join(CUDNN_CHOICES)}, got {cudnn!r}")
    src, work, extra = Path(src), Path(work), list(extra)
    cmd = ["make", "-C", str(src), *LLMC_CUDA_BASE]
    given = _make_var(extra, "GPU_COMPUTE_CAPABILITY")
    if given is not None:
        cap, cap_source = given or None, "given (--llmc-make)"
    else:
        cap, cap_source = gpu_compute_capability(smi)
        if cap:
            cmd.append(f"GPU_COMPUTE_CAPABILITY={cap}")
    env: dict[str, str] = {}
    use = _make_var(extra, "USE_CUDNN")
    if use is not None:  # the caller's own cuDNN setup (e.g. headers in ~/cudnn-frontend/include)
        on, note = use == "1", "USE_CUDNN as given (--llmc-make)"
    elif cudnn == "off":
        on, note = False, "off (asked)"
    else:
        headers, where_h = find_cudnn_frontend(work, carry, search)
        inc, lib, where_c = find_cudnn(search)
        n_inc, n_lib, where_n = find_cuda_library("nvrtc", "nvrtc.h", search, nvcc)
        if n_lib is not None and n_inc is None:
            where_n = f"nvrtc.h not found beside {where_n}"
        on = headers is not None and inc is not None and n_inc is not None
        if not on:
            note = "; ".join(w for w, ok in ((where_h, headers), (where_c, inc), (where_n, n_inc)) if ok is None)
            if cudnn == "on":
                raise GptspeedError(f"llm.c with cuDNN attention: {note}")
        else:
            note = f"frontend headers from {where_h}; cuDNN from {where_c}; NVRTC from {where_n}"
            make_vars, env = _cudnn_make_vars(src, work, headers, (inc, lib), (n_inc, n_lib), nvcc)
            cmd += make_vars
    if not any(c.startswith("NVCC_INCLUDES=") for c in cmd + extra):  # with cuDNN: in its NVCC_INCLUDES above
        cmd.append(f"NVCC_INCLUDES=-include {CUDA13_COMPAT}")
    cmd += extra
    import shlex

    if not cap:
        cap_source += ": nvcc builds for its default architecture"
    return {
        "command": cmd,
        "line": shlex.join(cmd),
        "env": env,
        "compute_capability": cap,
        "capability_source": cap_source,
        "cudnn": on,
        "cudnn_note": note,
    }


# ------------------------------------------------------------------- checking llm.c's link line
#: the prefix of an undefined symbol -> the library (``-l<name>``) that defines it, for the libraries
#: train_gpt2cu links by name (cudart comes with nvcc; libc, libstdc++ and libm with the host compiler)
SYMBOL_LIBS = (
    ("nvrtc", "nvrtc"),
    ("cudnn", "cudnn"),
    ("cublasLt", "cublasLt"),
    ("cublas", "cublas"),
    ("nvml", "nvidia-ml"),
)
#: ``nm -u`` of cudnn_att.o as :func:`check_link` recorded it (``--check-link --record``), with how
LINK_RECORD = Path(__file__).resolve().with_name("llmc_cudnn_att.nm-u.txt")


def read_symbols(path: str | os.PathLike = LINK_RECORD) -> list[str]:
    """The symbols of a record written by :func:`check_link`: every line but the ``#`` comments."""
    lines = Path(path).read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.startswith("#")]


def libraries_needed(symbols: list[str]) -> dict[str, list[str]]:
    """``{library: [its symbols]}`` for the undefined ``symbols`` a named library must define
    (:data:`SYMBOL_LIBS`; the first matching prefix wins, so ``cublasLt...`` is cublasLt's)."""
    out: dict[str, list[str]] = {}
    for sym in symbols:
        lib = next((lib for prefix, lib in SYMBOL_LIBS if sym.startswith(prefix)), None)
        if lib is not None:
            out.setdefault(lib, []).append(sym)
    return out


def unlinked(symbols: list[str], line: str) -> dict[str, list[str]]:
    """The libraries :func:`libraries_needed` names for ``symbols`` that the link ``line`` (a shell
    command line) does not name with ``-l``, with the symbols each would have defined."""
    import re
    import shlex

    named = {m.group(1) for tok in shlex.split(line) for m in [re.match(r"^-l(\S+)$", tok)] if m}
    return {lib: syms for lib, syms in libraries_needed(symbols).items() if lib not in named}


def link_line(build: dict) -> str:
    """The nvcc command that links ``train_gpt2cu`` for ``build`` (:func:`llmc_cuda_make`), as llm.c's
    Makefile writes it (``make -n``: nothing is compiled). GptspeedError when make prints none."""
    import subprocess

    cmd = build["command"]
    out = subprocess.run([cmd[0], "-n", *cmd[1:]], capture_output=True, text=True, timeout=120).stdout
    lines = [ln for ln in out.splitlines() if "train_gpt2.cu" in ln and "train_gpt2cu" in ln]
    if not lines:
        raise GptspeedError(f"make -n printed no train_gpt2cu link line for {build['line']}")
    return lines[-1]


def _exported(line: str, libs: list[str], extra_dirs: list[Path]) -> dict[str, set[str] | None]:
    """``{library: its dynamic symbols (nm -D --defined-only)}`` for each of ``libs`` found in the
    line's ``-L`` folders or ``extra_dirs``; None where no ``lib<name>.so`` is there to read."""
    import shlex
    import subprocess

    dirs = [Path(t[2:]) for t in shlex.split(line) if t.startswith("-L")] + extra_dirs
    out: dict[str, set[str] | None] = {}
    for lib in libs:
        path = next((d / f"lib{lib}.so" for d in dirs if (d / f"lib{lib}.so").exists()), None)
        if path is None:
            out[lib] = None
            continue
        nm = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, timeout=120)
        out[lib] = {ln.split()[-1].split("@")[0] for ln in nm.stdout.splitlines() if ln.strip()}
    return out


def check_link(
    llmc_dir: str | os.PathLike,
    work: str | os.PathLike,
    carry: str | os.PathLike | None,
    search: list[str] | None,
    record: str | os.PathLike | None = None,
) -> dict:
    """Compile llm.c's ``llmc/cudnn_att.cpp`` as its Makefile does for ``USE_CUDNN=1`` (the make line of
    :func:`llmc_cuda_make` for compute capability 90, target ``build/cudnn_att.o``, in a copy of
    ``llmc_dir`` under ``work``; ~90 CPU-seconds), list its undefined symbols (``nm -u``) and check
    that every library they need (:func:`libraries_needed`) is named on train_gpt2cu's link line
    (:func:`link_line`) and, where that library is at hand, exports them. With ``record``, write the
    symbols there, after ``#`` lines saying how they were produced. Returns ``{"symbols", "line",
    "unlinked", "unexported", "compile_s", "compile_cpu_s", "build"}``. GptspeedError if the compile
    fails or cuDNN, its frontend or NVRTC is not found."""
    import datetime
    import platform
    import resource
    import shutil
    import subprocess
    import time

    src, work = Path(work) / "llm.c", Path(work)
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(llmc_dir, src)
    build = llmc_cuda_make(src, work, ["GPU_COMPUTE_CAPABILITY=90"], cudnn="on", carry=carry, search=search)
    obj = [*build["command"][:3], "build/cudnn_att.o", *build["command"][4:]]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(obj, capture_output=True, text=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise GptspeedError(f"compiling cudnn_att.cpp failed: {(done.stdout + done.stderr).strip()[-800:]}")
    nm = subprocess.run(["nm", "-u", str(src / "build" / "cudnn_att.o")], capture_output=True, text=True, check=True)
    symbols = sorted({ln.split()[-1] for ln in nm.stdout.splitlines() if ln.strip()})
    line = link_line(build)
    needed = libraries_needed(symbols)
    exported = _exported(line, list(needed), nvcc_dirs()[1])
    unexported = {
        lib: [s for s in syms if s not in exported[lib]] for lib, syms in needed.items() if exported[lib] is not None
    }
    if record is not None:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        head = [
            "cudnn_att.o's undefined symbols (nm -u), one a line: llm.c's llmc/cudnn_att.cpp compiled as its",
            "Makefile compiles it for USE_CUDNN=1, by `python benchmarks/llmc.py --check-link` (llmc.check_link)",
            f"nvcc: {next((v for v in nvcc if 'release' in v), '?')}; {build['cudnn_note']}",
            f"compiled in {wall:.0f} s wall, {cpu:.0f} CPU-s ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), {datetime.date.today()}",
            "compile: " + " ".join(obj),
            "link line (make -n): " + line,
        ]
        Path(record).write_text("".join(f"# {h}\n" for h in head) + "".join(f"{s}\n" for s in symbols))
    return {
        "symbols": symbols,
        "line": line,
        "unlinked": unlinked(symbols, line),
        "unexported": {k: v for k, v in unexported.items() if v},
        "compile_s": wall,
        "compile_cpu_s": cpu,
        "build": build,
    }


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/llmc.py --check-link``: :func:`check_link`, printed; exit 1 when a library
    the symbols need is not on the link line or does not export them."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="llm.c beside gptspeed: checks of its GPU build on this machine")
    ap.add_argument("--check-link", action="store_true", required=True, help="compile cudnn_att.cpp, check its link")
    ap.add_argument("--llmc", default=str(Path(__file__).resolve().parents[2] / "shared" / "peers" / "llm.c"))
    ap.add_argument("--carry", default=str(Path(__file__).resolve().parents[1] / ".carry"), help="the frontend wheel")
    ap.add_argument("--site", action="append", default=None, help="a folder holding nvidia/*/ wheels (cuDNN, NVRTC)")
    ap.add_argument("--record", default=None, help=f"write the symbols here (the checked-in one: {LINK_RECORD.name})")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="llmc-link-") as work:
            r = check_link(args.llmc, work, args.carry, args.site, args.record)
    except GptspeedError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2
    needed = libraries_needed(r["symbols"])
    print(
        f"cudnn_att.o compiled in {r['compile_s']:.0f} s ({r['compile_cpu_s']:.0f} CPU-s); {len(r['symbols'])} undefined"
    )
    print("link line: " + r["line"])
    for lib, syms in needed.items():
        state = "MISSING from the link line" if lib in r["unlinked"] else "on the link line"
        print(f"  -l{lib}: {len(syms)} symbols ({', '.join(syms[:3])}, ...) {state}")
    for lib, syms in r["unexported"].items():
        print(f"  lib{lib}.so does not export: {', '.join(syms)}")
    return 1 if r["unlinked"] or r["unexported"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
