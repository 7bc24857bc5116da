"""``gptspeed.eval.val_loss``: validation loss: mean cross-entropy over the val split, the same on every rank."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gptspeed.eval.val_loss as val_loss
from gptspeed.data.loader import iter_eval_batches
from gptspeed.data.shards import write_shard
from gptspeed.errors import GptspeedError
from gptspeed.eval.val_loss import evaluate, evaluate_val
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import Runtime, resolve_runtime

from support.host_reads import Batches, _step
from support.shapes import PLAIN_LOSS_MODEL
from support.training import TINY_MODEL, make_step

pytestmark = pytest.mark.usefixtures("one_thread")


B, T = 3, 16


CPU = Runtime(device=torch.device("cpu"), dtype="float32", autocast_dtype=None, compile=False)


@pytest.fixture
def split(tmp_path):
    """Two val shards: 7 windows (batches of 3, 3, 1) and 4 windows (3, 1)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, windows in enumerate((7, 4)):
        paths.append(tmp_path / f"val_{i:06d}.bin")
        write_shard(paths[-1], rng.integers(0, 1000, windows * T + 1 + 5, dtype=np.uint16))
    return paths


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=T))
    with torch.no_grad():
        m.transformer.wte.weight.mul_(20.0)  # losses that differ from batch to batch
    return m


def batch_losses(model, shards, rank=0, world=1, max_tokens=0):
    """Each of this rank's batches' (sum of its targets' nats in float64, tokens), from the model
    called on the batches for each position's loss."""
    out = []
    with torch.no_grad():
        for x, y in iter_eval_batches(shards, B, T, max_tokens, rank=rank, world_size=world):
            out.append((float(model(x, y, reduction="none")[1].double().sum()), y.numel()))
    return out


# ------------------------------------------------------------------------------ several ranks
class FakeAllReduce:
    """torch.distributed.all_reduce for ranks run one after another: it records what each rank
    hands in and, for the last rank, sums in what the earlier ones handed in."""

    def __init__(self):
        self.seen = []

    def __call__(self, t, op=None):
        assert op is None  # a sum
        self.seen.append(t.clone())
        for s in self.seen[:-1]:
            t += s


class Seen(Exception):
    pass


def run_ranks(model, split, monkeypatch, parallel, seq_len=T, batch_size=B):
    """evaluate on ranks 1 then 0 of 2 (the all-reduce played by FakeAllReduce): rank 0's result,
    and the devices of the batches each forward was given."""
    monkeypatch.setattr(torch.distributed, "all_reduce", FakeAllReduce())
    monkeypatch.setattr(val_loss, "reshard", lambda m: None)
    real_forward, devices = model.forward, []
    monkeypatch.setattr(
        model, "forward", lambda x, y=None, **k: devices.append(x.device.type) or real_forward(x, y, **k)
    )
    results = {}
    for rank in (1, 0):
        rt = dataclasses.replace(CPU, rank=rank, world_size=2, parallel=parallel)
        results[rank] = evaluate(model, rt, split, batch_size, seq_len)
    monkeypatch.setattr(model, "forward", real_forward)
    return results[0], devices


T_PLAIN = TINY_MODEL["block_size"]


@pytest.mark.usefixtures("eager_compile")
def test_at_most_one_recompile_across_train_eval_train_with_a_partial_eval_batch(shakespeare_data):
    """Train, then evaluate 2.5 batches (the partial last one runs eagerly) -- the val loss and, in the
    same pass, bits per byte --, train, evaluate again: one graph for training, one for the
    grad-free forward, nothing more."""
    from torch._dynamo.utils import counters

    from gptspeed.data import find_shards
    from gptspeed.eval.bpb import bytes_table

    counters.clear()
    t = _step("compile")
    batches = Batches("cpu")
    val = find_shards(shakespeare_data, "val")
    nbytes = bytes_table(t.train_model, t.rt.device)
    for _ in range(2):
        t(batches.next_batch)
        got = evaluate_val(t.train_model, t.rt, val, 2, 16, max_tokens=5 * 16, nbytes=nbytes)
        assert got.tokens == 5 * 16 and np.isfinite(got.loss) and np.isfinite(got.bpb)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert max(counters["recompiles"].values(), default=0) <= 1


def test_the_mean_is_token_weighted_and_summed_in_float64(model, split):
    """Exactly the sum of every target's nats in float64, over the batches in order, over the tokens;
    and, to float rounding, the token-weighted mean of the batches' mean losses (the model's own)."""
    ref = batch_losses(model, split)
    total = 0.0
    for nats, _ in ref:
        total += nats
    tokens = sum(n for _, n in ref)
    got, n = evaluate(model, CPU, split, B, T)
    assert n == tokens == 11 * T
    assert got == total / tokens
    with torch.no_grad():
        means = [(float(model(x, y)[1]), y.numel()) for x, y in iter_eval_batches(split, B, T, 0)]
    assert got == pytest.approx(sum(m * k for m, k in means) / tokens, rel=1e-6)


def test_max_tokens_and_max_token_id_reach_the_batches(model, split):
    got, n = evaluate(model, CPU, split, B, T, max_tokens=4 * T)
    ref = batch_losses(model, split, max_tokens=4 * T)
    assert n == 4 * T and got == pytest.approx(sum(nats for nats, _ in ref) / n, rel=1e-12)
    with pytest.raises(GptspeedError, match="is not below the vocabulary size 500"):
        evaluate(model, CPU, split, B, T, max_token_id=500)


@pytest.mark.parametrize("training", [True, False])
def test_stop_abandons_the_evaluation_and_restores_the_mode(model, split, training):
    model.train(training)
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 2  # two batches, then stop

    assert evaluate(model, CPU, split, B, T, stop=stop) == (None, 2 * B * T)
    assert model.training is training
    evaluate(model, CPU, split, B, T)
    assert model.training is training


def test_only_the_partial_batches_run_eagerly(model, split, monkeypatch):
    rows = []

    @contextlib.contextmanager
    def eager():
        rows.append("eager")
        yield

    monkeypatch.setattr(val_loss, "eager", eager)
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda x, y=None, **k: rows.append(x.size(0)) or real_forward(x, y, **k))
    evaluate(model, CPU, split, B, T)
    assert rows == [3, 3, "eager", 1, 3, "eager", 1]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_ranks_sums_and_token_counts_add_up_to_the_one_process_mean(model, split, monkeypatch, parallel):
    fake = FakeAllReduce()
    monkeypatch.setattr(torch.distributed, "all_reduce", fake)
    resharded, shapes = [], {0: [], 1: []}
    monkeypatch.setattr(val_loss, "reshard", lambda m: resharded.append(m))
    real_forward = model.forward
    results = {}
    for rank in (1, 0):  # rank 0 last: it gets the sum of both
        monkeypatch.setattr(
            model,
            "forward",
            lambda x, y=None, _r=rank, **k: (
                shapes[_r].append(
                    (tuple(x.shape), x.dtype, bool(x.any()), y is not None and tuple(y.shape), k.get("reduction"))
                )
                or real_forward(x, y, **k)
            ),
        )
        rt = dataclasses.replace(CPU, rank=rank, world_size=2, parallel=parallel)
        results[rank] = evaluate(model, rt, split, B, T)
    monkeypatch.setattr(model, "forward", real_forward)
    one, n = evaluate(model, CPU, split, B, T)
    assert results[0][1] == n and results[0][0] == pytest.approx(one, rel=1e-12)
    # what each rank handed in: its own (nats, counted nats, bytes, tokens) in float64 (no bytes table: 0 bytes)
    for rank, handed in zip((1, 0), fake.seen):
        mine = batch_losses(model, split, rank=rank, world=2)
        assert handed.dtype == torch.float64 and handed.shape == (4,)
        assert float(handed[3]) == sum(k for _, k in mine) and handed[1:3].tolist() == [0.0, 0.0]
        assert float(handed[0]) == pytest.approx(sum(nats for nats, _ in mine), rel=1e-12)
    # 5 batches dealt round-robin: rank 0 gets 3, rank 1 gets 2; under FSDP rank 1 joins rank 0's
    # third forward with a full-size dummy batch of zeros, called as the others are (the same graph)
    real = {r: [s for s in shapes[r] if s[2]] for r in (0, 1)}
    assert [s[0][0] for s in real[0]] == [3, 1, 1] and [s[0][0] for s in real[1]] == [3, 3]
    assert {s[4] for r in (0, 1) for s in real[r]} == {"none"}
    dummies = [s for s in shapes[1] if not s[2]]
    assert dummies == ([((B, T), torch.int64, False, (B, T), "none")] if parallel == "fsdp" else [])
    assert not [s for s in shapes[0] if not s[2]]
    assert resharded == ([model, model] if parallel == "fsdp" else []), "FSDP's reshard was not handed the model"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_ranks_bits_per_byte_is_the_one_process_figure(model, split, monkeypatch, parallel):
    """Bits per byte over 2 ranks (each hands its nats, nats of the targets with bytes, bytes and
    tokens to the all-reduce) is the one process's, under DDP and FSDP2 alike; by hand, from each
    target's nats and bytes over the one process's batches."""
    nbytes = torch.arange(1000) % 4  # ids 0, 4, 8, ... have no bytes
    monkeypatch.setattr(torch.distributed, "all_reduce", FakeAllReduce())
    monkeypatch.setattr(val_loss, "reshard", lambda m: None)
    for rank in (1, 0):  # rank 0 last: it gets the sum of both
        rt = dataclasses.replace(CPU, rank=rank, world_size=2, parallel=parallel)
        got = evaluate_val(model, rt, split, B, T, nbytes=nbytes)
    one = evaluate_val(model, CPU, split, B, T, nbytes=nbytes)
    nats = count = 0.0
    with torch.no_grad():
        for x, y in iter_eval_batches(split, B, T, 0):
            per = model(x, y, reduction="none")[1].double()
            nats += float(per[nbytes[y] > 0].sum())
            count += int(nbytes[y].sum())
    assert 0 < count < 3 * 11 * T
    assert one.bpb == pytest.approx(nats / (math.log(2) * count), rel=1e-12)
    assert got.tokens == one.tokens and got.bpb == pytest.approx(one.bpb, rel=1e-12)
    assert got.loss == pytest.approx(one.loss, rel=1e-12) and one.loss == evaluate(model, CPU, split, B, T)[0]


@pytest.mark.parametrize("loss", ["fused", "plain"])
def test_the_one_pass_reads_the_device_once_however_many_batches(split, loss):
    """The val loss and bits per byte over 5 batches (one partial) with one host read: the float64
    sums stay on the device until the end (on a GPU, no sync per batch)."""
    from support.host_reads import HostReads

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=T, loss=loss))
    nbytes = torch.arange(model.config.vocab_size) % 4
    with HostReads() as mode:
        got = evaluate_val(model, CPU, split, B, T, nbytes=nbytes)
    assert np.isfinite(got.loss) and np.isfinite(got.bpb) and got.tokens == 11 * T
    assert mode.reads == ["tolist"], mode.reads


def test_reshard_reshards_every_fsdp_module_and_nothing_else(monkeypatch):
    import torch.distributed.fsdp as fsdp

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def reshard(self):
            self.calls += 1

    class Other(torch.nn.Linear):
        calls = 0

        def reshard(self):
            raise AssertionError("not an FSDP module")

    monkeypatch.setattr(fsdp, "FSDPModule", Fake)
    root = Fake()
    root.inner = Fake()
    root.other = Other(2, 2)
    val_loss.reshard(root)
    assert root.calls == root.inner.calls == 1


def test_every_tensor_goes_to_the_runtimes_device_not_the_default_one(model, split):
    """With the default device set elsewhere (meta: no data) the figure is the same: the sums live
    on ``rt.device``, asked for explicitly."""
    want = evaluate(model, CPU, split, B, T)
    with torch.device("meta"):
        assert evaluate(model, CPU, split, B, T) == want


def test_the_batches_are_made_on_the_runtimes_device(split):
    """A runtime on meta (a device other than the CPU, shapes only): the batches handed to the
    model are on it. The model records them and stops the evaluation (meta has no values)."""
    devices = []

    class Recorder(torch.nn.Module):
        def forward(self, x, y, reduction="mean"):
            devices.append((x.device.type, y.device.type))
            raise Seen

    rt = dataclasses.replace(CPU, device=torch.device("meta"))
    with pytest.raises(Seen):
        evaluate(Recorder(), rt, split, B, T)
    assert devices == [("meta", "meta")], f"the batches went to {devices}, not to the runtime's device (meta)"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_several_rank_path_makes_its_tensors_on_the_runtimes_device(model, split, monkeypatch, parallel):
    """With the default device set elsewhere (meta: no data) the ranks' figure is the one
    process's: FSDP's dummy batch and the token count are made on ``rt.device``, asked for."""
    one = evaluate(model, CPU, split, B, T)
    with torch.device("meta"):
        got, devices = run_ranks(model, split, monkeypatch, parallel)
    assert set(devices) == {"cpu"}, (
        f"a forward was given a batch on {set(devices) - {'cpu'}}, not on the runtime's device (cpu)"
    )
    assert len(devices) == (6 if parallel == "fsdp" else 5)  # 5 batches, and under FSDP one dummy
    assert got[1] == one[1] and got[0] == pytest.approx(one[0], rel=1e-12)


def test_the_ranks_token_count_is_exact_whatever_the_default_dtype(model, tmp_path, monkeypatch):
    """The count each rank hands to the all-reduce is float64, asked for: with bfloat16 as the
    default dtype (8 significant bits) rank 0's 343 windows (batches of 128 windows of 1 token,
    dealt round-robin: 128 + 128 + 87) stay 343, and the job's 599 tokens stay 599."""
    path = tmp_path / "val_000000.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 1000, 600, dtype=np.uint16))
    one = evaluate(model, CPU, [path], 128, 1)
    assert one[1] == 599
    torch.set_default_dtype(torch.bfloat16)
    try:
        got, _ = run_ranks(model, [path], monkeypatch, "ddp", seq_len=1, batch_size=128)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got[1] == 599, f"the ranks counted {got[1]} tokens, not 599: the count was not kept in float64"
    assert got[0] == pytest.approx(one[0], rel=1e-12)


# ---------------------------------------------------------------------------------- val loss
def test_val_loss_weighs_a_partial_last_batch_by_its_tokens(tmp_path):
    """A partial last batch weighted as a full one read 14.42 instead of 10.82."""
    from gptspeed.data.shards import write_shard
    from gptspeed.eval.val_loss import evaluate

    windows, B = 6, 4  # batches of 4 windows and 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, windows * T_PLAIN + 1 + 7, dtype=np.uint16)  # 7 tokens too few for a 7th window
    shard = tmp_path / "val_000000.bin"
    write_shard(shard, tokens)
    step = make_step(PLAIN_LOSS_MODEL, {})
    model = step.model.eval()
    # make the two batches' losses differ a lot, so the weighting shows
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
    t = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        per_window = [
            F.cross_entropy(
                model(t[i * T_PLAIN : (i + 1) * T_PLAIN][None])[0][0, :, :50257].float(),
                t[i * T_PLAIN + 1 : (i + 1) * T_PLAIN + 1],
                reduction="sum",
            )
            for i in range(windows)
        ]
    reference = float(sum(per_window)) / (windows * T_PLAIN)
    loss, n = evaluate(model, resolve_runtime("cpu", "float32", False), [shard], B, T_PLAIN)
    assert n == windows * T_PLAIN
    assert loss == pytest.approx(reference, rel=1e-5)
    first, last = float(sum(per_window[:4])) / (4 * T_PLAIN), float(sum(per_window[4:])) / (2 * T_PLAIN)
    assert abs(first - last) > 0.5  # equal weighting of the two batches would be far off
    assert abs(loss - (first + last) / 2) > 0.1


def test_bits_per_byte_is_none_without_a_bytes_table_and_nan_when_no_target_has_bytes(model, split):
    """``evaluate_val``'s ``bpb``: None when no ``nbytes`` table is given (the val loss alone), NaN -- not a
    division by zero -- when every target has 0 bytes (a table of zeros), the val loss the same either way."""
    plain = evaluate_val(model, CPU, split, B, T)
    assert plain.bpb is None and plain.tokens > 0
    zero = evaluate_val(model, CPU, split, B, T, nbytes=torch.zeros(model.config.vocab_size, dtype=torch.long))
    assert math.isnan(zero.bpb) and zero.loss == plain.loss and zero.tokens == plain.tokens
