"""``gptspeed.checkpoint.paths``: names in a run folder: the checkpoints (``ckpt_{step:08d}.pt`` files, ``ckpt_{step:08d}.dcp`` folders), their seals (``ckpt_{step:08d}.json``), the other files gptspeed writes there, and the temporary names its writes leave when killed. No torch, no I/O beyond listing a folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptspeed.checkpoint.paths import step_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_step_of_reads_a_checkpoints_name_and_is_0_for_another():
    assert step_of(Path("run/ckpt_00000042.dcp")) == 42
    assert step_of(Path("run/model.pt")) == 0
