"""Run by tests/bench/test_worker.py in a fresh process: a bench row's DDP step in a process group of
one (torchrun-free, ``file://`` rendezvous), two steps of 2 micro-batches; prints what the test checks
as one JSON line, then ends with ``os._exit`` -- never the interpreter's teardown.

Why a process of its own: DDP keeps the process group alive past ``destroy_process_group``, so the
group's destructor ran whenever the DDP model was freed, later in the pytest process; with gloo it
joined a worker thread that never ended (``std::thread::join`` in ``~ProcessGroupGloo``) and the
test session hung where pytest-timeout cannot interrupt it. Here the group is never destroyed by a
destructor (the process ends first, as ``python -m gptspeed.bench`` ends through
:func:`gptspeed.distributed.finish_process`), and the test waits with a timeout.

usage: python tests/support/ddp_row.py BACKEND DEVICE RENDEZVOUS_FILE
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist

from gptspeed.bench.stages import baseline_with
from gptspeed.bench.worker import StageSpec, bench_step, build_row
from gptspeed.runtime import resolve_runtime


def main(backend: str, device: str, rendezvous: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        dtype = "bfloat16" if device == "cuda" else "float32"
        rt = dataclasses.replace(resolve_runtime(device, dtype, False), parallel="ddp")
        spec = StageSpec(
            name="ddp",
            settings=baseline_with(dtype=dtype, attention="sdpa"),
            n_layer=1,
            n_head=2,
            n_embd=16,
            seq_len=16,
            batch_size=2,
            steps=1,
            warmup=1,
            device=device,
            grad_accum=2,
        )
        step, _ = build_row(spec, rt)
        seen = {
            "ddp": isinstance(step.train_model, torch.nn.parallel.DistributedDataParallel),
            "sync": step.sync is not None,  # no_sync() on the first micro-batch
            "accum": step.accum,
        }
        before = step.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
        x = torch.randint(0, 50257, (2, 16), device=device)
        losses = [bench_step(step, lambda: (x, x)) for _ in range(2)]
        seen["losses"] = [loss.item() for loss, _ in losses]
        seen["finite"] = all(math.isfinite(loss.item()) for loss, _ in losses)
        seen["skipped"] = [bool(skipped.item()) for _, skipped in losses]
        seen["moved"] = not torch.equal(step.model.transformer.h[0].mlp.c_fc.weight, before)
        return seen
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = 1
    try:
        print(json.dumps(main(*sys.argv[1:4])), flush=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no teardown: the DDP model (and the group it holds) is never freed in this process
