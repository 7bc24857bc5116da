"""The settings of the runs shared through the ``reference_run`` fixture (``gptspeed.make_config`` field names); the
other runs' shapes are in tests/support/shapes.py."""

from __future__ import annotations

from support.references import SHAKESPEARE, STREAM, THREADS
from support.shapes import STREAM_SETTINGS
from support.training import TINY_MODEL

# ----------------------------------------------------- the runs shared through the ``reference`` fixture
#: A host branch's run (tests/system/test_host_branches.py): 3 steps, evaluated at 0, 2 and 3, a checkpoint at
#: step 2 (and at the end); its data by name (tests/support/references.py), its threads pinned.
BRANCH_RUN = dict(
    TINY_MODEL,
    n_layer=1,
    batch_size=4,
    device="cpu",
    eval_every=2,
    eval_tokens=256,
    log_every=1,
    save_every=2,
    keep_checkpoints=3,
    max_steps=3,
    lr=3e-3,
    warmup_steps=1,
    threads=THREADS,
    data=SHAKESPEARE,
)

# (dtype, softmax, loss, compile): each host-dependent choice both ways, and the README quickstart's
# combination on each kind of CPU (nano: --softmax data, the CPU's auto loss = fused; bf16 hosts compile)
BRANCHES = [
    ("float32", "data", "fused", False),
    ("float32", "full", "plain", False),
    ("bfloat16", "data", "fused", True),
    ("bfloat16", "data", "plain", False),
    ("bfloat16", "full", "fused", False),
]

#: The pytest ids of :data:`BRANCHES`.
BRANCH_IDS = ["-".join(map(str, b)).replace("True", "compile").replace("False", "eager") for b in BRANCHES]


def branch_run(dtype: str, softmax: str, loss: str, compile: bool) -> tuple[dict, str | None]:
    """The settings and setup of a host branch's run (a compiled one with the "eager" backend: seconds on a CPU)."""
    return dict(BRANCH_RUN, dtype=dtype, softmax=softmax, loss=loss, compile=compile), (
        "eager-compile" if compile else None
    )


#: A run streaming a jsonl file: 6 steps, a checkpoint at step 3.
STREAM_RUN = dict(
    STREAM_SETTINGS,
    max_steps=6,
    save_every=3,
    keep_checkpoints=5,
    threads=THREADS,
    data=STREAM,
)
