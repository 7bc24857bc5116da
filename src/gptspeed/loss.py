"""Fused linear + cross-entropy: the LM-head loss without materialising the full logits.

The plain path computes logits ``(N, V)`` (N = B*T tokens, V = 50304), upcasts them to fp32,
takes a log-softmax and keeps it for backward: several passes over ``N * V * 4`` bytes (412 MB
for N = 2048) plus the allocator's page faults for each fresh buffer. Here the rows are taken
in chunks: each chunk's logits are computed, reduced to the loss, turned into
``dlogits = softmax - onehot`` and consumed at once by the two gradient matmuls, so only one
chunk of logits exists at a time and it stays hot in cache. Backward then only scales the
gradients that forward already produced. FLOPs are the same as the plain path; without
gradients (``torch.no_grad()``, evaluation) only the loss is computed: a third of them.

The chunk loop is a ``torch.library.custom_op`` (``gptspeed::fused_linear_cross_entropy``) with
a fake (shape-only) implementation and a registered backward, so ``torch.compile`` sees one
opaque op: no graph break, and compile time does not grow with the number of chunks (dynamo
would otherwise unroll the loop: 78 s of compile for 25 chunks).

Precision. The matmuls run in ``compute_dtype`` (the autocast dtype, chosen by
:func:`fused_linear_cross_entropy`, not by autocast inside the op); the softmax in fp32. The
gradient kept from forward is that of the *sum* of the per-token losses, ``softmax - onehot``
(every value in [-1, 1]: representable in fp16 / bf16 without a loss scale), and the weight
gradient is accumulated over chunks in fp32; the upstream gradient, which carries ``1 / N`` and
a GradScaler's scale, is applied in backward in fp32. Folding ``1 / N`` into the fp16 dlogits
instead (as this module once did) flushes most of the vocabulary's gradients to zero at
N = 16,384 tokens.

Technique: the chunked "fused linear cross-entropy" of Liger-Kernel (Hsu et al. 2024,
arXiv:2410.10989) and Wijmans et al. 2024 ("Cut Your Losses in Large-Vocabulary Language
Models", arXiv:2411.09009), written here in plain PyTorch; custom ops as in PyTorch's
"Python custom operators" tutorial (``torch.library.custom_op``, ``register_fake``,
``register_autograd``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from gptspeed.config import LOSSES
from gptspeed.errors import GptspeedError

#: target size of one chunk of logits, in elements: 16 MiB of fp32 on a CPU (measured on the
#: 2-core CPU this project is built on, larger chunks were no faster), 128 MiB on a GPU (fewer,
#: larger kernels). Rows per chunk are rounded down to a multiple of :data:`CHUNK_ROW_MULTIPLE`
#: (at least one multiple): at V = 50304 that is 128 rows (25 MB of fp32) on a CPU and 640 on a GPU.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 25}
#: chunk rows are a multiple of this: whole tensor-core tiles for the three matmuls.
CHUNK_ROW_MULTIPLE = 128


def resolve_loss(name: str, device_type: str) -> str:
    """The loss path to run for ``--loss name`` on a device: ``"fused"`` or ``"plain"``.

    ``auto`` is ``plain`` (full logits, then ``F.cross_entropy``: the anchors' path, as
    build-nanogpt measured it on an A100) everywhere but the CPU, until a GPU measurement
    shows the chunked loss faster there; on the CPU it is ``fused``, which measured 2.13x
    faster at the nano shape and even (0.98x) at GPT-2 124M with B=4, T=64 on this project's
    2-core CPU (benchmarks/LOG.md, "Fused vs plain loss on the CPU").
    ``fused``, ``plain`` and ``liger`` (:func:`liger_linear_cross_entropy`) are returned as they
    are. GptspeedError for any other name.
    """
    if name not in LOSSES:
        raise GptspeedError(f"--loss must be one of {', '.join(LOSSES)}, got {name!r}")
    if name != "auto":
        return name
    return "fused" if device_type == "cpu" else "plain"


def liger_problem(device_type: str) -> str | None:
    """Why ``--loss liger`` cannot run on ``device_type`` (one line), or None: Liger-Kernel's kernels
    are Triton kernels (CUDA only), and the package must be installed."""
    if device_type != "cuda":
        return f"--loss liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU (not {device_type}): use --loss fused"
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "--loss liger needs Liger-Kernel, which is not installed: pip install liger-kernel (or use --loss fused)"
    return None


def liger_linear_cross_entropy(
    x: Tensor, weight: Tensor, targets: Tensor, valid_vocab_size: int | None = None, softcap: float = 0.0
) -> Tensor:
    """Mean cross-entropy of ``x @ weight[:valid_vocab_size].T`` against ``targets`` through
    Liger-Kernel's fused linear + cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton
    Kernels for LLM Training", arXiv:2410.10989; ``liger_kernel.ops.fused_linear_cross_entropy``):
    chunked like :func:`fused_linear_cross_entropy`, with the logits' gradient computed in the
    forward so the ``(N, V)`` logits are never kept. ``x`` ``(N, C)``, ``weight`` ``(V, C)`` (the tied
    embedding), ``targets`` ``(N,)`` int64; the padded vocabulary rows (``valid_vocab_size`` onwards)
    are left out of the softmax by slicing the weight (a view: their gradient stays zero); ``softcap``:
    Liger's own tanh soft-capping (0 = off). Returns a 0-dim fp32 tensor. GptspeedError where :func:`liger_problem` says it cannot run."""
    problem = liger_problem(x.device.type)
    if problem:
        raise GptspeedError(problem)
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if valid_vocab_size is not None and valid_vocab_size < weight.size(0):
        weight = weight[:valid_vocab_size]
    if softcap:  # positional: bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap
        return LigerFusedLinearCrossEntropyFunction.apply(
            x, weight, targets, None, None, -100, 0.0, 0.0, "mean", float(softcap)
        )[0].float()
    return LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets)[0].float()  # (loss, z_loss, ...)


def default_chunk_rows(vocab_size: int, device_type: str) -> int:
    """Rows per chunk for a ``(rows, vocab_size)`` block of logits of about
    :data:`CHUNK_ELEMENTS` elements, rounded down to a multiple of :data:`CHUNK_ROW_MULTIPLE`."""
    rows = CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cuda"]) // vocab_size
    return max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


_ADDMM_INTO_FP32 = True  # until this torch's CUDA addmm refuses an fp32 accumulator for 16-bit inputs


def _accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor, scratch: Tensor) -> None:
    """``acc += a @ b`` with fp32 products and sums for 16-bit ``a`` ``(V, n)`` and ``b``
    ``(n, C)`` into fp32 ``acc`` ``(V, C)``, in place. ``scratch`` is an fp32 tensor of ``a``'s
    shape whose contents may be overwritten.

    On CUDA, ``addmm`` with ``out_dtype=float32`` (fp16/bf16 tensor-core inputs, fp32 output)
    writes into ``acc`` directly; if this torch refuses an fp32 ``acc`` there, the product goes
    through ``mm(..., out_dtype=float32)`` and an add (or, in a torch without ``out_dtype``, a
    16-bit product per chunk, added in fp32). Elsewhere (no ``out_dtype`` kernel on the
    CPU) it is an fp32 ``addmm_`` of the same values: the same numbers, no (V, C) temporary.
    """
    global _ADDMM_INTO_FP32
    if acc.device.type == "cuda":
        if _ADDMM_INTO_FP32:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # refused before any launch, if at all
                return
            except (RuntimeError, TypeError):
                _ADDMM_INTO_FP32 = False
        try:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
        except TypeError:  # an older torch without out_dtype: the chunk's product in 16 bits, summed in fp32
            acc.add_((a @ b).float())
    else:
        acc.addmm_(scratch.copy_(a), b.float())


def _chunk_logits(xc: Tensor, w: Tensor, valid_vocab_size: int, softcap: float) -> tuple[Tensor, Tensor | None]:
    """One chunk's logits ``(n, V)`` fp32 from ``xc`` ``(n, C)`` and ``w`` ``(V, C)`` (the compute
    dtype), soft-capped, the padding columns -inf; and, with ``softcap``, ``tanh(u / c)`` (the
    gradient's factor), else None."""
    logits = (xc @ w.t()).float()  # (n, V) fp32 (a fresh buffer: the matmul's own in fp32)
    capped = None
    if softcap > 0:
        capped = logits.div_(softcap).tanh_()  # in place: tanh(u / c), kept for the gradient
        logits = capped * softcap
    if w.shape[0] > valid_vocab_size:
        logits[:, valid_vocab_size:] = float("-inf")  # padding: never predicted
    return logits, capped


@torch.library.custom_op("gptspeed::fused_linear_cross_entropy", mutates_args=())
def _fused_lce(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    valid_vocab_size: int,
    chunk_rows: int,
    compute_dtype: torch.dtype,
    need_grad: bool,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sum over rows of ``logsumexp(logits) - logits[target]`` and, with ``need_grad``, its
    gradients: ``(loss_sum, grad_x, grad_w)`` = fp32 0-dim, ``(N, C)`` in ``x.dtype``, ``(V, C)``
    fp32; without ``need_grad`` the two gradients are empty and no gradient matmul runs. With
    ``softcap`` c > 0 the logits are ``c * tanh(x @ w.T / c)`` (Gemma 2), and the chain rule's
    ``1 - tanh^2`` multiplies the logits' gradient."""
    N = x.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        xs = x.to(compute_dtype)
        w = weight.to(compute_dtype)  # one cast for all chunks (a no-op in fp32)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else x.new_empty(0)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_grad else x.new_empty(0)
        for start in range(0, N, chunk_rows):
            xc = xs[start : start + chunk_rows]  # (n, C)
            tc = targets[start : start + chunk_rows]  # (n,)
            logits, capped = _chunk_logits(xc, w, valid_vocab_size, softcap)  # (n, V) fp32
            target_logit = logits.gather(1, tc.unsqueeze(1)).squeeze(1)  # (n,)
            if not need_grad:
                loss += (torch.logsumexp(logits, dim=1) - target_logit).sum()
                continue
            # softmax in place: max, subtract, exp, normalise -- no (n, V) temporaries
            m = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(m).exp_()
            s = probs.sum(dim=1, keepdim=True)
            loss += (m.squeeze(1) + s.log().squeeze(1) - target_logit).sum()
            probs.div_(s)
            probs[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0  # dlogits = softmax - onehot
            if softcap > 0:
                probs.mul_(1.0 - capped.square_())  # d(c tanh(u/c))/du = 1 - tanh^2(u/c)
            if compute_dtype == torch.float32:
                torch.mm(probs, w, out=grad_x[start : start + chunk_rows])  # (n, C)
                grad_w.addmm_(probs.t(), xc)  # (V, C), accumulated in place: no temporary
            else:
                g = probs.to(compute_dtype)  # (n, V), |values| <= 1
                grad_x[start : start + chunk_rows] = (g @ w).to(x.dtype)  # (n, C)
                _accumulate_fp32(grad_w, g.t(), xc, scratch=probs.t())  # (V, C) in fp32
    return loss, grad_x, grad_w


@_fused_lce.register_fake
def _(x, weight, targets, valid_vocab_size, chunk_rows, compute_dtype, need_grad, softcap=0.0):
    loss = x.new_empty((), dtype=torch.float32)
    if not need_grad:
        return loss, x.new_empty(0), x.new_empty(0)
    return loss, torch.empty_like(x), x.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[0], inputs[1]
    _, grad_x, grad_w = output
    ctx.save_for_backward(grad_x, grad_w)
    ctx.dtypes = (x.dtype, weight.dtype)
    ctx.mark_non_differentiable(grad_x, grad_w)
    ctx.set_materialize_grads(False)  # no zero tensors for the two gradient outputs' gradients


def _backward(ctx, grad_loss, _grad_grad_x, _grad_grad_w):
    grad_x, grad_w = ctx.saved_tensors
    if grad_x.numel() == 0 and grad_w.numel() == 0:
        raise RuntimeError(
            "fused_linear_cross_entropy ran without gradients (need_grad=False); it cannot be differentiated"
        )
    x_dtype, w_dtype = ctx.dtypes
    g = grad_loss.float()  # carries 1/N and any loss scale: applied in fp32
    dx = grad_x * g if grad_x.dtype == torch.float32 else (grad_x.float() * g).to(x_dtype)
    dw = (grad_w * g).to(w_dtype)
    return dx, dw, None, None, None, None, None, None


_fused_lce.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("gptspeed::linear_cross_entropy_rows", mutates_args=())
def _lce_rows(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    valid_vocab_size: int,
    chunk_rows: int,
    compute_dtype: torch.dtype,
    softcap: float = 0.0,
) -> Tensor:
    """Each row's ``logsumexp(logits) - logits[target]``, ``(N,)`` fp32: the rows :func:`_fused_lce`
    sums, chunked the same way, without gradients (evaluation: no autograd formula is registered)."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        xs, w = x.to(compute_dtype), weight.to(compute_dtype)
        for start in range(0, x.shape[0], chunk_rows):
            logits, _ = _chunk_logits(xs[start : start + chunk_rows], w, valid_vocab_size, softcap)  # (n, V)
            tc = targets[start : start + chunk_rows].unsqueeze(1)  # (n, 1)
            out[start : start + chunk_rows] = torch.logsumexp(logits, dim=1) - logits.gather(1, tc).squeeze(1)
    return out


@_lce_rows.register_fake
def _(x, weight, targets, valid_vocab_size, chunk_rows, compute_dtype, softcap=0.0):
    return x.new_empty(x.shape[0], dtype=torch.float32)


def compute_dtype_for(x: Tensor) -> torch.dtype:
    """The dtype the LM-head matmuls run in: the autocast dtype when autocast is on for
    ``x``'s device, else ``x.dtype`` (also on devices autocast does not know, e.g. ``meta``)."""
    if x.device.type in ("cpu", "cuda", "mps", "xpu") and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def fused_linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    valid_vocab_size: int | None = None,
    chunk_rows: int | None = None,
    softcap: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Mean cross-entropy of ``softmax(x @ weight.T)`` against ``targets``, computed in chunks.

    Args:
        x: ``(N, C)`` hidden states (fp32, or any float dtype). Under autocast the matmuls run
            in the autocast dtype (decided here and passed to the op explicitly) and the
            softmax in fp32; otherwise in ``x.dtype``.
        weight: ``(V, C)`` LM-head weight (the tied token embedding).
        targets: ``(N,)`` int64 token ids in ``[0, valid_vocab_size)``.
        valid_vocab_size: columns at and beyond it are vocabulary padding, excluded from the
            softmax (default: all ``V``).
        chunk_rows: rows per chunk (default: :func:`default_chunk_rows`, a multiple of 128).
        softcap: tanh soft-capping of the logits at this value (``c * tanh(logits / c)``; Gemma 2,
            Team et al. 2024); 0 = off.
        reduction: ``"mean"``, or ``"none"``: each row's loss, for evaluation (no gradient flows
            through it: ``RuntimeError`` where one would be needed).

    Returns:
        0-dim fp32 tensor, the mean loss in nats/token (``"none"``: ``(N,)`` fp32). Gradients for
        ``x`` and ``weight`` equal those of ``F.cross_entropy(x @ weight.T, targets)`` up to float rounding; they are
        computed in forward when grad mode is on and ``x`` or ``weight`` requires grad, so a
        following backward costs only a scaling, and under ``torch.no_grad()`` only the loss is
        computed (one matmul instead of three).
    """
    N, V = x.shape[0], weight.shape[0]
    if valid_vocab_size is None:
        valid_vocab_size = V
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(V, x.device.type)
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction == "none":
        if need_grad:
            raise RuntimeError("fused_linear_cross_entropy(reduction='none') has no gradient: call it under no_grad")
        return _lce_rows(x, weight, targets, valid_vocab_size, chunk_rows, compute_dtype_for(x), float(softcap))
    loss_sum, _, _ = _fused_lce(
        x, weight, targets, valid_vocab_size, chunk_rows, compute_dtype_for(x), need_grad, float(softcap)
    )
    return loss_sum / N


def chunked_loss(name: str, device_type: str, reduction: str = "mean") -> Callable[..., Tensor] | None:
    """The chunked loss function that ``--loss name`` runs on ``device_type`` (:func:`resolve_loss`):
    :func:`fused_linear_cross_entropy` (with ``reduction``) or :func:`liger_linear_cross_entropy`; None
    for the plain path. Per position (``reduction="none"``) it is the fused one: Liger's returns the mean."""
    path = resolve_loss(name, device_type)
    if path == "plain":
        return None
    if path == "fused" or reduction == "none":
        return functools.partial(fused_linear_cross_entropy, reduction=reduction)
    return liger_linear_cross_entropy
