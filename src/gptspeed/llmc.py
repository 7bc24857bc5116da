"""llm.c's model checkpoint format: write a gptspeed GPT so llm.c's ``train_gpt2`` trains it.

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
    h[:8] = [LLMC_MAGIC, LLMC_VERSION, config.block_size, config.valid_vocab_size, config.n_layer,
             config.n_head, config.n_embd, config.vocab_size]
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
    shapes = {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C), "qkvw": (L, 3 * C, C),
              "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C),
              "fcw": (L, 4 * C, C), "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
              "lnfw": (C,), "lnfb": (C,)}
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


def build_train_gpt2(llmc_dir: str | os.PathLike, out_dir: str | os.PathLike,
                     cflags: tuple[str, ...] = ("-O2",), cc: str | None = None) -> Path:
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


def prepare_llmc_dir(work_dir: str | os.PathLike, model: GPT, train_tokens: np.ndarray,
                     val_tokens: np.ndarray) -> Path:
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


def read_lines(fd: int, on_line, deadline: float) -> list[str]:
    """Read text lines from the file descriptor ``fd`` (a pipe or a pseudo-terminal's master side)
    as they arrive, handing each (decoded, without its line end) to ``on_line``; stop when it
    returns True, at end of file (or EIO: a terminal's child exited) or at ``time.perf_counter()``
    ``deadline``. Returns every line read."""
    import select
    import time

    lines: list[str] = []
    pending = b""
    while time.perf_counter() < deadline:
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal (exited)
            break
        if not chunk:
            break
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace").rstrip("\r")
            lines.append(line)
            if on_line(line):
                return lines
    return lines


def run_train_gpt2(binary: str | os.PathLike, work_dir: str | os.PathLike, steps: int, *,
                   threads: int | None = None, timeout_s: float = 3600.0, env: dict | None = None) -> dict:
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
    proc = subprocess.Popen([str(binary)], cwd=work_dir, env=env, stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, close_fds=True)
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
        raise GptspeedError(f"llm.c's train_gpt2 stopped after {len(losses)} of {steps} steps: "
                            + " | ".join(lines[-5:]).strip())
    return {"losses": losses, "step_ms": step_ms, "val_losses": val_losses,
            "peak_rss_bytes": rusage.ru_maxrss * 1024, "wall_s": time.perf_counter() - t0, "stdout": "\n".join(lines)}
