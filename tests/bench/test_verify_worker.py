"""``gptspeed.bench.verify_worker``: one ``bench verify`` rung, in this (fresh) process: :func:`verify_stage`."""

from __future__ import annotations

import pytest

from support.verify_rows import TINY_RUNG


def test_a_candidate_micro_batch_reads_your_sequences_regrouped():
    """The verify worker with ``read_micro_batch``: B=4 x 1 reads the same 4 sequences a step as
    B=2 x 2, so the losses agree (fp32: only the summation order differs)."""
    import dataclasses

    from gptspeed.bench.verify_worker import verify_stage
    from gptspeed.bench.worker import StageSpec

    base = StageSpec(
        name="r",
        settings={"dtype": "float32", "compile": False},
        **TINY_RUNG,
        grad_accum=2,
        extra={"read_micro_batch": 2},
    )
    yours = verify_stage(base)
    bigger = verify_stage(dataclasses.replace(base, batch_size=4, grad_accum=1))
    assert bigger["batch_size"] == 4 and bigger["grad_accum"] == 1
    assert bigger["losses"] == pytest.approx(yours["losses"], rel=1e-5)
