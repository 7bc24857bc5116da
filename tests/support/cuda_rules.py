"""CUDA's ``torch._scaled_mm`` rules, enforced on the CPU.

The CPU kernel of ``torch._scaled_mm`` multiplies whatever it is given; the CUDA kernel (cuBLASLt)
refuses, and PyTorch's own meta kernel for non-CPU devices states the rules: the first operand
row-major with its inner dimension a multiple of 16, the second column-major with both
dimensions multiples of 16, both operands float8, the scales fp32 (one value each for
tensorwise scaling, or ``(M, 1)`` and ``(1, N)`` for rowwise), no bias with an fp32 output. Run
FP8 code under :func:`cuda_scaled_mm_rules` and a call a GPU would refuse raises here too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class CudaRuleError(AssertionError):
    """A ``_scaled_mm`` call that CUDA would refuse."""


@dataclass
class ScaledMMCall:
    shape_a: tuple[int, int]
    shape_b: tuple[int, int]
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    out_dtype: torch.dtype | None
    use_fast_accum: bool


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0))


def check_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """Raise :class:`CudaRuleError` naming the first rule the call breaks."""
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise CudaRuleError(f"operands must be matrices, got {tuple(mat1.shape)} and {tuple(mat2.shape)}")
    if mat1.dtype not in FP8 or mat2.dtype not in FP8:
        raise CudaRuleError(f"operands must be float8, got {mat1.dtype} and {mat2.dtype}")
    if not _row_major(mat1):
        raise CudaRuleError(f"mat1 must be row-major, got shape {tuple(mat1.shape)} stride {mat1.stride()}")
    if not _col_major(mat2):
        raise CudaRuleError(f"mat2 must be column-major, got shape {tuple(mat2.shape)} stride {mat2.stride()}")
    if mat1.size(1) % 16:
        raise CudaRuleError(f"mat1's inner dimension must be a multiple of 16, got {tuple(mat1.shape)}")
    if mat2.size(0) % 16 or mat2.size(1) % 16:
        raise CudaRuleError(f"both dimensions of mat2 must be multiples of 16, got {tuple(mat2.shape)}")
    M, N = mat1.size(0), mat2.size(1)
    for name, s, rowwise in (("scale_a", scale_a, (M, 1)), ("scale_b", scale_b, (1, N))):
        if s is None or s.dtype != torch.float32:
            raise CudaRuleError(f"{name} must be an fp32 tensor, got {None if s is None else s.dtype}")
        if s.numel() != 1 and tuple(s.shape) != rowwise:
            raise CudaRuleError(
                f"{name} must hold one value (tensorwise) or be {rowwise} (rowwise), got {tuple(s.shape)}"
            )
    if bias is not None and out_dtype == torch.float32:
        raise CudaRuleError("bias is not supported with an fp32 output")


@contextlib.contextmanager
def cuda_scaled_mm_rules():
    """Within the block, ``torch._scaled_mm`` checks CUDA's rules before it runs; yields the list
    of :class:`ScaledMMCall` made, for the test to inspect."""
    real = torch._scaled_mm
    calls: list[ScaledMMCall] = []

    def strict(
        mat1,
        mat2,
        scale_a=None,
        scale_b=None,
        bias=None,
        scale_result=None,
        out_dtype=None,
        use_fast_accum=False,
        **kwargs,
    ):
        check_scaled_mm(mat1, mat2, scale_a, scale_b, bias, out_dtype)
        calls.append(
            ScaledMMCall(tuple(mat1.shape), tuple(mat2.shape), mat1.dtype, mat2.dtype, out_dtype, bool(use_fast_accum))
        )
        return real(
            mat1,
            mat2,
            scale_a=scale_a,
            scale_b=scale_b,
            bias=bias,
            scale_result=scale_result,
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
            **kwargs,
        )

    torch._scaled_mm = strict
    try:
        yield calls
    finally:
        torch._scaled_mm = real
