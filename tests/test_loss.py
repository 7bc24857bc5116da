"""``gptspeed.loss``: fused linear + cross-entropy: the LM-head loss without materialising the full logits."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gptspeed.loss as loss_mod
from gptspeed.errors import GptspeedError
from gptspeed.loss import (
    compute_dtype_for,
    default_chunk_rows,
    fused_linear_cross_entropy,
    liger_linear_cross_entropy,
    liger_problem,
    resolve_loss,
)
from gptspeed.model import GPT, GPTConfig

from support.packages import fake_packages

pytestmark = pytest.mark.usefixtures("one_thread")


OP = torch.ops.gptspeed.fused_linear_cross_entropy.default


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **kw})


def tiny(**kw) -> GPTConfig:  # for the compile tests: one block, less to trace
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=32, block_size=16), **kw})


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


# -------------------------------------------------------------------- no gradients without grad
def _mm_flops(fn) -> int:
    """Matmul FLOPs (2*M*K*N per mm / addmm / addmm_) of everything ``fn`` runs, including the
    aten calls inside the custom op (the profiler sees them; FlopCounterMode stops at the op)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    flops = 0
    for e in prof.events():
        if e.name == "aten::mm":
            (m, k), (_, n) = e.input_shapes[:2]
            flops += 2 * m * k * n
        elif e.name in ("aten::addmm", "aten::addmm_"):  # (bias or accumulator, mat1, mat2)
            (m, k), (_, n) = e.input_shapes[1:3]
            flops += 2 * m * k * n
    return flops


# -------------------------------------------------------------------------- torch.compile
def _explain(model, idx):
    return torch._dynamo.explain(model)(idx, idx)


def _graph_stats(explanation):
    """(call_function nodes, of which the loss op) over every traced graph and its subgraphs
    (an autograd.Function is traced into a subgraph of its own)."""
    ops = [
        n.target
        for g in explanation.graphs
        for sub in g.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for n in sub.graph.nodes
        if n.op == "call_function"
    ]
    return len(ops), sum(op is OP for op in ops)


class StandInLiger(torch.autograd.Function):
    """Liger's fused linear cross-entropy as plain torch, with its positional arguments (bias,
    ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap): the softcap
    (None = off) as Liger applies it, ``cap * tanh(logits / cap)``."""

    @staticmethod
    def forward(ctx, *a):
        raise AssertionError("apply is replaced")

    @staticmethod
    def apply(
        x,
        w,
        t,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
    ):
        # Liger's kernel takes these as floats (a None fails its launch): so does the stand-in
        assert type(lse_square_scale) is float and type(label_smoothing) is float, (lse_square_scale, label_smoothing)
        logits = (x @ w.t()).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        loss = F.cross_entropy(
            logits, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
        keep = t != ignore_index  # Liger's z-loss: lse_square_scale * logsumexp(logits)^2 over the kept rows
        return loss + lse_square_scale * (torch.logsumexp(logits[keep], -1) ** 2).mean(), None


@pytest.fixture
def stand_in_liger(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    mod.LigerFusedLinearCrossEntropyFunction = StandInLiger
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", mod)
    monkeypatch.setattr(loss_mod, "liger_problem", lambda device_type: None)


class RecordOps(TorchDispatchMode):
    """Every aten op run while active, with its output's shape."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out


class _Stand:
    """What compute_dtype_for reads of a tensor: its device type and dtype (a CUDA, MPS or XPU
    tensor cannot be made on this machine)."""

    def __init__(self, device_type: str):
        self.device, self.dtype = torch.device(device_type), torch.float32


def _reference_and_fused(x0, w0, t, chunk_rows, softcap=0.0, grad=True):
    """(reference loss, x grad, w grad) from F.cross_entropy on the (soft-capped) logits, and the
    same from the fused op with ``chunk_rows`` rows per chunk."""

    def capped(logits):
        return softcap * torch.tanh(logits / softcap) if softcap > 0 else logits

    out = []
    for fused in (False, True):
        x, w = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss = (
                fused_linear_cross_entropy(x, w, t, chunk_rows=chunk_rows, softcap=softcap)
                if fused
                else F.cross_entropy(capped(x @ w.t()), t)
            )
            if grad:
                loss.backward()
        out.append((loss.detach(), x.grad, w.grad))
    return out


# ------------------------------------------------------------------------------------ values
def test_fused_loss_matches_plain_loss_and_gradients():
    torch.manual_seed(0)
    a = GPT(small(loss="plain"))
    b = GPT(small(loss="fused"))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 50257, (2, 32))
    tgt = torch.randint(0, 50257, (2, 32))
    la = a(idx, tgt)[1]
    lb = b(idx, tgt)[1]
    la.backward()
    lb.backward()
    assert lb.item() == pytest.approx(la.item(), abs=1e-5)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6, rtol=1e-4), n


def test_fused_linear_cross_entropy_against_reference():
    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(100, 16, requires_grad=True)
    t = torch.randint(0, 90, (37,))
    ref_logits = x @ w.t()
    ref = F.cross_entropy(ref_logits.masked_fill(torch.arange(100) >= 90, float("-inf")), t)
    gx, gw = torch.autograd.grad(ref * 3.0, (x, w))
    got = fused_linear_cross_entropy(x, w, t, valid_vocab_size=90, chunk_rows=8)  # 5 chunks, ragged last
    hx, hw = torch.autograd.grad(got * 3.0, (x, w))  # upstream gradient scales correctly
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(hx, gx, atol=1e-6) and torch.allclose(hw, gw, atol=1e-6)
    assert hw[90:].abs().max() == 0
    with torch.no_grad():
        assert fused_linear_cross_entropy(x, w, t, 90).item() == pytest.approx(ref.item(), rel=1e-6)


def test_bf16_loss_and_gradients_close_to_fp32():
    torch.manual_seed(0)
    x = torch.randn(300, 32, requires_grad=True)
    w = (torch.randn(500, 32) * 0.1).requires_grad_()
    t = torch.randint(0, 500, (300,))
    ref = F.cross_entropy(x @ w.t(), t)
    gx, gw = torch.autograd.grad(ref, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(x, w, t, chunk_rows=128)  # 3 chunks
    hx, hw = torch.autograd.grad(got, (x, w))
    assert got.dtype == torch.float32 and hx.dtype == torch.float32 and hw.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=2e-2)
    assert _rel(hx, gx.double()) < 2e-2 and _rel(hw, gw.double()) < 2e-2  # bf16 has 8 mantissa bits


def test_default_chunk_rows_are_multiples_of_128():
    assert default_chunk_rows(50304, "cpu") == 128
    assert default_chunk_rows(50304, "cuda") == 640
    assert default_chunk_rows(1000, "cpu") == 4096
    assert default_chunk_rows(10**7, "cuda") == 128  # never fewer than one multiple
    for v in (50257, 50304, 32000, 128256):
        for dev in ("cpu", "cuda", "mps"):
            assert default_chunk_rows(v, dev) % 128 == 0


def test_no_gradient_matmuls_without_grad():
    torch.manual_seed(0)
    N, V, C = 256, 1000, 32
    x = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V, C, requires_grad=True)
    t = torch.randint(0, V, (N,))
    forward_only = 2 * N * V * C
    with torch.no_grad():
        assert _mm_flops(lambda: fused_linear_cross_entropy(x, w, t, chunk_rows=128)) == forward_only
    assert _mm_flops(lambda: fused_linear_cross_entropy(x.detach(), w.detach(), t, chunk_rows=128)) == forward_only
    with torch.inference_mode():
        assert _mm_flops(lambda: fused_linear_cross_entropy(x, w, t, chunk_rows=128)) == forward_only
    # with grad: forward and both gradient matmuls, once each
    assert _mm_flops(lambda: fused_linear_cross_entropy(x, w, t, chunk_rows=128)) == 3 * forward_only


def test_eval_forward_of_the_model_costs_a_forward():
    torch.manual_seed(0)
    model = GPT(small(loss="fused"))
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        no_grad = _mm_flops(lambda: model(idx, idx))
    with_grad = _mm_flops(lambda: model(idx, idx))
    head = 2 * 64 * 50304 * 64  # N * V * C of the LM head
    assert with_grad - no_grad == 2 * head  # exactly the head's two gradient matmuls


# -------------------------------------------------------------------------- fp16 gradients
def test_fp16_gradients_at_16k_tokens_match_plain_with_loss_scale():
    """fp16 autocast, N = 16,384 tokens, a 65,536 loss scale (GradScaler's initial scale): the
    fused gradients are as accurate as the plain path's, and no vocabulary row the plain path
    gives a gradient is zeroed. (Folding 1/N into fp16 dlogits underflowed them.)"""
    torch.manual_seed(0)
    N, V, C, scale = 16384, 512, 8, 65536.0
    x = torch.randn(N, C).half().float()  # fp16-exact inputs: only the computation rounds
    w = (torch.randn(V, C) * 0.5).half().float()
    w[:128, 0] = -2.0  # 128 rare tokens: x[:, 0] = 3 makes their probabilities ~1e-6 (median)
    x[:, 0] = 3.0
    t = torch.randint(128, V, (N,))
    # exact reference, fp64
    logits = x.double() @ w.double().t()
    d = (logits.softmax(1) - F.one_hot(t, V).double()) / N
    ref_x, ref_w = d @ w.double(), d.t() @ x.double()

    def grads(loss_fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(xg, wg)
        (loss * scale).backward()  # as GradScaler.scale(loss).backward()
        return xg.grad / scale, wg.grad / scale  # unscale in fp32, as GradScaler.unscale_

    plain_x, plain_w = grads(lambda a, b: F.cross_entropy((a @ b.t()).float(), t))
    fused_x, fused_w = grads(lambda a, b: fused_linear_cross_entropy(a, b, t))
    assert plain_x.dtype == fused_x.dtype == torch.float32
    plain_err = max(_rel(plain_x, ref_x), _rel(plain_w, ref_w))
    assert plain_err < 2e-3  # the reference path itself is accurate here
    assert _rel(fused_x, ref_x) < 2 * plain_err + 1e-4
    assert _rel(fused_w, ref_w) < 2 * plain_err + 1e-4
    plain_rows = plain_w.abs().amax(1) > 0
    fused_rows = fused_w.abs().amax(1) > 0
    assert plain_rows[:128].all()  # the rare tokens' rows get a gradient on the plain path...
    assert not (plain_rows & ~fused_rows).any()  # ...and on the fused path


def test_compiled_gpt_has_no_graph_break_and_one_loss_op(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny(loss="fused"))
    idx = torch.randint(0, 50257, (2, 16))
    one = _explain(model, idx)
    assert one.graph_break_count == 0 and one.graph_count == 1
    n_ops, n_loss = _graph_stats(one)
    # 32 chunks instead of 1: the traced graph is the same size (the loop is inside the op)
    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 1)
    monkeypatch.setattr(loss_mod, "CHUNK_ROW_MULTIPLE", 1)  # -> 1-row chunks: 32 of them
    assert loss_mod.default_chunk_rows(50304, "cpu") == 1
    torch._dynamo.reset()
    many = _explain(model, idx)
    assert many.graph_break_count == 0 and _graph_stats(many)[0] == n_ops
    assert n_loss == 1  # the chunk loop is one op in the graph
    torch._dynamo.reset()


def test_compiled_training_step_matches_eager():
    """The op's fake implementation and registered backward work through AOTAutograd."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(tiny(loss="fused"))
    compiled_model = GPT(tiny(loss="fused"))
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, 50257, (2, 16))
    le, lc = eager(idx, idx)[1], compiled(idx, idx)[1]
    le.backward()
    lc.backward()
    assert lc.item() == pytest.approx(le.item(), abs=1e-5)
    for (n, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        assert torch.allclose(pe.grad, pc.grad, atol=1e-6, rtol=1e-4), n
    with torch.no_grad():
        assert compiled(idx, idx)[1].item() == pytest.approx(le.item(), abs=1e-5)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- --loss auto
def test_resolve_loss():
    assert resolve_loss("auto", "cuda") == "plain"  # the anchors' path until a GPU measures otherwise
    assert resolve_loss("auto", "mps") == "plain"
    assert resolve_loss("auto", "cpu") == "fused"  # measured faster on the CPU (benchmarks/LOG.md)
    for name in ("fused", "plain"):
        for dev in ("cpu", "cuda", "mps"):
            assert resolve_loss(name, dev) == name
    with pytest.raises(GptspeedError, match="--loss"):
        resolve_loss("chunked", "cpu")


def test_auto_is_the_default_and_resolves_on_the_inputs_device():
    assert GPTConfig().loss == "auto"
    torch.manual_seed(0)
    model = GPT(small())
    idx = torch.randint(0, 50257, (2, 32))
    logits, loss = model(idx, idx, return_logits=True)
    expected = resolve_loss("auto", "cpu")
    assert (logits is None) == (expected == "fused") and loss.shape == ()
    assert model(idx, idx)[0] is None  # the training forward returns the loss only
    with pytest.raises(GptspeedError, match="loss"):
        GPT(small(loss="chunked"))


# ------------------------------------------------------------------------------------ CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fused_matches_plain_in_16_bit(dtype):
    """On a GPU, in bf16 and fp16 autocast at N = 16,384, V = 50,304: the fused loss and its
    gradients against the plain path with a 65,536 loss scale, both against fp64."""
    torch.manual_seed(0)
    N, V, C, scale = 16384, 50304, 768, 65536.0
    x = torch.randn(N, C, device="cuda").to(dtype).float()
    w = (torch.randn(V, C, device="cuda") * 0.02).to(dtype).float()
    t = torch.randint(0, 50257, (N,), device="cuda")
    ref_x, ref_w, ref_loss = torch.empty(N, C, dtype=torch.float64, device="cuda"), 0, 0
    for s in range(0, N, 1024):  # fp64 reference in row blocks: a few GB at most (a 16 GB T4 runs this)
        logits = x[s : s + 1024].double() @ w.double().t()
        logits[:, 50257:] = float("-inf")
        ref_loss = ref_loss + F.cross_entropy(logits, t[s : s + 1024], reduction="sum")
        d = logits.softmax(1)
        d[torch.arange(d.size(0), device="cuda"), t[s : s + 1024]] -= 1
        d /= N
        ref_x[s : s + 1024] = d @ w.double()
        ref_w = ref_w + d.t() @ x[s : s + 1024].double()
        del logits, d
    ref_loss = ref_loss / N

    def run(loss_fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(xg, wg)
        (loss * scale).backward()
        out = loss.item(), xg.grad / scale, wg.grad / scale
        torch.cuda.empty_cache()
        return out

    def plain(a, b):
        lg = a @ b.t()
        lg[:, 50257:] = float("-inf")
        return F.cross_entropy(lg.float(), t)

    pl, px, pw = run(plain)
    fl, fx, fw = run(lambda a, b: fused_linear_cross_entropy(a, b, t, 50257))
    assert fl == pytest.approx(ref_loss.item(), rel=1e-2) and pl == pytest.approx(ref_loss.item(), rel=1e-2)
    plain_err = max(_rel(px, ref_x), _rel(pw, ref_w))
    assert _rel(fx, ref_x) < 2 * plain_err + 1e-4 and _rel(fw, ref_w) < 2 * plain_err + 1e-4
    assert not ((pw.abs().amax(1) > 0) & (fw.abs().amax(1) == 0)).any()


# ------------------------------------------------------------------------------------ --loss liger
def test_liger_is_refused_off_cuda_and_without_the_package_before_the_model_is_built(monkeypatch):
    from gptspeed import step as step_mod

    from support.packages import fake_packages
    from support.training import make_step

    monkeypatch.setattr(step_mod, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(
        GptspeedError, match=r"--loss liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU \(not cpu\)"
    ):
        make_step(dict(n_layer=1, n_head=2, n_embd=32, block_size=32, loss="liger"))
    from gptspeed.loss import liger_problem

    fake_packages(monkeypatch, liger_kernel=False)
    assert "pip install liger-kernel" in liger_problem("cuda")


@pytest.mark.parametrize("softmax", ["full", "data"])
def test_liger_is_handed_the_unpadded_head_and_its_loss_is_the_models(monkeypatch, softmax):
    """The wiring, on the CPU, with a stand-in for Liger's autograd function (plain cross-entropy):
    the LM head reaches it without the padded rows (their logits would take probability mass: the
    padded-vocabulary mask), and its loss and gradients are what the model returns."""
    import sys
    import types

    import gptspeed.loss as loss_mod

    seen = {}

    class FakeLigerFLCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, t):
            raise AssertionError("apply is replaced")

        @staticmethod
        def apply(x, w, t):
            seen["rows"] = w.size(0)
            return F.cross_entropy((x @ w.t()).float(), t), None, None, None

    mod = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    mod.LigerFusedLinearCrossEntropyFunction = FakeLigerFLCE
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", mod)
    monkeypatch.setattr(loss_mod, "liger_problem", lambda device_type: None)
    torch.manual_seed(0)
    plain = GPT(small(loss="plain", softmax=softmax))
    liger = GPT(small(loss="liger", softmax=softmax))
    liger.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 50257, (2, 32))
    if softmax == "data":
        ids = torch.unique(idx)
        plain.set_softmax_ids(ids)
        liger.set_softmax_ids(ids)
    lp, ll = plain(idx, idx)[1], liger(idx, idx)[1]
    assert seen["rows"] == (50257 if softmax == "full" else ids.numel())
    torch.testing.assert_close(ll, lp, rtol=1e-6, atol=1e-6)
    lp.backward()
    ll.backward()
    gp, gl = plain.transformer.wte.weight.grad, liger.transformer.wte.weight.grad
    torch.testing.assert_close(gl, gp, rtol=1e-5, atol=1e-7)
    assert gl[50257:].abs().max() == 0  # the padded rows get no gradient


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_liger_matches_plain_loss_and_gradients():
    """On a GPU with Liger-Kernel installed, in bf16 autocast at GPT-2's head (C = 768, V = 50304):
    the loss and the head's gradient within bf16's tolerance of the plain path's."""
    from gptspeed.loss import liger_problem

    if liger_problem("cuda"):
        pytest.skip(liger_problem("cuda"))
    torch.manual_seed(0)
    cfg = dict(n_layer=1, n_head=12, n_embd=768, block_size=1024)
    plain = GPT(GPTConfig(**cfg, loss="plain")).cuda()
    liger = GPT(GPTConfig(**cfg, loss="liger")).cuda()
    liger.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 50257, (4, 1024), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ll = plain(idx, idx)[1], liger(idx, idx)[1]
    assert ll.item() == pytest.approx(lp.item(), rel=1e-2)
    lp.backward()
    ll.backward()
    gp, gl = plain.transformer.wte.weight.grad.float(), liger.transformer.wte.weight.grad.float()
    assert (gl - gp).norm() / gp.norm() < 2e-2
    assert gl[50257:].abs().max() == 0


def test_the_matmuls_run_in_the_autocast_dtype_where_autocast_is_on_else_in_the_inputs():
    x = torch.randn(2, 3)
    assert compute_dtype_for(x) == torch.float32
    assert compute_dtype_for(x.double()) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype_for(x) == torch.bfloat16
        assert compute_dtype_for(torch.randn(2, 3, device="meta")) == torch.float32  # no autocast on meta


def test_under_autocast_the_fused_loss_computes_in_the_autocast_dtype(monkeypatch):
    """The op is handed the autocast dtype (bf16): its loss is the bf16 matmul's, not fp32's."""
    torch.manual_seed(0)
    x, w, t = torch.randn(64, 32), torch.randn(300, 32), torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(x, w, t)
    want = F.cross_entropy((x.bfloat16() @ w.bfloat16().t()).float(), t)
    fp32 = F.cross_entropy(x @ w.t(), t)
    assert abs(float(got) - float(want)) < 1e-5 < abs(float(got) - float(fp32))


def test_gradients_keep_each_inputs_dtype_when_the_two_differ():
    """bf16 hidden states against an fp32 weight (no autocast): the loss is fp32 and each gradient
    has its input's dtype, close to the gradient of F.cross_entropy on the same bf16 products."""
    torch.manual_seed(0)
    x = torch.randn(40, 16).bfloat16().requires_grad_()
    w = torch.randn(70, 16).requires_grad_()
    t = torch.randint(0, 70, (40,))
    got = fused_linear_cross_entropy(x, w, t, chunk_rows=16)
    gx, gw = torch.autograd.grad(got, (x, w))
    assert got.dtype == torch.float32 and gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    xr, wr = x.detach().float().requires_grad_(), w.detach().bfloat16().float().requires_grad_()
    ref = F.cross_entropy(xr @ wr.t(), t)
    rx, rw = torch.autograd.grad(ref, (xr, wr))
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-2)
    assert ((gx.float() - rx).norm() / rx.norm()) < 2e-2 and ((gw - rw).norm() / rw.norm()) < 2e-2


def test_liger_is_refused_off_cuda_naming_the_device():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(
        GptspeedError,
        match=r"^--loss liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU "
        r"\(not cpu\): use --loss fused$",
    ):
        liger_linear_cross_entropy(x, w, t)
    assert liger_problem("mps").endswith("(not mps): use --loss fused")


def test_liger_on_cuda_needs_the_package(monkeypatch):
    fake_packages(monkeypatch, liger_kernel=False)
    assert liger_problem("cuda") == (
        "--loss liger needs Liger-Kernel, which is not installed: pip install liger-kernel (or use --loss fused)"
    )
    fake_packages(monkeypatch, liger_kernel=True)
    assert liger_problem("cuda") is None


def test_the_loss_of_a_model_whose_config_asks_for_it_goes_through_the_fused_op(monkeypatch):
    """``--loss fused`` (and auto on a CPU) computes the loss with fused_linear_cross_entropy."""
    from gptspeed.model import GPT, GPTConfig

    calls = []
    real = loss_mod.fused_linear_cross_entropy
    monkeypatch.setattr(loss_mod, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    idx = torch.randint(0, 50257, (2, 8))
    for loss, softmax, fused in (
        ("fused", "full", True),
        ("auto", "full", True),
        ("plain", "full", False),
        ("fused", "data", True),
        ("auto", "data", True),
        ("plain", "data", False),
    ):
        calls.clear()
        torch.manual_seed(0)
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, loss=loss, softmax=softmax))(idx, idx)
        assert bool(calls) is fused, (loss, softmax)


def test_the_liger_loss_is_not_soft_capped_unless_asked(stand_in_liger):
    """Called without ``softcap`` it is the plain cross-entropy of x @ W.T (large logits, where
    a cap of any size would change the loss); with one, that of the capped logits."""
    torch.manual_seed(0)
    x, w, t = torch.randn(16, 8) * 4, torch.randn(40, 8) * 4, torch.randint(0, 40, (16,))
    plain = F.cross_entropy(x @ w.t(), t)
    assert float(liger_linear_cross_entropy(x, w, t)) == pytest.approx(float(plain), rel=1e-5)
    capped = F.cross_entropy(5.0 * torch.tanh((x @ w.t()) / 5.0), t)
    assert float(liger_linear_cross_entropy(x, w, t, softcap=5.0)) == pytest.approx(float(capped), rel=1e-5)
    assert abs(float(capped) - float(plain)) > 1.0


def test_the_soft_capped_liger_loss_is_plain_cross_entropy_otherwise(stand_in_liger):
    """With a softcap, the other positional arguments keep their plain meaning: rows whose target is
    -100 are left out (as in ``F.cross_entropy``), no label smoothing, no z-loss."""
    torch.manual_seed(0)
    x, w, t = torch.randn(16, 8) * 4, torch.randn(40, 8) * 4, torch.randint(0, 40, (16,))
    t[::3] = -100
    capped = 5.0 * torch.tanh((x @ w.t()) / 5.0)
    want = F.cross_entropy(capped, t)  # ignore_index=-100, label_smoothing=0, no z-loss
    got = float(liger_linear_cross_entropy(x, w, t, softcap=5.0))
    assert got == pytest.approx(float(want), rel=1e-5), f"soft-capped Liger loss {got} != cross-entropy {float(want)}"


def test_the_x_gradient_is_rounded_once_to_xs_dtype_not_through_the_weights():
    """bf16 hidden states, an fp16 weight, a loss scale of 2^20 (16 rows: 65,536 per row): x's
    gradient, far beyond fp16's range (65,504), is finite bf16 -- the fp32 product rounded to x's
    dtype, not to the weight's (where it would overflow to inf)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8).bfloat16().requires_grad_()
    w = torch.randn(30, 8).half().requires_grad_()
    t = torch.randint(0, 30, (16,))
    scale = torch.tensor(2.0**20)
    (gx,) = torch.autograd.grad(fused_linear_cross_entropy(x, w, t), (x,), grad_outputs=scale)
    xr = x.detach().float().requires_grad_()
    ref = F.cross_entropy(xr @ w.detach().bfloat16().float().t(), t)  # the bf16 products, in fp32
    (rx,) = torch.autograd.grad(ref, (xr,), grad_outputs=scale)
    assert gx.dtype == torch.bfloat16
    assert bool(torch.isfinite(gx).all()), "x's gradient overflowed: it went through the weight's dtype (fp16)"
    assert rx.abs().max() > 65504 and ((gx.float() - rx).norm() / rx.norm()) < 2e-2


def test_the_ops_gradient_outputs_are_not_differentiable():
    """The op's loss is differentiable; its grad_x and grad_w outputs are not (backward ignores
    any gradient flowing into them)."""
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    t = torch.randint(0, 10, (6,))
    loss, grad_x, grad_w = torch.ops.gptspeed.fused_linear_cross_entropy(x, w, t, 10, 128, torch.float32, True, 0.0)
    assert loss.requires_grad
    assert not grad_x.requires_grad, "the op's grad_x output is differentiable"
    assert not grad_w.requires_grad, "the op's grad_w output is differentiable"


def test_backward_allocates_no_zero_gradients_for_the_unused_outputs():
    """Backward only scales the gradients forward made: no zero tensors of grad_x's (N, C) or
    grad_w's (V, C) shape are made for the gradient outputs nothing used (a (V, C) fp32 block is
    154 MB at GPT-2's vocabulary)."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    loss = fused_linear_cross_entropy(x, w, torch.randint(0, 10, (8,)))
    with RecordOps() as rec:
        loss.backward()
    zeros = [op for op in rec.ops if op[0].startswith(("zeros", "new_zeros"))]
    assert not zeros, f"backward made zero tensors {zeros}"
    assert sorted(shape for name, shape in rec.ops if name.startswith("mul")) == [(8, 4), (10, 4)]


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps", "xpu"])
def test_every_autocast_device_type_gives_its_autocast_dtype(monkeypatch, device_type):
    """On each device autocast knows (cpu, cuda, mps, xpu), autocast on means the autocast dtype;
    elsewhere (meta) the input's own dtype, and autocast is not asked about."""
    asked = []
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda t: asked.append(t) or True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda t: torch.float16)
    assert compute_dtype_for(_Stand(device_type)) == torch.float16, device_type
    assert asked == [device_type]
    assert compute_dtype_for(_Stand("meta")) == torch.float32 and asked == [device_type]


def test_a_frozen_head_still_gives_the_input_its_gradient():
    """Only ``x`` requires grad (a frozen LM head, e.g. a probe on a fixed model): backward works and
    x's gradient is F.cross_entropy's."""
    torch.manual_seed(0)
    x0, w, t = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    x = x0.clone().requires_grad_(True)
    fused_linear_cross_entropy(x, w, t).backward()
    ref = x0.clone().requires_grad_(True)
    F.cross_entropy(ref @ w.t(), t).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)
    assert w.grad is None


def test_the_default_chunk_follows_the_inputs_device_type(monkeypatch):
    """Without chunk_rows, the chunk is default_chunk_rows(V, x's device type): here the CPU's."""
    seen = []
    real = loss_mod.default_chunk_rows
    monkeypatch.setattr(loss_mod, "default_chunk_rows", lambda v, d: seen.append((v, d)) or real(v, d))
    x, w, t = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    fused_linear_cross_entropy(x, w, t)
    assert seen == [(10, "cpu")]


def test_the_op_run_without_gradients_refuses_to_be_differentiated():
    """Called directly with need_grad=False, the op makes no gradients; differentiating it anyway
    is an error that says why (rather than a zero or garbage gradient)."""
    x, w, t = torch.randn(8, 4, requires_grad=True), torch.randn(10, 4), torch.randint(0, 10, (8,))
    loss, grad_x, grad_w = loss_mod._fused_lce(x, w, t, 10, 8, torch.float32, False, 0.0)
    assert grad_x.numel() == 0 and grad_w.numel() == 0
    with pytest.raises(RuntimeError, match=r"ran without gradients \(need_grad=False\); it cannot be differentiated"):
        loss.backward()
    with pytest.raises(RuntimeError) as err:
        loss_mod._fused_lce(x, w, t, 10, 8, torch.float32, False, 0.0)[0].backward()
    assert str(err.value) == (
        "fused_linear_cross_entropy ran without gradients (need_grad=False); it cannot be differentiated"
    )


def test_a_softcap_of_one_caps_the_logits_and_their_gradient():
    """softcap=1.0 is a cap like any positive one (tanh of the logits), forward and backward."""
    torch.manual_seed(0)
    x, w, t = torch.randn(12, 8), torch.randn(20, 8), torch.randint(0, 20, (12,))
    (want, wx, ww), (got, gx, gw) = _reference_and_fused(x, w, t, chunk_rows=5, softcap=1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, wx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, ww, rtol=1e-4, atol=1e-6)


def test_fp32_gradients_and_no_grad_losses_add_up_over_every_chunk():
    """12 rows in chunks of 5 (5, 5, 2): every chunk's rows get their gradient in fp32, and the loss
    without gradients sums every chunk, not the last one."""
    torch.manual_seed(0)
    x, w, t = torch.randn(12, 8), torch.randn(20, 8), torch.randint(0, 20, (12,))
    (want, wx, ww), (got, gx, gw) = _reference_and_fused(x, w, t, chunk_rows=5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)
    (want, _, _), (got, _, _) = _reference_and_fused(x, w, t, chunk_rows=5, grad=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_each_rows_softmax_is_shifted_by_its_own_max():
    """Two rows whose logits lie 300 apart: shifted by one global max, the lower row's exponentials
    would all underflow to 0 (log 0 = -inf); by its own max each row's loss stays finite and exact."""
    x = torch.tensor([[1.0], [-1.0]])
    w = torch.tensor([[150.0], [149.0], [148.0]])  # row 0's logits ~ +150, row 1's ~ -150
    t = torch.tensor([1, 2])
    (want, wx, ww), (got, gx, gw) = _reference_and_fused(x, w, t, chunk_rows=2)
    assert torch.isfinite(got), f"loss {got}: the rows shared one max"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)


def test_the_weight_gradient_stays_fp32_under_a_float64_default_dtype():
    """A user who set torch's default dtype to float64 still gets fp32 gradients of fp32 inputs,
    equal to F.cross_entropy's."""
    torch.manual_seed(0)
    x, w, t = torch.randn(12, 8), torch.randn(20, 8), torch.randint(0, 20, (12,))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        (want, wx, ww), (got, gx, gw) = _reference_and_fused(x, w, t, chunk_rows=5)
    finally:
        torch.set_default_dtype(old)
    assert gw.dtype == torch.float32 and gx.dtype == torch.float32
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)


def test_an_unknown_loss_is_refused_listing_the_losses_word_for_word():
    """resolve_loss's refusal names every --loss choice, comma-separated, and the name it was given."""
    with pytest.raises(GptspeedError) as e:
        loss_mod.resolve_loss("chunked", "cpu")
    want = "--loss must be one of auto, fused, plain, liger, got 'chunked'"
    assert str(e.value) == want, f"the --loss refusal is worded wrong: {str(e.value)!r}, want {want!r}"


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_each_rows_loss_is_that_rows_cross_entropy_over_every_chunk(softcap):
    """``reduction="none"``: ``(N,)`` fp32, each row's cross-entropy (padding columns left out, the
    soft cap applied) across chunks of 2 rows; their mean is the fused mean."""
    torch.manual_seed(0)
    x, w, t = torch.randn(7, 8), torch.randn(11, 8), torch.randint(0, 9, (7,))
    with torch.no_grad():
        rows = fused_linear_cross_entropy(x, w, t, 9, chunk_rows=2, softcap=softcap, reduction="none")
        mean = fused_linear_cross_entropy(x, w, t, 9, chunk_rows=2, softcap=softcap)
    logits = (x @ w.t())[:, :9]
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    assert rows.shape == (7,) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, F.cross_entropy(logits, t, reduction="none"))
    torch.testing.assert_close(rows.mean(), mean)


def test_each_rows_loss_refuses_to_run_where_a_gradient_is_wanted():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no gradient"):
        fused_linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(4, dtype=torch.long), reduction="none")


def test_the_compiled_per_position_loss_is_the_eager_one_without_a_graph_break():
    """The eval forward (``reduction="none"``) through dynamo and AOTAutograd: the rows op's fake
    implementation gives the ``(B, T)`` shape; one graph, the eager figures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(tiny(loss="fused")).eval()
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(idx, idx, reduction="none")
        got = torch.compile(model, backend="aot_eager")(idx, idx, reduction="none")[1]
        want = model(idx, idx, reduction="none")[1]
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert got.shape == (2, 16)
    torch.testing.assert_close(got, want)
