"""``gptspeed.cpu``: the host CPU: its bf16 matmul flags (/proc/cpuinfo), the dtype and compile defaults they give on a CPU (measured: benchmarks/LOG.md), and glibc's allocator kept from returning a step's freed memory (``mallopt`` through ctypes)."""

from __future__ import annotations

import os

from gptspeed.cpu import cpu_has_native_bf16, default_cpu_dtype

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


def test_native_bf16_reads_proc_cpuinfo_by_default():
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            assert cpu_has_native_bf16() == cpu_has_native_bf16(f.read())


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
