"""A ladder row run in this process (the worker's own entry point, without a fresh interpreter); the bench's flags
and smallest row are in tests/support/shapes.py."""

from __future__ import annotations

import contextlib
import json

import torch


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
