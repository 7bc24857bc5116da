"""The fused linear + cross-entropy (gptspeed.loss): values and gradients against the plain
path, no gradient work without grad, fp16 gradients at a real batch size, one opaque op under
torch.compile, and the ``--loss auto`` rule."""

import pytest
import torch
from torch.nn import functional as F

import gptspeed.loss as loss_mod
from gptspeed.errors import GptspeedError
from gptspeed.loss import default_chunk_rows, fused_linear_cross_entropy, resolve_loss
from gptspeed.model import GPT, GPTConfig

OP = torch.ops.gptspeed.fused_linear_cross_entropy.default


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **kw})


def tiny(**kw) -> GPTConfig:  # for the compile tests: one block, less to trace
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=32, block_size=16), **kw})


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


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
    from conftest import fake_packages, make_step

    from gptspeed import step as step_mod

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
