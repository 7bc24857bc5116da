"""FP8 matmuls for the transformer blocks' Linear layers (``--fp8``) and for the LM head
(``--fp8-lm-head``), through torchao.

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

The LM head (``--fp8-lm-head``, independent of ``--fp8``) is the largest matmul of a GPT-2 step
(``n_embd x vocab_size``, 768 x 50304 at 124M: 31% of the weight matmuls' FLOPs, 27% counting
attention's, by the 6N + 12LCT count); the modded-nanogpt speedrun's records run it in FP8. It
is converted by the same recipe. torchao's ``Float8Linear.from_float`` keeps the module's
Parameter object, so the head stays tied to the token embedding (``model.lm_head.weight is
model.transformer.wte.weight``): the embedding lookup reads the fp32 master weight, only the
head's matmul casts it to e4m3, and both uses' gradients accumulate into the one fp32 ``.grad``.
Only ``--loss plain`` calls the head module (:meth:`gptspeed.model.GPT.logits`); the chunked
losses and ``--softmax data`` multiply by its weight (or rows of it) directly, where a converted
module would change nothing: :func:`check_fp8_lm_head` and :func:`check_fp8_lm_head_loss` refuse
them. torchao's matmul returns a view made inside its autograd Function, which autograd forbids
writing into, so the converted head is marked ``returns_view`` and the model masks the padded
vocabulary columns out of place (a new tensor; under torch.compile fused into the loss).

CUDA's ``torch._scaled_mm`` (PyTorch's own meta kernel states the rules) wants the first operand
row-major with its inner dimension a multiple of 16, the second column-major with both
dimensions multiples of 16, fp8 operands and fp32 scalar scales. In training every dimension of
the three matmuls of a layer ``(M, K) @ (K, N)`` is an inner dimension once (M = tokens per
micro-batch in the weight gradient), so ``batch_size * seq_len`` must be a multiple of 16:
:func:`check_fp8_shapes` refuses a configuration that breaks it before anything runs. A CPU's
``_scaled_mm`` checks none of this, so the tests run the FP8 path under a helper that does
(``tests/support/cuda_rules.py``).
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
LM_HEAD = "lm_head"


def check_fp8_device(device: torch.device, flag: str = "--fp8") -> None:
    """GptspeedError (one line, naming ``flag``) unless ``device`` is a CUDA GPU with FP8 tensor
    cores (compute capability >= (8, 9): Ada Lovelace, Hopper and newer)."""
    if device.type != "cuda":
        raise GptspeedError(f"{flag} needs an NVIDIA GPU with FP8 tensor cores (H100, L4, ...); not {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise GptspeedError(
            f"{flag} needs compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}"
        )


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
        raise GptspeedError(
            f"--fp8 would convert no layer: at n_embd {model_config.n_embd} every Linear is too small "
            f"for FP8 to pay (largest {biggest[0]}x{biggest[1]}; torchao's rule skips in <= 4096 and "
            f"out <= 1024); drop --fp8"
        )
    tokens = batch_size * seq_len
    if batch_size and tokens % GEMM_MULTIPLE:
        raise GptspeedError(
            f"--fp8 needs batch_size * seq_len to be a multiple of {GEMM_MULTIPLE} (CUDA's FP8 "
            f"matmul); got {batch_size} * {seq_len} = {tokens}: change --batch-size or --seq-len"
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_fp8_lm_head(batch_size: int, seq_len: int, model_config) -> None:
    """Refuse ``--fp8-lm-head`` before the first step, with one line, where the converted head
    would never run or CUDA's ``_scaled_mm`` would refuse it: ``model_config.loss`` ``fused`` or
    ``liger`` (they multiply by the head's weight in chunks, never calling the module);
    ``softmax="data"`` (it multiplies by rows of the weight); ``n_embd`` or ``vocab_size`` not a
    multiple of 16 (the head's matmuls ``(M, n_embd) @ (n_embd, V)``, ``(M, V) @ (V, n_embd)``
    and ``(V, M) @ (M, n_embd)`` have each as an inner dimension or a dimension of the second
    operand; e.g. the tokenizer's 50257); or ``batch_size * seq_len`` (``M``) not a multiple of
    16, as :func:`check_fp8_shapes` for ``--fp8``. ``batch_size`` 0 (``--batch-size auto``, not
    yet known) skips the last. ``--loss auto`` is checked where its device is known
    (:func:`check_fp8_lm_head_loss`). ``model_config``: a :class:`gptspeed.model.GPTConfig`.
    Raises :class:`GptspeedError`."""
    m = model_config
    if m.loss in ("fused", "liger"):
        raise GptspeedError(
            f"--fp8-lm-head converts the LM head module, which only --loss plain calls "
            f"(--loss {m.loss} multiplies by the head's weight in chunks): use --loss plain"
        )
    if m.softmax == "data":
        raise GptspeedError(
            "--fp8-lm-head converts the LM head module, which --softmax data bypasses (it "
            "multiplies by the rows of the data's token ids): use --softmax full, or drop "
            "--fp8-lm-head"
        )
    if m.vocab_size % GEMM_MULTIPLE:
        raise GptspeedError(
            f"--fp8-lm-head needs --vocab-size to be a multiple of {GEMM_MULTIPLE} (CUDA's FP8 "
            f"matmul); got {m.vocab_size}: use --vocab-size {_round_up(m.vocab_size, 64)} (padded to a "
            "multiple of 64; the padding rows are never predicted)"
        )
    if m.n_embd % GEMM_MULTIPLE:
        raise GptspeedError(
            f"--fp8-lm-head needs --n-embd to be a multiple of {GEMM_MULTIPLE} (CUDA's FP8 matmul); "
            f"got {m.n_embd}: change --n-embd (e.g. {_round_up(m.n_embd, GEMM_MULTIPLE)}), or drop "
            "--fp8-lm-head"
        )
    tokens = batch_size * seq_len
    if batch_size and tokens % GEMM_MULTIPLE:
        raise GptspeedError(
            f"--fp8-lm-head needs batch_size * seq_len to be a multiple of {GEMM_MULTIPLE} (CUDA's "
            f"FP8 matmul); got {batch_size} * {seq_len} = {tokens}: change --batch-size or --seq-len"
        )


def check_fp8_lm_head_loss(loss: str, path: str, device_type: str) -> None:
    """GptspeedError (one line) unless ``--loss loss`` resolves to the plain path on ``device_type``:
    ``path`` is what :func:`gptspeed.loss.resolve_loss` resolved it to (``auto`` is ``fused`` on a
    CPU, ``plain`` elsewhere), the caller's to give, as this module imports nothing that imports
    the configuration. The plain path is the one that calls the LM head module ``--fp8-lm-head``
    converts."""
    if path != "plain":
        how = f"--loss {loss} resolves to {path} on {device_type}" if loss == "auto" else f"this run has --loss {loss}"
        raise GptspeedError(
            f"--fp8-lm-head runs only on the plain loss path (the one that calls the LM head module); "
            f"{how}: use --loss plain"
        )


def convert_to_float8(model: nn.Module, *, blocks: bool = True, lm_head: bool = False, skip_small: bool = True) -> int:
    """Convert Linear layers of ``model`` (a :class:`gptspeed.model.GPT`) in place with
    ``torchao.float8.convert_to_float8_training`` (default recipe: tensorwise, fast accumulation
    in the forward matmul), in one pass: with ``blocks`` (``--fp8``) the transformer blocks'
    eligible layers (:func:`fp8_eligible`; ``skip_small=False`` converts small layers too, for
    tests), with ``lm_head`` (``--fp8-lm-head``) the LM head -- whatever its size: at any GPT-2
    vocabulary it is far above torchao's threshold. A tied head stays tied (torchao keeps the
    Parameter object; re-tied if a release did not) and is marked ``returns_view`` (see the
    module's docstring). Returns the number of layers converted. GptspeedError if torchao is
    missing."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        flag = "--fp8" if blocks else "--fp8-lm-head"
        raise GptspeedError(f"{flag} needs torchao: pip install 'gptspeed[fp8]' (torchao=={TORCHAO_VERSION})") from None
    names = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        ok = (lm_head and fqn == LM_HEAD) or (
            blocks and fp8_eligible(fqn, module.in_features, module.out_features, skip_small)
        )
        if ok:
            names.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=keep)
    if LM_HEAD in names:
        model.lm_head.returns_view = True
        if model.config.tie_embeddings and model.lm_head.weight is not model.transformer.wte.weight:
            model.lm_head.weight = model.transformer.wte.weight
    return len(names)
