"""``gptspeed.step``: the training step: one object that ``gptspeed train``, the bench's ladder rows, its verify rungs, the ``--batch-size auto`` probe and the tests all build the same way, from a :class:`RunConfig` and a resolved :class:`~gptspeed.runtime.Runtime`."""

from __future__ import annotations

import dataclasses
import io
import math
import sysconfig

import pytest
import torch

from gptspeed import batchsize
from gptspeed import step as step_mod
from gptspeed.compat import check_torch
from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.step import TrainStep

from support.cli import run_main
from support.host_reads import ACCUM2, RUNGS, Batches, HostReads, _step
from support.packages import fake_packages
from support.shapes import HOST_READS_MODEL, PLAIN_LOSS_MODEL
from support.training import TINY_MODEL, make_step, one_step

pytestmark = pytest.mark.usefixtures("one_thread")


def host_resident_state(optimizer):
    """AdamW's per-parameter ``step`` tensors that PyTorch keeps on the host unless the optimizer
    is fused or capturable (``torch.optim.adamw``: ``_get_value(step)`` reads them without a sync)."""
    out = []
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for state in opt.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type == "cpu" and not opt.defaults.get("fused"):
                out.append(step)
    return out


# Documented exceptions: the non-fused AdamW and Muon cannot skip a non-finite step on the device,
# so optimizer_step reads that flag (one host read per optimizer step, never per micro-step).
ONE_READ_PER_STEP = {"baseline", "sdpa+vocab-pad", "muon"}


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
    v = n / 1024**i
    return f"{v:.0f} B" if i == 0 else f"{v:,.2f} {units[i]}"


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


# ------------------------------------------------------------------------------ the size check
def measured(cfg) -> tuple[int, int]:
    """(parameters, buffer bytes) of the model of ``cfg``, built and counted here."""
    m = GPT(cfg.model)
    return sum(p.numel() for p in m.parameters()), sum(b.numel() * b.element_size() for b in m.buffers())


# ------------------------------------------------------------------------------ compile toolchain
@pytest.fixture
def gpu_toolchain(monkeypatch, tmp_path):
    """triton importable, Python.h present; ``which`` knows only the names put in the returned set."""
    import sysconfig

    fake_packages(monkeypatch, triton=True)
    (tmp_path / "Python.h").write_text("")
    real_get_paths = sysconfig.get_paths  # the other paths kept: importing torch._dynamo reads "stdlib"
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real_get_paths(*a, **k), "include": str(tmp_path)})
    known: set[str] = set()
    monkeypatch.setattr(step_mod.shutil, "which", lambda name: f"/usr/bin/{name}" if name in known else None)
    return known


# ------------------------------------------------------------------------------ check_step's rules
def unvalidated(**overrides):
    """A pico configuration with ``overrides``, not validated (``--fp8``'s shape rule would refuse a
    model this small; check_step's own rules are what is under test)."""
    return preset("pico").override({**dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2), **overrides})


@pytest.fixture
def torchao_installed(monkeypatch):
    """``importlib.util.find_spec("torchao")`` finds it (whether or not this machine has it)."""
    fake_packages(monkeypatch, torchao=True)


CPU_BF16 = dataclasses.replace(CPU, dtype="bfloat16", autocast_dtype=torch.bfloat16)


# ------------------------------------------------------------------------------ the GradScaler
CPU_FP16 = dataclasses.replace(CPU, dtype="float16", autocast_dtype=torch.float16)


# ------------------------------------------------------------------------------ TrainStep's parts
class Recorder(torch.nn.Module):
    """A stand-in model: ``forward(x, y) -> (None, loss)``, noting each call in ``events``."""

    def __init__(self, events: list):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))
        self.events = events

    def forward(self, x, y):
        self.events.append("forward")
        return None, (self.w.sum() * x.float().mean())


@pytest.fixture
def compile_calls(monkeypatch, tmp_path):
    """torch.compile recorded (``(what, kwargs)``) instead of run; the compile cache's folder restored."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls = []

    def compile(what, **kw):
        calls.append((what, kw))
        return what

    monkeypatch.setattr(torch, "compile", compile)
    return calls


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of one process (no torchrun), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the refusals, word for word
SIZE_FIX = "lower --n-layer / --n-embd / --vocab-size / --seq-len"  # the size check's advice


def shape_words(cfg, params: int) -> str:
    """How the size check names the model: its shape and its parameters (counted here)."""
    m = cfg.model
    return (
        f"n_layer {m.n_layer}, n_embd {m.n_embd}, vocab_size {m.vocab_size}, seq_len {m.block_size}: "
        f"{params:,} parameters"
    )


T = TINY_MODEL["block_size"]


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50257, (rows, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def first_moments(step) -> list[torch.Tensor]:
    """AdamW's exp_avg after its first step, parameter by parameter: ``(1 - beta1) * grad`` exactly,
    so it shows the gradient the optimizer was handed (after clipping, unscaling, accumulation)."""
    return [step.optimizer.state[p]["exp_avg"].clone() for p in step.params]


def total_norm(tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


CUDA = Runtime(device=torch.device("cuda", 0), dtype="bfloat16", autocast_dtype=torch.bfloat16, compile=True)


def pico(**overrides):
    cfg = preset("pico").override(overrides)
    cfg.validate()
    return cfg


@pytest.fixture
def never_builds(monkeypatch):
    """Fails the test if the step gets as far as building a model (the rules come first)."""

    def build(cfg):
        raise AssertionError("the model was built before the step's rules were checked")

    monkeypatch.setattr(step_mod, "build_model", build)


@pytest.mark.usefixtures("eager_compile")
@pytest.mark.parametrize("rung", list(RUNGS))
def test_no_host_reads_inside_a_training_step(rung):
    t = _step(rung)
    assert t.accum == 2  # gradient accumulation: two micro-batches per optimizer step
    batches = Batches(t.rt.device)
    t(batches.next_batch)  # warm-up (compilation traces read shapes, not values); optimizer state exists now
    with HostReads(host_resident_state(t.optimizer)) as mode:
        for _ in range(3):
            t(batches.next_batch)
    expected = 3 if rung in ONE_READ_PER_STEP else 0
    assert len(mode.reads) == expected, (rung, mode.reads)


@pytest.mark.usefixtures("eager_compile")
def test_float16_grad_scaler_step_reads_nothing_with_fused_adamw():
    """float16 + GradScaler (GPUs without bf16): the scaler's skip goes to fused AdamW's found_inf."""
    rt = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    t = make_step({**HOST_READS_MODEL, "loss": "plain"}, dict(fused_adamw=True), rt=rt, train_kw=ACCUM2)
    assert t.scaler.is_enabled() and t.accum == 2
    batches = Batches("cpu")
    t(batches.next_batch)
    with HostReads() as mode:
        for _ in range(2):
            t(batches.next_batch)
    assert mode.reads == []


@pytest.mark.usefixtures("eager_compile")
@pytest.mark.parametrize("model", [dict(loss="plain", attention="sdpa"), dict(loss="fused", attention="manual")])
def test_no_tensor_on_the_wrong_device(model, shakespeare_data):
    """Parameters, batches (through the loader's hand-off) and every tensor the step creates on
    ``meta``: a CPU tensor mixed in raises ("Tensor on device cpu is not on the expected device")."""
    from gptspeed.data import find_shards
    from gptspeed.data.loader import TokenLoader

    rt = Runtime(device=torch.device("meta"), dtype="float32", autocast_dtype=None, compile=False)
    t = make_step({**HOST_READS_MODEL, **model}, dict(fused_adamw=False), rt=rt, train_kw=ACCUM2)
    t.skips_on_device = True  # fused AdamW's path (found_inf on the device); no fused kernel exists for meta
    t.optimizer.step = lambda: None
    loader = TokenLoader(find_shards(shakespeare_data, "train"), 2, 16, device=rt.device)
    loss, grad_norm, bad = t(loader.next_batch)
    assert {loss.device.type, grad_norm.device.type, bad.device.type} == {"meta"}
    assert t.optimizer.found_inf.device.type == "meta"
    assert all(p.grad is None for p in t.params)  # zeroed (set to None) after the step


@pytest.mark.usefixtures("eager_compile")
def test_a_stray_cpu_tensor_is_caught_on_meta():
    """The check above has teeth: a step that adds a CPU tensor to the loss fails on meta."""
    rt = Runtime(device=torch.device("meta"), dtype="float32", autocast_dtype=None, compile=False)
    t = make_step({**HOST_READS_MODEL, "loss": "plain"}, dict(fused_adamw=False), rt=rt)
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        (t.train_model(x, x)[1] + torch.ones(1)).backward()


@pytest.mark.usefixtures("eager_compile")
@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_compiled_step_and_eval_have_no_graph_break(mode):
    t = _step("compile" if mode == "model" else "compile-blocks")
    x, y = Batches("cpu").next_batch()
    inner = t.model if mode == "model" else t.model.transformer.h[0].forward  # the block's own forward
    arg = (x, y) if mode == "model" else (torch.randn(2, 16, 32),)
    explained = torch._dynamo.explain(inner)(*arg)
    assert explained.graph_break_count == 0, explained.break_reasons
    with torch.no_grad():
        explained = torch._dynamo.explain(inner)(*arg)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize(
    "n",
    [
        0,
        1,
        1023,
        1024,
        1536,
        3 * 1024**2 + 1024**2 // 2,
        5 * 1024**3,
        7 * 1024**4,
        2 * 1024**5,
        3 * 1024**6,
        -2048,
        10**7,
    ],
)
def test_format_bytes_matches_the_documented_units(n):
    assert step_mod.format_bytes(n) == reference_format(n)


def test_format_bytes_of_unknown_is_a_question_mark():
    assert step_mod.format_bytes(None) == "?"


@pytest.mark.parametrize(
    "files, sysconf, want",
    [
        ({"/proc/meminfo": MEMINFO}, None, 1000 * 1024),  # MemAvailable, in kB
        ({"/proc/meminfo": "MemTotal: 16000 kB\n"}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 10}, 40960),  # no line
        ({"/proc/meminfo": "MemAvailable: lots kB\n"}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 3}, 12288),  # unreadable
        ({}, {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 5}, 20480),  # no /proc/meminfo
        ({}, {"SC_PAGE_SIZE": 4096}, None),  # nothing known
        ({"/proc/meminfo": MEMINFO, V2[0]: "500000\n", V2[1]: "100000\n"}, None, 400000),  # cgroup v2 caps
        ({"/proc/meminfo": MEMINFO, V2[0]: "5000000\n", V2[1]: "100000\n"}, None, 1000 * 1024),  # limit above RAM
        (
            {"/proc/meminfo": MEMINFO, V2[0]: "max\n", V2[1]: "100000\n", V1[0]: "300000", V1[1]: "0"},
            None,
            1000 * 1024,
        ),  # v2 says no limit: v1 is not read
        ({"/proc/meminfo": MEMINFO, V1[0]: "300000\n", V1[1]: "100000\n"}, None, 200000),  # cgroup v1
        (
            {"/proc/meminfo": MEMINFO, V2[0]: "300000", V2[1]: "oops", V1[0]: "250000", V1[1]: "50000"},
            None,
            200000,
        ),  # v2 unreadable: v1
        ({"/proc/meminfo": MEMINFO, V1[0]: str(1 << 60), V1[1]: "1"}, None, 1000 * 1024),  # "no limit" as a number
        ({"/proc/meminfo": MEMINFO, V1[0]: str((1 << 60) - 1), V1[1]: "1"}, None, 1000 * 1024),
        ({"/proc/meminfo": MEMINFO, V1[0]: "1024", V1[1]: "1023"}, None, 1),
        ({"/proc/meminfo": MEMINFO, V1[0]: "1024", V1[1]: "4096"}, None, 0),  # over the limit already
    ],
)
def test_host_memory_available_reads_meminfo_then_caps_by_the_cgroup(monkeypatch, files, sysconf, want):
    fake_files(monkeypatch, files, sysconf)
    assert step_mod.host_memory_available() == want


def test_the_cpus_memory_is_the_host_memory(monkeypatch):
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 12345)
    assert step_mod.device_memory_available(torch.device("cpu")) == (12345, "of RAM available")


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
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 10**12)
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


@pytest.mark.parametrize(
    "error, oom",
    [
        (MemoryError(), True),
        (torch.OutOfMemoryError("CUDA out of memory"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp] Out Of Memory"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),
        (OSError("can't allocate memory"), False),
    ],
)
def test_is_out_of_memory_knows_the_allocators_ways_of_saying_it(error, oom):
    assert step_mod.is_out_of_memory(error) is oom


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_running_out_of_memory_while_building_is_one_line(monkeypatch, error):
    def gpt(config):
        raise error

    monkeypatch.setattr(step_mod, "GPT", gpt)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 5 * 1024**3)
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
        "install one, e.g. apt-get install gcc" + fix
    )
    gpu_toolchain.add("gcc")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path / "none")})
    assert step_mod.compile_toolchain_problem("cuda", env={}) == (
        f"torch.compile on a GPU needs Python's headers for Triton's launcher ({tmp_path / 'none' / 'Python.h'} is "
        "missing): install them, e.g. apt-get install python3-dev" + fix
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert step_mod.compile_toolchain_problem("cuda", env={}) == (
        "torch.compile on a GPU needs triton (it ships with PyTorch's CUDA wheels: pip install triton)" + fix
    )


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
    assert seen == dict(
        device=rt.device,
        sequences=8,
        agreed=5,
        settings={
            "model": dataclasses.asdict(cfg.model),
            "dtype": "float32",
            "compile": True,
            "optimizer": cfg.optim.optimizer,
            "world_size": 1,
            "parallel": parallel,
            "compile_mode": r.compile_mode,
            "compile_tuning": r.compile_tuning,
            "activation_checkpointing": r.activation_checkpointing,
            "fp8": r.fp8,
            "fp8_lm_head": r.fp8_lm_head,
            "sdpa_backend": r.sdpa_backend,
        },
    )
    assert type(seen["sequences"]) is int and said == ["probing"]
    ((probe_cfg, _),) = built
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
    monkeypatch.setattr(
        batchsize, "resolve_auto_batch", lambda device, settings, sequences, make_step, **kw: make_step(2)() or 2
    )
    meta = dataclasses.replace(CPU, device=torch.device("meta"))
    assert step_mod.auto_batch_size(small(), meta, say=lambda m: None) == 2
    ((x, y),) = batches
    assert x.device.type == y.device.type == "meta", "the probe's tokens are not on rt.device"
    assert x.shape == y.shape == (2, 16)


def test_auto_batch_without_a_global_batch_asks_for_no_sequence_count(monkeypatch):
    seen = []
    monkeypatch.setattr(
        batchsize, "resolve_auto_batch", lambda device, settings, sequences, *a, **k: seen.append(sequences) or 2
    )
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
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 10**12)
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


def test_fp8_without_torchao_is_refused_with_its_install_command(monkeypatch):
    fake_packages(monkeypatch, torchao=False)
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(unvalidated(fp8=True), CPU, 1)
    assert str(e.value) == "--fp8 needs torchao, which is not installed: pip install 'gptspeed[fp8]'", (
        "a missing torchao must be named with the command that installs it"
    )


def test_fp8_with_torchao_installed_goes_on_to_the_device_check(torchao_installed):
    """torchao found: the refusal on a CPU is the device's (no FP8 tensor cores), not "install torchao"."""
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(unvalidated(fp8=True), CPU, 1)
    assert str(e.value) == "--fp8 needs an NVIDIA GPU with FP8 tensor cores (H100, L4, ...); not cpu", (
        "with torchao installed, --fp8 on a CPU must be refused for the device, not for a missing torchao"
    )


def test_no_compile_skips_the_gpu_compile_toolchain_check(monkeypatch):
    """A CUDA run with --no-compile needs no triton / C compiler: check_step asks only when the run
    compiles (here triton is missing: the compiled run is refused, the eager one is not)."""
    fake_packages(monkeypatch, triton=False)
    cuda = dataclasses.replace(CPU, device=torch.device("cuda"))
    cfg = small()
    with pytest.raises(GptspeedError, match="needs triton"):
        step_mod.check_step(cfg, dataclasses.replace(cuda, compile=True), 1)
    step_mod.check_step(cfg, cuda, 1)  # eager: triton is not needed, nothing is refused


@pytest.mark.parametrize("rt, dtype", [(CPU, "float32"), (CPU_BF16, "bfloat16")])
def test_an_attention_kernel_the_device_lacks_is_refused_naming_the_runs_attention_shape(rt, dtype):
    """--sdpa-backend cudnn on a CPU: check_step tries the run's attention (n_head 2 heads of
    n_embd / n_head = 8 channels, T = block_size 16, in the autocast dtype or float32, on the CPU)
    and refuses it in one line naming exactly that."""
    cfg = small(sdpa_backend="cudnn")
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(cfg, rt, 1)
    msg = str(e.value)
    want = f"--sdpa-backend cudnn cannot run this attention (2 heads x 8 channels, T=16, {dtype}, cpu): "
    assert msg.startswith(want), f"the refusal must name the run's attention shape and dtype: {msg!r}"
    assert msg.endswith("; use --sdpa-backend auto") and "\n" not in msg, msg
    step_mod.check_step(small(sdpa_backend="math"), rt, 1)  # a kernel the CPU has is not refused


# ------------------------------------------------------------------------------ device memory
def test_a_cuda_device_without_cuda_has_unknown_free_memory(monkeypatch):
    """A runtime naming CUDA where PyTorch sees none: nothing to measure -- (None, "free on the GPU"),
    not the host's RAM."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 12345)
    assert step_mod.device_memory_available(torch.device("cuda")) == (None, "free on the GPU")


def test_the_mps_devices_memory_is_its_recommended_working_set(monkeypatch):
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 7 * 1024**3, raising=False)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 12345)
    assert step_mod.device_memory_available(torch.device("mps")) == (7 * 1024**3, "the MPS device can use"), (
        "on MPS the memory is torch.mps.recommended_max_memory(), not the host's RAM"
    )


@pytest.mark.parametrize(
    "rt, enabled, sharded",
    [
        (CPU, False, False),
        (CPU_FP16, True, False),
        (dataclasses.replace(CPU_FP16, parallel="ddp"), True, False),
        (dataclasses.replace(CPU, parallel="fsdp"), False, False),
        (dataclasses.replace(CPU_FP16, parallel="fsdp"), True, True),
    ],
)
def test_the_grad_scaler_scales_float16_only_and_is_the_sharded_one_under_fsdp(rt, enabled, sharded):
    """make_scaler's docstring: a GradScaler enabled for float16 only; under FSDP2 with float16 the
    ShardedGradScaler (which agrees on overflow across ranks); otherwise the plain one."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = step_mod.make_scaler(rt)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled() is enabled, f"loss scaling must be {'on' if enabled else 'off'} for {rt.dtype}"
    assert isinstance(scaler, ShardedGradScaler) is sharded, (
        f"parallel {rt.parallel}, {rt.dtype}: the sharded scaler is for FSDP2 with float16 only"
    )


def test_the_grad_scaler_is_made_for_the_runs_device():
    """The scaler belongs to the run's device: a new scale given as a tensor on that device is
    accepted (torch refuses one whose device is not the scaler's)."""
    scaler = step_mod.make_scaler(CPU_FP16)
    scaler.scale(torch.ones(()))
    scaler.update(torch.tensor(1024.0))
    assert scaler.get_scale() == 1024.0


def test_a_given_model_is_the_one_trained():
    model = Recorder([])
    step = step_mod.TrainStep(small(), CPU, model=model)
    assert step.model is model, "TrainStep(model=...) must train the module it is given, not a fresh GPT"
    assert [p for g in step.optimizer.param_groups for p in g["params"]] == [model.w]


def test_the_step_picks_the_fused_adamw_on_a_cpu_and_skips_bad_steps_on_the_device():
    """--fused-adamw unset: the fused kernel, which the CPU has (PyTorch >= 2.4), so a non-finite
    step is skipped on the device (skips_on_device)."""
    step = step_mod.TrainStep(small(), CPU, model=Recorder([]))
    assert step.optimizer.defaults["fused"] is True, "the fused AdamW is available on a CPU and must be used"
    assert step.skips_on_device is True


def test_fsdp_with_float16_steps_the_foreach_adamw(monkeypatch):
    """FSDP2 + float16: the fused AdamW rejects ShardedGradScaler's found_inf, so the step uses the
    foreach AdamW (and reads the skip flag); any other mix keeps the fused one. parallelize is
    replaced by the identity: a process group is not what is under test."""
    monkeypatch.setattr(step_mod, "parallelize", lambda model, rt, **kw: model)
    fsdp = step_mod.TrainStep(small(), dataclasses.replace(CPU_FP16, parallel="fsdp"), model=Recorder([]))
    assert not fsdp.optimizer.defaults["fused"] and fsdp.skips_on_device is False, (
        "FSDP2 with float16 must not use the fused AdamW"
    )
    for rt in (CPU_FP16, dataclasses.replace(CPU, parallel="fsdp")):
        other = step_mod.TrainStep(small(), rt, model=Recorder([]))
        assert other.optimizer.defaults["fused"] is True and other.skips_on_device is True, (
            f"parallel {rt.parallel}, {rt.dtype}: the fused AdamW must be kept"
        )


def test_activation_checkpointing_reaches_the_model():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    step = step_mod.TrainStep(small(activation_checkpointing="full"), CPU)
    assert all(isinstance(b, CheckpointWrapper) for b in step.model.transformer.h), (
        "--activation-checkpointing full must wrap every block"
    )


def test_fp8_reaches_the_model(monkeypatch, torchao_installed):
    """--fp8: the model's Linear layers are converted (torchao's conversion and the GPU check are
    stood in for: this CPU has no FP8)."""
    from gptspeed import fp8

    converted = []
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(fp8, "convert_to_float8", lambda model, **kw: converted.append(model) or 1)
    step = step_mod.TrainStep(unvalidated(fp8=True), CPU)
    assert converted == [step.model], "--fp8 must convert the model's Linear layers"


def test_the_step_compiles_with_inductor_in_the_runs_tuning_by_default(compile_calls):
    cfg = small(compile=True, compile_tuning="max-autotune-no-cudagraphs")
    step = step_mod.TrainStep(cfg, dataclasses.replace(CPU, compile=True))
    assert compile_calls == [
        (step.model, {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": False})
    ], "the whole model must be compiled by inductor (the default backend) in --compile-tuning's mode"


def test_the_step_compiles_with_the_backend_it_is_given(compile_calls):
    step = step_mod.TrainStep(small(compile=True), dataclasses.replace(CPU, compile=True), backend="eager")
    assert compile_calls == [(step.model, {"backend": "eager", "mode": None, "dynamic": False})]


def test_compile_mode_blocks_compiles_each_block_in_place(compile_calls):
    step = step_mod.TrainStep(
        small(compile=True, compile_mode="blocks", n_layer=2), dataclasses.replace(CPU, compile=True), backend="eager"
    )
    assert step.train_model is step.model, "--compile-mode blocks leaves the model itself uncompiled"
    assert [what.__self__ for what, _ in compile_calls] == list(step.model.transformer.h), (
        "--compile-mode blocks must compile each transformer block"
    )


def ddp_reductions(micro_batches: int, **step_kw) -> tuple[int, list[int]]:
    """One DDP step (a group of one, B 2 x T 16, ``micro_batches`` a full step) called with ``step_kw``:
    ``(micro-batches read, the 0-based micro-batch in whose backward each gradient bucket was all-reduced)``."""
    cfg = small(total_batch_tokens=micro_batches * 2 * 16)
    step = step_mod.TrainStep(cfg, dataclasses.replace(CPU, parallel="ddp"))
    assert step.accum == micro_batches
    micro, reduced_in = [], []

    def hook(state, bucket):
        reduced_in.append(len(micro) - 1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    step.train_model.register_comm_hook(None, hook)
    x = torch.randint(0, cfg.model.valid_vocab_size, (2, 17))

    def next_batch():
        micro.append(1)
        return x[:, :-1], x[:, 1:]

    step(next_batch, **step_kw)
    return len(micro), reduced_in


def test_ddp_reduces_gradients_only_in_the_last_micro_step(group_of_one):
    """Two micro-steps a step under DDP: the gradients are all-reduced once, in the second
    micro-step's backward (no_sync on the first), not after every micro-batch."""
    read, reduced_in = ddp_reductions(2)
    assert read == 2 and reduced_in and set(reduced_in) == {1}, (
        f"gradients were all-reduced in micro-steps {reduced_in}: only the last (1) should reduce"
    )


def test_under_ddp_a_warm_up_step_of_fewer_micro_batches_reduces_in_its_own_last_one(group_of_one):
    """--batch-warmup-steps under DDP: a step of 2 micro-batches on a run of 4 all-reduces once, in its second
    micro-batch's backward (no_sync before it); a full step of the same run in its fourth."""
    read, reduced_in = ddp_reductions(4, accum=2)
    assert read == 2 and reduced_in and set(reduced_in) == {1}, reduced_in
    read, reduced_in = ddp_reductions(4)
    assert read == 4 and reduced_in and set(reduced_in) == {3}, reduced_in


def test_with_cuda_graphs_each_micro_step_marks_a_new_graph_step_before_its_forward(monkeypatch, gpu_toolchain):
    """--compile-tuning reduce-overhead on CUDA replays CUDA graphs: every forward must be preceded by
    torch.compiler.cudagraph_mark_step_begin(), or a replay overwrites the last one's outputs. A
    CUDA runtime on this CPU: parallelize is the identity (no device move, no compile) and the
    stand-in model runs on the CPU."""
    gpu_toolchain.add("cc")
    events = []
    monkeypatch.setattr(step_mod, "parallelize", lambda model, rt, **kw: model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    cuda = dataclasses.replace(CPU, device=torch.device("cuda"), compile=True)
    step = step_mod.TrainStep(small(compile=True, compile_tuning="reduce-overhead"), cuda, model=Recorder(events))
    x = torch.zeros(2, 16, dtype=torch.long)
    step.forward_backward(x, x, last_micro_step=True)
    step.forward_backward(x, x, last_micro_step=True)
    assert events == ["mark", "forward", "mark", "forward"], events


def test_the_ram_refusal_names_the_weights_the_ram_and_the_fix_word_for_word(monkeypatch):
    """Two blocks, a causal-mask buffer, one byte of RAM short: the refusal is exactly "the model
    (shape) needs <4 bytes a parameter + buffers> of RAM for its fp32 weights alone, more than the
    <RAM> of RAM available: lower --n-layer / --n-embd / --vocab-size / --seq-len"."""
    cfg = small(n_layer=2, attention="manual")
    params, buffers = measured(cfg)
    need = 4 * params + buffers
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: need - 1)
    with pytest.raises(step_mod.ModelTooLarge) as e:
        step_mod.check_model_fits(cfg)
    want = (
        f"the model ({shape_words(cfg, params)}) needs {reference_format(need)} of RAM for its fp32 weights "
        f"alone, more than the {reference_format(need - 1)} of RAM available: {SIZE_FIX}"
    )
    assert str(e.value) == want, f"the RAM refusal is worded wrong:\n got {str(e.value)!r}\nwant {want!r}"


@pytest.mark.parametrize("parallel, world", [("none", 1), ("fsdp", 2), ("fsdp", 23)])
def test_the_device_refusal_gives_each_part_of_the_estimate_word_for_word(monkeypatch, parallel, world):
    """Two blocks (activations are per block: 2 bytes x B x T x C x n_layer), micro-batch 3, one
    byte short of the device's memory: the refusal names the total, the 16 bytes a parameter
    (rounded up to whole bytes per rank, "sharded over N ranks" from 2 ranks on, nothing said in
    one) plus the buffers, the activations, the memory there is and the fix, exactly. 23 ranks:
    16 x parameters / 23 falls short of a whole byte by enough that rounding it up shows in the
    KiB's second decimal."""
    cfg = small(n_layer=2, attention="manual", batch_size=3)
    params, buffers = measured(cfg)
    m = cfg.model
    state = math.ceil(16 * params / world) + buffers
    activations = 2 * 3 * m.block_size * m.n_embd * 2
    need = state + activations
    if world == 23:  # the case is only a test of the rounding while rounding shows
        assert reference_format(state) != reference_format(16 * params / world + buffers)
    rt = dataclasses.replace(CPU, parallel=parallel, world_size=world)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 10**12)
    monkeypatch.setattr(step_mod, "device_memory_available", lambda device: (need - 1, "of test memory"))
    with pytest.raises(step_mod.ModelTooLarge) as e:
        step_mod.check_model_fits(cfg, rt)
    sharded = f", sharded over {world} ranks" if world > 1 else ""
    want = (
        f"the model ({shape_words(cfg, params)}) needs at least {reference_format(need)} on cpu to train: "
        f"{reference_format(state)} for its weights, gradients and optimizer state (16 bytes a parameter{sharded}) "
        f"and {reference_format(activations)} for activations at --batch-size 3, more than the "
        f"{reference_format(need - 1)} of test memory: {SIZE_FIX} / --batch-size"
    )
    assert str(e.value) == want, f"the device refusal is worded wrong:\n got {str(e.value)!r}\nwant {want!r}"


def test_running_out_of_memory_while_building_is_worded_word_for_word(monkeypatch):
    """The build's out-of-memory line, exactly: the parameters, their fp32 bytes (4 each), the RAM
    available now (5 GiB) and the advice."""
    cfg = small()
    params, _ = measured(cfg)

    def gpt(config):
        raise MemoryError()

    monkeypatch.setattr(step_mod, "GPT", gpt)
    monkeypatch.setattr(step_mod, "host_memory_available", lambda: 5 * 1024**3)
    with pytest.raises(GptspeedError) as e:
        step_mod.build_model(cfg)
    want = (
        f"out of memory while building the model ({params:,} parameters, {reference_format(4 * params)} of fp32 "
        "weights; 5.00 GiB of RAM available now): lower --n-layer / --n-embd, or free memory"
    )
    assert str(e.value) == want, (
        f"the build's out-of-memory line is worded wrong:\n got {str(e.value)!r}\nwant {want!r}"
    )


@pytest.mark.parametrize("limit_file, usage_file", [V2, V1], ids=["v2", "v1"])
@pytest.mark.parametrize(
    "limit, want", [(1 << 60, 1 << 61), ((1 << 60) - 1, (1 << 60) - 1 - 5)], ids=["2^60", "2^60-1"]
)
def test_a_cgroup_limit_of_two_to_the_sixty_or_more_is_no_limit(monkeypatch, limit_file, usage_file, limit, want):
    """2^61 bytes available (MemAvailable in kB): a cgroup limit of exactly 2^60 reads as "no limit"
    (the RAM stands), one byte less is a limit (limit less usage, 5 bytes, caps it)."""
    meminfo = f"MemTotal: {1 << 52} kB\nMemAvailable: {1 << 51} kB\n"
    fake_files(monkeypatch, {"/proc/meminfo": meminfo, limit_file: f"{limit}\n", usage_file: "5\n"})
    got = step_mod.host_memory_available()
    assert got == want, f"cgroup limit {limit}: {got} bytes available, want {want}"


# ------------------------------------------------------------------------------ one optimizer step, by hand
def test_after_a_step_the_gradients_are_freed_not_zero_filled():
    """zero_grad(set_to_none=True): after a step every parameter's .grad is None (the memory of
    the gradients is given back between steps), not a tensor of zeros."""
    step = step_mod.TrainStep(small(), CPU)
    x = torch.randint(0, 100, (2, 16))
    step(lambda: (x, x))
    left = [n for n, p in step.model.named_parameters() if p.grad is not None]
    assert not left, f"gradients kept after the step: {left[:3]}"


@pytest.mark.parametrize("done", [2, 0])
def test_a_stop_before_a_micro_batch_abandons_the_step_and_drops_its_gradients(done):
    """``stop`` is asked before each of the step's 3 micro-batches: True before micro-batch ``done`` raises
    StepAbandoned(done, 3), "step abandoned after <done> of 3 micro-batches", with no further batch read; the
    gradients accumulated so far are dropped (every .grad None) and nothing is stepped (the weights as
    before, AdamW without state)."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(total_batch_tokens=3 * 2 * 16), CPU)
    assert step.accum == 3
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    x = torch.randint(0, 100, (2, 16))
    reads, asked = [], []

    def next_batch():
        reads.append(x)
        return x, x

    def stop():
        asked.append(True)
        return len(asked) > done

    with pytest.raises(step_mod.StepAbandoned) as left:
        step(next_batch, stop)
    assert (left.value.done, left.value.accum) == (done, 3) and len(reads) == done
    assert str(left.value) == f"step abandoned after {done} of 3 micro-batches"
    assert all(p.grad is None for p in step.model.parameters()), "the abandoned step's gradients were kept"
    moved = [n for n, p in step.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert not moved and not step.optimizer.state, f"an abandoned step moved {moved[:3]}"


def test_a_finite_loss_with_a_non_finite_gradient_skips_the_step():
    """The step is bad when the loss OR the gradient is not finite: here the loss is finite and one
    gradient element is inf -- bad is True and no weight moves."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(), CPU)
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    for p in step.model.parameters():
        p.grad = torch.full_like(p, 0.01)
    next(iter(step.model.parameters())).grad[0] = float("inf")
    grad_norm, bad = step.optimizer_step(torch.tensor(2.5))
    assert bool(bad) and not torch.isfinite(grad_norm), "a non-finite gradient under a finite loss was stepped"
    moved = [n for n, p in step.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert not moved, f"weights moved in a skipped step: {moved[:3]}"


def test_a_float16_step_returns_its_bad_flag_as_a_device_bool():
    """With float16's GradScaler the flag is the loss's finiteness, a bool tensor like every other
    step's: False for a finite loss, True for an infinite one."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(), CPU_FP16)
    step.scaler.scale(torch.ones(()))  # what a forward_backward does first: the scale is made
    for loss, want in ((2.5, False), (float("inf"), True)):
        for p in step.model.parameters():
            p.grad = torch.full_like(p, 0.01)
        _, bad = step.optimizer_step(torch.tensor(loss))
        assert isinstance(bad, torch.Tensor) and bad.dtype == torch.bool and bool(bad) is want, (
            f"loss {loss}: bad = {bad!r}"
        )


def test_the_steps_loss_is_made_on_the_runs_device_not_the_default_one():
    """The loss accumulator is made on the run's device: with another default device (meta, as a
    GPU run's default would be the CPU), the returned loss is still the CPU's, with its value."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(), CPU)
    x = torch.randint(0, 100, (2, 16))
    with torch.device("meta"):
        loss, grad_norm, bad = step(lambda: (x, x))
    assert loss.device.type == "cpu" and torch.isfinite(loss), f"the step's loss was made on {loss.device}"


def test_under_fsdp_the_gradient_norm_is_made_whole(group_of_one):
    """FSDP2's clip_grad_norm_ returns a DTensor; the step returns a plain tensor with the global
    norm (here one rank: the unsharded model's gradient norm, computed by hand)."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(), dataclasses.replace(CPU, parallel="fsdp"))
    for p in step.model.parameters():
        p.grad = torch.full_like(p, 0.5)
    count = sum(p.numel() for p in step.model.parameters())
    grad_norm, bad = step.optimizer_step(torch.tensor(2.5))
    assert type(grad_norm) is torch.Tensor, f"the norm is a {type(grad_norm).__name__}, not a plain tensor"
    assert float(grad_norm) == pytest.approx(0.5 * math.sqrt(count), rel=1e-5) and not bool(bad)


# ---------------------------------------------------------------------------------- clipping
def test_clipping_scales_the_gradient_by_clip_over_norm():
    """--grad-clip ignored, or applied to the wrong tensor, changes what AdamW is handed."""
    x, y = batch(4)
    free = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=0.0))
    _, norm, _ = one_step(free, x, y)
    norm = float(norm)
    clip = norm / 4  # certainly clips
    clipped = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=clip))
    _, norm_clipped, _ = one_step(clipped, x, y)
    assert float(norm_clipped) == pytest.approx(norm, rel=1e-6)  # the logged norm is the one before clipping
    beta1 = clipped.optimizer.param_groups[0]["betas"][0]
    for a, b in zip(first_moments(clipped), first_moments(free)):
        torch.testing.assert_close(a, b * (clip / norm), rtol=1e-5, atol=1e-9)
    assert total_norm(first_moments(clipped)) == pytest.approx((1 - beta1) * clip, rel=1e-5)
    # a clip above the norm changes nothing
    loose = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=norm * 2))
    one_step(loose, x, y)
    for a, b in zip(first_moments(loose), first_moments(free)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_float16_clips_the_unscaled_gradient_like_float32():
    """Clipping before GradScaler.unscale_ sees the gradient times the loss scale: the logged norm
    read 144,565 instead of 2.21 and the threshold became grad_clip / scale."""
    x, y = batch(4)
    ref = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=0.0))
    _, norm32, _ = one_step(ref, x, y)
    clip = float(norm32) / 3
    s32 = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=clip))
    loss32, n32, _ = one_step(s32, x, y)
    rt16 = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    s16 = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=clip), rt=rt16)
    s16.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # no overflow at this scale; unscale_ must divide it
    assert s16.scaler.is_enabled()
    loss16, n16, bad16 = one_step(s16, x, y)
    assert not bool(bad16)
    assert float(loss16) == pytest.approx(float(loss32), rel=1e-2)
    assert float(n16) == pytest.approx(float(n32), rel=2e-2), "float16's logged gradient norm is not the unscaled one"
    beta1 = s16.optimizer.param_groups[0]["betas"][0]
    assert total_norm(first_moments(s16)) == pytest.approx((1 - beta1) * clip, rel=2e-2)
    for a, b in zip(first_moments(s16), first_moments(s32)):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3 * (1 - beta1) * clip)
    # AdamW's first update is about lr * sign(grad): float16's noise may flip the sign of a gradient
    # near 0, so the weights agree to 2 lr (the moments above are the sharp check)
    lr = s16.optimizer.param_groups[0]["lr"]
    for p16, p32 in zip(s16.params, s32.params):
        torch.testing.assert_close(p16, p32, rtol=0, atol=2.5 * lr)


# ---------------------------------------------------------------------------------- accumulation
def test_accumulated_gradient_equals_the_one_batch_gradient():
    """Backward before dividing by the micro-steps doubled the gradient; only a DDP test caught it,
    by 3.5e-4 against a 1e-5 tolerance."""
    x, y = batch(4, seed=1)
    whole = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=0.0), train_kw=dict(batch_size=4, total_batch_tokens=4 * T))
    split = make_step(PLAIN_LOSS_MODEL, dict(grad_clip=0.0), train_kw=dict(batch_size=2, total_batch_tokens=4 * T))
    assert (whole.accum, split.accum) == (1, 2)
    loss_whole, norm_whole, _ = one_step(whole, x, y)
    halves = iter([(x[:2], y[:2]), (x[2:], y[2:])])
    loss_split, norm_split, _ = split(lambda: next(halves))
    assert float(loss_split) == pytest.approx(float(loss_whole), rel=1e-6)
    assert float(norm_split) == pytest.approx(float(norm_whole), rel=1e-5)
    for a, b in zip(first_moments(split), first_moments(whole)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    for a, b in zip(split.params, whole.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_step_never_updates_the_weights(fused):
    trainer = make_step(dict(n_layer=1, n_head=2, n_embd=16, block_size=8), dict(fused_adamw=fused), seed=0)
    model, opt, params = trainer.model, trainer.optimizer, trainer.params
    assert trainer.skips_on_device is fused  # fused AdamW skips on the device, the other path reads the flag
    x = torch.randint(0, 50257, (2, 8))
    one_step(trainer, x, x)  # one good step: state exists
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    loss, norm, bad = one_step(trainer, x, x)
    assert bool(bad) and not torch.isfinite(loss)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) or (
            torch.isnan(v).equal(torch.isnan(before[k])) and torch.equal(v.nan_to_num(), before[k].nan_to_num())
        ), k
    for k, v in opt.state[params[0]].items():
        assert torch.equal(v, state_before[k]), k  # moments and step count untouched


def test_cuda_graphs_with_accumulation_are_refused_where_the_step_is_built(never_builds):
    cfg = pico(compile_tuning="reduce-overhead", batch_size=4, total_batch_tokens=8 * 64)
    with pytest.raises(
        GptspeedError, match="reduce-overhead uses CUDA graphs.*2 micro-steps.*max-autotune-no-cudagraphs"
    ) as e:
        TrainStep(cfg, CUDA)
    # the advice that works: one micro-step per step by lowering the global batch to B x T x processes
    # (raising B until it covers GPT-2's 0.5M tokens, as it used to say, cannot fit in memory)
    assert "lower --total-batch-tokens to 256 (B x T x processes)" in str(e.value)
    assert "raise --batch-size" not in str(e.value)


def test_fp8_without_torchao_names_the_package(monkeypatch, never_builds):
    fake_packages(monkeypatch, torchao=False)
    cfg = preset("gpt2").override(dict(fp8=True, batch_size=4))
    with pytest.raises(GptspeedError, match=r"--fp8 needs torchao.*gptspeed\[fp8\]"):
        TrainStep(cfg, dataclasses.replace(CUDA, compile=False))


def test_muon_with_a_grad_scaler_is_refused_for_the_resolved_dtype(never_builds):
    fp16 = dataclasses.replace(CUDA, dtype="float16", autocast_dtype=torch.float16, compile=False)
    with pytest.raises(GptspeedError, match="muon does not support float16"):  # --dtype auto on a V100 resolves so
        TrainStep(pico(optimizer="muon"), fp16)


@pytest.mark.parametrize(
    "missing, says", [("cc", "C compiler"), ("Python.h", "Python's headers"), ("triton", "needs triton")]
)
def test_compile_on_a_gpu_needs_triton_a_c_compiler_and_pythons_headers(
    monkeypatch, tmp_path, never_builds, missing, says
):
    fake_packages(monkeypatch, triton=missing != "triton")
    if missing == "cc":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(step_mod.shutil, "which", lambda name: None)
    if missing == "Python.h":
        monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    with pytest.raises(GptspeedError, match=f"{says}.*--no-compile") as e:
        TrainStep(pico(), CUDA)
    assert "\n" not in str(e.value)
    assert step_mod.compile_toolchain_problem("cpu") is None  # a CPU's inductor checks its own C++ compiler


def test_the_toolchain_check_passes_on_a_machine_that_has_it(monkeypatch):
    fake_packages(monkeypatch, triton=True)
    assert step_mod.compile_toolchain_problem("cuda") is None  # this machine has gcc and Python.h (CI's image too)


def test_auto_batch_resets_the_peak_memory_after_probing(monkeypatch):
    from gptspeed import batchsize

    events = []
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda *a, **k: events.append("probe") or 8)
    monkeypatch.setattr(step_mod, "reset_peak_memory", lambda device: events.append(("reset", device.type)))
    cfg = pico(batch_size=0, total_batch_tokens=64 * 64)
    assert step_mod.auto_batch_size(cfg, dataclasses.replace(CUDA, compile=False), say=lambda m: None) == 8
    assert events == ["probe", ("reset", "cuda")]


def test_the_steps_micro_batches_come_from_the_configuration():

    step = TrainStep(
        pico(n_layer=1, n_embd=16, n_head=2, batch_size=2, total_batch_tokens=3 * 2 * 64),
        resolve_runtime("cpu", "float32", False),
    )
    seen = []

    def next_batch():
        seen.append(1)
        x = torch.randint(0, 50257, (2, 64))
        return x, x

    loss, grad_norm, bad = step(next_batch)
    assert step.accum == 3 and len(seen) == 3 and not bad.item() and torch.isfinite(grad_norm)


@pytest.mark.parametrize(
    "version, ok", [("2.13.0+cpu", True), ("2.9.1", True), ("2.8.0", False), ("2.4.1+cu121", False), ("3.0.0", True)]
)
def test_torch_older_than_the_minimum_is_one_line(version, ok):
    if ok:
        check_torch(version)
    else:
        with pytest.raises(GptspeedError, match=r"needs torch >= 2\.9.*this is torch " + version.replace("+", r"\+")):
            check_torch(version)


def test_an_old_torch_stops_the_cli_with_one_line(monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.5.0" if name == "torch" else real(name))
    proc = run_main("sample", "--run", "nowhere", "--prompt", "x")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "needs torch >= 2.9" in proc.stderr


# ------------------------------------------------------------------------------ the warm-ups' steps
def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_step_of_fewer_micro_batches_averages_the_gradients_of_those_it_reads():
    """``accum=2`` on a run of 4 micro-batches a step (``--batch-warmup-steps``' early steps): the step reads 2
    micro-batches, its loss is their mean, and the gradient it applies is that of their mean loss -- computed
    here on a copy of the model, batch by batch."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(total_batch_tokens=4 * 2 * 16), CPU)
    assert step.accum == 4
    twin = GPT(step.model.config)
    twin.load_state_dict(step.model.state_dict())
    batches = [(torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))) for _ in range(3)]
    want_loss = sum(twin(x, y)[1] for x, y in batches[:2]) / 2
    want_loss.backward()
    reads = iter(batches)
    got = {}
    real = step.optimizer_step
    step.optimizer_step = lambda loss: (got.update(grads_of(step.model)), real(loss))[1]
    loss, _, bad = step(lambda: next(reads), accum=2)
    assert next(reads) is batches[2]  # the third batch is left for the next step
    assert not bad and loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    want = grads_of(twin)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize(
    "arch", [{}, dict(pos_emb="rope", qk_norm=True, doc_mask=True, value_embeds=1, n_layer=2)], ids=["gpt2", "modern"]
)
def test_a_step_at_a_shorter_sequence_length_trains_each_piece_as_its_own_sequence(arch):
    """``seq_len=4`` on ``(2, 16)`` micro-batches (``--seq-len-warmup-steps``' early steps): the loss and gradient
    are those of the 8 sequences of 4 tokens, each run through a copy of the model on its own (positions from 0,
    attention within the piece), averaged over every target."""
    torch.manual_seed(0)
    step = step_mod.TrainStep(small(**arch), CPU)
    twin = GPT(step.model.config)
    twin.load_state_dict(step.model.state_dict())
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    x[0, 6] = x[1, 9] = 50256  # document starts inside pieces, for the document mask
    pieces = [(x[r, i : i + 4][None], y[r, i : i + 4][None]) for r in range(2) for i in range(0, 16, 4)]
    want_loss = sum(twin(a, b)[1] for a, b in pieces) / len(pieces)
    want_loss.backward()
    loss = step.forward_backward(x, y, last_micro_step=True, seq_len=4)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    want, got = grads_of(twin), grads_of(step.model)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    whole = step_mod.TrainStep(small(**arch), CPU)  # the full length is the plain step
    whole.model.load_state_dict(twin.state_dict())
    assert whole.forward_backward(x, y, True, seq_len=16).item() == pytest.approx(twin(x, y)[1].item(), rel=1e-6)


# ------------------------------------------------------------------------------ check_step's wording
@pytest.mark.parametrize("fp8, flag", [(False, "--fp8-lm-head"), (True, "--fp8")])
def test_a_missing_torchao_is_refused_naming_the_flag_that_asked_for_it(monkeypatch, fp8, flag):
    """``--fp8-lm-head`` alone without torchao: the refusal names ``--fp8-lm-head`` (the flag the user gave),
    not ``--fp8``; with both flags it names ``--fp8``."""
    fake_packages(monkeypatch, torchao=False)
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(unvalidated(fp8=fp8, fp8_lm_head=True, loss="plain"), CPU, 1)
    assert str(e.value) == f"{flag} needs torchao, which is not installed: pip install 'gptspeed[fp8]'"


@pytest.mark.parametrize("fp8, flag", [(False, "--fp8-lm-head"), (True, "--fp8")])
def test_the_fp8_device_refusal_names_the_flag_that_asked_for_it(torchao_installed, fp8, flag):
    """torchao found, a CPU: the refusal is the device's (no FP8 tensor cores), in one line naming the flag
    given -- ``--fp8-lm-head`` when only the LM head is converted, ``--fp8`` otherwise."""
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(unvalidated(fp8=fp8, fp8_lm_head=True, loss="plain"), CPU, 1)
    assert str(e.value) == f"{flag} needs an NVIDIA GPU with FP8 tensor cores (H100, L4, ...); not cpu"


@pytest.mark.parametrize("reason", ["", "float32: as asked"])
def test_residual_bfloat16_without_bf16_autocast_is_refused_with_the_dtype_and_its_reason(reason):
    """``--residual-dtype bfloat16`` on a float32 run: one line naming the dtype the run computes in, followed by
    why it resolved so in parentheses when the runtime says why -- and nothing (no empty parentheses) when not."""
    rt = dataclasses.replace(CPU, dtype_reason=reason)
    with pytest.raises(GptspeedError) as e:
        step_mod.check_step(unvalidated(residual_dtype="bfloat16"), rt, 1)
    why = f" ({reason})" if reason else ""
    assert str(e.value) == (
        f"--residual-dtype bfloat16 needs bf16 autocast; this run computes in float32{why}: use "
        "--dtype bfloat16, or --residual-dtype float32"
    )


# ------------------------------------------------------------------------------ TrainStep's options reach their parts
@pytest.mark.parametrize("threads", [0, 3])
def test_threads_sets_torchs_cpu_threads_before_the_model_is_built(monkeypatch, threads):
    """``--threads N`` on a CPU run: torch.set_num_threads(N), before the model is built (its init runs on
    them); 0 leaves PyTorch's default alone; a GPU run leaves the CPU's threads alone."""
    events = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: events.append(("threads", n)))
    real_build = step_mod.build_model
    monkeypatch.setattr(step_mod, "build_model", lambda cfg, rt: events.append("build") or real_build(cfg, rt))
    step_mod.TrainStep(small(threads=threads), CPU)
    assert events == ([("threads", threads)] if threads else []) + ["build"]
    events.clear()
    monkeypatch.setattr(step_mod, "parallelize", lambda model, rt, **kw: model)
    cuda = dataclasses.replace(CPU, device=torch.device("cuda"))
    step_mod.TrainStep(small(threads=threads), cuda, model=Recorder([]))
    assert events == [], "a GPU run must not change the CPU's thread count"


def test_fp8_lm_head_converts_the_lm_head(monkeypatch, torchao_installed):
    """``--fp8-lm-head`` alone: the model's LM head is converted and the blocks are not (torchao's conversion
    and the GPU check are stood in for: this CPU has no FP8)."""
    from gptspeed import fp8

    converted = []
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device, flag="--fp8": None)
    monkeypatch.setattr(fp8, "convert_to_float8", lambda model, **kw: converted.append((model, kw)) or 1)
    step = step_mod.TrainStep(unvalidated(fp8_lm_head=True, loss="plain"), CPU)
    assert converted == [(step.model, dict(blocks=False, lm_head=True))], converted


def fsdp_casts(monkeypatch, cast_weights_once: bool) -> tuple[int, list[float]]:
    """(FSDP2 weight casts, losses) over 2 steps of 2 micro-batches of a 1-block bf16 model under FSDP2 in
    one process: a cast is a fresh unshard of an FSDP group's weights (the block's, the root's)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    casts = [0]
    real = pg.FSDPParamGroup.unshard

    def counting(self, *a, **k):
        if self._all_gather_result is None and not self.is_unsharded:
            casts[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(pg.FSDPParamGroup, "unshard", counting)
    cfg = small(parallel="fsdp", dtype="bfloat16", cast_weights_once=cast_weights_once, total_batch_tokens=2 * 2 * 16)
    torch.manual_seed(0)
    step = step_mod.TrainStep(cfg, dataclasses.replace(CPU_BF16, parallel="fsdp"))
    assert step.accum == 2
    x = torch.randint(0, 100, (8, 17))
    batches = iter([(x[i : i + 2, :-1], x[i : i + 2, 1:]) for i in range(0, 8, 2)])
    casts[0] = 0
    losses = [step(lambda: next(batches))[0].item() for _ in range(2)]
    return casts[0], losses


def test_cast_weights_once_casts_each_fsdp_groups_weights_once_a_step(monkeypatch, group_of_one):
    """``--cast-weights-once`` (FSDP2, bf16): each FSDP group (here the block and the root) casts its weights
    once an optimizer step -- kept from forward to backward and between micro-steps -- where without it each
    micro-step casts every group in its forward and the block again in its backward; the losses are the same."""
    groups, steps, micro = 2, 2, 2
    every, losses = fsdp_casts(monkeypatch, False)
    once, kept = fsdp_casts(monkeypatch, True)
    assert every == (groups + 1) * micro * steps
    assert once == groups * steps, f"{once} casts in {steps} steps: the weights must be cast once a step"
    assert kept == losses


class ShapeRecorder(torch.nn.Module):
    """A stand-in model noting the ``(x, y)`` each forward is given."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.seen = []

    def forward(self, x, y):
        self.seen.append((x, y))
        return None, self.w * x.float().mean()


@pytest.mark.parametrize("batch", [2, 4])
def test_a_step_at_a_shorter_sequence_length_hands_the_model_pieces_of_that_length(batch):
    """``step(next_batch, seq_len=4)`` on ``(batch, 16)`` micro-batches -- including a batch of 4 rows, as many
    as the piece's length: every micro-batch reaches the model as ``(batch * 16 / 4, 4)`` inputs and targets,
    each row the next 4 tokens of the batch in order, the targets aligned with their inputs."""
    model = ShapeRecorder()
    step = step_mod.TrainStep(small(batch_size=batch, total_batch_tokens=2 * batch * 16), CPU, model=model)
    assert step.accum == 2
    batches = [
        (torch.arange(batch * 16).view(batch, 16) + 100 * k, torch.arange(batch * 16).view(batch, 16) - k)
        for k in range(2)
    ]
    reads = iter(batches)
    step(lambda: next(reads), seq_len=4)
    assert len(model.seen) == 2
    for (x, y), (got_x, got_y) in zip(batches, model.seen):
        want_x = torch.stack([x[r, i : i + 4] for r in range(batch) for i in range(0, 16, 4)])
        want_y = torch.stack([y[r, i : i + 4] for r in range(batch) for i in range(0, 16, 4)])
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y), (got_x.shape, got_y.shape)


def test_the_length_warm_up_compiles_one_static_graph_per_length():
    """``--seq-len-warmup-steps`` through a compiled step at lengths 4, 8 and 16 (then 16 and 4 again): one graph
    per length, each of static shapes (no symbolic size among its inputs: dynamo's automatic dynamic shapes would
    make the second length's graph a dynamic one), and the lengths already seen reuse their graph."""
    graphs = []

    def backend(gm, example_inputs):
        shapes = [n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")]
        symbolic = [s for s in shapes if isinstance(s, torch.SymInt)]
        symbolic += [s for s in shapes if isinstance(s, torch.Tensor) for d in s.shape if isinstance(d, torch.SymInt)]
        graphs.append((tuple(shapes[0].shape) if isinstance(shapes[0], torch.Tensor) else None, symbolic))
        return gm.forward

    torch._dynamo.reset()
    cfg = small(seq_len_warmup_steps=3, seq_len_start=4)
    step = step_mod.TrainStep(cfg, dataclasses.replace(CPU, compile=True), backend=backend)
    x = torch.randint(0, 100, (2, 16))
    for t in (4, 8, 16, 16, 4):
        step(lambda: (x, x), seq_len=t)
    torch._dynamo.reset()
    assert all(not symbolic for _, symbolic in graphs), graphs
    assert [len(graphs)] == [3], graphs


def test_a_compiled_step_makes_room_for_a_static_graph_per_length():
    """A warm-up from 1 token to 1,024 trains at 11 lengths: the compiled step raises dynamo's per-function
    cache to hold a graph for each, plus evaluation's and a spare (past the limit dynamo would run the full
    length -- the rest of the run -- eagerly); it never lowers a larger limit."""
    import torch._dynamo.config as dynamo_config

    from gptspeed.schedules import seq_lens

    cfg = small(block_size=1024, seq_len_warmup_steps=1000, seq_len_start=1, max_steps=1001)
    assert seq_lens(cfg) == [2**k for k in range(11)]
    for limit, want in ((8, 13), (64, 64)):
        with dynamo_config.patch(recompile_limit=limit):
            step_mod.TrainStep(cfg, dataclasses.replace(CPU, compile=True), backend="eager")
            assert dynamo_config.recompile_limit == want
    assert seq_lens(small()) == [16]
