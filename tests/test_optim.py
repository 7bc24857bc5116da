"""``gptspeed.optim``: optimizer construction: the registry, AdamW's groups, Muon+AdamW."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gptspeed import optim
from gptspeed.config import OPTIMIZERS as CHOICES
from gptspeed.config import OptimConfig
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.optim import MuonWithAdamW, build_optimizer, muon_params, param_groups
from gptspeed.runtime import Runtime
from gptspeed.trainer import build_train_config, fit

from support.padded_model import _batch, _model
from support.shapes import PADDED_VOCAB_MODEL, PLAIN_LOSS_MODEL
from support.training import TINY_MODEL, make_step, one_step, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


# every setting away from torch's defaults (Muon: lr 1e-3, momentum 0.95, weight decay 0.1; AdamW:
# betas (0.9, 0.999), eps 1e-8), so a setting that is not passed on shows
CFG = OptimConfig(
    lr=3e-3, muon_lr=0.03, muon_momentum=0.8, weight_decay=0.05, beta1=0.7, beta2=0.9, eps=1e-6, optimizer="muon"
)


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))


def fill_grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def reference(model: GPT, cfg: OptimConfig):
    """torch.optim.Muon and AdamW built from MuonWithAdamW's docstring: Muon (Nesterov, lr
    ``muon_lr``, momentum ``muon_momentum``, decoupled decay ``weight_decay``, adjust_lr_fn
    "original") on the blocks' 2-D weights; AdamW (lr, betas, eps) on the rest, decay on 2-D only."""
    names = dict(model.named_parameters())
    hidden = [p for n, p in names.items() if p.dim() == 2 and n.startswith("transformer.h.")]
    rest = [p for n, p in names.items() if not (p.dim() == 2 and n.startswith("transformer.h."))]
    muon = torch.optim.Muon(
        hidden,
        lr=cfg.muon_lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        adjust_lr_fn="original",
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    return muon, adamw


# ------------------------------------------------------------------ AdamW from the run's settings
ADAMW = OptimConfig(lr=3e-3, weight_decay=0.05, beta1=0.7, beta2=0.9, eps=1e-3, optimizer="adamw", fused_adamw=False)


def build_sgd(model, cfg, device_type):
    """Plain SGD at --lr (momentum 0.9): the toy."""
    opt = torch.optim.SGD([p for p in model.parameters()], lr=cfg.lr, momentum=0.9)
    for g in opt.param_groups:
        g["lr_mult"] = 1.0
    return opt, False


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(optim, "OPTIMIZERS", dict(optim.OPTIMIZERS))
    monkeypatch.setattr(optim, "CONFIG_OPTIMIZERS", CHOICES)
    before = list(CHOICES)
    spec = optim.register_optimizer(optim.OptimizerSpec("toy-sgd", build_sgd, grad_scaler=False, doc="SGD"))
    yield spec
    CHOICES[:] = before


def test_muon_with_adamw_steps_like_torchs_optimizers_built_from_its_settings():
    """Every hyperparameter reaches the optimizer that uses it: two steps of MuonWithAdamW equal two
    steps of torch.optim.Muon + AdamW built directly from the documented settings."""
    model = tiny()
    ref_model = copy.deepcopy(model)
    opt = MuonWithAdamW(model, CFG, fused=False)
    muon, adamw = reference(ref_model, CFG)
    for seed in (1, 2):
        fill_grads(model, seed)
        fill_grads(ref_model, seed)
        opt.step()
        muon.step()
        adamw.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # the settings torch's defaults could silently replace: Nesterov and the "original" lr rule
    for g in opt.muon.param_groups:
        assert g["nesterov"] is True and g["adjust_lr_fn"] == "original"


@pytest.mark.parametrize("fused", [True, False])
def test_muon_with_adamw_uses_the_fused_adamw_it_is_given(fused):
    opt = MuonWithAdamW(tiny(), CFG, fused=fused)
    assert bool(opt.adamw.defaults["fused"]) is fused
    opt, reported = build_optimizer(tiny(), CFG, "cpu")
    assert reported is False and opt.adamw.defaults["fused"] is True  # chosen where available, reported False


def test_lr_mult_makes_the_schedule_scale_both_optimizers_to_their_peaks():
    """The trainer sets ``group["lr"] = lr * group["lr_mult"]``: at the schedule's peak (``cfg.lr``)
    Muon's groups must get ``muon_lr`` and AdamW's ``lr``."""
    opt = MuonWithAdamW(tiny(), CFG, fused=False)
    for g in opt.param_groups:
        g["lr"] = CFG.lr * g["lr_mult"]
    assert [g["lr"] for g in opt.adamw.param_groups] == [CFG.lr, CFG.lr]
    assert [g["lr"] for g in opt.muon.param_groups] == pytest.approx([CFG.muon_lr])
    assert opt.param_groups == opt.adamw.param_groups + opt.muon.param_groups


def test_muon_state_round_trip_continues_the_same_trajectory():
    """state_dict -> load_state_dict into a fresh MuonWithAdamW: the next step is the one the
    original takes (momentum buffers and AdamW moments restored, both optimizers)."""
    a_model = tiny()
    a = MuonWithAdamW(a_model, CFG, fused=False)
    fill_grads(a_model, 1)
    a.step()
    b_model = copy.deepcopy(a_model)
    b = MuonWithAdamW(b_model, CFG, fused=False)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert set(a.state_dict()) == {"adamw", "muon"}
    fill_grads(a_model, 2)
    fill_grads(b_model, 2)
    a.step()
    b.step()
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # a fresh optimizer (no state loaded) takes another step: the test can tell
    c_model = copy.deepcopy(b_model)
    fill_grads(c_model, 2)
    MuonWithAdamW(c_model, CFG, fused=False).step()
    assert any(not torch.equal(p, q) for p, q in zip(c_model.parameters(), b_model.parameters()))


@pytest.mark.parametrize("state", [{"state": {}, "param_groups": []}, {"adamw": {}}, {"adamw": {}, "muon": {}, "x": 1}])
def test_muon_refuses_an_optimizer_state_that_is_not_muon_and_adamw(state):
    opt = MuonWithAdamW(tiny(), CFG, fused=False)
    with pytest.raises(
        GptspeedError,
        match=r"^the checkpoint's optimizer state is not Muon\+AdamW: resume with its "
        r"--optimizer$",
    ):
        opt.load_state_dict(state)


def test_muon_zero_grad_drops_the_gradients_of_both_optimizers():
    model = tiny()
    opt = MuonWithAdamW(model, CFG, fused=False)
    fill_grads(model, 1)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    fill_grads(model, 1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_frozen_parameters_are_left_to_no_optimizer():
    """A parameter with requires_grad False goes to neither Muon nor AdamW, wherever it comes in
    the model (here the first, the token embedding, and one in the middle)."""
    model = tiny()
    frozen = [model.transformer.wte.weight, model.transformer.h[0].attn.c_attn.weight]
    for p in frozen:
        p.requires_grad_(False)
    hidden, rest = muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    want = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in hidden + rest} == {id(p) for p in want} and len(hidden + rest) == len(want)
    assert all(names[id(p)].startswith("transformer.h.") and p.dim() == 2 for p in hidden)
    assert not any(p is f for p in hidden + rest for f in frozen)


def test_muon_takes_the_fused_adamw_setting_as_given():
    """``fused_adamw`` False is kept (the fused kernel is picked only when the setting is None)."""
    cfg = OptimConfig(**{**CFG.__dict__, "fused_adamw": False})
    opt, _ = build_optimizer(tiny(), cfg, "cpu")
    assert not opt.adamw.defaults["fused"]


def test_registering_an_optimizer_makes_it_a_choice_once(monkeypatch):
    from gptspeed import config as config_mod
    from gptspeed import optim as optim_mod

    monkeypatch.setattr(optim_mod, "OPTIMIZERS", dict(optim_mod.OPTIMIZERS))
    monkeypatch.setattr(optim_mod, "CONFIG_OPTIMIZERS", list(config_mod.OPTIMIZERS))
    spec = optim_mod.OptimizerSpec(name="toy", build=lambda model, cfg, device_type: (None, False))
    assert optim_mod.register_optimizer(spec) is spec
    assert optim_mod.OPTIMIZERS["toy"] is spec and optim_mod.optimizer_spec("toy") is spec
    optim_mod.register_optimizer(spec)
    assert optim_mod.CONFIG_OPTIMIZERS.count("toy") == 1 and optim_mod.CONFIG_OPTIMIZERS[:-1] == list(
        config_mod.OPTIMIZERS
    )


def test_adamw_steps_like_torchs_adamw_built_from_its_settings():
    """Every setting reaches AdamW: two steps of build_optimizer's AdamW equal two steps of
    torch.optim.AdamW built directly from lr, betas, eps, with weight decay on the >= 2-D tensors
    only (every setting away from torch's defaults: lr 1e-3, eps 1e-8)."""
    model = tiny()
    ref_model = copy.deepcopy(model)
    opt, _ = build_optimizer(model, ADAMW, "cpu")
    params = list(ref_model.parameters())
    ref = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": ADAMW.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=ADAMW.lr,
        betas=(ADAMW.beta1, ADAMW.beta2),
        eps=ADAMW.eps,
    )
    for seed in (1, 2):
        fill_grads(model, seed)
        fill_grads(ref_model, seed)
        opt.step()
        ref.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{name}: AdamW did not use the run's settings")


def test_adamw_groups_carry_an_lr_mult_of_one():
    """OptimizerSpec's contract: each param group carries ``lr_mult`` and the trainer sets
    ``group["lr"] = lr * group["lr_mult"]``; AdamW's groups all take the schedule's rate itself."""
    opt, _ = build_optimizer(tiny(), ADAMW, "cpu")
    for g in opt.param_groups:
        g["lr"] = ADAMW.lr * g["lr_mult"]  # as the OptimizerSpec docstring says the trainer does
    assert [g["lr"] for g in opt.param_groups] == [ADAMW.lr, ADAMW.lr], (
        "AdamW's groups must run at the schedule's rate (lr_mult 1)"
    )


@pytest.mark.parametrize(
    "device_type, fused", [("cuda", True), ("cpu", True), ("mps", True), ("xla", False), ("meta", False)]
)
def test_the_fused_adamw_is_used_where_pytorch_has_its_kernel(device_type, fused):
    """PyTorch documents fused AdamW for CUDA, CPU and MPS: there, with --fused-adamw unset, the
    fused kernel is used and a non-finite step is skipped on the device; elsewhere not."""
    from gptspeed.optim import fused_adamw_available

    assert fused_adamw_available(device_type) is fused
    opt, skips = build_optimizer(tiny(), OptimConfig(optimizer="adamw"), device_type)
    assert bool(opt.defaults["fused"]) is fused and skips is fused, (
        f"on {device_type} the fused AdamW must {'' if fused else 'not '}be used"
    )


def test_weight_decay_only_on_matrices_and_embeddings():
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == m.num_params(non_embedding=False)
    assert any(p is m.transformer.wte.weight for p in decay["params"])


def test_per_group_rates_on_a_model_without_an_lm_head_decay_every_matrix_and_embedding():
    """With --embed-lr / --scalar-lr set, param_groups works on any module: one without an ``lm_head`` attribute has
    no head group; the matrices and the embeddings get ``weight_decay``, the gains and biases none, each group the
    ``lr_mult`` of its peak rate over ``cfg.lr``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    emb, lin, norm = model
    cfg = OptimConfig(lr=1e-3, embed_lr=0.5, scalar_lr=0.02)
    groups = param_groups(model, 0.1, cfg)
    got = [([id(p) for p in g["params"]], g["weight_decay"], g["lr_mult"]) for g in groups]
    want = [
        ([id(lin.weight)], 0.1, 1.0),
        ([id(emb.weight)], 0.1, 0.5 / 1e-3),
        ([id(lin.bias), id(norm.weight), id(norm.bias)], 0.0, 0.02 / 1e-3),
    ]
    assert [(ids, wd) for ids, wd, _ in got] == [(ids, wd) for ids, wd, _ in want]
    assert [m for *_, m in got] == pytest.approx([m for *_, m in want])


def test_fused_adamw_choice():
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    opt, fused = build_optimizer(m, OptimConfig(), "cpu")
    assert fused and opt.defaults["fused"]
    opt, fused = build_optimizer(m, OptimConfig(fused_adamw=False), "cpu")
    assert not fused and not opt.defaults["fused"]
    assert opt.defaults["betas"] == (0.9, 0.95)


def test_a_registered_optimizer_trains_checkpoints_and_resumes(toy, shakespeare_data, tmp_path):
    base = dict(
        TINY_MODEL,
        data=str(shakespeare_data),
        optimizer="toy-sgd",
        lr=0.05,
        batch_size=4,
        max_steps=4,
        save_every=2,
        eval_every=0,
        log_every=1,
        device="cpu",
        dtype="float32",
    )
    full = tmp_path / "full"
    fit(build_train_config("pico", dict(base, out=str(full))), echo=False)
    losses = train_losses(full)
    assert losses[4] < losses[1]  # it trains
    part = tmp_path / "part"
    part.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json", "config.json"):
        (part / name).write_bytes((full / name).read_bytes())
    fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    assert train_losses(part)[4] == losses[4]  # SGD's momentum buffers came back with the checkpoint


def test_a_registered_optimizers_rules_are_the_steps(toy):
    step = make_step(TINY_MODEL, dict(optimizer="toy-sgd"))
    assert isinstance(step.optimizer, torch.optim.SGD) and step.skips_on_device is False
    fp16 = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    with pytest.raises(GptspeedError, match="--optimizer toy-sgd does not support float16"):
        make_step(TINY_MODEL, dict(optimizer="toy-sgd"), rt=fp16)


def test_an_unregistered_name_is_one_line():
    assert "toy-sgd" not in CHOICES and set(optim.OPTIMIZERS) == set(CHOICES) == {"adamw", "muon"}
    with pytest.raises(GptspeedError, match="--optimizer must be one of adamw, muon, got 'sgd'"):
        make_step(TINY_MODEL, dict(optimizer="sgd"))


# ---------------------------------------------------------------------------------- weight decay
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weight_decay_goes_to_matrices_only(optimizer):
    """Muon's AdamW group decayed biases and LayerNorm gains; only the Muon / AdamW split was checked."""
    wd = 0.123
    step = make_step(PLAIN_LOSS_MODEL, dict(optimizer=optimizer, weight_decay=wd))
    seen = []
    for group in step.optimizer.param_groups:
        for p in group["params"]:
            seen.append(p)
            expected = wd if p.dim() >= 2 else 0.0
            assert group["weight_decay"] == expected, (optimizer, tuple(p.shape), group["weight_decay"])
    assert sorted(map(id, seen)) == sorted(map(id, step.params))  # every parameter once
    assert any(p.dim() < 2 for p in seen) and any(p.dim() >= 2 for p in seen)


# ------------------------------------------------------------------------------------------ Muon
def test_muon_splits_hidden_matrices_from_the_rest():
    model = _model()
    hidden, rest = muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].split(".")[-2] for p in hidden} == {"c_attn", "c_proj", "c_fc"}
    assert all(p.dim() == 2 for p in hidden) and len(hidden) == 4 * 2
    rest_names = {names[id(p)] for p in rest}
    assert "transformer.wte.weight" in rest_names and "transformer.wpe.weight" in rest_names  # wte = the head
    assert "transformer.h.0.ln_1.weight" in rest_names and "transformer.h.0.attn.c_attn.bias" in rest_names
    assert len(hidden) + len(rest) == len(list(model.parameters()))
    opt, fused = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-3, muon_lr=0.02), "cpu")
    assert isinstance(opt, MuonWithAdamW) and fused is False  # Muon has no found_inf: one sync per step
    assert sorted(g["lr_mult"] for g in opt.param_groups) == [1.0, 1.0, 20.0]


def test_muon_steps_lower_the_loss_and_never_update_on_a_nonfinite_step():
    trainer = make_step(PADDED_VOCAB_MODEL, dict(optimizer="muon", lr=1e-3, muon_lr=0.02, fused_adamw=False), seed=0)
    model, opt = trainer.model, trainer.optimizer
    x, y = _batch()
    losses = [one_step(trainer, x, y)[0].item() for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5, losses
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = json.dumps({k: str(v) for k, v in opt.state_dict()["muon"]["state"].items()})
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = float("nan")
    loss, _, bad = one_step(trainer, x, y)
    assert bad.item()
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = before["transformer.ln_f.weight"][0]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert json.dumps({k: str(v) for k, v in opt.state_dict()["muon"]["state"].items()}) == state_before


# ---- each switch against its paper's formula, at the layer's output
KELLER_JORDAN_QUINTIC = (3.4445, -4.7750, 2.0315)


def newton_schulz_by_hand(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Muon (2024, kellerjordan.github.io/posts/muon): the quintic Newton-Schulz
    iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, coefficients (3.4445, -4.7750, 2.0315),
    from ``X = G / ||G||_F`` (transposed when tall, so ``A`` is the small Gram matrix), in fp64."""
    a, b, c = KELLER_JORDAN_QUINTIC
    tall = G.size(0) > G.size(1)
    X = G.double().t() if tall else G.double()
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.t()
        X = a * X + (b * A + c * A @ A) @ X
    return X.t() if tall else X


def test_a_muon_step_is_newton_schulz_of_the_nesterov_momentum_scaled_by_sqrt_of_rows_over_cols():
    """Two Muon steps of each hidden matrix, against Keller Jordan's algorithm computed by hand:
    momentum ``B <- mu B + (1 - mu) g``, Nesterov's ``u = (1 - mu) g + mu B``, orthogonalised by 5
    quintic Newton-Schulz steps (:func:`newton_schulz_by_hand`), decoupled weight decay ``W <- W (1 -
    lr wd)``, and the update ``lr * sqrt(max(1, rows / cols)) * NS(u)`` (his scaling, torch's
    ``adjust_lr_fn="original"``: 2 for c_fc's 128 x 32, sqrt 3 for c_attn's 96 x 32, 1 for the
    others -- not Moonshot's ``0.2 * sqrt(max(rows, cols))``). gptspeed iterates in bf16, so the
    change of each matrix must be the fp64 one within 3% (Frobenius; bf16 gives 1-2%, and 4 or 6
    steps, other coefficients or Moonshot's scaling are 13-40% away); the weights are N(0, 1) so
    that the decay's share of the change is ~30%."""
    o = OptimConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, muon_momentum=0.8, weight_decay=0.1, fused_adamw=False)
    model = tiny()
    opt, _ = build_optimizer(model, o, "cpu")
    hidden = {n: p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hidden.values():
            p.copy_(torch.randn(p.shape, generator=g))
    momentum = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in hidden.items()}
    mu, lr, wd = o.muon_momentum, o.muon_lr, o.weight_decay
    for seed in (1, 2):
        fill_grads(model, seed)
        before = {n: p.detach().double().clone() for n, p in hidden.items()}
        opt.step()
        for n, p in hidden.items():
            grad = p.grad.double()
            momentum[n] = mu * momentum[n] + (1 - mu) * grad
            u = (1 - mu) * grad + mu * momentum[n]
            rows, cols = p.shape
            want = -lr * wd * before[n] - lr * max(1.0, rows / cols) ** 0.5 * newton_schulz_by_hand(u)
            got = p.detach().double() - before[n]
            err = float((got - want).norm() / want.norm())
            assert err < 0.03, f"step {seed}, {n} {tuple(p.shape)}: the change is {err:.1%} away from Muon's"


# ---- the speedrun's per-group Adam rates and Muon's momentum warm-up


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_adam_group_reaches_its_own_peak_rate_and_the_default_keeps_two_groups(optimizer):
    """--embed-lr, --head-lr, --scalar-lr (the modded-nanogpt speedrun's per-group Adam rates): at the
    schedule's peak every embedding, the untied head, every gain and bias and every other matrix get
    their own rate; without them AdamW keeps its two groups (a checkpoint's layout is unchanged)."""
    from gptspeed.config import preset
    from gptspeed.schedules import set_lr

    shape = dict(TINY_MODEL, n_layer=2, tie_embeddings=False, value_embeds=1, optimizer=optimizer, warmup_steps=0)
    cfg = preset("pico").override(dict(shape, lr=1e-3, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04))
    model = GPT(cfg.model)
    opt, _ = build_optimizer(model, cfg.optim, "cpu")
    set_lr(opt, cfg, 0)
    rate = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    hidden = {id(p) for p in muon_params(model)[0]} if optimizer == "muon" else set()
    for name, p in model.named_parameters():
        if id(p) in hidden:
            want = cfg.optim.muon_lr
        elif name.startswith(("transformer.wte", "transformer.wpe", "transformer.ve")):
            want = 0.6
        elif name == "lm_head.weight":
            want = 0.008
        elif p.dim() < 2:
            want = 0.04
        else:
            want = 1e-3
        assert rate[id(p)] == pytest.approx(want), name
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(decay[id(p)] == 0.0 for p in model.parameters() if p.dim() < 2 and id(p) not in hidden)
    plain = preset("pico").override(dict(shape, lr=1e-3))
    opt, _ = build_optimizer(GPT(plain.model), plain.optim, "cpu")
    adam = opt if optimizer == "adamw" else opt.adamw
    assert [g["weight_decay"] for g in adam.param_groups] == [plain.optim.weight_decay, 0.0]


@pytest.mark.parametrize("name", ["nano", "gpt2"])
def test_the_speedrun_recipes_group_rates_and_warm_up_scale_with_the_preset(name):
    """``--recipe speedrun`` at nano (lr 2e-3, where it was tuned) and at gpt2 (lr 6e-4): the tied head's (the token
    embedding's) and the gains' peak rates are the multiple of ``--lr`` the recipe declares (3x: 6e-3 at nano, 1.8e-3 at
    gpt2, not nano's 6e-3 at 10x gpt2's rate), Muon's matrices at ``--muon-lr``; the warm-up is the declared share of
    ``--max-steps``. A rate or warm-up given as a flag replaces the recipe's multiple."""
    from gptspeed.config import RECIPES

    cfg = build_train_config(name, {}, recipe_name="speedrun")
    with torch.device("meta"):
        model = GPT(cfg.model)
    opt = MuonWithAdamW(model, cfg.optim, fused=False)
    mult = {id(p): g["lr_mult"] for g in opt.param_groups for p in g["params"]}
    declared = RECIPES["speedrun"]
    assert model.config.tie_embeddings and model.lm_head.weight is model.transformer.wte.weight
    assert mult[id(model.transformer.wte.weight)] == declared["embed_lr_ratio"] == 3.0
    assert mult[id(model.transformer.ln_f.weight)] == declared["scalar_lr_ratio"]
    assert mult[id(model.transformer.h[0].attn.c_attn.weight)] * cfg.optim.lr == pytest.approx(cfg.optim.muon_lr)
    head_lr = mult[id(model.lm_head.weight)] * cfg.optim.lr
    assert head_lr == pytest.approx({"nano": 6e-3, "gpt2": 1.8e-3}[name])
    assert cfg.warmup_steps() == round(declared["warmup_ratio"] * cfg.train.max_steps) == {"nano": 7, "gpt2": 381}[name]
    assert build_train_config(name, {"max_steps": 100}, recipe_name="speedrun").warmup_steps() == 2  # as tuned
    flagged = build_train_config(name, {"embed_lr": 1e-3, "warmup_steps": 5}, recipe_name="speedrun")
    assert (flagged.optim.group_lr("embed"), flagged.optim.group_lr("scalar"), flagged.warmup_steps()) == (
        1e-3,
        pytest.approx(3 * cfg.optim.lr),
        5,
    )
