"""``gptspeed.checkpoint.manager``: the :class:`Checkpointer`: a run's stateful parts, registered by name, saved when due and restored on resume -- in the run's format (:mod:`gptspeed.checkpoint.formats`)."""

from __future__ import annotations

import pytest
import torch

from gptspeed.checkpoint import (
    Checkpointer,
    load_checkpoint,
)
from gptspeed.checkpoint.dcp_reader import read_metadata

from support.checkpoints import RUN_ID, Part, _names, _ThreeGroups

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(ck: Checkpointer) -> Checkpointer:
    ck.register("model", Part({"w": torch.ones(2)}))
    return ck


def test_a_checkpointer_keeps_the_newest_two_by_default(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, meta={"run_id": RUN_ID}))
    for step in (1, 2, 3):
        ck.save(step)
    assert _names(tmp_path) == ["ckpt_00000002.json", "ckpt_00000002.pt", "ckpt_00000003.json", "ckpt_00000003.pt"], (
        "a Checkpointer made without keep must keep the newest 2 checkpoints"
    )


def test_a_checkpointer_saves_only_at_the_last_step_by_default(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, last_step=3))
    assert [ck.due(step) for step in (1, 2, 3)] == [False, False, True], "every defaults to 0: never, but the last step"
    assert [ck.save_if_due(step) for step in (1, 2)] == [None, None]
    assert ck.save_if_due(3) == tmp_path / "ckpt_00000003.pt"
    assert _names(tmp_path) == ["ckpt_00000003.json", "ckpt_00000003.pt"]


def test_save_if_due_saves_a_step_that_is_not_due_only_when_stopping(tmp_path):
    ck = _tiny(Checkpointer(tmp_path, every=4, last_step=10))
    assert ck.save_if_due(3) is None and _names(tmp_path) == [], "stopping defaults to False: step 3 is not due"
    assert ck.save_if_due(3, stopping=True) == tmp_path / "ckpt_00000003.pt"
    assert ck.save_if_due(4) == tmp_path / "ckpt_00000004.pt"


def test_a_pt_checkpoint_records_the_optimizers_layout_and_one_without_an_optimizer_records_none(tmp_path):
    from gptspeed.checkpoint import ModelState, OptimizerState

    model, optimizer = torch.nn.Linear(3, 2), _ThreeGroups()
    ck = Checkpointer(tmp_path)
    ck.register("model", ModelState(model))
    ck.register("optimizer", OptimizerState(model, optimizer))
    state = load_checkpoint(ck.save(1))
    layout = state.get("optimizer_layout")
    assert layout == [["optimizer", 3]], (
        f"the checkpoint must record the optimizer's layout (one optimizer, 3 param groups), got {layout!r}"
    )
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.2, 0.1 * 3]
    weights = tmp_path / "weights"
    weights.mkdir()
    ck = Checkpointer(weights)
    ck.register("model", ModelState(model))
    state = load_checkpoint(ck.save(1))
    assert sorted(state) == ["format", "format_version", "model", "step"], (
        "a checkpoint without an optimizer records no optimizer_layout"
    )


def test_a_sharded_checkpointer_shards_the_parts_registered_sharded_and_puts_the_others_in_meta_pt(tmp_path):
    from gptspeed.checkpoint import ModelState, OptimizerState

    model, optimizer = torch.nn.Linear(3, 2), _ThreeGroups()
    ck = Checkpointer(tmp_path, sharded=True, meta={"run_id": RUN_ID})
    ck.register("model", ModelState(model), sharded=True)
    ck.register("optimizer", OptimizerState(model, optimizer))  # not sharded: meta.pt's
    ck.register("rng", Part({"torch": torch.arange(4, dtype=torch.uint8)}))
    final = ck.save(2)
    assert final == tmp_path / "ckpt_00000002.dcp"
    assert sorted(read_metadata(final).state_dict_metadata) == ["model.bias", "model.weight"], (
        "only the parts registered with sharded=True go into the shards"
    )
    meta = load_checkpoint(final)
    assert "model" not in meta and "optimizer" in meta and "rng" in meta, (
        f"a part registered without sharded=True must be saved in meta.pt; meta.pt holds {sorted(meta)}"
    )
    layout = meta.get("optimizer_layout")
    assert layout == [["optimizer", 3]], (
        f"a sharded checkpoint must record the optimizer's layout (one optimizer, 3 param groups), got {layout!r}"
    )
    # ... and a checkpointer registered the same way restores each part from its place
    model2 = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(model2.weight)
    rng = Part({})
    back = Checkpointer(tmp_path, sharded=True)
    back.register("model", ModelState(model2), sharded=True)
    back.register("rng", rng)
    rest = back.load(final)
    assert torch.equal(model2.weight, model.weight) and torch.equal(rng.sd["torch"], torch.arange(4, dtype=torch.uint8))
    assert "rng" not in rest and "model" not in rest and rest["step"] == 2
