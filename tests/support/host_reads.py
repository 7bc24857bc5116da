"""Host reads of device values counted (``.item()``, ``bool()``, ``.tolist()``, copies to the CPU): what a CUDA step must not do, checked on the CPU; the training steps and batches those tests run."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from gptspeed.runtime import resolve_runtime

from support.shapes import HOST_READS_MODEL
from support.training import make_step

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


ACCUM2 = dict(batch_size=2, total_batch_tokens=2 * 2 * HOST_READS_MODEL["block_size"])  # two micro-batches per step


def _step(rung: str):
    """The rung's training step (:class:`gptspeed.step.TrainStep`), two micro-batches of
    :class:`Batches` per optimizer step."""
    model, optim, run = RUNGS[rung]
    dtype = run.get("dtype", "float32")
    rt = resolve_runtime("cpu", dtype, run.get("compile", False))
    runtime = {k: v for k, v in run.items() if k in ("compile_mode", "activation_checkpointing")}
    return make_step({**HOST_READS_MODEL, **model}, optim, rt=rt, train_kw=ACCUM2, **runtime)
