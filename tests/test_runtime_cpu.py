"""The CPU defaults of :func:`gptspeed.runtime.resolve_runtime` (issue 14): bf16 only where the CPU
multiplies bf16 natively, compile only for runs long enough to repay it, the compile cache, and
glibc's malloc keeping freed memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import child_env

from gptspeed.cpu import cpu_has_native_bf16, default_cpu_dtype
from gptspeed.runtime import resolve_runtime

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763
flags\t\t: fpu vme de pse tsc msr avx avx2 fma f16c bmi2 sha_ni vaes
"""
ZEN4 = ZEN3.replace("vaes", "vaes avx512f avx512bw avx512_bf16")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16 i8mm\n"


def test_native_bf16_is_read_from_cpu_flags():
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS)
    assert cpu_has_native_bf16(ZEN4)  # avx512_bf16 alone
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS.replace(" avx512_bf16", ""))  # amx_bf16 alone
    assert not cpu_has_native_bf16(ZEN3)
    assert not cpu_has_native_bf16(ARM)  # not measured: not counted
    assert not cpu_has_native_bf16("")
    # a flag's name must match whole, not as a substring of another
    assert not cpu_has_native_bf16(ZEN3.replace("vaes", "vaes xavx512_bf16x"))


def test_auto_dtype_on_cpu_follows_native_bf16():
    assert default_cpu_dtype(SAPPHIRE_RAPIDS)[0] == "bfloat16"
    dtype, reason = default_cpu_dtype(ZEN3)
    assert dtype == "float32" and "no native bf16" in reason


def test_resolve_runtime_cpu_auto_dtype_matches_this_machine():
    rt = resolve_runtime("cpu", "auto", compile=False)
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert rt.dtype == expected
    assert rt.autocast_dtype == (torch.bfloat16 if expected == "bfloat16" else None)
    assert rt.dtype_reason
    # an explicit dtype is kept, whatever the CPU
    assert resolve_runtime("cpu", "float32", compile=False).dtype == "float32"
    assert resolve_runtime("cpu", "bfloat16", compile=False).dtype == "bfloat16"


def test_explicit_compile_is_kept_on_cpu():
    assert resolve_runtime("cpu", "float32", compile=True).compile is True
    assert resolve_runtime("cpu", "float32", compile=False).compile is False


def test_native_bf16_reads_proc_cpuinfo_by_default():
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            assert cpu_has_native_bf16() == cpu_has_native_bf16(f.read())


def test_compile_uses_a_persistent_cache_folder(tmp_path, monkeypatch):
    from gptspeed.model import GPT, GPTConfig
    from gptspeed.parallelize import parallelize

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
    parallelize(model, resolve_runtime("cpu", "float32", compile=False))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ""  # no compile: nothing set
    parallelize(model, resolve_runtime("cpu", "float32", compile=True), backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    # a folder the user chose is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    parallelize(model, resolve_runtime("cpu", "float32", compile=True), backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_auto_compile_on_cpu_only_where_measured_to_pay():
    from gptspeed.cpu import CPU_BF16_COMPILE_BREAK_EVEN_STEPS as N
    from gptspeed.cpu import default_cpu_compile

    # float32: measured no faster than eager, whatever the run's length
    on, reason = default_cpu_compile("float32", 10**6, SAPPHIRE_RAPIDS)
    assert not on and "float32" in reason
    # bf16 with native bf16 matmuls: on only for runs longer than the break-even
    assert default_cpu_compile("bfloat16", N + 1, SAPPHIRE_RAPIDS)[0]
    on, reason = default_cpu_compile("bfloat16", N, SAPPHIRE_RAPIDS)
    assert not on and str(N) in reason
    assert not default_cpu_compile("bfloat16", None, SAPPHIRE_RAPIDS)[0]  # length unknown
    # bf16 emulated (no native matmuls): off
    assert not default_cpu_compile("bfloat16", 10**6, ZEN3)[0]


def test_resolve_runtime_auto_compile_on_this_cpu():
    long_run = resolve_runtime("cpu", "auto", compile=None, planned_steps=10**6)
    assert long_run.compile == (long_run.dtype == "bfloat16" and cpu_has_native_bf16())
    assert long_run.compile_reason.startswith("on" if long_run.compile else "off")
    assert resolve_runtime("cpu", "auto", compile=None, planned_steps=1).compile is False
    assert resolve_runtime("cpu", "auto", compile=None).compile is False  # length unknown


FAULTS_SCRIPT = """
import resource, sys, torch
from gptspeed.cpu import keep_freed_memory

def faults_of_steps(n=5):
    # a CPU training step's pattern at GPT-2 124M: two 154 MB fp32 buffers (50304 x 768, the tied
    # embedding's gradients) allocated, written and freed every step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = torch.empty(50304, 768).fill_(1.0)
        b = torch.empty(50304, 768).fill_(2.0)
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_steps(1)
plain = faults_of_steps()
applied, reason = keep_freed_memory()
for _ in range(4):  # the heap grows to the steps' peak once (measured: within 10 steps here)
    faults_of_steps()
kept = faults_of_steps()
print(plain, kept, applied, reason, sep="|")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_stops_page_faulting_a_steps_large_buffers_in_again():
    res = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert res.returncode == 0, res.stderr
    plain, kept, applied, reason = res.stdout.strip().split("|")
    assert applied == "True", reason
    pages = 50304 * 768 * 4 // 4096  # of one buffer
    # glibc mmaps a buffer this large and unmaps it on free: every page of both faults in again every step
    assert int(plain) >= 5 * 2 * pages, plain
    # kept: once the heap has grown to the steps' peak, the freed memory is reused, already mapped
    assert int(kept) < 1000, kept


def test_threads_setting_sets_torchs_intra_op_threads_on_a_cpu_and_zero_leaves_them():
    from conftest import TINY_MODEL, make_step

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        make_step(TINY_MODEL, threads=0)
        assert torch.get_num_threads() == 2  # 0: PyTorch's own choice, untouched
        make_step(TINY_MODEL, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
