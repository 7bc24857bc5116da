"""``gptspeed.optim``: optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction

import pytest
import torch

from gptspeed import optim
from gptspeed.config import OPTIMIZERS as CHOICES
from gptspeed.config import OptimConfig
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.optim import MuonWithAdamW, build_optimizer, lr_at, muon_params, param_groups
from gptspeed.runtime import Runtime
from gptspeed.trainer import build_train_config, fit

from support.padded_model import _batch, _model
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


SHAPE = dict(TINY_MODEL, loss="plain")


SHAPE_PADDED = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


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


# ------------------------------------------------------------------ the learning-rate schedule, set into the groups
def test_set_lr_writes_the_schedules_rate_times_each_groups_lr_mult():
    """set_lr follows the run's settings (wsd, its decay share, --min-lr-ratio, warm-up, max steps)
    and writes lr * lr_mult into every group (a group without lr_mult gets lr). Worked out by hand:
    lr 1e-2, min ratio 0.25 (min 2.5e-3), warm-up 2, 10 steps, wsd with decay share 0.5 (decay from
    step 5): step 7: lr = 2.5e-3 + 7.5e-3 * (10 - 7) / 5 = 7e-3."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import set_lr

    cfg = RunConfig(
        optim=OptimConfig(lr=1e-2, min_lr_ratio=0.25, warmup_steps=2, lr_schedule="wsd", decay_ratio=0.5),
        train=TrainConfig(max_steps=10),
    )
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 4.0}], lr=1.0)
    assert set_lr(opt, cfg, 7) == pytest.approx(7e-3, rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([7e-3, 2.8e-2], rel=1e-12), (
        "each group's lr must be the schedule's rate times its lr_mult (1 without one)"
    )
    assert set_lr(opt, cfg, 4) == pytest.approx(1e-2, rel=1e-12), "before the decay share wsd holds the peak"
    assert set_lr(opt, cfg, 10) == pytest.approx(2.5e-3, rel=1e-12), "at max_steps: lr * min_lr_ratio"


def test_lr_at_defaults_to_a_decay_share_of_one_fifth_for_wsd():
    """wsd without decay_ratio decays over the last 20% of the steps: at step 50 of 100 (no
    warm-up) it still holds the peak, at step 90 it is half way down."""
    from gptspeed.optim import lr_at

    kw = dict(max_lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=100, schedule="wsd")
    assert lr_at(50, **kw) == 1.0, "wsd's default decay share is 0.2: step 50 of 100 is before it"
    assert lr_at(90, **kw) == pytest.approx(0.5, rel=1e-12)


def test_lr_at_is_the_final_rate_from_max_steps_on_even_when_warm_up_lasts_the_whole_run():
    """A step at or past max_steps gets min_lr, also when the warm-up is as long as the run (the
    cosine's progress would read 0 there and give the peak)."""
    from gptspeed.optim import lr_at

    for schedule in ("cosine", "wsd"):
        assert lr_at(10, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=10, schedule=schedule) == 0.1, schedule


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
    step = make_step(SHAPE, dict(optimizer=optimizer, weight_decay=wd))
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
    trainer = make_step(SHAPE_PADDED, dict(optimizer="muon", lr=1e-3, muon_lr=0.02, fused_adamw=False), seed=0)
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
def schedule_by_hand(step: int, schedule: str, peak: float, floor: float, warmup: int, steps: int, share: float):
    """The learning rate of 0-based step ``step``, from the papers' shapes: a linear warm-up in which
    step ``s`` of ``warmup`` runs at ``(s + 1) / warmup`` of the peak; then ``cosine`` (GPT-3, Brown
    et al. 2020, appendix B): ``floor + (peak - floor) * (1 + cos(pi * t)) / 2``, ``t`` the share of
    the steps after the warm-up done; or ``wsd`` (Hägele et al. 2024): the peak until the last
    ``share`` of the run (never inside the warm-up), then a straight line from the peak there to
    ``floor`` at ``steps``; ``floor`` from ``steps`` on."""
    if step >= steps:
        return floor
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "cosine":
        return floor + (peak - floor) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2
    start = max(warmup, steps * (1 - share))
    return peak if step < start else peak - (peak - floor) * (step - start) / (steps - start)


@pytest.mark.parametrize(
    "schedule, warmup", [("cosine", dict(warmup_steps=4)), ("wsd", dict(warmup_ratio=0.2))], ids=["cosine", "wsd"]
)
def test_the_lr_of_every_step_of_a_run_is_the_schedules_closed_form_in_every_group(schedule, warmup):
    """What the trainer's loop sets before each step (``set_lr``), for a 20-step run with a 4-step
    warm-up (given as steps, or as a ratio of the run), a floor of 0.25 of the peak and, for wsd, a
    decay share of 0.33 (the decay starts between two steps, at 13.4): the base rate is the closed
    form at every step, AdamW's groups run at it and Muon's at it times ``muon_lr / lr``."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import set_lr

    o = OptimConfig(
        optimizer="muon", lr=1e-2, muon_lr=0.05, min_lr_ratio=0.25, lr_schedule=schedule, decay_ratio=0.33, **warmup
    )
    cfg = RunConfig(optim=o, train=TrainConfig(max_steps=20))
    opt, _ = build_optimizer(tiny(), o, "cpu")
    for step in range(23):
        want = schedule_by_hand(step, schedule, 1e-2, 2.5e-3, 4, 20, 0.33)
        assert set_lr(opt, cfg, step) == pytest.approx(want, rel=1e-12, abs=0), f"step {step}"
        assert [g["lr"] for g in opt.adamw.param_groups] == pytest.approx([want, want], rel=1e-12, abs=0)
        assert [g["lr"] for g in opt.muon.param_groups] == pytest.approx([want * 5], rel=1e-12, abs=0)


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
    from gptspeed.optim import set_lr

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


@pytest.mark.parametrize("warmup", [300, 1, 0])
def test_muons_momentum_warms_up_linearly_then_holds_and_adamw_is_untouched(warmup):
    """--muon-momentum-warmup N with start 0.85 and --muon-momentum 0.95 (the speedrun's: N = 300): the
    momentum of step s is 0.85 + min(s / N, 1) * 0.10 (N = 1: 0.85 at step 0 only), what
    ``muon_momentum_at`` gives and ``set_lr`` sets into Muon's groups with the learning rate; AdamW's betas
    do not move; N = 0 (the default, off) is 0.95 at every step, Muon's momentum left as built."""
    from gptspeed.config import preset
    from gptspeed.optim import muon_momentum_at, set_lr

    cfg = preset("pico").override(
        dict(TINY_MODEL, optimizer="muon", muon_momentum_warmup=warmup, muon_momentum_start=0.85, muon_momentum=0.95)
    )
    opt, _ = build_optimizer(GPT(cfg.model), cfg.optim, "cpu")
    for step in (0, 1, 150, 299, 300, 1000):
        frac = min(Fraction(step, warmup), 1) if warmup else 1
        want = float(Fraction("0.85") + frac * Fraction("0.10"))
        assert muon_momentum_at(step, cfg.optim) == pytest.approx(want, rel=1e-12), f"step {step}"
        set_lr(opt, cfg, step)
        assert [g["momentum"] for g in opt.muon.param_groups] == [pytest.approx(want, rel=1e-12)], f"step {step}"
        assert all(g["betas"] == (cfg.optim.beta1, cfg.optim.beta2) for g in opt.adamw.param_groups)


def test_the_muon_momentum_warm_up_leaves_another_optimizers_momentum_alone(toy):
    """--muon-momentum-warmup moves Muon's momentum only: a registered optimizer with a ``momentum`` of its
    own (the toy SGD's 0.9) keeps it at every step."""
    from gptspeed.config import preset
    from gptspeed.optim import set_lr

    cfg = preset("pico").override(
        dict(TINY_MODEL, optimizer="toy-sgd", muon_momentum_warmup=300, muon_momentum_start=0.85, muon_momentum=0.95)
    )
    opt, _ = build_optimizer(GPT(cfg.model), cfg.optim, "cpu")
    for step in (0, 150, 300):
        set_lr(opt, cfg, step)
        assert [g["momentum"] for g in opt.param_groups] == [0.9], f"step {step}"


# ------------------------------------------------------------------ --attn-window: the window's warm-up
def window_by_hand(step: int, start: int, final: int, max_steps: int) -> int:
    """The speedrun's window warm-up written out: linear in ``step / max_steps`` from ``start`` (at most
    ``final``) to ``final``, rounded up to a multiple of 128 tokens, never past ``final`` (``final`` from
    ``max_steps`` on); exact rationals, so no float rounding can move a step across a multiple of 128."""

    start = min(start, final)
    if step >= max_steps:
        return final
    linear = start + Fraction(final - start) * step / max_steps
    return min(final, 128 * math.ceil(linear / 128))


@pytest.mark.parametrize(
    "start, final, max_steps",
    [(128, 1792, 37), (128, 1792, 1750), (1, 1000, 20), (300, 200, 9), (64, 100, 5), (128, 1024, 896)],
)
def test_the_attention_window_of_every_step_is_the_linear_warm_up_rounded_up_to_128(start, final, max_steps):
    """``attn_window_at``, what the trainer's loop sets into the model before each step, equals the
    closed form at every step of a run and past it; the windows never shrink, are multiples of 128 or
    the final window, start at the start rounded up, and reach the final window. A start above the
    final window is taken as the final window (constant); a final window of 128 or less is constant."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import attn_window_at

    cfg = RunConfig(
        model=GPTConfig(block_size=2048, attn_window=final, attn_window_start=start),
        train=TrainConfig(max_steps=max_steps),
    )
    got = [attn_window_at(s, cfg) for s in range(max_steps + 3)]
    assert got == [window_by_hand(s, start, final, max_steps) for s in range(max_steps + 3)]
    assert all(a <= b for a, b in zip(got, got[1:]))
    assert all(w % 128 == 0 or w == final for w in got)
    assert got[0] == min(final, 128 * math.ceil(min(start, final) / 128)) and got[-1] == final
    if final <= 128 or start >= final:
        assert set(got) == {final}
    off = RunConfig(model=GPTConfig(block_size=2048), train=TrainConfig(max_steps=max_steps))
    assert {attn_window_at(s, off) for s in range(max_steps + 1)} == {0}


def test_the_speedruns_windows_are_128_to_1792_growing_one_block_at_a_time():
    """The modded-nanogpt speedrun's warm-up (``next_multiple_of_n(1728 * step / num_iterations, n=128)``,
    from 128 to 1792 tokens) as ``--attn-window 1792 --attn-window-start 128``: the same range, one
    128-token block at a time, each of the 14 windows in use for a run of consecutive steps."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import attn_window_at

    cfg = RunConfig(
        model=GPTConfig(block_size=2048, attn_window=1792, attn_window_start=128), train=TrainConfig(max_steps=1750)
    )
    got = [attn_window_at(s, cfg) for s in range(1750)]
    assert sorted(set(got)) == list(range(128, 1793, 128))
    assert all(b - a in (0, 128) for a, b in zip(got, got[1:]))


def accum_by_hand(step: int, start_tokens: int | None, micro: int, full: int, n: int) -> int:
    """The batch-size warm-up's micro-batches, written from its definition (GPT-3's linear ramp in whole
    micro-batches): exact fractions, floored."""
    if n == 0 or step >= n:
        return full
    a0 = min(full, max(1, (start_tokens or micro) // micro))
    return a0 + math.floor(Fraction(full - a0) * step / n)


@pytest.mark.parametrize(
    "start_tokens, full, n, world",
    [
        (None, 8, 5, 1),
        (3 * 256, 8, 7, 1),
        (1, 4, 3, 2),
        (10**9, 6, 4, 1),
        (512, 1, 4, 2),
        (2 * 256, 16, 100, 1),
        (3 * 256 + 100, 8, 5, 2),
    ],
)
def test_the_batch_of_every_step_is_the_linear_warm_up_in_whole_micro_batches(start_tokens, full, n, world):
    """``grad_accum_at``, the micro-batches the trainer's loop gives each step, equals the ramp written from its
    definition at every step of the warm-up and past it; it never shrinks, starts at ``--batch-start-tokens`` in
    whole micro-batches of all the processes' tokens (rounded down, at least one, at most the full batch) and
    ends at the full accumulation; ``tokens_between`` is the sum of the steps' tokens over any span. Both count
    one process unless told the world size."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import grad_accum_at, tokens_between

    B, T = 4, 32
    micro = B * T * world
    cfg = RunConfig(
        model=GPTConfig(block_size=T),
        train=TrainConfig(
            batch_size=B, total_batch_tokens=full * micro, batch_warmup_steps=n, batch_start_tokens=start_tokens
        ),
    )
    got = [grad_accum_at(s, cfg, world) for s in range(n + 3)]
    assert got == [accum_by_hand(s, start_tokens, micro, full, n) for s in range(n + 3)]
    assert all(a <= b for a, b in zip(got, got[1:])) and got[-1] == full
    assert got[0] == min(full, max(1, (start_tokens or micro) // micro))
    for first, last in [(0, n + 3), (1, n), (n - 1, n + 2), (n + 1, n + 3), (2, 2), (5, 1)]:
        want = micro * sum(got[s] for s in range(first, last)) if last <= n + 3 else None
        assert tokens_between(first, last, cfg, world) == want
    assert tokens_between(0, 1000, cfg, world) == micro * (sum(got[:n]) + (1000 - n) * full)
    if world == 1:
        assert [grad_accum_at(s, cfg) for s in range(n + 3)] == got
        assert tokens_between(0, 1000, cfg) == micro * (sum(got[:n]) + (1000 - n) * full)
    off = RunConfig(model=GPTConfig(block_size=T), train=TrainConfig(batch_size=B, total_batch_tokens=full * micro))
    assert {grad_accum_at(s, off, world) for s in range(n + 1)} == {full}
    assert tokens_between(3, 10, off, world) == 7 * full * micro


def seq_len_by_hand(step: int, start: int, full: int, n: int) -> int:
    """The sequence-length warm-up's length, from its definition: the line from ``start`` to ``full`` over ``n``
    steps, rounded down to a halving of ``full`` (never below the shortest halving at or above ``start``)."""
    if n == 0 or step >= n:
        return full
    start = min(start, full)
    halvings = {full // 2**k for k in range(12) if full % 2**k == 0 and full // 2**k >= start}
    line = start + Fraction(full - start) * step / n
    return max([t for t in halvings if t <= line], default=min(halvings))


@pytest.mark.parametrize(
    "start, full, n", [(64, 1024, 100), (16, 64, 3), (100, 1024, 50), (8, 96, 20), (5000, 1024, 9), (1, 7, 4)]
)
def test_the_sequence_length_of_every_step_is_the_linear_warm_up_rounded_down_to_a_halving(start, full, n):
    """``seq_len_at``, the length the trainer's loop trains each step's sequences at, equals the warm-up written from
    its definition at every step and past it; every length divides ``--seq-len`` (the micro-batch's tokens cut
    whole), the lengths never shrink and end at ``--seq-len``."""
    from gptspeed.config import RunConfig, TrainConfig
    from gptspeed.optim import seq_len_at

    cfg = RunConfig(model=GPTConfig(block_size=full), train=TrainConfig(seq_len_warmup_steps=n, seq_len_start=start))
    got = [seq_len_at(s, cfg) for s in range(n + 3)]
    assert got == [seq_len_by_hand(s, start, full, n) for s in range(n + 3)]
    assert all(full % t == 0 for t in got) and all(a <= b for a, b in zip(got, got[1:])) and got[-1] == full
    off = RunConfig(model=GPTConfig(block_size=full))
    assert {seq_len_at(s, off) for s in range(n + 1)} == {full}


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
