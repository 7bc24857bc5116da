"""FP8 matmuls for the transformer blocks' Linear layers (``--fp8``), through torchao.

The layers are converted with ``torchao.float8.convert_to_float8_training`` (torchao's float8
training, the implementation torchtitan uses: tensorwise dynamic scaling, e4m3 inputs and
weights, e5m2 output gradients, fp32 accumulation inside ``torch._scaled_mm``, fast
accumulation in the forward matmul; Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
arXiv:2209.05433). torchao is an optional dependency: ``pip install 'gptspeed[fp8]'``.

Which layers: only the blocks' ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc`` and
``mlp.c_proj`` (the embeddings and the tied LM head stay in the autocast dtype, as torchtitan
keeps its output layer), and of those only layers large enough to gain, by torchao's rule for
the tensorwise recipe (``torchao.float8.float8_linear_utils._auto_filter_for_tensorwise`` in
torchao 0.18, from its H100 microbenchmarks; torchtitan's ``auto_filter_small_kn``): both
dimensions multiples of 16, and not ``in_features <= 4096 and out_features <= 1024``. At GPT-2
124M (n_embd 768) that keeps ``c_attn`` (768 -> 2304) and ``c_fc`` (768 -> 3072) and skips both
``c_proj`` layers. Conversion swaps modules but keeps their parameters, so parameter names and
the state dict are unchanged (checkpoints load either way).

CUDA's ``torch._scaled_mm`` (PyTorch's own meta kernel states the rules) wants the first operand
row-major with its inner dimension a multiple of 16, the second column-major with both
dimensions multiples of 16, fp8 operands and fp32 scalar scales. In training every dimension of
the three matmuls of a layer ``(M, K) @ (K, N)`` is an inner dimension once (M = tokens per
micro-batch in the weight gradient), so ``batch_size * seq_len`` must be a multiple of 16:
:func:`check_fp8_shapes` refuses a configuration that breaks it before anything runs. A CPU's
``_scaled_mm`` checks none of this, so the tests run the FP8 path under a helper that does
(``tests/cuda_rules.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gptspeed.errors import GptspeedError

#: the torchao release gptspeed is tested with (the ``fp8`` extra pins it).
TORCHAO_VERSION = "0.18.0"
#: CUDA's ``_scaled_mm`` needs its dimensions to be multiples of this.
GEMM_MULTIPLE = 16
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


def large_enough(in_features: int, out_features: int) -> bool:
    """torchao's tensorwise rule (H100 microbenchmarks): a Linear gains from FP8 unless
    ``in_features <= 4096 and out_features <= 1024``."""
    return not (in_features <= 4096 and out_features <= 1024)


def fp8_eligible(name: str, in_features: int, out_features: int, skip_small: bool = True) -> bool:
    """Whether the Linear ``name`` (``in_features -> out_features``) is converted: one of the
    blocks' :data:`BLOCK_LINEARS`, dimensions multiples of 16 and, with ``skip_small``,
    :func:`large_enough`."""
    if not (name.startswith("transformer.h.") and name.endswith(BLOCK_LINEARS)):
        return False
    if in_features % GEMM_MULTIPLE or out_features % GEMM_MULTIPLE:
        return False
    return large_enough(in_features, out_features) or not skip_small


def block_linears(n_embd: int) -> dict[str, tuple[int, int]]:
    """``{name: (in_features, out_features)}`` of one GPT-2 block's Linear layers."""
    C = n_embd
    return {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}


def check_fp8_shapes(batch_size: int, seq_len: int, model_config) -> None:
    """Refuse ``--fp8`` before the first step, with one line, when CUDA's ``_scaled_mm`` would:
    ``batch_size * seq_len`` (the M of every converted layer's matmuls) not a multiple of 16;
    or when no Linear layer of ``model_config`` (a :class:`gptspeed.model.GPTConfig`) is
    converted, so ``--fp8`` would change nothing. ``batch_size`` 0 (``--batch-size auto``, not
    yet known) checks only the layers. Raises :class:`GptspeedError`."""
    layers = {n: d for n, d in block_linears(model_config.n_embd).items() if fp8_eligible("transformer.h.0." + n, *d)}
    if not layers:
        biggest = max(block_linears(model_config.n_embd).values(), key=lambda d: d[0] * d[1])
        raise GptspeedError(f"--fp8 would convert no layer: at n_embd {model_config.n_embd} every Linear is too small "
                            f"for FP8 to pay (largest {biggest[0]}x{biggest[1]}; torchao's rule skips in <= 4096 and "
                            f"out <= 1024); drop --fp8")
    tokens = batch_size * seq_len
    if batch_size and tokens % GEMM_MULTIPLE:
        raise GptspeedError(f"--fp8 needs batch_size * seq_len to be a multiple of {GEMM_MULTIPLE} (CUDA's FP8 "
                            f"matmul); got {batch_size} * {seq_len} = {tokens}: change --batch-size or --seq-len")


def convert_to_float8(model: nn.Module, *, skip_small: bool = True) -> int:
    """Convert the transformer blocks' eligible Linear layers (:func:`fp8_eligible`) of ``model``
    in place with ``torchao.float8.convert_to_float8_training`` (default recipe: tensorwise,
    fast accumulation in the forward matmul). ``skip_small=False`` converts small layers too
    (for tests). Returns the number of layers converted. GptspeedError if torchao is missing."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise GptspeedError(f"--fp8 needs torchao: pip install 'gptspeed[fp8]' (torchao=={TORCHAO_VERSION})") from None
    names = []

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = isinstance(module, nn.Linear) and fp8_eligible(fqn, module.in_features, module.out_features, skip_small)
        if ok:
            names.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=keep)
    return len(names)
