"""Run by tests/test_distributed.py under torchrun (gloo, CPU): the end of a rank after a gloo
collective, as ``gptspeed train`` ends one. DDP is built once (it keeps the process group, and its
worker threads, alive past ``destroy_process_group``), then an all_reduce whose tensor the
worker thread releases after the rank saw it complete, then the exit: through
:func:`gptspeed.distributed.finish_process` (``finish``), or the interpreter's ordinary teardown
(``plain``: a rank dies with SIGABRT, "terminate called without an active exception", in 3 launches
of 6 with 4 ranks on a 2-core CPU, 3 of 16 with 2).

usage: python -m torch.distributed.run --standalone --nproc_per_node N tests/support/gloo_exit.py finish|plain
"""

import sys

import torch

from gptspeed.distributed import finish_process, init_distributed, shutdown_distributed
from gptspeed.runtime import resolve_runtime


def main() -> None:
    rt = resolve_runtime("cpu", "float32", False, "ddp")
    init_distributed(rt)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    t = torch.ones(1024)
    t.note = "a tensor with Python state: its PyObject lives as long as the tensor"
    torch.distributed.all_reduce(t)
    assert t[0].item() == rt.world_size
    del t
    shutdown_distributed()
    print(f"rank {rt.rank} done", flush=True)
    if sys.argv[1] == "finish":
        finish_process(0)


if __name__ == "__main__":
    main()
