"""gptspeed.step where the mutation check (tools/mutation/README.md) found it unguarded: the memory
figures (RAM from /proc/meminfo and the cgroup, the size check's thresholds against a model built
and counted here), format_bytes, the out-of-memory test, the compile toolchain check, and what
``--batch-size auto`` hands its probe. Tiny models, no subprocess, no GPU: files, compilers and
memory are faked where the step reads them."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from gptspeed import batchsize
from gptspeed import step as step_mod
from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT
from gptspeed.runtime import Runtime

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = Runtime(device=torch.device("cpu"), dtype="float32", autocast_dtype=None, compile=False)


def small(**overrides):
    cfg = preset("pico").override({**dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2), **overrides})
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------ format_bytes
def reference_format(n: float) -> str:
    """The docstring's format: the largest of B, KiB, ..., PiB that leaves |value| >= 1 (B below
    1 KiB), two decimals (none for B), thousands separators past PiB."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    while i < 5 and abs(n) >= 1024 ** (i + 1):
        i += 1
    v = n / 1024 ** i
    return f"{v:.0f} B" if i == 0 else f"{v:,.2f} {units[i]}"


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 3 * 1024 ** 2 + 1024 ** 2 // 2, 5 * 1024 ** 3, 7 * 1024 ** 4,
                               2 * 1024 ** 5, 3 * 1024 ** 6, -2048, 10 ** 7])
def test_format_bytes_matches_the_documented_units(n):
    assert step_mod.format_bytes(n) == reference_format(n)


def test_format_bytes_of_unknown_is_a_question_mark():
    assert step_mod.format_bytes(None) == "?"


# ------------------------------------------------------------------------------ RAM available
def fake_files(monkeypatch, files: dict[str, str], sysconf: dict[str, int] | None = None):
    """``open`` in gptspeed.step reads ``files`` (any other path: FileNotFoundError); os.sysconf
    answers from ``sysconf`` (ValueError for a name it lacks)."""
    def fake_open(path, *a, **k):
        if path in files:
            return io.StringIO(files[path])
        raise FileNotFoundError(path)

    def fake_sysconf(name):
        if sysconf is None or name not in sysconf:
            raise ValueError(name)
        return sysconf[name]

    monkeypatch.setattr(step_mod, "open", fake_open, raising=False)
    monkeypatch.setattr(step_mod.os, "sysconf", fake_sysconf)


MEMINFO = "MemTotal:       16000 kB\nMemFree:         900 kB\nMemAvailable:    1000 kB\nBuffers: 5 kB\n"
V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
V1 = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


@pytest.mark.parametrize("files, sysconf, want", [
    ({"/proc/meminfo": MEMINFO}, None, 1000 * 1024),  # MemAvailable, in kB
    ({"/proc/meminfo": "MemTotal: 16000 kB\n"}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 10}, 40960),  # no line
    ({"/proc/meminfo": "MemAvailable: lots kB\n"}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 3}, 12288),  # unreadable
    ({}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 5}, 20480),  # no /proc/meminfo
    ({}, {"SC_PAGE_SIZE": 4096}, None),  # nothing known
    ({"/proc/meminfo": MEMINFO, V2[0]: "500000\n", V2[1]: "100000\n"}, None, 400000),  # cgroup v2 caps
    ({"/proc/meminfo": MEMINFO, V2[0]: "5000000\n", V2[1]: "100000\n"}, None, 1000 * 1024),  # limit above RAM
    ({"/proc/meminfo": MEMINFO, V2[0]: "max\n", V2[1]: "100000\n", V1[0]: "300000", V1[1]: "0"}, None,
     1000 * 1024),  # v2 says no limit: v1 is not read
    ({"/proc/meminfo": MEMINFO, V1[0]: "300000\n", V1[1]: "100000\n"}, None, 200000),  # cgroup v1
    ({"/proc/meminfo": MEMINFO, V2[0]: "300000", V2[1]: "oops", V1[0]: "250000", V1[1]: "50000"}, None,
     200000),  # v2 unreadable: v1
    ({"/proc/meminfo": MEMINFO, V1[0]: str(1 << 60), V1[1]: "1"}, None, 1000 * 1024),  # "no limit" as a number
    ({"/proc/meminfo": MEMINFO, V1[0]: str((1 << 60) - 1), V1[1]: "1"}, None, 1000 * 1024),
    ({"/proc/meminfo": MEMINFO, V1[0]: "1024", V1[1]: "1023"}, None, 1),
    ({"/proc/meminfo": MEMINFO, V1[0]: "1024", V1[1]: "4096"}, None, 0),  # over the limit already
])
def test_host_memory_available_reads_meminfo_then_caps_by_the_cgroup(monkeypatch, files, sysconf, want):
    fake_files(monkeypatch, files, sysconf)
    assert step_mod.host_memory_available() == want


def test_the_cpus_memory_is_the_host_memory(monkeypatch):
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 12345)
    assert step_mod.device_memory_available(torch.device("cpu")) == (12345, "of RAM available")


# ------------------------------------------------------------------------------ the size check
def measured(cfg) -> tuple[int, int]:
    """(parameters, buffer bytes) of the model of ``cfg``, built and counted here."""
    m = GPT(cfg.model)
    return sum(p.numel() for p in m.parameters()), sum(b.numel() * b.element_size() for b in m.buffers())


@pytest.mark.parametrize("overrides", [{}, dict(attention="manual"), dict(softmax="data")])
def test_the_ram_check_is_four_bytes_a_parameter_plus_the_buffers(monkeypatch, overrides):
    cfg = small(**overrides)
    params, buffers = measured(cfg)
    need = 4 * params + buffers
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: need)
    step_mod.check_model_fits(cfg)  # exactly enough
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: need - 1)
    with pytest.raises(step_mod.ModelTooLarge) as e:
        step_mod.check_model_fits(cfg)
    msg = str(e.value)
    assert "\n" not in msg and step_mod.format_bytes(need) in msg and step_mod.format_bytes(need - 1) in msg
    assert f"{params:,} parameters" in msg
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: None)  # unknown: not refused
    step_mod.check_model_fits(cfg)


@pytest.mark.parametrize("parallel, world, batch", [("none", 1, 2), ("fsdp", 3, 2), ("ddp", 3, 2), ("none", 1, 0)])
def test_the_device_check_is_sixteen_bytes_a_parameter_sharded_plus_activations(monkeypatch, parallel, world, batch):
    """16 bytes a parameter (divided over the ranks under FSDP, rounded up) + the buffers + one
    ``B x T x C`` activation of 2 bytes per block, B at least 1."""
    cfg = small(batch_size=batch, attention="manual", total_batch_tokens=4 * 16 if batch == 0 else None)  # 0: auto
    params, buffers = measured(cfg)
    shards = world if parallel == "fsdp" else 1
    m = cfg.model
    need = math.ceil(16 * params / shards) + buffers + 2 * max(1, batch) * m.block_size * m.n_embd * m.n_layer
    rt = dataclasses.replace(CPU, parallel=parallel, world_size=world)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 10 ** 12)
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (need, "of test memory"))
    step_mod.check_model_fits(cfg, rt)
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (need - 1, "of test memory"))
    with pytest.raises(step_mod.ModelTooLarge) as e:
        step_mod.check_model_fits(cfg, rt)
    msg = str(e.value)
    assert "\n" not in msg and step_mod.format_bytes(need) in msg and "of test memory" in msg
    assert (f"sharded over {shards} ranks" in msg) == (shards > 1)
    assert f"--batch-size {max(1, batch)}" in msg
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (None, "unknown"))
    step_mod.check_model_fits(cfg, rt)


# ------------------------------------------------------------------------------ building
def test_build_model_draws_the_weights_after_seeding_with_the_runs_seed():
    cfg = small(seed=7)
    torch.manual_seed(7)
    ref = GPT(cfg.model)
    torch.manual_seed(123)  # whatever the global generator holds before
    got = step_mod.build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters()))


@pytest.mark.parametrize("error, oom", [
    (MemoryError(), True), (torch.OutOfMemoryError("CUDA out of memory"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp] Out Of Memory"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False), (ValueError("out of memory"), False),
    (OSError("can't allocate memory"), False)])
def test_is_out_of_memory_knows_the_allocators_ways_of_saying_it(error, oom):
    assert step_mod.is_out_of_memory(error) is oom


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_running_out_of_memory_while_building_is_one_line(monkeypatch, error):
    def gpt(config):
        raise error

    monkeypatch.setattr(step_mod, "GPT", gpt)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 5 * 1024 ** 3)
    cfg = small()
    with pytest.raises(GptspeedError) as e:
        step_mod.build_model(cfg)
    msg = str(e.value)
    params = cfg.model.num_params()
    assert msg.startswith("out of memory while building the model") and "\n" not in msg
    assert f"{params:,} parameters" in msg and step_mod.format_bytes(4 * params) in msg and "5.00 GiB" in msg


def test_another_runtime_error_while_building_is_not_dressed_as_memory(monkeypatch):
    def gpt(config):
        raise RuntimeError("a bug")

    monkeypatch.setattr(step_mod, "GPT", gpt)
    with pytest.raises(RuntimeError, match="^a bug$"):
        step_mod.build_model(small())


# ------------------------------------------------------------------------------ compile toolchain
@pytest.fixture
def gpu_toolchain(monkeypatch, tmp_path):
    """triton importable, Python.h present; ``which`` knows only the names put in the returned set."""
    import importlib.util
    import sysconfig

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    known: set[str] = set()
    monkeypatch.setattr(step_mod.shutil, "which", lambda name: f"/usr/bin/{name}" if name in known else None)
    return known


@pytest.mark.parametrize("compiler", ["cc", "gcc", "clang"])
def test_any_of_cc_gcc_clang_is_a_c_compiler(gpu_toolchain, compiler):
    gpu_toolchain.add(compiler)
    assert step_mod.compile_toolchain_problem("cuda", env={}) is None


def test_each_missing_piece_of_the_gpu_toolchain_is_named_with_its_fix(gpu_toolchain, monkeypatch, tmp_path):
    import importlib.util
    import sysconfig

    fix = "; or run with --no-compile"
    assert step_mod.compile_toolchain_problem("cuda", env={}) == (
        "torch.compile on a GPU needs a C compiler for Triton's launcher (none of $CC, cc, gcc, clang is on PATH): "
        "install one, e.g. apt-get install gcc" + fix)
    gpu_toolchain.add("gcc")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path / "none")})
    assert step_mod.compile_toolchain_problem("cuda", env={}) == (
        f"torch.compile on a GPU needs Python's headers for Triton's launcher ({tmp_path / 'none' / 'Python.h'} is "
        "missing): install them, e.g. apt-get install python3-dev" + fix)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert step_mod.compile_toolchain_problem("cuda", env={}) == (
        "torch.compile on a GPU needs triton (it ships with PyTorch's CUDA wheels: pip install triton)" + fix)


def test_the_compiler_named_by_cc_in_the_given_environment_counts(gpu_toolchain, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    gpu_toolchain.add("my-cc")
    assert step_mod.compile_toolchain_problem("cuda", env={"CC": "my-cc"}) is None
    problem = step_mod.compile_toolchain_problem("cuda", env={"CC": "not-there"})
    assert problem is not None and problem.startswith("torch.compile on a GPU needs a C compiler")
    assert problem.endswith("; or run with --no-compile")
    monkeypatch.setenv("CC", "my-cc")  # the process's environment is read only when none is given
    assert step_mod.compile_toolchain_problem("cuda") is None
    assert step_mod.compile_toolchain_problem("cuda", env={}) is not None


# ------------------------------------------------------------------------------ --batch-size auto
def test_agree_min_in_one_process_is_the_value_itself():
    assert step_mod.agree_min(CPU, 7) == 7


@pytest.mark.parametrize("parallel", ["none", "ddp"])
def test_auto_batch_probes_eager_unwrapped_steps_at_each_size(monkeypatch, parallel):
    """What the probe is handed: the device, the settings that key its cache, the sequences per
    global batch, and a step maker whose steps are eager (and unwrapped for DDP), at micro-batch
    ``b`` with no accumulation, on random tokens shifted by one."""
    built, batches, seen = [], [], {}
    real = step_mod.TrainStep

    class Recording(real):
        def __init__(self, cfg, rt, **kw):
            assert rt.compile is False and rt.parallel == "none", rt  # before anything is compiled
            built.append((cfg, rt))
            super().__init__(cfg, rt, **kw)

        def __call__(self, next_batch):
            batches.append(next_batch())
            return super().__call__(lambda: batches[-1])

    def fake_resolve(device, settings, sequences, make_step, *, say, agree):
        seen.update(device=device, settings=settings, sequences=sequences, agreed=agree(5))
        say("probing")
        run = make_step(3)
        run()
        run()
        return 3

    monkeypatch.setattr(step_mod, "TrainStep", Recording)
    monkeypatch.setattr(batchsize, "resolve_auto_batch", fake_resolve)
    cfg = small(batch_size=4, total_batch_tokens=8 * 16, compile=True)
    rt = dataclasses.replace(CPU, compile=True, parallel=parallel)
    said = []
    assert step_mod.auto_batch_size(cfg, rt, say=said.append) == 3
    r = cfg.runtime
    assert seen == dict(device=rt.device, sequences=8, agreed=5, settings={
        "model": dataclasses.asdict(cfg.model), "dtype": "float32", "compile": True, "optimizer": cfg.optim.optimizer,
        "world_size": 1, "parallel": parallel, "compile_mode": r.compile_mode, "compile_tuning": r.compile_tuning,
        "activation_checkpointing": r.activation_checkpointing, "fp8": r.fp8, "sdpa_backend": r.sdpa_backend})
    assert type(seen["sequences"]) is int and said == ["probing"]
    (probe_cfg, _), = built
    assert probe_cfg.train.batch_size == 3 and probe_cfg.train.total_batch_tokens is None
    assert cfg.train.batch_size == 4 and cfg.train.total_batch_tokens == 8 * 16  # the run's own is untouched
    assert len(batches) == 2
    for x, y in batches:
        assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < cfg.model.valid_vocab_size


def test_auto_batch_probes_on_tokens_made_on_the_runs_device(monkeypatch):
    """On a GPU the probe's random tokens must be made there, with the model (CPU tokens would
    fail the probe's step, or measure nothing of the GPU's memory): here the runtime's device is
    meta (not the CPU); a stand-in step records the batch it is handed."""
    batches = []

    class Step:
        def __init__(self, cfg, rt):
            pass

        def __call__(self, next_batch):
            batches.append(next_batch())

    monkeypatch.setattr(step_mod, "TrainStep", Step)
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda device, settings, sequences, make_step, **kw:
                        make_step(2)() or 2)
    meta = dataclasses.replace(CPU, device=torch.device("meta"))
    assert step_mod.auto_batch_size(small(), meta, say=lambda m: None) == 2
    ((x, y),) = batches
    assert x.device.type == y.device.type == "meta", "the probe's tokens are not on rt.device"
    assert x.shape == y.shape == (2, 16)


def test_auto_batch_without_a_global_batch_asks_for_no_sequence_count(monkeypatch):
    seen = []
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda device, settings, sequences, *a, **k: seen.append(sequences) or 2)
    assert step_mod.auto_batch_size(small(total_batch_tokens=None), CPU, say=lambda m: None) == 2
    assert seen == [None]


def test_auto_batch_sizes_that_fail_the_size_check_are_out_of_memory_to_the_probe(monkeypatch):
    """Micro-batch 1 fits, 1000 does not: the probe sees the size check's refusal of 1000 as
    CUDA's out-of-memory (its "does not fit"), and a model that cannot train at 1 is refused
    before any probing."""
    cfg = small()
    params, buffers = measured(cfg)
    m = cfg.model
    at = lambda b: 16 * params + buffers + 2 * b * m.block_size * m.n_embd * m.n_layer  # noqa: E731
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 10 ** 12)
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (at(1), "of test memory"))
    outcomes = []

    def fake_resolve(device, settings, sequences, make_step, **kw):
        for b in (1000, 1):
            try:
                make_step(b)
                outcomes.append((b, "fits"))
            except torch.cuda.OutOfMemoryError as e:
                outcomes.append((b, "oom"))
                assert "needs at least" in str(e)
        return 1

    monkeypatch.setattr(batchsize, "resolve_auto_batch", fake_resolve)
    assert step_mod.auto_batch_size(cfg, CPU, say=lambda m: None) == 1
    assert outcomes == [(1000, "oom"), (1, "fits")]
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (at(1) - 1, "of test memory"))
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda *a, **k: pytest.fail("probed a model that cannot fit"))
    with pytest.raises(step_mod.ModelTooLarge, match="--batch-size 1"):
        step_mod.auto_batch_size(cfg, CPU, say=lambda m: None)
