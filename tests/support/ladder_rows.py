"""The tiny shape of the bench's tests (``gptspeed bench`` flags: the ladder's and ``--verify``'s), the smallest row as
:class:`gptspeed.bench.worker.StageSpec` fields, and a ladder row run in this process (the worker's own entry point,
without a fresh interpreter)."""

from __future__ import annotations

import contextlib
import json

import torch

from support.training import TINY_MODEL, flags

TINY = [
    *flags(dict(TINY_MODEL, batch_size=2)),
    "--steps",
    "2",
    "--warmup",
    "1",
    "--synthetic",
    "--device",
    "cpu",
    "--compile-backend",
    "eager",
]

#: The smallest row on the CPU (StageSpec fields): one step of 1 x 8 tokens of a 1-block model; each test adds its
#: name and settings (and what it changes).
TINY_ROW = dict(n_layer=1, n_head=2, n_embd=16, seq_len=8, batch_size=1, steps=1, warmup=1, device="cpu")


# ------------------------------------------------------------------------------------ end to end
def in_process_worker(spec, log_path, timeout=None):
    """``ladder.run_worker`` without the fresh process: the worker's own entry point, here (saves a
    torch and transformers import per row; the process boundary is tested by the peer-row and
    verify tests, whose workers run as processes)."""

    from gptspeed.bench import entry

    torch._dynamo.reset()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = log_path.with_suffix(".spec.json"), log_path.with_suffix(".result.json")
    spec_path.write_text(json.dumps(spec.to_dict()))
    with open(log_path, "w") as log, contextlib.redirect_stdout(log):
        assert entry.main([str(spec_path), str(result_path)]) == 0
    return json.loads(result_path.read_text())
