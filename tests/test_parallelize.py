"""``gptspeed.parallelize``: how a model is wrapped for training, from outside (torchtitan style): FP8 conversion, activation checkpointing, DDP or FSDP2, then ``torch.compile`` -- with its kernel cache, its CUDA-graph rules -- and :func:`unwrap`, the one place that knows how to get the plain module back."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from gptspeed.config import preset
from gptspeed.errors import GptspeedError
from gptspeed.parallelize import check_cuda_graphs, compile_cache_dir, parallelize, use_compile_cache
from gptspeed.runtime import Runtime, resolve_runtime

from support.padded_model import CPU, _batch, _model
from support.paths import SRC

pytestmark = pytest.mark.usefixtures("one_thread")


PROBE = r"""
import json, os, socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1]); s.close()
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
from gptspeed.config import preset
from gptspeed.distributed import finish_process, init_distributed
from gptspeed.runtime import resolve_runtime
from gptspeed.step import TrainStep

casts, dtypes = [0], set()
real = pg.FSDPParamGroup.unshard
def counting(self, *a, **k):  # a fresh unshard: FSDP2's cast (and, over several ranks, all-gather) of the weights
    if self._all_gather_result is None and not self.is_unsharded:
        casts[0] += 1
    return real(self, *a, **k)
pg.FSDPParamGroup.unshard = counting
rt = resolve_runtime(os.environ["PROBE_DEVICE"], "bfloat16", False, "fsdp")
init_distributed(rt)
torch.manual_seed(0)
x = torch.randint(0, 50257, (24, 17), device=rt.device)
out = {}
for keep in (False, True):
    cfg = preset("pico").override(dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=2,
                                       total_batch_tokens=2 * 16 * 4, parallel="fsdp", dtype="bfloat16",
                                       compile=False, cast_weights_once=keep))
    cfg.validate(world_size=1)
    step = TrainStep(cfg, rt)
    step.model.transformer.h[0].register_forward_pre_hook(lambda m, i: dtypes.add(str(m.attn.c_attn.weight.dtype)))
    batches = iter([(x[i:i + 2, :-1], x[i:i + 2, 1:]) for i in range(0, 24, 2)])  # 3 steps of 4 micro-batches
    casts[0], losses = 0, []
    for _ in range(3):
        loss, _, _ = step(lambda: next(batches))
        losses.append(loss.item())
    out[str(keep)] = [casts[0], losses]
out["dtypes"] = sorted(dtypes)
print(json.dumps(out), flush=True)
finish_process(0)
"""


def _loss_and_grads(train_model, model, x, y):
    _, loss = train_model(x, y)
    loss.backward()
    # by state-dict name (a checkpoint_wrapper's module prefix is not part of it)
    grads = {n: p.grad.clone() for n, p in model.state_dict(keep_vars=True).items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_weights_are_cast_once_a_step_and_the_losses_do_not_change(device):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "PROBE_DEVICE": device,
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (every, losses), (once, kept) = out["False"], out["True"]
    # 3 FSDP groups (2 blocks, the root): per micro-step 3 casts in forward and the 2 blocks' again in
    # backward (resharded after forward) = 5, x 4 micro-steps x 3 steps; kept: 3 a step
    assert every == 5 * 4 * 3 and once == 3 * 3
    assert kept == losses  # the same bf16 weights, cast once instead of four times: the same numbers
    assert out["dtypes"] == ["torch.bfloat16"]  # the blocks compute with FSDP2's bf16 copy


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (dict(cast_weights_once=True), "--parallel auto --dtype auto"),
        (dict(cast_weights_once=True, parallel="fsdp", dtype="float32"), "--parallel fsdp --dtype float32"),
        (dict(cast_weights_once=True, parallel="ddp", dtype="bfloat16"), "--parallel ddp"),
    ],
)
def test_cast_weights_once_is_refused_without_fsdp_and_bf16(settings, fragment):
    cfg = preset("pico").override(settings)
    with pytest.raises(GptspeedError, match="--cast-weights-once keeps FSDP2's bf16 weights") as e:
        cfg.validate(world_size=1)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    preset("pico").override({**settings, "parallel": "fsdp", "dtype": "bfloat16"}).validate(world_size=1)


@pytest.mark.usefixtures("eager_compile")
def test_cuda_graphs_with_gradient_accumulation_are_refused_up_front():
    cuda = Runtime(device=torch.device("cuda", 0), dtype="bfloat16", autocast_dtype=torch.bfloat16, compile=True)
    for tuning in ("reduce-overhead", "max-autotune"):
        with pytest.raises(GptspeedError, match="max-autotune-no-cudagraphs"):
            check_cuda_graphs(cuda, tuning, 32)
        check_cuda_graphs(cuda, tuning, 1)  # one micro-step per optimizer step: fine
    check_cuda_graphs(cuda, "max-autotune-no-cudagraphs", 32)
    check_cuda_graphs(dataclasses.replace(cuda, device=torch.device("cpu")), "reduce-overhead", 32)  # no CUDA graphs
    check_cuda_graphs(dataclasses.replace(cuda, compile=False), "reduce-overhead", 32)


@pytest.mark.parametrize("where", ["a file", "/proc"])
def test_a_compile_cache_that_cannot_be_made_falls_back_with_a_note(tmp_path, monkeypatch, capsys, where):
    if where == "a file":
        root = tmp_path / "cache"
        root.write_text("not a folder")
    else:
        root = "/proc/gptspeed-cache"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    monkeypatch.setenv("GPTSPEED_CACHE", str(root))
    wanted = compile_cache_dir()
    path = use_compile_cache()
    assert path != wanted and path.is_dir() and os.access(path, os.W_OK)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)  # where inductor writes its kernels now
    note = capsys.readouterr().out
    assert f"note: the compile cache {wanted} cannot be made" in note and "set $GPTSPEED_CACHE" in note


def test_a_writable_compile_cache_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "new" / "cache"))
    assert use_compile_cache() == tmp_path / "new" / "cache" / "inductor"
    assert (tmp_path / "new" / "cache" / "inductor").is_dir()


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


def test_coordinate_descent_tuning_joins_the_compile_modes_own_inductor_options(monkeypatch):
    """--coordinate-descent-tuning: torch.compile takes a mode or options, not both, so the mode's own options
    (``torch._inductor.list_mode_options``) travel with it; inductor alone gets them (an eager backend takes none)."""
    from gptspeed.parallelize import compile_options

    assert compile_options("default", False) == {"mode": None}
    assert compile_options("reduce-overhead", False) == {"mode": "reduce-overhead"}
    assert compile_options("default", True) == {"options": {"coordinate_descent_tuning": True}}
    autotune = compile_options("max-autotune-no-cudagraphs", True)["options"]
    assert autotune["max_autotune"] is True and autotune["coordinate_descent_tuning"] is True
    assert compile_options("reduce-overhead", True)["options"] == {
        "triton.cudagraphs": True,
        "coordinate_descent_tuning": True,
    }
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    rt = resolve_runtime("cpu", "float32", True)
    parallelize(_model(), rt, coordinate_descent_tuning=True)
    parallelize(_model(), rt, coordinate_descent_tuning=True, backend="eager")
    assert seen == [
        {"backend": "inductor", "dynamic": False, "options": {"coordinate_descent_tuning": True}},
        {"backend": "eager", "dynamic": False, "mode": None},
    ]
