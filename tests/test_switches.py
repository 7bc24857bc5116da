"""The modern-GPT switches (issue 32), each off by default: shapes, gradients, parameter counts, the
KV-cache sampling path, documents that never see each other, soft-capped logits through every loss
path, the WSD schedule, resume, and export refusing what GPT-2's format cannot hold."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, assert_user_error, run_main, train_losses

from gptspeed.model import GPT, GPTConfig, document_ids
from gptspeed.optim import lr_at
from gptspeed.sample import generate, generate_cached, left_pad
from gptspeed.tokenizer import EOT_TOKEN
from gptspeed.trainer import build_train_config, fit

pytestmark = pytest.mark.usefixtures("one_thread")

SWITCHES = {
    "rope": dict(pos_emb="rope"),
    "qk-norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"),
    "rmsnorm": dict(norm="rmsnorm"),
    "untied": dict(tie_embeddings=False),
    "zero-init": dict(zero_init_proj=True),
    "softcap": dict(logit_softcap=15.0),
    "doc-mask": dict(doc_mask=True),
}
ALL = {k: v for s in SWITCHES.values() for k, v in s.items()}
CASES = {**SWITCHES, "all": ALL, "all-manual": dict(ALL, attention="manual")}


def tiny(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**dict(TINY_MODEL, n_layer=2), **kw}))


def with_documents(B=2, T=32, seed=0) -> torch.Tensor:
    """Token ids with an <|endoftext|> inside every row (documents packed as gptspeed writes them)."""
    idx = torch.randint(0, 50000, (B, T), generator=torch.Generator().manual_seed(seed))
    idx[:, 0] = EOT_TOKEN
    idx[:, T // 3] = EOT_TOKEN
    idx[0, 2 * T // 3] = EOT_TOKEN
    return idx


@pytest.mark.parametrize("name", CASES)
def test_each_switch_trains_every_parameter_and_counts_them(name):
    model = tiny(**CASES[name]).train()
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())  # the size check's count
    idx = with_documents()
    logits, _ = model(idx)
    assert logits.shape == (2, 32, 50304) and torch.isinf(logits[..., 50257:]).all()
    _, loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert silent == []
    if model.config.zero_init_proj:  # zero-initialised output projections learn from the first step
        assert model.transformer.h[0].mlp.c_proj.weight.abs().max() == 0
        # (with an untied head zeroed too, only the head has a gradient at the first step, as in the speedrun)
        first = model.lm_head if not model.config.tie_embeddings else model.transformer.h[0].mlp.c_proj
        assert first.weight.grad.abs().max() > 0
    if not model.config.tie_embeddings:
        assert model.lm_head.weight is not model.transformer.wte.weight
    if model.config.pos_emb == "rope":
        assert "wpe" not in model.transformer


@pytest.mark.parametrize("name", CASES)
def test_kv_cache_sampling_draws_the_cache_free_tokens(name):
    model = tiny(**CASES[name]).eval()
    idx = with_documents(B=2, T=6, seed=3)
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    ref = torch.stack(list(generate(model, idx, 30, temperature=1.0, generator=g())), dim=1)  # past block_size too
    got = torch.stack(list(generate_cached(model, idx, 30, temperature=1.0, generator=g())), dim=1)
    assert torch.equal(ref, got)
    prompts = [[EOT_TOKEN, 11, 12, EOT_TOKEN, 14], [21, 22]]  # left padding too
    batch, pad = left_pad(prompts)
    cached = torch.stack(list(generate_cached(model, batch, 8, temperature=0, pad=pad)), dim=1)
    for row, prompt in enumerate(prompts):
        alone = torch.stack(list(generate(model, torch.tensor([prompt]), 8, temperature=0)), dim=1)
        assert torch.equal(cached[row], alone[0])


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_with_the_document_mask_each_document_computes_as_if_alone(attention):
    """--doc-mask with rotary positions (relative: a document's logits do not depend on where in the
    window it starts): the logits of a packed window equal those of each document run alone."""
    model = tiny(pos_emb="rope", doc_mask=True, attention=attention).eval()
    idx = with_documents(B=1, T=30)
    starts = [0, 10, 20]
    packed = model(idx)[0]
    for a, b in zip(starts, starts[1:] + [30]):
        alone = model(idx[:, a:b])[0]
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-4, atol=1e-4)
    free = tiny(pos_emb="rope", attention=attention).eval()  # the same weights without the mask see across
    free.load_state_dict(model.state_dict())
    assert not torch.allclose(free(idx)[0][:, 10:20], model(idx[:, 10:20])[0], atol=1e-3)
    assert document_ids(idx)[0].tolist() == [1] * 10 + [2] * 10 + [3] * 10


@pytest.mark.parametrize("loss", ["plain", "fused"])
@pytest.mark.parametrize("softmax", ["full", "data"])
def test_soft_capped_logits_and_loss_through_every_loss_path(loss, softmax):
    """cap * tanh(logits / cap) (Gemma 2): the logits stay within +-cap, and each loss path's loss and
    gradients equal the formula's, computed here from the plain logits."""
    cap = 2.0
    model = tiny(logit_softcap=cap, loss=loss, softmax=softmax)
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(5))
    if softmax == "data":
        model.set_softmax_ids(torch.unique(idx))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(50)  # logits far beyond the cap
    _, got = model(idx, idx)
    h = model.hidden_states(idx)
    ids = model.softmax_ids if softmax == "data" else torch.arange(50257)
    raw = h @ model.lm_head.weight[ids].t()
    capped = cap * torch.tanh(raw / cap)
    target = torch.searchsorted(ids, idx.reshape(-1))
    want = F.cross_entropy(capped.reshape(-1, ids.numel()), target)
    assert (
        raw.abs().max() > 5 * cap
        and model(idx)[0][..., :50257].isfinite().logical_and(model(idx)[0][..., :50257].abs() > cap + 1e-5).sum() == 0
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g_got = torch.autograd.grad(got, model.lm_head.weight)[0]
    g_want = torch.autograd.grad(want, model.lm_head.weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_the_wsd_schedule_warms_up_holds_then_decays_linearly():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, schedule="wsd", decay_ratio=0.2)
    lrs = [lr_at(s, **kw) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(lr == 1.0 for lr in lrs[10:80])
    assert lrs[90] == pytest.approx(0.55) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:]))
    cosine = lr_at(55, **{**kw, "schedule": "cosine"})
    assert cosine == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_a_modern_run_resumes_to_the_bit_and_cannot_be_exported(shakespeare_data, tmp_path):
    flags = dict(
        TINY_MODEL,
        **{k: v for k, v in ALL.items() if k != "doc_mask"},
        doc_mask=True,
        lr_schedule="wsd",
        data=str(shakespeare_data),
        batch_size=4,
        max_steps=4,
        save_every=2,
        eval_every=0,
        log_every=1,
        device="cpu",
        dtype="float32",
        warmup_steps=1,
    )
    full = tmp_path / "full"
    fit(build_train_config("pico", dict(flags, out=str(full))), echo=False)
    part = tmp_path / "part"
    part.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json", "config.json"):
        (part / name).write_bytes((full / name).read_bytes())
    fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    assert train_losses(part)[4] == train_losses(full)[4]
    assert_user_error(
        run_main("export-hf", "--run", str(full), "--out", str(tmp_path / "hf")),
        "not GPT-2's architecture",
        "--pos-emb rope",
    )
    proc = run_main("sample", "--run", str(full), "--max-new-tokens", "4", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
