"""Fused linear + cross-entropy: the LM-head loss without materialising the full logits.

The plain path computes logits ``(N, V)`` (N = B*T tokens, V = 50304), upcasts them to fp32,
takes a log-softmax and keeps it for backward: several passes over ``N * V * 4`` bytes (412 MB
for N = 2048) plus the allocator's page faults for each fresh buffer. Here the rows are taken
in chunks: each chunk's logits are computed, reduced to the loss, turned into
``dlogits = softmax - onehot`` and consumed at once by the two gradient matmuls, so only one
chunk of logits exists at a time and it stays hot in cache. Backward then only scales the
gradients that forward already produced. FLOPs are the same as the plain path.

Technique: the chunked "fused linear cross-entropy" of Liger-Kernel (Hsu et al. 2024,
arXiv:2410.10989) and Wijmans et al. 2024 ("Cut Your Losses in Large-Vocabulary Language
Models", arXiv:2411.09009), written here in plain PyTorch.
"""

from __future__ import annotations

import torch

#: target size of one chunk of logits, in elements: 16 MiB of fp32 on a CPU (it stays in cache;
#: measured on the 2-core CI machine, larger chunks were no faster), 128 MiB on a GPU (fewer,
#: larger kernels: a B*T = 16k-token micro-batch at V = 50304 is 25 chunks).
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 25}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, valid_vocab_size, chunk_rows):
        N = x.shape[0]
        V = weight.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc_all = x.to(dtype)
            w = weight.to(dtype)  # one cast for all chunks (a no-op in fp32)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            if need_grad:
                grad_x = torch.empty_like(x)
                grad_w = torch.zeros_like(weight, dtype=torch.float32)
            for start in range(0, N, chunk_rows):
                xc = xc_all[start : start + chunk_rows]  # (n, C)
                tc = targets[start : start + chunk_rows]  # (n,)
                logits = (xc @ w.t()).float()  # (n, V) fp32
                if V > valid_vocab_size:
                    logits[:, valid_vocab_size:] = float("-inf")  # padding: never predicted
                target_logit = logits.gather(1, tc.unsqueeze(1)).squeeze(1)  # (n,)
                if not need_grad:
                    loss += (torch.logsumexp(logits, dim=1) - target_logit).sum()
                    continue
                # softmax in place: max, subtract, exp, normalise -- no (n, V) temporaries
                m = logits.amax(dim=1, keepdim=True)
                probs = logits.sub_(m).exp_()
                s = probs.sum(dim=1, keepdim=True)
                loss += (m.squeeze(1) + s.log().squeeze(1) - target_logit).sum()
                probs.mul_((s * N).reciprocal_())  # softmax / N: one pass
                probs[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0 / N
                g = probs.to(dtype)  # d(mean loss)/d logits, (n, V)
                grad_x[start : start + chunk_rows] = (g @ w).to(x.dtype)  # (n, C)
                if dtype == torch.float32:
                    grad_w.addmm_(g.t(), xc)  # (V, C), accumulated in place: no temporary
                else:
                    grad_w += (g.t() @ xc).float()
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss.to(grad_x.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    valid_vocab_size: int | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``softmax(x @ weight.T)`` against ``targets``, computed in chunks.

    Args:
        x: ``(N, C)`` hidden states (fp32, or any dtype; under autocast the matmuls run in the
            autocast dtype and the softmax in fp32).
        weight: ``(V, C)`` LM-head weight (the tied token embedding).
        targets: ``(N,)`` int64 token ids in ``[0, valid_vocab_size)``.
        valid_vocab_size: columns at and beyond it are vocabulary padding, excluded from the
            softmax (default: all ``V``).
        chunk_rows: rows per chunk (default: about :data:`CHUNK_ELEMENTS` logits per chunk for
            the device).

    Returns:
        0-dim fp32 tensor, the mean loss. Gradients for ``x`` and ``weight`` equal those of
        ``F.cross_entropy(x @ weight.T, targets)`` up to float rounding; they are computed in
        forward, so this costs nothing extra when a backward follows and skips them under
        ``torch.no_grad()``.
    """
    V = weight.shape[0]
    if valid_vocab_size is None:
        valid_vocab_size = V
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS.get(x.device.type, 1 << 25) // V)
    return _FusedLinearCrossEntropy.apply(x, weight, targets, valid_vocab_size, chunk_rows)
