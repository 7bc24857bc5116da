import pytest

from gptspeed.config import OptimConfig
from gptspeed.model import GPT, GPTConfig
from gptspeed.optim import build_optimizer, lr_at, param_groups


def test_lr_schedule_warmup_then_cosine():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lrs = [lr_at(s, **kw) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # rising warm-up
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:110]))  # decaying
    assert lrs[60] == pytest.approx(0.55)  # half-way through the cosine
    assert lrs[110] == lrs[119] == pytest.approx(0.1)


def test_weight_decay_only_on_matrices_and_embeddings():
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == m.num_params(non_embedding=False)
    assert any(p is m.transformer.wte.weight for p in decay["params"])


def test_fused_adamw_choice():
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    opt, fused = build_optimizer(m, OptimConfig(), "cpu")
    assert fused and opt.defaults["fused"]
    opt, fused = build_optimizer(m, OptimConfig(fused_adamw=False), "cpu")
    assert not fused and not opt.defaults["fused"]
    assert opt.defaults["betas"] == (0.9, 0.95)
