"""The worker process of ``gptspeed bench``: ``python -m gptspeed.bench SPEC.json RESULT.json`` runs one
ladder row (:func:`gptspeed.bench.worker.run_stage`) or one verify rung
(:func:`gptspeed.bench.verify_worker.verify_stage`) in this fresh process and writes its result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gptspeed.bench.verify_worker import verify_stage
from gptspeed.bench.worker import PEER_KIND, StageSpec, free_device_memory, oom_reason, run_stage
from gptspeed.errors import GptspeedError


def main(argv: list[str] | None = None) -> int:
    """``SPEC.json RESULT.json``: run :func:`run_stage` (or, for ``mode == "verify"``,
    :func:`gptspeed.bench.verify_worker.verify_stage`) and write its result.

    Out of device memory (``torch.OutOfMemoryError``) is a ``failed`` result naming the batch
    size (:func:`oom_reason`), so the parent records it and goes on to the next row.
    A GptspeedError is one line on stderr and exit 2 -- except in verify mode, where it is a
    ``skipped`` result ("refused: ...": gptspeed refuses that combination up front); a missing
    transformers for the peer row is a ``skipped`` result; anything else keeps its traceback (a
    bug) and exits 1."""
    spec_path, result_path = argv if argv is not None else sys.argv[1:]
    spec = StageSpec(**json.loads(Path(spec_path).read_text()))
    try:
        if spec.mode == "verify":
            result = verify_stage(spec)
        else:
            result = {"status": "ok", **run_stage(spec)}
    except ImportError as e:
        if spec.kind != PEER_KIND or "transformers" not in str(e):
            raise
        result = {"status": "skipped", "reason": f"transformers is not installed ({e}); pip install 'gptspeed[hf]'"}
    except torch.OutOfMemoryError as e:  # torch.cuda.OutOfMemoryError is the same class
        free_device_memory()
        result = {"status": "failed", "reason": oom_reason(e, spec), "oom": True}
    except GptspeedError as e:
        if spec.mode != "verify":
            print(f"gptspeed bench: error: {e}", file=sys.stderr)
            return 2
        result = {"status": "skipped", "reason": f"refused: {e}"}
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0
