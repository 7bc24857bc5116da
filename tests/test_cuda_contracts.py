"""The rules a GPU enforces and a CPU does not, checked on the CPU (issue 12, section 3).

- No host-device synchronisation inside a training step that is not a log step: every host read
  (``item``, ``__bool__``, ``__float__``, ``tolist``, ``cpu``, ``nonzero``, ...) is counted with a
  ``TorchFunctionMode`` over steps with gradient accumulation, for every ladder rung that runs on a
  CPU (``--parallel ddp|fsdp``: tests/dist_scenarios.py, asserted in test_distributed.py).
- No tensor created on the wrong device: the step runs with its parameters, batches and counters
  on PyTorch's ``meta`` device, where any CPU tensor mixed in raises, as a CUDA kernel would.
- 0 graph breaks in the compiled step and evaluation (``torch._dynamo.explain``), and at most one
  recompile across train -> eval -> train (the grad-mode guard), also with a partial last eval
  batch and HellaSwag's rows in ``--compile-mode blocks``.
- CUDA graphs with gradient accumulation are refused up front; ``torch._scaled_mm``'s layout rules:
  tests/cuda_rules.py and test_fp8.py.
What only a GPU can show is in the ``cuda``-marked tests and ``gptspeed bench --verify``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import make_step
from torch.overrides import TorchFunctionMode

from gptspeed.errors import GptspeedError
from gptspeed.parallelize import check_cuda_graphs
from gptspeed.runtime import Runtime, resolve_runtime

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)
HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host (a sync on a GPU). ``host_resident``:
    tensors that live on the host even on a GPU (AdamW's ``step`` counters when not capturable),
    whose reads are not syncs."""

    def __init__(self, host_resident=()):
        super().__init__()
        self.reads: list[str] = []
        self.host_ids = {id(t) for t in host_resident}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not (args and id(args[0]) in self.host_ids):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def host_resident_state(optimizer):
    """AdamW's per-parameter ``step`` tensors that PyTorch keeps on the host unless the optimizer
    is fused or capturable (``torch.optim.adamw``: ``_get_value(step)`` reads them without a sync)."""
    out = []
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for state in opt.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type == "cpu" and not opt.defaults.get("fused"):
                out.append(step)
    return out


class Batches:
    """A loader of fixed random micro-batches on ``device``."""

    def __init__(self, device, B=2, T=16, n=4):
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(0, 50257, (B, T + 1), generator=g).to(device) for _ in range(n)]
        self.i = 0

    def next_batch(self):
        t = self.data[self.i % len(self.data)]
        self.i += 1
        return t[:, :-1], t[:, 1:]


RUNGS = {  # the ladder's rungs that run on a CPU: model and optimizer settings, runtime settings
    "baseline": (dict(attention="manual", vocab_size=50257, loss="plain"), dict(fused_adamw=False), {}),
    "sdpa+vocab-pad": (dict(loss="plain"), dict(fused_adamw=False), {}),
    "fused-adamw": (dict(loss="plain"), dict(fused_adamw=True), {}),
    "fused-ce": (dict(loss="fused"), dict(fused_adamw=True), {}),
    "bf16": (dict(loss="fused"), dict(fused_adamw=True), dict(dtype="bfloat16")),
    "compile": (dict(loss="fused"), dict(fused_adamw=True), dict(compile=True)),
    "compile-blocks": (dict(loss="fused"), dict(fused_adamw=True), dict(compile=True, compile_mode="blocks")),
    "selective-ac": (dict(loss="fused"), dict(fused_adamw=True), dict(activation_checkpointing="selective")),
    "muon": (dict(loss="fused"), dict(optimizer="muon", fused_adamw=True), {}),
}
# Documented exceptions: the non-fused AdamW and Muon cannot skip a non-finite step on the device,
# so optimizer_step reads that flag (one host read per optimizer step, never per micro-step).
ONE_READ_PER_STEP = {"baseline", "sdpa+vocab-pad", "muon"}


ACCUM2 = dict(batch_size=2, total_batch_tokens=2 * 2 * SHAPE["block_size"])  # two micro-batches per step


def _step(rung: str):
    """The rung's training step (:class:`gptspeed.step.TrainStep`), two micro-batches of
    :class:`Batches` per optimizer step."""
    model, optim, run = RUNGS[rung]
    dtype = run.get("dtype", "float32")
    rt = resolve_runtime("cpu", dtype, run.get("compile", False))
    runtime = {k: v for k, v in run.items() if k in ("compile_mode", "activation_checkpointing")}
    return make_step({**SHAPE, **model}, optim, rt=rt, train_kw=ACCUM2, **runtime)


@pytest.fixture(autouse=True)
def _eager_compile(monkeypatch):
    """torch.compile with the "eager" backend: dynamo traces (graph breaks and recompiles are
    real), no inductor code generation (seconds, not minutes, on a CPU)."""
    import gptspeed.parallelize as parallelize

    real = parallelize.parallelize
    monkeypatch.setattr(parallelize, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    import gptspeed.step as step

    monkeypatch.setattr(step, "parallelize", parallelize.parallelize)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("rung", list(RUNGS))
def test_no_host_reads_inside_a_training_step(rung):
    t = _step(rung)
    assert t.accum == 2  # gradient accumulation: two micro-batches per optimizer step
    batches = Batches(t.rt.device)
    t(batches.next_batch)  # warm-up (compilation traces read shapes, not values); optimizer state exists now
    with HostReads(host_resident_state(t.optimizer)) as mode:
        for _ in range(3):
            t(batches.next_batch)
    expected = 3 if rung in ONE_READ_PER_STEP else 0
    assert len(mode.reads) == expected, (rung, mode.reads)


def test_float16_grad_scaler_step_reads_nothing_with_fused_adamw():
    """float16 + GradScaler (GPUs without bf16): the scaler's skip goes to fused AdamW's found_inf."""
    rt = Runtime(device=torch.device("cpu"), dtype="float16", autocast_dtype=torch.float16, compile=False)
    t = make_step({**SHAPE, "loss": "plain"}, dict(fused_adamw=True), rt=rt, train_kw=ACCUM2)
    assert t.scaler.is_enabled() and t.accum == 2
    batches = Batches("cpu")
    t(batches.next_batch)
    with HostReads() as mode:
        for _ in range(2):
            t(batches.next_batch)
    assert mode.reads == []


def test_the_training_loop_reads_the_device_only_at_log_eval_and_save_steps(shakespeare_data, tmp_path):
    """The whole loop (lr, step, non-finite counters, what is due, signals): host reads happen
    only inside log_step, evaluation and checkpointing."""
    from gptspeed.configure import build_train_config
    from gptspeed.runtime import resolve_runtime as rr
    from gptspeed.trainer import Trainer

    cfg = build_train_config(
        "pico",
        dict(
            **SHAPE,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            batch_size=2,
            total_batch_tokens=64,
            max_steps=6,
            log_every=100,
            eval_every=0,
            eval_tokens=64,
            save_every=0,
            device="cpu",
            dtype="float32",
        ),
    )
    trainer = Trainer(cfg, rr("cpu", "float32", False), echo=False)
    mode = HostReads()
    paused = {"depth": 0}
    for name in ("log_step", "evaluate", "record"):
        inner = getattr(trainer, name)

        def outside(*a, _inner=inner, **k):
            paused["depth"] += 1
            before = len(mode.reads)
            try:
                return _inner(*a, **k)
            finally:
                del mode.reads[before:]
                paused["depth"] -= 1

        setattr(trainer, name, outside)
    save = trainer.checkpointer.save

    def save_outside(step):
        before = len(mode.reads)
        try:
            return save(step)
        finally:
            del mode.reads[before:]

    trainer.checkpointer.save = save_outside
    with mode:
        summary = trainer.train()
    assert summary["step"] == 6 and trainer.accum == 2
    assert mode.reads == []


@pytest.mark.parametrize("model", [dict(loss="plain", attention="sdpa"), dict(loss="fused", attention="manual")])
def test_no_tensor_on_the_wrong_device(model, shakespeare_data):
    """Parameters, batches (through the loader's hand-off) and every tensor the step creates on
    ``meta``: a CPU tensor mixed in raises ("Tensor on device cpu is not on the expected device")."""
    from gptspeed.data import find_shards
    from gptspeed.data.loader import TokenLoader

    rt = Runtime(device=torch.device("meta"), dtype="float32", autocast_dtype=None, compile=False)
    t = make_step({**SHAPE, **model}, dict(fused_adamw=False), rt=rt, train_kw=ACCUM2)
    t.skips_on_device = True  # fused AdamW's path (found_inf on the device); no fused kernel exists for meta
    t.optimizer.step = lambda: None
    loader = TokenLoader(find_shards(shakespeare_data, "train"), 2, 16, device=rt.device)
    loss, grad_norm, bad = t(loader.next_batch)
    assert {loss.device.type, grad_norm.device.type, bad.device.type} == {"meta"}
    assert t.optimizer.found_inf.device.type == "meta"
    assert all(p.grad is None for p in t.params)  # zeroed (set to None) after the step


def test_a_stray_cpu_tensor_is_caught_on_meta():
    """The check above has teeth: a step that adds a CPU tensor to the loss fails on meta."""
    rt = Runtime(device=torch.device("meta"), dtype="float32", autocast_dtype=None, compile=False)
    t = make_step({**SHAPE, "loss": "plain"}, dict(fused_adamw=False), rt=rt)
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        (t.train_model(x, x)[1] + torch.ones(1)).backward()


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_compiled_step_and_eval_have_no_graph_break(mode):
    t = _step("compile" if mode == "model" else "compile-blocks")
    x, y = Batches("cpu").next_batch()
    inner = t.model if mode == "model" else t.model.transformer.h[0].forward  # the block's own forward
    arg = (x, y) if mode == "model" else (torch.randn(2, 16, 32),)
    explained = torch._dynamo.explain(inner)(*arg)
    assert explained.graph_break_count == 0, explained.break_reasons
    with torch.no_grad():
        explained = torch._dynamo.explain(inner)(*arg)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_at_most_one_recompile_across_train_eval_train_with_a_partial_eval_batch(shakespeare_data):
    """Train, then evaluate 2.5 batches (the partial last one runs eagerly), train, evaluate again:
    one graph for training, one for the grad-free forward, nothing more."""
    from torch._dynamo.utils import counters

    from gptspeed.data import find_shards
    from gptspeed.eval.val_loss import evaluate

    counters.clear()
    t = _step("compile")
    batches = Batches("cpu")
    val = find_shards(shakespeare_data, "val")
    for _ in range(2):
        t(batches.next_batch)
        loss, n = evaluate(t.train_model, t.rt, val, 2, 16, max_tokens=5 * 16)
        assert n == 5 * 16 and np.isfinite(loss)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert max(counters["recompiles"].values(), default=0) <= 1


def test_hellaswag_in_blocks_mode_does_not_recompile():
    """HellaSwag's rows have their own lengths; in --compile-mode blocks they used to recompile
    every block. Now it runs eagerly."""
    from torch._dynamo.utils import counters

    from gptspeed.eval.hellaswag import HellaSwagItem, evaluate_hellaswag

    counters.clear()
    t = _step("compile-blocks")
    batches = Batches("cpu")
    t(batches.next_batch)
    graphs = counters["stats"]["unique_graphs"]
    items = [
        HellaSwagItem(ctx=tuple(range(1, 4 + k)), endings=tuple((5,) * (1 + e) for e in range(4)), label=k % 4)
        for k in range(6)
    ]
    result = evaluate_hellaswag(t.model, items, device="cpu", batch_examples=2)
    assert result["examples"] == 6
    t(batches.next_batch)
    assert counters["stats"]["unique_graphs"] == graphs


def test_cuda_graphs_with_gradient_accumulation_are_refused_up_front():
    cuda = Runtime(device=torch.device("cuda", 0), dtype="bfloat16", autocast_dtype=torch.bfloat16, compile=True)
    for tuning in ("reduce-overhead", "max-autotune"):
        with pytest.raises(GptspeedError, match="max-autotune-no-cudagraphs"):
            check_cuda_graphs(cuda, tuning, 32)
        check_cuda_graphs(cuda, tuning, 1)  # one micro-step per optimizer step: fine
    check_cuda_graphs(cuda, "max-autotune-no-cudagraphs", 32)
    check_cuda_graphs(dataclasses.replace(cuda, device=torch.device("cpu")), "reduce-overhead", 32)  # no CUDA graphs
    check_cuda_graphs(dataclasses.replace(cuda, compile=False), "reduce-overhead", 32)
