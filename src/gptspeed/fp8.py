"""FP8 matmuls for the transformer blocks' Linear layers (``--fp8``), with ``torch._scaled_mm``.

Per-tensor dynamic scaling, recomputed every call from the tensor's absolute maximum (no amax
history): activations and weights are cast to ``float8_e4m3fn`` (more mantissa) for the forward
matmul, the output gradient to ``float8_e5m2`` (more range) for the two backward matmuls, as in
Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv:2209.05433), and torchao's
float8 training recipe ("tensorwise"). Accumulation is in fp32 inside ``_scaled_mm``; outputs
come back in the autocast dtype (bf16) or fp32. The master weights stay fp32.

Only the blocks' ``c_attn``, ``c_proj`` and ``c_fc`` are converted (:func:`convert_to_float8`);
the embeddings and the tied LM head stay in bf16, which is what torchao and modded-nanogpt do
for the numerically sensitive ends of the network. Conversion changes each Linear's class in
place, so parameter names and the state dict are unchanged (checkpoints load either way).

``torch._scaled_mm`` is fast only on GPUs with FP8 tensor cores (compute capability >= 8.9:
Ada, Hopper); :func:`check_fp8_device` refuses anything else with a one-line error. It also runs
on a CPU in recent PyTorch (slowly), which is how the tests check the numerics.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gptspeed.errors import GptspeedError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def check_fp8_device(device: torch.device) -> None:
    """GptspeedError (one line) unless ``device`` is a CUDA GPU with FP8 tensor cores
    (compute capability >= (8, 9): Ada Lovelace, Hopper and newer)."""
    if device.type != "cuda":
        raise GptspeedError(f"--fp8 needs an NVIDIA GPU with FP8 tensor cores (H100, L4, ...); not {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise GptspeedError(f"--fp8 needs compute capability 8.9 or newer (Ada, Hopper); "
                            f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")


def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic scaling: returns ``(x_fp8, inv_scale)`` with ``x ~= x_fp8.float() * inv_scale``.

    ``scale = fp8_max / amax(|x|)`` (amax clamped to 1e-12 so an all-zero tensor is fine); values
    are saturated to ``[-fp8_max, fp8_max]`` (448 for e4m3fn, 57344 for e5m2) before the cast.
    ``inv_scale`` is a 0-dim fp32 tensor on ``x``'s device -- what ``torch._scaled_mm`` takes as
    ``scale_a`` / ``scale_b``. No host-device sync.
    """
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = fmax / amax
    x_fp8 = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return x_fp8, scale.reciprocal()


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for fp8 ``a`` ``(M, K)`` and ``b`` ``(K, N)``, fp32 accumulation.
    ``_scaled_mm`` wants ``a`` row-major and ``b`` column-major; K and N multiples of 16."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """``y = x @ w.T`` with e4m3 inputs forward and e5m2 output gradients backward."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype):
        x8, x_inv = quantize(x2d, E4M3)
        w8, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.out_dtype, ctx.x_dtype, ctx.w_dtype = out_dtype, x2d.dtype, weight.dtype
        return _mm(x8, x_inv, w8.t(), w_inv, out_dtype)  # (M, N)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g8, g_inv = quantize(grad, E5M2)
        grad_x = _mm(g8, g_inv, w8, w_inv, ctx.out_dtype).to(ctx.x_dtype)  # (M, N) @ (N, K)
        grad_w = _mm(g8.t(), g_inv, x8, x_inv, torch.float32).to(ctx.w_dtype)  # (N, M) @ (M, K)
        return grad_x, grad_w, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs in FP8 through :class:`_Float8Matmul`.

    Input ``(..., in_features)`` in fp32 or the autocast dtype; output ``(..., out_features)`` in
    the autocast dtype when autocast is on, else fp32. ``in_features`` and ``out_features`` must
    be multiples of 16 (``_scaled_mm``); the bias is added in the output dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else torch.float32
        shape = x.shape
        with torch.autocast(x.device.type, enabled=False):
            y = _Float8Matmul.apply(x.reshape(-1, shape[-1]), self.weight, out_dtype)
            if self.bias is not None:
                y = y + self.bias.to(out_dtype)
        return y.view(*shape[:-1], self.out_features)


def convert_to_float8(model: nn.Module) -> int:
    """Turn the transformer blocks' Linear layers (``BLOCK_LINEARS`` of every ``transformer.h.*``)
    into :class:`Float8Linear` in place; embeddings and the LM head are left alone. Returns the
    number converted. ValueError if a layer's dimensions are not multiples of 16."""
    n = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.startswith("transformer.h.") and name.endswith(BLOCK_LINEARS):
            if module.in_features % 16 or module.out_features % 16:
                raise ValueError(f"{name}: FP8 matmuls need dimensions divisible by 16, got "
                                 f"{module.out_features}x{module.in_features}")
            module.__class__ = Float8Linear
            n += 1
    return n
