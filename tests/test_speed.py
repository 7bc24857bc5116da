"""Issue 7's techniques on a CPU: Muon, activation checkpointing, per-block compile, no
recompilation between train and eval, --batch-size auto's probe logic, ladder stages (FP8: tests/test_fp8.py).
GPU-only paths (the CUDA probe) skip without CUDA."""

import json
import shutil

import pytest
import torch
from conftest import assert_user_error, make_step, one_step, run_cli

from gptspeed.config import OptimConfig
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT, GPTConfig
from gptspeed.optim import MuonWithAdamW, build_optimizer, muon_params
from gptspeed.parallelize import parallelize
from gptspeed.runtime import resolve_runtime
from gptspeed.trainer import build_train_config, fit

SHAPE = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
CPU = resolve_runtime("cpu", "float32", False)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SHAPE, **kw}))


def _batch(B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (B, T), generator=g), torch.randint(0, 50257, (B, T), generator=g)


def _loss_and_grads(train_model, model, x, y):
    _, loss = train_model(x, y)
    loss.backward()
    # by state-dict name (a checkpoint_wrapper's module prefix is not part of it)
    grads = {n: p.grad.clone() for n, p in model.state_dict(keep_vars=True).items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


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
    trainer = make_step(SHAPE, dict(optimizer="muon", lr=1e-3, muon_lr=0.02, fused_adamw=False), seed=0)
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


def test_muon_resume_from_checkpoint_is_bit_identical(shakespeare_data, tmp_path):
    from test_train import TINY, records

    full = tmp_path / "full"
    base = dict(
        TINY,
        data=str(shakespeare_data),
        max_steps=5,
        save_every=2,
        keep_checkpoints=5,
        eval_every=0,
        optimizer="muon",
        muon_lr=0.02,
    )
    summary = fit(build_train_config("pico", dict(base, out=str(full))), echo=False)
    assert summary["step"] == 5 and summary["interrupted"] is None, summary
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(full / "ckpt_00000002.pt", part)
    shutil.copy(full / "ckpt_00000002.json", part)
    assert fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)["step"] == 5
    a = {r["step"]: r for r in records(full)}
    b = {r["step"]: r for r in records(part)}
    for s in range(3, 6):
        assert b[s]["train_loss"] == a[s]["train_loss"], s
    assert b[5]["val_loss"] == a[5]["val_loss"]
    with pytest.raises(GptspeedError, match="optimizer"):  # the other optimizer would not continue the run
        fit(build_train_config(None, dict(out=str(part), resume=True, max_steps=6, optimizer="adamw")), echo=False)


# ------------------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_same_loss_and_grads(mode):
    x, y = _batch()
    ref_model = _model()
    ref_loss, ref_grads = _loss_and_grads(ref_model, ref_model, x, y)
    model = _model()
    train_model = parallelize(model, CPU, activation_checkpointing=mode)
    assert list(model.state_dict()) == list(ref_model.state_dict())  # applied from outside, names unchanged
    loss, grads = _loss_and_grads(train_model, model, x, y)
    assert torch.equal(loss, ref_loss)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=0, atol=0, msg=k)
    with torch.no_grad():  # eval runs the plain forward
        assert torch.equal(train_model(x, y)[1], ref_model(x, y)[1])
    with pytest.raises(GptspeedError, match="activation-checkpointing"):
        parallelize(_model(), CPU, activation_checkpointing="most")


def test_activation_checkpointing_passes_a_blocks_second_argument_through():
    """Each block is wrapped by PyTorch's checkpoint_wrapper, which forwards every argument: the KV
    cache, the block's second positional argument, reaches the attention (the hand-written wrapper
    bound it to a default parameter and dropped it)."""
    from gptspeed.model import KVCache

    x, _ = _batch()
    ref_model, model = _model(), _model()
    parallelize(model, CPU, activation_checkpointing="full")
    assert type(model.transformer.h[0]).__name__ == "CheckpointWrapper"
    with torch.no_grad():
        outs = []
        for m in (ref_model, model):
            kv = KVCache(m.config.n_layer, x.size(1))
            logits, _ = m(x[:, :-1], kv=kv)  # prefill: writes the cache
            kv.start = x.size(1) - 1
            step, _ = m(x[:, -1:], pos=torch.tensor([x.size(1) - 1]), kv=kv)  # one token, reading it
            outs.append((logits, step, kv.k[0].clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------- compile: blocks, no recompiles
def test_compile_blocks_traces_and_matches_eager():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y = _batch()
    ref_model = _model()
    ref_loss, ref_grads = _loss_and_grads(ref_model, ref_model, x, y)
    model = _model()
    rt = resolve_runtime("cpu", "float32", True)
    train_model = parallelize(model, rt, compile_mode="blocks", backend="eager")
    assert train_model is model  # blocks compiled in place
    loss, grads = _loss_and_grads(train_model, model, x, y)
    torch.testing.assert_close(loss, ref_loss)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, msg=k)
    # both blocks traced by dynamo; the second block reuses the first's code (one unique graph)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_eval_after_training_does_not_recompile():
    """Dynamo guards on grad mode, so the first evaluation (under no_grad, same shapes) compiles
    its forward-only graph once; after that, train and eval alternate with no compile at all."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y = _batch()
    model = _model()
    train_model = parallelize(model, resolve_runtime("cpu", "float32", True), backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train():
        train_model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def evaluate():
        model.eval()
        with torch.no_grad():
            train_model(x, y)
        model.train()

    train()
    train()
    assert counters["stats"]["unique_graphs"] == 1
    evaluate()
    after_first_eval = counters["stats"]["unique_graphs"]
    assert after_first_eval <= 2  # the grad-free forward, once
    for _ in range(2):
        train()
        evaluate()
    assert counters["stats"]["unique_graphs"] == after_first_eval
    assert not counters["recompiles"] or max(counters["recompiles"].values(), default=0) <= 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- --batch-size auto
def test_probe_finds_the_largest_fitting_batch():
    from gptspeed.batchsize import largest_fitting

    for limit_true in (1, 2, 3, 7, 8, 13, 64, 100, 1000):
        calls = []

        def fits(b):
            calls.append(b)
            return b <= limit_true

        assert largest_fitting(fits, limit=1024) == limit_true
        assert len(calls) <= 2 * 11
    assert largest_fitting(lambda b: False) == 0
    assert largest_fitting(lambda b: True, limit=48) == 48


def test_pick_micro_batch_is_a_power_of_two_dividing_the_global_batch():
    from gptspeed.batchsize import pick_micro_batch

    assert pick_micro_batch(100, 512) == 64  # 90 after the margin -> 64
    assert pick_micro_batch(40, 512) == 32
    assert pick_micro_batch(40, 24) == 8  # must divide 24 sequences
    assert pick_micro_batch(1, 512) == 1
    assert pick_micro_batch(100, None) == 64
    with pytest.raises(GptspeedError, match="not even one sequence"):
        pick_micro_batch(0, 512)


def test_auto_batch_cache_and_cpu_refusal(tmp_path, monkeypatch):
    from gptspeed import batchsize

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    key = batchsize.cache_key("NVIDIA H100", {"n_layer": 12})
    assert key != batchsize.cache_key("NVIDIA H100", {"n_layer": 24})
    assert batchsize.cached_fit(key) is None
    batchsize.store_fit(key, 37)
    assert batchsize.cached_fit(key) == 37
    assert batchsize.cache_path() == tmp_path / "cache" / "batch_size.json"
    with pytest.raises(GptspeedError, match="needs CUDA"):
        batchsize.resolve_auto_batch(torch.device("cpu"), {}, 512, lambda b: None)
    from gptspeed.config import AUTO_BATCH_SIZE, parse_batch_size

    assert parse_batch_size("auto") == AUTO_BATCH_SIZE and parse_batch_size("8") == 8


def test_batch_size_auto_on_cpu_is_a_one_line_error(shakespeare_data, tmp_path):
    proc = run_cli(
        "train",
        "--preset",
        "pico",
        "--data",
        str(shakespeare_data),
        "--out",
        str(tmp_path / "r"),
        "--device",
        "cpu",
        "--batch-size",
        "auto",
        "--total-batch-tokens",
        "4096",
        timeout=120,
    )
    assert_user_error(proc, "--batch-size auto", "CUDA")


def test_auto_batch_cache_key_names_world_size_and_parallel_mode(monkeypatch):
    """The fit for 8 FSDP ranks is not the fit for 1 process: the cache key says which."""
    import dataclasses

    from gptspeed import batchsize
    from gptspeed.config import preset
    from gptspeed.step import auto_batch_size

    seen = []
    monkeypatch.setattr(batchsize, "resolve_auto_batch", lambda device, settings, *a, **k: seen.append(settings) or 8)
    cfg = preset("pico").override(dict(batch_size=0, total_batch_tokens=64 * 64))
    for world, parallel in ((1, "none"), (8, "fsdp"), (8, "ddp")):
        rt = dataclasses.replace(CPU, world_size=world, parallel=parallel)
        assert auto_batch_size(cfg, rt, say=lambda m: None) == 8
    assert [(s["world_size"], s["parallel"]) for s in seen] == [(1, "none"), (8, "fsdp"), (8, "ddp")]
    assert len({batchsize.cache_key("NVIDIA H100 80GB HBM3", s) for s in seen}) == 3


@pytest.mark.cuda
def test_cuda_probe_finds_a_batch(tmp_path, monkeypatch):
    from gptspeed.config import preset
    from gptspeed.step import auto_batch_size

    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path))
    cfg = preset("pico").override(dict(batch_size=0, total_batch_tokens=64 * 64, compile=False))
    rt = resolve_runtime("cuda", "auto", False)
    b = auto_batch_size(cfg, rt, say=lambda m: None)
    assert b >= 1 and 64 % b == 0 and (b & (b - 1)) == 0


# ------------------------------------------------------------------------------------------ ladder
def test_issue7_stages_follow_fused_ce_and_skip_with_reasons_on_cpu():
    from gptspeed.bench.stages import STAGE_NAMES, plan_ladder, record

    new = ["batch-auto", "fp8", "muon", "compile-blocks", "max-autotune"]
    assert list(STAGE_NAMES[STAGE_NAMES.index("fused-ce") + 1 :]) == new
    rows = {r.stage.name: r for r in plan_ladder(torch.device("cpu"), None, "eager")}
    for name in ("batch-auto", "fp8", "max-autotune"):
        assert rows[name].settings is None and "cpu" in rows[name].skip_reason, name
    assert rows["muon"].skip_reason is None and rows["muon"].settings["optimizer"] == "muon"
    last = record(rows["compile-blocks"].settings)
    assert (last["compile_mode"], last["optimizer"], last["loss"], last["fp8"], last["batch_auto"]) == (
        "blocks",
        "muon",
        "fused",
        False,
        False,
    )
