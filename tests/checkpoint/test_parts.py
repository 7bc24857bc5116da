"""``gptspeed.checkpoint.parts``: the stateful parts of a run besides the loader and the trainer's counters: RNG states, the model, the optimizer (each with ``state_dict()`` / ``load_state_dict()``, the torchtitan / ``torch.distributed.checkpoint.stateful.Stateful`` protocol), and :func:`load_part`, which turns a part that does not fit its checkpoint into one line."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptspeed.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    RNGState,
    consolidate,
    load_checkpoint,
    load_part,
)
from gptspeed.checkpoint.dcp_reader import (
    ALLOWED_GLOBALS,
    load_full,
    read_metadata,
)
from gptspeed.errors import GptspeedError

from support.checkpoints import _Payload, _ThreeGroups, reseal
from support.cli import run_main
from support.training import TINY_MODEL, make_step

pytestmark = pytest.mark.usefixtures("one_thread")


class _Raises:
    def __init__(self, error):
        self.error = error

    def load_state_dict(self, state):
        raise self.error


_TAIL = "resume with the settings it was written with, or start a new --out"


RUN_ID = "0123456789abcdef0123"


MODEL = dict(TINY_MODEL, vocab_size=128, valid_vocab_size=128)


CKPT = "ckpt_00000002.dcp"


def _sharded_run(root: Path, optimizer: str):
    """A run folder holding the sharded checkpoint of step 2 (model + optimizer after one step),
    config.json and metrics.jsonl; returns (run, the step whose state it holds)."""
    step = make_step(MODEL, dict(optimizer=optimizer))
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 128, (2, 32), generator=gen) for _ in range(2))
    step(lambda: (x, y))
    run = root / optimizer
    run.mkdir()
    config = step.cfg.to_dict()
    (run / "config.json").write_text(json.dumps({**config, "derived": {"run_id": RUN_ID}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 5.0}) + "\n")
    ck = Checkpointer(run, sharded=True, meta={"config": config, "data": None, "world_size": 1, "run_id": RUN_ID})
    ck.register("model", ModelState(step.model, True), sharded=True)
    ck.register("optimizer", OptimizerState(step.model, step.optimizer, True), sharded=True)
    ck.register("rng", RNGState(torch.device("cpu")))
    ck.save(2)
    return run, step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return {opt: _sharded_run(root, opt) for opt in ("adamw", "muon")}


@pytest.fixture
def run(runs, tmp_path):
    """A copy of the AdamW run, for a test to alter."""
    copy = tmp_path / "run"
    shutil.copytree(runs["adamw"][0], copy)
    return copy


def assert_identical(a, b, where="state"):
    """Equal nested dicts (an OrderedDict equals a dict) / lists / values, tensors bit for bit
    (same dtype, same bytes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
        return
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, z) in enumerate(zip(a, b)):
            assert_identical(x, z, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        ), where
    else:
        assert a == b, where


def rewrite_metadata(ckpt: Path, change) -> None:
    """Unpickle the real .metadata, ``change(md)`` (returning what to pickle instead, or None to
    keep ``md``), pickle it back and reseal."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own, untouched file
    new = change(md)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md if new is None else new, f)
    reseal(ckpt)


def one_line_refusal(proc, *needles):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def _outside(md):
    next(iter(md.storage_data.values())).relative_path = "../outside.distcp"


def _transform(md):
    next(iter(md.storage_data.values())).transform_descriptors = ["zstandard"]


def _huge(md):
    md.state_dict_metadata["model.transformer.wte.weight"].size = torch.Size([1 << 40, 32])


def _not_metadata(md):
    return {"state_dict_metadata": md.state_dict_metadata}


@pytest.mark.parametrize(
    "part, state, detail",
    [
        # torch's errors: a first line naming the module, then the telling line
        (torch.nn.Linear(2, 3), {"weight": torch.zeros(3, 2)}, 'Missing key(s) in state_dict: "bias".'),
        (
            torch.nn.Linear(2, 3),
            {"weight": torch.zeros(3, 2), "bias": torch.zeros(3), "extra": torch.zeros(1)},
            'Unexpected key(s) in state_dict: "extra".',
        ),
        # any other error: its first line, cut at 200 characters; its type when it has no message
        (_Raises(ValueError("bad value\nsecond line")), {}, "bad value"),
        (_Raises(RuntimeError("x" * 300)), {}, "x" * 200),
        (_Raises(RuntimeError()), {}, "RuntimeError"),
    ],
    ids=["missing-key", "unexpected-key", "first-line", "cut-at-200", "no-message"],
)
def test_a_part_that_does_not_fit_is_one_line_with_the_telling_line_of_the_error(part, state, detail):
    with pytest.raises(GptspeedError) as e:
        load_part(Path("run/ckpt_00000002.pt"), "model", part, state)
    assert str(e.value) == f"checkpoint ckpt_00000002.pt: its model state does not fit this run ({detail}): {_TAIL}"


def test_rng_state_sets_the_cuda_generator_only_on_a_cuda_device_and_only_when_saved(monkeypatch):
    """On this CPU machine torch.cuda.set_rng_state is replaced by a recorder: a RNGState of device
    cuda restores a saved CUDA state on its device; of device cpu, or with none saved, it sets none."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    cpu_state, cuda_state = torch.get_rng_state(), torch.arange(8, dtype=torch.uint8)
    cuda = torch.device("cuda")
    RNGState(cuda).load_state_dict({"torch": cpu_state, "cuda": cuda_state})
    assert len(calls) == 1 and calls[0][0] is cuda_state and calls[0][1] == cuda, (
        f"the saved CUDA state must be set once on the cuda device, got {calls}"
    )
    calls.clear()
    RNGState(cuda).load_state_dict({"torch": cpu_state, "cuda": None})
    RNGState(torch.device("cpu")).load_state_dict({"torch": cpu_state, "cuda": cuda_state})
    assert calls == [], "no CUDA state may be set without a saved one, or on a CPU device"


def test_a_model_state_is_the_plain_modules_by_default_and_refuses_an_empty_state():
    """ModelState(model) is not sharded unless told: loading an empty model state into a plain module
    is a strict load that misses every weight (the sharded path takes an empty dict as nothing to load)."""
    from gptspeed.checkpoint import ModelState

    model = torch.nn.Linear(2, 2)
    part = ModelState(model)
    assert part.sharded is False, "ModelState's sharded must default to False"
    with pytest.raises(GptspeedError) as e:
        load_part(Path("ckpt_00000001.pt"), "model", part, {})
    assert str(e.value) == (
        "checkpoint ckpt_00000001.pt: its model state does not fit this run (Missing key(s) in "
        'state_dict: "weight", "bias".): resume with the settings it was written with, or start a '
        "new --out"
    ), f"an empty model state must be refused as missing every weight, got {e.value}"


def test_the_optimizer_layout_names_each_underlying_optimizer_by_the_optimizers_names():
    """OptimizerState.layout: ``[[name, param groups], ...]`` with the names the optimizer gives
    (MuonWithAdamW: ("adamw", "muon")), "optimizer" for one without names."""
    from gptspeed.checkpoint import OptimizerState

    both = SimpleNamespace(
        names=("adamw", "muon"), optimizers=[SimpleNamespace(param_groups=[{}, {}]), SimpleNamespace(param_groups=[{}])]
    )
    layout = OptimizerState(None, both).layout()
    assert layout == [["adamw", 2], ["muon", 1]], f"the layout must use the optimizer's names, got {layout!r}"
    assert OptimizerState(None, _ThreeGroups()).layout() == [["optimizer", 3]]


def test_rng_state_saves_the_cuda_generator_of_its_device_under_cuda_and_none_on_a_cpu(monkeypatch):
    """On this CPU machine torch.cuda.get_rng_state is replaced by a recorder: a RNGState of device
    cuda saves {"torch": the CPU state, "cuda": its device's CUDA state}; of device cpu, "cuda": None."""
    calls, cuda_state = [], torch.arange(8, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(device) or cuda_state)
    cuda = torch.device("cuda", 0)
    sd = RNGState(cuda).state_dict()
    assert sorted(sd) == ["cuda", "torch"] and sd["cuda"] is cuda_state, (
        f"a cuda RNGState must save its CUDA generator's state under 'cuda', got {sd}"
    )
    assert calls == [cuda], f"the CUDA state must be read from the RNGState's own device, read from {calls}"
    assert torch.equal(sd["torch"], torch.get_rng_state())
    calls.clear()
    sd = RNGState(torch.device("cpu")).state_dict()
    assert sorted(sd) == ["cuda", "torch"] and sd["cuda"] is None and calls == [], (
        f"a cpu RNGState saves 'cuda': None and reads no CUDA state, got {sd} and reads {calls}"
    )


# --------------------------------------------------------------------------- real checkpoints
def test_allow_list_is_what_real_metadata_names(runs):
    """Every global the real .metadata files name is allowed (and nothing but module-qualified names)."""
    for run, _ in runs.values():
        seen = set()

        class Tracing(pickle.Unpickler):
            def find_class(self, module, name):
                seen.add(f"{module}.{name}")
                return super().find_class(module, name)

        with open(run / CKPT / ".metadata", "rb") as f:
            Tracing(f).load()
        assert seen and seen <= ALLOWED_GLOBALS, seen - ALLOWED_GLOBALS
        assert "torch.distributed.checkpoint.metadata.Metadata" in seen


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_consolidate_is_bit_identical_to_the_saved_state_and_to_dcp_to_torch_save(runs, optimizer, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run, step = runs[optimizer]
    out = consolidate(run, tmp_path / "one")
    assert out == tmp_path / "one" / "ckpt_00000002.pt"
    ck = load_checkpoint(out)  # sealed, weights_only
    assert_identical(ck["model"], step.model.state_dict())
    assert_identical(ck["optimizer"], step.optimizer.state_dict())
    assert (tmp_path / "one" / "config.json").read_bytes() == (run / "config.json").read_bytes()
    assert (tmp_path / "one" / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    # what torch's own (unsafe) converter reads from this benign checkpoint, entry for entry
    dcp_to_torch_save(run / CKPT, tmp_path / "ref.pt")
    assert_identical(load_full(run / CKPT), torch.load(tmp_path / "ref.pt", weights_only=True))


def test_checkpointer_load_restores_the_sharded_parts(runs):
    run, saved = runs["muon"]
    fresh = make_step(MODEL, dict(optimizer="muon"))
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    ck = Checkpointer(run, sharded=True)
    ck.register("model", ModelState(fresh.model, True), sharded=True)
    ck.register("optimizer", OptimizerState(fresh.model, fresh.optimizer, True), sharded=True)
    ck.load(run / CKPT)
    assert_identical(fresh.model.state_dict(), saved.model.state_dict())
    assert_identical(fresh.optimizer.state_dict()["muon"]["state"], saved.optimizer.state_dict()["muon"]["state"])


# --------------------------------------------------------------------------- hostile folders
def test_crafted_metadata_is_refused_by_consolidate_and_resume_and_runs_nothing(run, tmp_path):
    marker = tmp_path / "pwned"

    def plant(md):
        md.storage_meta.save_id = _Payload(marker)

    rewrite_metadata(run / CKPT, plant)
    proc = run_main("consolidate", "--run", str(run), "--out", str(tmp_path / "out"))
    one_line_refusal(
        proc,
        f"refusing to load {run / CKPT}: its .metadata asks for posix.system",
        "which a checkpoint's metadata never holds",
    )
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the resume path (train --resume --parallel fsdp loads through Checkpointer.load on every rank)
    step = make_step(MODEL)
    ck = Checkpointer(run, sharded=True)
    ck.register("model", ModelState(step.model, True), sharded=True)
    with pytest.raises(GptspeedError, match="asks for posix.system") as e:
        ck.load(run / CKPT)
    assert "\n" not in str(e.value) and not marker.exists()
    # plain pickle would have run it: the file is the attack the test says it is
    with open(run / CKPT / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_metadata_may_not_set_the_state_of_a_shared_object(run):
    """``find_class`` alone would let BUILD alter an allowed class (here: give DCP's enum an attribute)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    (run / CKPT / ".metadata").write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nN}X\x05\x00\x00\x00plantK\x01s\x86b."
    )
    reseal(run / CKPT)
    with pytest.raises(GptspeedError, match=r"sets the state of a enum\.EnumType|sets the state of a enum\.EnumMeta"):
        read_metadata(run / CKPT)
    assert not hasattr(_MEM_FORMAT_ENCODING, "plant")


def test_crafted_bytes_entry_is_refused_and_runs_nothing(run, tmp_path):
    """A non-tensor entry (an optimizer's lr) that DCP would read with torch.load(weights_only=False)."""
    marker = tmp_path / "pwned"
    shard = run / CKPT / "__0_0.distcp"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())

    def point_lr_at_payload(md):
        for index, info in md.storage_data.items():
            if index.fqn == "optimizer.param_groups.0.lr":
                info.offset, info.length = offset, len(buf.getvalue())
                return None
        raise AssertionError("no lr entry")

    rewrite_metadata(run / CKPT, point_lr_at_payload)
    proc = run_main("consolidate", "--run", str(run), "--out", str(tmp_path / "out.pt"))
    one_line_refusal(
        proc, f"refusing to load {run / CKPT}: its entry optimizer.param_groups.0.lr asks for posix.system"
    )
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    step = make_step(MODEL)
    ck = Checkpointer(run, sharded=True)
    ck.register("model", ModelState(step.model, True), sharded=True)
    ck.register("optimizer", OptimizerState(step.model, step.optimizer, True), sharded=True)
    with pytest.raises(GptspeedError, match="optimizer.param_groups.0.lr asks for posix.system"):
        ck.load(run / CKPT)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, reason",
    [
        (_outside, "points outside the folder ('../outside.distcp')"),
        (_transform, "asks for stream transforms ['zstandard'], which gptspeed never writes"),
        (_huge, "its tensors would take"),
        (_not_metadata, "it holds a dict"),
    ],
)
def test_metadata_describing_what_the_folder_does_not_hold_is_refused(run, change, reason):
    shutil.copyfile(run / CKPT / "__0_0.distcp", run / "outside.distcp")  # a readable file, outside the .dcp
    rewrite_metadata(run / CKPT, change)
    with pytest.raises(GptspeedError) as e:
        consolidate(run, run.parent / "out")
    assert str(e.value).startswith(f"refusing to load {run / CKPT}: its .metadata is not a checkpoint's metadata")
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_damaged_metadata_is_one_line(run, tmp_path):
    (run / CKPT / ".metadata").write_bytes(b"\x80\x04not a pickle")
    reseal(run / CKPT)
    proc = run_main("consolidate", "--run", str(run), "--out", str(tmp_path / "out"))
    one_line_refusal(proc, f"checkpoint {run / CKPT} is unreadable: its .metadata is damaged")


# --------------------------------------------------------------------------- consolidate's --out
def test_existing_out_file_is_replaced_only_with_force(runs, tmp_path):
    run = runs["adamw"][0]
    out = tmp_path / "model.pt"
    out.write_bytes(b"the user's file")
    proc = run_main("consolidate", "--run", str(run), "--out", str(out))
    one_line_refusal(proc, f"--out {out} already exists: pass --force")
    assert out.read_bytes() == b"the user's file"
    proc = run_main("consolidate", "--run", str(run), "--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(out)["step"] == 2
    # a consolidated file (sealed) is replaced with --force too
    assert consolidate(run, out, force=True) == out and load_checkpoint(out)["step"] == 2


def test_out_named_as_a_checkpoint_is_refused_even_with_force(runs, tmp_path):
    run = runs["adamw"][0]
    other = tmp_path / "other_run"
    other.mkdir()
    theirs = other / "ckpt_00000010.pt"
    theirs.write_bytes(b"another run's checkpoint")
    (other / "ckpt_00000010.json").write_text('{"step": 10}')
    for out in (theirs, tmp_path / "new" / "ckpt_00000002.pt", other / "ckpt_00000002.dcp"):
        proc = run_main("consolidate", "--run", str(run), "--out", str(out), "--force")
        one_line_refusal(proc, f"--out {out} is a checkpoint's name")
    assert theirs.read_bytes() == b"another run's checkpoint"
    assert (other / "ckpt_00000010.json").read_text() == '{"step": 10}'
    assert sorted(p.name for p in other.iterdir()) == ["ckpt_00000010.json", "ckpt_00000010.pt"]
    assert not (tmp_path / "new").exists()


def test_out_inside_the_source_run_is_refused_even_with_force(run):
    before = sorted(p.name for p in run.iterdir())
    for out in (run / "model.pt", run / "sub", run, run / CKPT / "x.pt"):
        with pytest.raises(GptspeedError, match="the run being consolidated: choose a path outside it"):
            consolidate(run, out, force=True)
        with pytest.raises(GptspeedError, match="the run being consolidated"):
            consolidate(run / CKPT, out, force=True)  # the .dcp named directly: its run folder is its parent
    assert sorted(p.name for p in run.iterdir()) == before and not (run / "sub").exists()


def test_out_folder_with_another_runs_files_is_refused(runs, tmp_path):
    run = runs["adamw"][0]
    other = tmp_path / "other"
    other.mkdir()
    config = json.dumps({"model": {"n_layer": 3}, "train": {}, "derived": {"run_id": "another"}})
    (other / "config.json").write_text(config)
    (other / "metrics.jsonl").write_text('{"step": 7}\n')
    proc = run_main("consolidate", "--run", str(run), "--out", str(other), "--force")
    one_line_refusal(proc, f"--out {other} already holds a config.json that is not {run}'s")
    (other / "config.json").unlink()
    with pytest.raises(GptspeedError, match="already holds a metrics.jsonl that is not"):
        consolidate(run, other, force=True)
    assert sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]
    assert (other / "metrics.jsonl").read_text() == '{"step": 7}\n'
    # files gptspeed did not write (a Hugging Face folder, notes): refused as for train --out
    (other / "metrics.jsonl").unlink()
    (other / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(GptspeedError, match="already holds files gptspeed did not write"):
        consolidate(run, other)


def test_out_file_whose_seal_name_is_taken_is_refused_even_with_force(runs, tmp_path):
    """``--out DIR/config.pt`` would seal itself as DIR/config.json."""
    run = runs["adamw"][0]
    (tmp_path / "config.json").write_text('{"the user": "config"}')
    proc = run_main("consolidate", "--run", str(run), "--out", str(tmp_path / "config.pt"), "--force")
    one_line_refusal(proc, f"would replace {tmp_path / 'config.json'}, which is not a checkpoint's seal")
    assert (tmp_path / "config.json").read_text() == '{"the user": "config"}' and not (tmp_path / "config.pt").exists()


def test_out_kinds_that_do_not_fit(runs, tmp_path):
    run = runs["adamw"][0]
    (tmp_path / "folder.pt").mkdir()
    with pytest.raises(GptspeedError, match="is a folder: name a FILE.pt"):
        consolidate(run, tmp_path / "folder.pt", force=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(GptspeedError, match="is a file: name a FILE.pt to write"):
        consolidate(run, tmp_path / "afile", force=True)
    assert (tmp_path / "afile").read_text() == "x"
