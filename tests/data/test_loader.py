"""``gptspeed.data.loader``: the training loader: token windows from memory-mapped shards, prefetched, resumable exactly."""

from __future__ import annotations

import os
import threading
import types

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import gptspeed.data.loader as loader_mod
from gptspeed.data.loader import TokenLoader, eval_batches_per_rank, eval_schedule, iter_eval_batches, to_device
from gptspeed.data.shards import MappedShard, ShardError, shard_fingerprint, write_shard
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN

from support.loader_shards import B, T, _val_shard

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate((1000, 30, 700)):  # the middle shard is too short for one batch
        toks = rng.integers(0, 50000, n)
        toks[::97] = EOT_TOKEN
        paths.append(tmp_path / f"train_{i:06d}.bin")
        write_shard(paths[-1], toks)
    return paths


@pytest.fixture
def shards_uneven(tmp_path):
    """1010 tokens (63 windows of 16, 31 of 32: a world of 2 skips a tail a world of 1 reads), a
    shard too short for anything, and 700 tokens."""
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate((1010, 30, 700)):
        toks = rng.integers(0, 50000, n)
        toks[::97] = EOT_TOKEN
        paths.append(tmp_path / f"train_{i:06d}.bin")
        write_shard(paths[-1], toks)
    return paths


def advanced(loader: TokenLoader, n: int) -> TokenLoader:
    for _ in range(n):
        loader.next_batch()
    return loader


def job_batch(ranks: list[TokenLoader]) -> torch.Tensor:
    """The next global micro-batch of a job: its ranks' batches, rank order."""
    return torch.cat([r.next_batch()[0] for r in ranks])


# ------------------------------------------------------------------------------ caches
class CountingLock:
    """A lock that counts how often it was taken."""

    def __init__(self):
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self):
        self.lock.acquire()
        self.taken += 1

    def __exit__(self, *exc):
        self.lock.release()


class GateLock(CountingLock):
    """A lock that also counts the threads that came to it, so a test can wait until all have."""

    def __init__(self):
        super().__init__()
        self.arrived, self.cond = 0, threading.Condition()

    def __enter__(self):
        with self.cond:
            self.arrived += 1
            self.cond.notify_all()
        super().__enter__()


def window_of(i: int) -> tuple[int, int]:
    """(shard, token offset) of window ``i`` of an epoch of the ``shards`` fixture at B*T = 16: 63
    windows in shard 0, 1 in shard 1, 43 in shard 2."""
    return (0, i * 16) if i < 63 else (1, 0) if i == 63 else (2, (i - 64) * 16)


@pytest.fixture
def draws(monkeypatch):
    """The epochs whose permutation was drawn (np.random.default_rng([seed, epoch]) calls), in order."""
    real, seen = np.random.default_rng, []
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: seen.append(seed) or real(seed))
    return seen


# ------------------------------------------------------------------ what a loader counts and starts with
def _shard_of(tmp_path, n: int, name: str):
    path = tmp_path / name
    write_shard(path, np.arange(n) % 1000)
    return path


def test_batches_are_consecutive_shifted_windows(shards):
    loader = TokenLoader(shards, 2, 8)
    x, y = loader.next_batch()
    raw = np.fromfile(shards[0], dtype="<u2", offset=1024)
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
    np.testing.assert_array_equal(x.flatten().numpy(), raw[:16])
    np.testing.assert_array_equal(y.flatten().numpy(), raw[1:17])


def test_ranks_read_disjoint_slices_and_count_the_same_documents(shards):
    single = TokenLoader(shards, 2, 8, world_size=1)
    r0 = TokenLoader(shards, 1, 8, rank=0, world_size=2)
    r1 = TokenLoader(shards, 1, 8, rank=1, world_size=2)
    for _ in range(200):  # several epochs, through the short shard
        x, _ = single.next_batch()
        a, _ = r0.next_batch()
        b, _ = r1.next_batch()
        assert torch.equal(torch.cat([a, b]), x)
    assert r0.documents == r1.documents == single.documents > 0
    assert single.epoch == 200 // ((999 // 16) + (699 // 16))


def test_state_round_trip_resumes_the_same_stream(shards):
    a = TokenLoader(shards, 2, 8)
    for _ in range(70):
        a.next_batch()
    b = TokenLoader(shards, 2, 8)
    b.load_state_dict(a.state_dict())
    for _ in range(50):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert a.state_dict() == b.state_dict()
    with pytest.raises(GptspeedError, match="does not fit"):
        TokenLoader(shards, 4, 8).load_state_dict(a.state_dict())


def test_too_little_data_is_a_user_error(shards):
    with pytest.raises(GptspeedError, match="fewer than one micro-batch"):
        TokenLoader(shards[1:2], 2, 64)


def test_eval_batches_cover_the_split_in_order(shards):
    got = list(iter_eval_batches(shards[:1], 4, 10))
    assert [x.shape[0] for x, _ in got] == [4] * 24 + [3]  # 99 windows of 10 (+1)
    raw = np.fromfile(shards[0], dtype="<u2", offset=1024)
    np.testing.assert_array_equal(torch.cat([x.flatten() for x, _ in got]).numpy(), raw[:990])
    capped = list(iter_eval_batches(shards[:1], 4, 10, max_tokens=100))
    assert sum(x.numel() for x, _ in capped) == 100


@pytest.mark.parametrize("workers", [1, 3])
def test_prefetching_gives_the_same_batches_and_exact_state(shards, workers):
    ref = TokenLoader(shards, 2, 8)
    pre = TokenLoader(shards, 2, 8, workers=workers, prefetch=2)
    for _ in range(70):
        assert torch.equal(ref.next_batch()[0], pre.next_batch()[0])
    state = pre.state_dict()  # what was consumed, not what the threads have prefetched
    assert state == ref.state_dict() and state["batches"] == 70
    resumed = TokenLoader(shards, 2, 8, workers=workers)
    resumed.load_state_dict(state)
    for _ in range(50):
        assert torch.equal(ref.next_batch()[1], resumed.next_batch()[1])
    assert resumed.documents == ref.documents and resumed.wait_s >= 0
    pre.close()
    resumed.close()


def test_random_sampling_is_a_seeded_resumable_permutation(shards):
    a = TokenLoader(shards, 2, 8, sampling="random", seed=5, workers=2)
    per_epoch = a.batches_per_epoch
    seq = TokenLoader(shards, 2, 8)
    xs = [a.next_batch()[0] for _ in range(per_epoch)]
    ys = [seq.next_batch()[0] for _ in range(per_epoch)]
    key = lambda t: tuple(t.flatten().tolist())  # noqa: E731
    assert sorted(map(key, xs)) == sorted(map(key, ys)) and list(map(key, xs)) != list(map(key, ys))
    assert a.epoch == 1 and a.documents == seq.documents
    b = TokenLoader(shards, 2, 8, sampling="random", seed=5)
    b.load_state_dict(a.state_dict())
    for _ in range(30):  # the next epoch's permutation differs from the first, and matches on resume
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(GptspeedError, match="does not fit"):
        TokenLoader(shards, 2, 8, sampling="random", seed=6).load_state_dict(a.state_dict())
    a.close()


def test_prefetch_thread_errors_reach_next_batch(tmp_path):
    write_shard(tmp_path / "t.bin", np.full(100, 60000))
    loader = TokenLoader([tmp_path / "t.bin"], 2, 8, max_token_id=50257, workers=1)
    with pytest.raises(GptspeedError, match="not below the vocabulary size"):
        loader.next_batch()


# ------------------------------------------------------------------------------ world size changes
def test_one_process_position_resumes_on_two_ranks_at_a_global_batch_boundary(shards_uneven):
    """1 process after 20 batches (320 tokens) -> 2 ranks: each global batch of the pair is two
    consecutive batches of the single process, to the end of the shard."""
    single = advanced(TokenLoader(shards_uneven, B, T), 20)
    state = single.state_dict()
    ranks = [TokenLoader(shards_uneven, B, T, rank=r, world_size=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(dict(state))
    for _ in range(10):  # global batches 10 .. 19 of the pair's epoch, shard 0
        want = torch.cat([single.next_batch()[0], single.next_batch()[0]])
        assert torch.equal(job_batch(ranks), want)
    assert ranks[0].batches == ranks[1].batches == 20  # counted in the pair's global batches
    assert ranks[0].documents == ranks[1].documents


def test_two_ranks_position_resumes_in_one_process(shards_uneven):
    """2 ranks after 7 global batches -> 1 process: it reads on from token 7 x 32."""
    pair = [TokenLoader(shards_uneven, B, T, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(7):
        job_batch(pair)
    state = pair[0].state_dict()
    single = TokenLoader(shards_uneven, B, T)
    single.load_state_dict(state)
    ref = advanced(TokenLoader(shards_uneven, B, T), 14)
    for _ in range(12):
        assert torch.equal(single.next_batch()[0], ref.next_batch()[0])
    assert single.documents == ref.documents


def test_a_state_without_its_world_size_field_is_read_from_its_global_tokens(shards_uneven):
    """States saved before ``world_size`` was recorded: the world size is global tokens / (B x T)."""
    pair = [TokenLoader(shards_uneven, B, T, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(3):
        job_batch(pair)
    state = {k: v for k, v in pair[0].state_dict().items() if k != "world_size"}
    single = TokenLoader(shards_uneven, B, T)
    single.load_state_dict(state)
    ref = advanced(TokenLoader(shards_uneven, B, T), 6)
    assert torch.equal(single.next_batch()[0], ref.next_batch()[0])
    same = TokenLoader(shards_uneven, B, T, rank=1, world_size=2)  # and the same world size needs no re-sharding
    same.load_state_dict(state)
    assert torch.equal(same.next_batch()[0], pair[1].next_batch()[0])
    one = {k: v for k, v in advanced(TokenLoader(shards_uneven, B, T), 5).state_dict().items() if k != "world_size"}
    again = TokenLoader(shards_uneven, B, T)
    again.load_state_dict(one)
    assert again.batches == 5


@pytest.mark.parametrize("batches", [21, 62])
def test_a_position_off_the_new_world_sizes_batches_is_refused_naming_both(shards_uneven, batches):
    """21 batches of 16 tokens end mid-way through a batch of 32; after 62 the position is in the
    tail a world of 2 skips (31 windows of 32 in 1010 tokens)."""
    state = advanced(TokenLoader(shards_uneven, B, T), batches).state_dict()
    assert state["shard_index"] == 0
    with pytest.raises(GptspeedError) as e:
        TokenLoader(shards_uneven, B, T, rank=0, world_size=2).load_state_dict(state)
    assert str(e.value) == (
        "the checkpoint's data position was saved with world size 1 and does not fall on a batch "
        "boundary for world size 2: resume with 1 process(es)"
    )


def test_random_sampling_is_never_re_sharded(shards_uneven):
    state = advanced(TokenLoader(shards_uneven, B, T, sampling="random", seed=3), 20).state_dict()
    with pytest.raises(GptspeedError, match="world size 1 and does not fall on a batch boundary for world size 2"):
        TokenLoader(shards_uneven, B, T, rank=0, world_size=2, sampling="random", seed=3).load_state_dict(state)


# ------------------------------------------------------------------------------ older states
def test_a_state_from_before_the_batch_counter_resumes_from_epoch_shard_and_position(shards_uneven):
    a = advanced(TokenLoader(shards_uneven, B, T), 180)  # epochs of 63 + 43 batches: the second, in the last shard
    state = {k: v for k, v in a.state_dict().items() if k != "batches"}
    assert state["epoch"] == 1 and state["shard_index"] == 2
    b = TokenLoader(shards_uneven, B, T)
    b.load_state_dict(state)
    assert b.batches == 180 and b.documents == a.documents
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])


@pytest.mark.parametrize(
    "field, other", [("sampling", {"sampling": "random"}), ("align_to_docs", {"align_to_docs": True})]
)
def test_a_state_without_a_later_field_was_sequential_and_unaligned(shards_uneven, field, other):
    """States saved before ``sampling`` / ``align_to_docs`` were recorded were taken sequential and not aligned to
    documents: such a state resumes a loader of the defaults and is refused by one sampling randomly or aligned."""
    state = {k: v for k, v in advanced(TokenLoader(shards_uneven, B, T), 4).state_dict().items() if k != field}
    b = TokenLoader(shards_uneven, B, T)
    b.load_state_dict(state)
    assert b.batches == 4
    with pytest.raises(
        GptspeedError,
        match="^the checkpoint's data position does not fit this data folder or batch "
        r"shape \(different shards, batch size, sequence length, world size, "
        r"sampling, seed or --align-to-docs\)$",
    ):
        TokenLoader(shards_uneven, B, T, **other).load_state_dict(state)


def test_the_seed_matters_to_random_sampling_only(shards_uneven):
    state = advanced(TokenLoader(shards_uneven, B, T, seed=1), 4).state_dict()
    b = TokenLoader(shards_uneven, B, T, seed=2)  # sequential: the seed draws nothing
    b.load_state_dict(state)
    assert b.batches == 4


# ------------------------------------------------------------------------------ evaluation batches
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("max_tokens", [0, 100, 333])
def test_eval_batches_per_rank_is_the_most_any_rank_gets(shards_uneven, world, max_tokens):
    got = [
        len(list(iter_eval_batches(shards_uneven, 4, 10, max_tokens, rank=r, world_size=world))) for r in range(world)
    ]
    assert eval_batches_per_rank(shards_uneven, 4, 10, max_tokens, world) == max(got)
    if world == 1 and max_tokens == 0:  # the defaults: the whole split, one process
        assert eval_batches_per_rank(shards_uneven, 4, 10) == max(got)


# ------------------------------------------------------------------------------ helpers
def test_to_device_copies_to_a_device_that_is_not_the_cpu():
    buf = np.arange(5, dtype=np.int64)
    t = to_device(buf, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [0, 1, 2, 3, 4]
    m = to_device(buf, torch.device("meta"))  # meta: no data, but it shows where the tensor went
    assert m.device.type == "meta" and m.shape == (5,) and m.dtype == torch.int64


def test_rows_to_xy_splits_rows_into_inputs_and_shifted_targets_on_the_device():
    """Rows ``(B, T + 1)`` -> x = each row's first T tokens, y = its last T; on the CPU as they are, on another device
    (meta: no data, but it shows where the tensors went) copied there."""
    t = torch.arange(10).view(2, 5)
    x, y = loader_mod.rows_to_xy(t, torch.device("cpu"))
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    mx, my = loader_mod.rows_to_xy(t, torch.device("meta"))
    assert mx.device.type == my.device.type == "meta" and mx.shape == my.shape == (2, 4), (mx, my)


class _RecordTo(TorchFunctionMode):
    """Records the arguments of every ``Tensor.to`` call made inside it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.calls.append((args[1:], kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("split", ["rows_to_xy", "to_xy"])
def test_the_copy_of_a_batch_to_another_device_is_non_blocking(split):
    """rows_to_xy and to_xy promise a non-blocking copy to a device that is not the CPU (the host tensor is pinned
    on CUDA, so the host thread queues the copy and goes on preparing work); on the CPU nothing is copied."""
    rows = torch.arange(10).view(2, 5)
    call = {
        "rows_to_xy": lambda d: loader_mod.rows_to_xy(rows, d),
        "to_xy": lambda d: loader_mod.to_xy(torch.arange(9), 2, 4, d),
    }[split]
    with _RecordTo() as meta:
        x, _ = call(torch.device("meta"))
    assert x.device.type == "meta"
    assert meta.calls and all(kw.get("non_blocking") is True for _, kw in meta.calls), meta.calls
    with _RecordTo() as cpu:
        call(torch.device("cpu"))
    assert cpu.calls == []


def test_a_shard_whose_tokens_changed_but_not_its_length_is_refused_with_expect(tmp_path):
    """``expect`` (tokens, fingerprint) per shard: a shard rewritten under the run with as many tokens but other ones
    is a ShardError when first opened, in one line naming it; without ``expect`` only the length is checked."""
    path = _shard_of(tmp_path, 40, "train_000000.bin")
    expect = [(40, shard_fingerprint(path))]
    loader, unchecked = TokenLoader([path], B, T, expect=expect), TokenLoader([path], B, T)
    write_shard(path, np.arange(40) % 1000 + 1)  # the same length, other tokens
    with pytest.raises(ShardError) as e:
        loader.next_batch()
    assert str(e.value) == (
        f"shard {path} changed under the running job (its tokens are not those it held when the run started): it was "
        "re-prepared or replaced; put the run's data back to --resume, or start a new run on the new data"
    )
    assert unchecked.next_batch()[0].flatten().tolist() == list(range(1, 17))


def test_the_fingerprint_checked_is_that_of_the_tokens_mapped_not_of_the_path_reopened(tmp_path, monkeypatch):
    """The shard mapped holds other tokens than the run started on, and the original is put back under its path right
    after the loader opened it: the loader reads the mapped tokens, so it must refuse them (a fingerprint of the file
    the path names a moment later would pass the wrong tokens)."""
    path = _shard_of(tmp_path, 40, "train_000000.bin")
    expect = [(40, shard_fingerprint(path))]
    original = path.read_bytes()
    write_shard(path, np.arange(40) % 1000 + 1)  # the same length, other tokens

    def open_then_restore(p):
        shard = MappedShard(p)  # maps the changed file; the path then names the original again
        (tmp_path / "restore.bin").write_bytes(original)
        os.replace(tmp_path / "restore.bin", p)
        return shard

    monkeypatch.setattr(loader_mod, "MappedShard", open_then_restore)
    loader = TokenLoader([path], B, T, expect=expect)
    with pytest.raises(ShardError, match="its tokens are not those it held when the run started"):
        loader.next_batch()


def test_epoch_progress_is_the_consumed_fraction_of_this_epoch(shards_uneven):
    loader = TokenLoader(shards_uneven, B, T)
    per_epoch = loader.batches_per_epoch
    for n in (0, 1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 3):
        loader.batches = n
        assert loader.epoch_progress() == pytest.approx((n % per_epoch) / per_epoch)
        assert 0 <= loader.epoch_progress() < 1


def test_prefetch_threads_are_named_for_the_loader(shards_uneven):
    loader = TokenLoader(shards_uneven, B, T, workers=2)
    loader.next_batch()
    names = {t.name for t in threading.enumerate()}
    assert {"gptspeed-loader-0", "gptspeed-loader-1"} <= names
    loader.close()


def test_a_state_of_another_batch_split_is_refused_even_with_the_same_global_batch(shards_uneven):
    """2 ranks of B=2 and 1 process of B=4 read 32 tokens a step, but not the same batches: the
    recorded world size tells them apart (and, when not recorded, global tokens / (B x T) does)."""
    pair = [TokenLoader(shards_uneven, B, T, rank=r, world_size=2) for r in (0, 1)]
    job_batch(pair)
    state = pair[0].state_dict()
    with pytest.raises(GptspeedError, match="does not fit this data folder or batch shape"):
        TokenLoader(shards_uneven, 2 * B, T).load_state_dict(state)


def test_an_unrecorded_world_size_is_named_as_a_whole_number(shards_uneven):
    state = {k: v for k, v in advanced(TokenLoader(shards_uneven, B, T), 21).state_dict().items() if k != "world_size"}
    with pytest.raises(
        GptspeedError,
        match="^the checkpoint's data position was saved with world size 1 and does not "
        "fall on a batch boundary for world size 2: resume with 1 process",
    ):
        TokenLoader(shards_uneven, B, T, rank=0, world_size=2).load_state_dict(state)


# ------------------------------------------------------------------------------ the evaluation schedule
def test_eval_schedule_reads_the_whole_split_by_default():
    """No budget given: every window, batch_size at a time, the last of a shard smaller. 101 tokens
    hold 10 windows of 10 (+1): 4 + 4 + 2; 30 tokens hold 2."""
    got = list(eval_schedule([101, 30], 4, 10))
    assert got == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 2)], (
        f"the default budget did not read the whole split: {got}"
    )


def test_eval_schedule_takes_a_budget_of_one_token_as_a_budget():
    """Any positive max_tokens is a budget (only 0 means the whole split): 1 token is one window."""
    got = list(eval_schedule([101, 30], 4, 10, max_tokens=1))
    assert got == [(0, 0, 1)], f"max_tokens=1 should give one window of one shard, got {got}"


def test_an_open_shard_is_read_without_taking_the_lock(shards_uneven, monkeypatch):
    """70 batches (sequential: 63 windows in shard 0, 1 in shard 1, 43 in shard 2) read the three
    shards: each is opened once, under the lock; the batches from an open shard take no lock
    (prefetch threads do not queue behind each other)."""
    opened = []
    monkeypatch.setattr(loader_mod, "MappedShard", lambda p: opened.append(p) or MappedShard(p))
    loader = TokenLoader(shards_uneven, B, T)
    loader._lock = lock = CountingLock()
    advanced(loader, 70)
    assert opened == shards_uneven, f"shards opened: {opened}"
    assert lock.taken == 3, f"the lock was taken {lock.taken} times for 70 batches from 3 shards (once per opening)"


def test_two_threads_opening_the_same_shard_at_once_open_it_once(shards_uneven, monkeypatch):
    """Two prefetch threads both find shard 0 unopened and wait for the lock: the first opens it,
    the second finds it open there and uses the same map."""
    opened = []
    monkeypatch.setattr(loader_mod, "MappedShard", lambda p: opened.append(p) or MappedShard(p))
    loader = TokenLoader(shards_uneven, B, T)
    loader._lock = gate = GateLock()
    got = []
    gate.lock.acquire()
    threads = [threading.Thread(target=lambda: got.append(loader._shard(0))) for _ in range(2)]
    for t in threads:
        t.start()
    with gate.cond:
        assert gate.cond.wait_for(lambda: gate.arrived == 2, timeout=10)
    gate.lock.release()
    for t in threads:
        t.join(timeout=10)
    assert len(got) == 2 and got[0] is got[1], "the two threads got different maps of the same shard"
    assert opened == [shards_uneven[0]], f"shard 0 was opened {len(opened)} times"


def test_an_epochs_permutation_is_drawn_once(shards_uneven, draws):
    """30 batches of random sampling in epoch 0 draw its permutation once; the batches are its
    windows in its order (107 windows an epoch: 63 in shard 0, 1 in shard 1, 43 in shard 2)."""
    perm = np.random.default_rng([5, 0]).permutation(107)  # counted too: drawn here, by the test
    loader = TokenLoader(shards_uneven, B, T, sampling="random", seed=5)
    for g in range(30):
        i = int(perm[g])
        assert loader._window(g) == window_of(i), f"batch {g} is not window {i} of the permutation"
    advanced(loader, 30)
    assert draws == [[5, 0], [5, 0]], f"permutations drawn: {draws[1:]} (once for epoch 0 expected)"


def test_the_previous_epochs_permutation_is_kept_and_older_ones_dropped(shards_uneven, draws):
    """At an epoch boundary a prefetch thread may still make the last batch of the previous epoch:
    its permutation is kept. Two epochs later it is dropped (memory stays bounded), and drawn again,
    the same, if asked for (107 batches an epoch)."""
    loader = TokenLoader(shards_uneven, B, T, sampling="random", seed=5)
    last = loader._window(106)  # epoch 0's last batch
    loader._window(107)  # epoch 1's first
    assert loader._window(106) == last  # a thread behind, after epoch 1 began
    loader._window(214)  # epoch 2's first
    assert loader._window(106) == last
    assert [e for _, e in draws] == [0, 1, 2, 0], (
        f"epochs drawn {[e for _, e in draws]}: epoch 0 kept while epoch 1 began, dropped once epoch 2 did"
    )


def test_wait_s_adds_up_the_time_of_every_batch(shards_uneven, monkeypatch):
    """A clock that moves 0.25 s between its readings: each batch takes 0.25 s, four take 1 s."""
    ticks = iter(np.arange(1000.0, 2000.0, 0.25))
    monkeypatch.setattr(loader_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    loader = advanced(TokenLoader(shards_uneven, B, T), 4)
    assert loader.wait_s == 1.0, f"wait_s is {loader.wait_s} after 4 batches of 0.25 s"


def test_a_shard_holds_one_batch_per_full_window_plus_the_one_token_of_its_last_target(tmp_path):
    """A micro-batch reads B*T + 1 tokens (inputs and the targets shifted by one): a shard of n
    tokens holds (n - 1) // (B*T) of them. By hand, B*T = 16: 17 tokens hold 1, 32 hold 1 (not 2),
    33 hold 2."""
    paths = [_shard_of(tmp_path, n, f"train_{i:06d}.bin") for i, n in enumerate((17, 32, 33))]
    loader = TokenLoader(paths, B, T)
    assert loader.batches_per_shard == [1, 1, 2], loader.batches_per_shard
    assert loader.tokens_per_epoch == 4 * 16, "tokens per epoch: batches times B*T"
    assert loader.wait_s == 0.0, "no time waited before the first batch"


def test_a_split_too_short_for_one_batch_says_how_many_tokens_it_has_and_needs(tmp_path):
    with pytest.raises(GptspeedError) as e:
        TokenLoader([_shard_of(tmp_path, 16, "train_000000.bin")], B, T)
    assert str(e.value) == (
        "train split has 16 tokens, fewer than one micro-batch needs (batch_size 2 x seq_len 8 "
        "x world size 1 + 1 = 17): lower --batch-size / --seq-len or prepare more text"
    ), str(e.value)
    with pytest.raises(GptspeedError, match=r"^train split has 0 tokens, fewer than one micro-batch needs"):
        TokenLoader([], B, T)  # no shard at all: said the same way


def test_by_default_random_sampling_uses_seed_0_and_batches_are_made_in_the_calling_thread(shards_uneven):
    loader = TokenLoader(shards_uneven, B, T, sampling="random")
    perm = np.random.default_rng([0, 0]).permutation(loader.batches_per_epoch)
    i = int(perm[0])
    assert loader._window(0) == window_of(i), "the default seed is 0"
    before = {t.name for t in threading.enumerate()}
    loader.next_batch()
    started = {t.name for t in threading.enumerate()} - before
    assert not any(n.startswith("gptspeed-loader") for n in started), f"workers=0 by default, yet {started}"


@pytest.mark.parametrize("prefetch, depth", [(None, 4), (1, 1), (0, 1)])
def test_each_worker_keeps_prefetch_batches_ready_4_by_default_at_least_1(shards_uneven, monkeypatch, prefetch, depth):
    seen = []
    real = loader_mod.Prefetcher
    monkeypatch.setattr(loader_mod, "Prefetcher", lambda sources, d, name: seen.append(d) or real(sources, d, name))
    loader = TokenLoader(shards_uneven, B, T, workers=1, **({} if prefetch is None else {"prefetch": prefetch}))
    try:
        loader.next_batch()
    finally:
        loader.close()
    assert seen == [depth], f"prefetch {prefetch}: queue depth {seen}, expected {depth}"


# ------------------------------------------------------------------------------ closing
def test_close_gives_up_on_a_worker_stuck_in_a_read_after_a_bounded_wait(shards_uneven, monkeypatch):
    """A worker hangs making batch 1 (a stalled read): close() must still return -- it waits for
    each thread with a finite timeout, not forever. The wait itself is stood in for (each thread's
    join records its timeout and returns at once), so the test takes no seconds."""
    release = threading.Event()
    real_make = TokenLoader._make

    def make(self, g):
        if g >= 1:
            release.wait()  # the read that never returns (until the test ends)
        return real_make(self, g)

    monkeypatch.setattr(TokenLoader, "_make", make)
    loader = TokenLoader(shards_uneven, B, T, workers=1)
    waits = []
    try:
        loader.next_batch()  # batch 0; the worker is now stuck in batch 1
        for t in loader._prefetcher._threads:

            def join(timeout=None, real_join=t.join):
                waits.append(timeout)
                assert timeout is not None, "close() would wait forever for a worker stuck in a read"
                real_join(0)  # a join that timed out: the thread is left behind (a daemon)

            t.join = join
        loader.close()
    finally:
        release.set()
    assert waits and all(w is not None and w > 0 for w in waits), waits
    assert loader._prefetcher is None


# ------------------------------------------------------------------------------ token ids, host tensors
def test_a_token_id_equal_to_the_vocabulary_size_is_refused_and_the_first_bad_one_named():
    """Ids must be *below* max_token_id: an id equal to it is already out of the embedding. Of
    [1, 10, 3, 11] with a vocabulary of 10 the first bad id is the 10 at index 1 (+ the offset 40)."""
    loader_mod.check_token_ids(np.array([1, 9, 3], dtype=np.uint16), 10, "s.bin", 0)  # all below: fine
    with pytest.raises(GptspeedError) as e:
        loader_mod.check_token_ids(np.array([1, 10, 3], dtype=np.uint16), 10, "s.bin", 40)
    assert str(e.value).startswith("s.bin: token id 10 at token 41 is not below the vocabulary size 10: "), (
        f"an id equal to the vocabulary size is not refused as the id at token 41: {e.value}"
    )
    with pytest.raises(GptspeedError) as e:
        loader_mod.check_token_ids(np.array([1, 10, 3, 11], dtype=np.uint16), 10, "s.bin", 0)
    assert str(e.value).startswith("s.bin: token id 10 at token 1 "), (
        f"the first id >= the vocabulary size (10 at token 1) is not the one named: {e.value}"
    )


def test_host_tensor_pins_the_host_memory_for_a_cuda_device_only(monkeypatch):
    """Documented: pinned memory when the device is CUDA (so the copy can be non-blocking), plain
    memory otherwise. pin_memory is stood in for (no CUDA here): it records the tensor it pinned."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self * 0 + 7)
    buf = np.arange(5, dtype=np.uint16)
    for dev in ("cpu", "meta"):
        t = loader_mod.host_tensor(buf, torch.device(dev))
        assert t.tolist() == [0, 1, 2, 3, 4] and t.dtype == torch.int64, f"host tensor for {dev}: {t}"
    assert pinned == [], f"host memory was pinned for a device that is not CUDA: {pinned}"
    t = loader_mod.host_tensor(buf, torch.device("cuda"))
    assert len(pinned) == 1 and pinned[0].tolist() == [0, 1, 2, 3, 4], "the host tensor for CUDA was not pinned"
    assert t.tolist() == [7] * 5, "host_tensor did not return the pinned tensor for CUDA"


def test_an_int64_array_becomes_a_host_tensor_without_a_copy():
    """An int64 array (bench/worker.py passes one to to_device) is used as it is: no second host
    copy of the window (astype(copy=False)); a uint16 shard window is converted to int64."""
    buf = np.arange(6, dtype=np.int64)
    t = loader_mod.host_tensor(buf, torch.device("cpu"))
    assert np.shares_memory(t.numpy(), buf), "an int64 array was copied on its way to a host tensor"
    assert np.shares_memory(to_device(buf, torch.device("cpu")).numpy(), buf), (
        "to_device copied an int64 array on the CPU"
    )


# ------------------------------------------------------------------------------ evaluation: edges
def test_eval_schedule_gives_no_batch_for_a_shard_too_short_for_one_window():
    """Shards of 0, 1 and 10 tokens hold no window of 10 (+1): they give no batch (not an empty one)
    whether they come first, between or last; 11 tokens hold exactly one."""
    got = list(eval_schedule([0, 101, 1, 10, 11, 10], 4, 10))
    assert got == [(1, 0, 4), (1, 4, 4), (1, 8, 2), (4, 0, 1)], (
        f"shards without a full window gave batches (or rows of 0): {got}"
    )


def test_a_val_split_of_exactly_one_sequence_plus_one_token_is_evaluated(tmp_path):
    """seq_len + 1 = 11 tokens are one sequence (inputs 0..9, targets 1..10); 10 tokens are not:
    refused, with the message naming both counts."""
    ok = _val_shard(tmp_path / "val_000000.bin", np.arange(100, 111))
    got = [(x.tolist(), y.tolist()) for x, y in iter_eval_batches([ok], 4, 10)]
    assert got == [([list(range(100, 110))], [list(range(101, 111))])], (
        f"a split of seq_len + 1 tokens did not give its one sequence: {got}"
    )
    short = _val_shard(tmp_path / "val_000001.bin", np.arange(100, 110))
    with pytest.raises(GptspeedError) as e:
        list(iter_eval_batches([short], 4, 10))
    assert str(e.value) == (
        "val split has 10 tokens, fewer than one sequence (seq_len 10 + 1): prepare more text, "
        "raise --val-fraction or lower --seq-len"
    ), f"a split of seq_len tokens: {e.value}"
    with pytest.raises(GptspeedError) as e:  # no val shard at all: 0 tokens, the same one line
        list(iter_eval_batches([], 4, 10))
    assert str(e.value).startswith("val split has 0 tokens, fewer than one sequence (seq_len 10 + 1)"), (
        f"an empty val split: {e.value}"
    )


# ------------------------------------------------------------------------------ rows aligned to documents
def documents_of(rng, lengths) -> np.ndarray:
    """Documents of the given lengths, each an <|endoftext|> then tokens that are never one, after a few tokens of a
    document begun before (as a shard's head may be)."""
    parts = [rng.integers(0, 50000, 3)]
    for n in lengths:
        parts += [np.array([EOT_TOKEN]), rng.integers(0, 50000, n - 1)]
    return np.concatenate(parts)


@pytest.mark.parametrize("seed", range(6))
def test_aligned_rows_start_at_a_document_or_go_on_with_a_long_one_and_skip_only_short_tails(seed):
    """``doc_aligned_rows`` against the properties that define it, on documents shorter and longer than a row: the
    first row starts at the first document start; each next row starts either right where the last one ended (only
    when no document starts within a row's length from there) or at the first document start after that end, less
    than a row away (a short tail skipped); rows never overlap; and no further row fits after the last."""
    rng = np.random.default_rng(seed)
    T = int(rng.integers(4, 12))
    tokens = documents_of(rng, rng.integers(1, 3 * T, 40))
    starts = np.flatnonzero(tokens == EOT_TOKEN)
    rows = loader_mod.doc_aligned_rows(tokens, T).tolist()
    assert rows and rows[0] == starts[0]
    ends = [p + T for p in rows]
    for end, nxt in zip(ends, rows[1:]):
        later = starts[starts >= end]
        first = int(later[0]) if len(later) else len(tokens)
        if nxt == end:
            assert first == end or first - end >= T  # a document starts there, or a long one goes on
        else:
            assert nxt == first and 0 < nxt - end < T  # a short tail skipped, the next row at its document's start
    assert all(p + T + 1 <= len(tokens) for p in rows)
    later = starts[starts >= ends[-1]]  # the row after the last would not fit
    first = int(later[0]) if len(later) else len(tokens)
    after = first if first - ends[-1] < T else ends[-1]
    assert after + T + 1 > len(tokens)
    assert loader_mod.doc_aligned_rows(tokens[:3], T).size == 0  # no document start: no row


@pytest.mark.parametrize(
    "tokens, want",
    [
        # a document start at 1; row [1, 5] ends at 5, a document starts there: next row at 5; row [5, 9] ends at 9,
        # inside a long document (next start 15, 6 >= T away): next row at 9; row [9, 13], the start at 15 is 2 < T
        # away: 13, 14 skipped, next row at 15, which ends exactly at the shard's end (15 + T + 1 = 20 tokens)
        ([9, EOT_TOKEN, 1, 2, 3, EOT_TOKEN, 1, 2, 3, 4, 5, 6, 7, 8, 9, EOT_TOKEN, 1, 2, 3, 4], [1, 5, 9, 15]),
        ([9, EOT_TOKEN, 1, 2, 3, EOT_TOKEN, 1, 2, 3, 4, 5, 6, 7, 8, 9, EOT_TOKEN, 1, 2, 3], [1, 5, 9]),  # 1 short
        ([EOT_TOKEN, 1, 2, 3, 4], [0]),  # one row, exactly T + 1 tokens
        ([EOT_TOKEN, 1, 2, 3], []),  # T tokens: no row
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], []),  # no document start: no row
    ],
    ids=["long-doc-short-tail-exact-end", "last-row-one-short", "exactly-one-row", "too-short", "no-document"],
)
def test_aligned_rows_worked_out_by_hand_are_int64_offsets(tokens, want):
    """``doc_aligned_rows`` at T = 4 (rows of 5 tokens) on token lists whose rows are worked out by hand, and the
    documented int64 offsets, also when there is no row."""
    rows = loader_mod.doc_aligned_rows(np.array(tokens, dtype=np.uint16), 4)
    assert rows.tolist() == want and rows.dtype == np.int64, (rows, rows.dtype)


def test_an_aligned_loader_reads_rows_from_document_starts_split_by_rank_and_counts_their_documents(tmp_path):
    """``align_to_docs``: the job's micro-batch is B x world size consecutive aligned rows (rank r the r-th B), x a
    row's first T tokens and y the next T; the documents counted are those in every rank's rows."""
    rng = np.random.default_rng(1)
    tokens = documents_of(rng, rng.integers(2, 3 * T, 60))
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    rows = loader_mod.doc_aligned_rows(tokens, T)
    ranks = [TokenLoader([path], B, T, rank=r, world_size=2, align_to_docs=True) for r in range(2)]
    assert ranks[0].batches_per_epoch == len(rows) // (2 * B)
    for g in range(ranks[0].batches_per_epoch):
        for r, loader in enumerate(ranks):
            x, y = loader.next_batch()
            mine = rows[(g * 2 + r) * B : (g * 2 + r + 1) * B]
            assert x.tolist() == [tokens[p : p + T].tolist() for p in mine]
            assert y.tolist() == [tokens[p + 1 : p + T + 1].tolist() for p in mine]
        job = rows[g * 2 * B : (g + 1) * 2 * B]
        assert ranks[0].documents == sum(int((tokens[p : p + T] == EOT_TOKEN).sum()) for p in rows[: (g + 1) * 2 * B])
        assert all(tokens[p] == EOT_TOKEN or p - T in rows for p in job)
    assert ranks[0].epoch == 1


@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_an_aligned_loader_resumes_exactly_and_refuses_a_state_taken_otherwise(shards, sampling):
    """A loader rebuilt from an aligned loader's state reads the batches the first would have read next (across the
    epoch's end, with workers); a state taken aligned is refused by an unaligned loader, and one taken by 2 ranks by
    one process, in one line."""
    first = advanced(TokenLoader(shards, B, T, sampling=sampling, seed=3, align_to_docs=True), 5)
    state = first.state_dict()
    want = [first.next_batch() for _ in range(2 * first.batches_per_epoch)]
    again = TokenLoader(shards, B, T, sampling=sampling, seed=3, align_to_docs=True, workers=2)
    again.load_state_dict(state)
    got = [again.next_batch() for _ in range(2 * first.batches_per_epoch)]
    again.close()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
    assert again.documents == first.documents
    with pytest.raises(GptspeedError, match="--align-to-docs"):
        TokenLoader(shards, B, T, sampling=sampling, seed=3).load_state_dict(state)
    if sampling == "sequential":  # rows dealt to 2 ranks are not re-dealt to one
        two = advanced(TokenLoader(shards, 1, T, world_size=2, align_to_docs=True), 3).state_dict()
        with pytest.raises(GptspeedError, match=r"resume with 2 process\(es\)"):
            TokenLoader(shards, 1, T, world_size=1, align_to_docs=True).load_state_dict(two)


def test_aligned_rows_too_few_for_a_micro_batch_are_one_line(tmp_path):
    path = tmp_path / "train_000000.bin"
    write_shard(path, np.array([7, 8, EOT_TOKEN] + [5] * (T + 1)))  # one row
    with pytest.raises(GptspeedError, match="--align-to-docs: the train split has fewer rows"):
        TokenLoader([path], B, T, align_to_docs=True)


def test_an_aligned_batch_with_a_token_id_past_the_vocabulary_names_that_rows_token(tmp_path):
    """``align_to_docs`` rows need not be adjacent in the shard: an id >= ``max_token_id`` in rank 1's second row is
    refused in one line naming the shard and the token's own place (its row's start + its column), not an offset
    counted through the stacked rows."""
    rng = np.random.default_rng(4)
    tokens = documents_of(rng, rng.integers(2, 3 * T, 60))
    rows = loader_mod.doc_aligned_rows(tokens, T)
    p, col = int(rows[B + 1]), T - 2  # rank 1's second row of the first job batch
    assert tokens[p + col] != EOT_TOKEN and tokens[:p].size
    tokens[p + col] = 50300
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    assert rows[B + 1] != rows[B] + T + 1, "the rows must not be adjacent for this test to tell the offsets apart"
    loader = TokenLoader([path], B, T, rank=1, world_size=2, align_to_docs=True, max_token_id=50257)
    with pytest.raises(GptspeedError) as e:
        loader.next_batch()
    assert str(e.value).startswith(f"{path}: token id 50300 at token {p + col:,} is not below the vocabulary size "), (
        e.value
    )
    ok = TokenLoader([path], B, T, rank=0, world_size=2, align_to_docs=True, max_token_id=50257)
    assert ok.next_batch()[0].shape == (B, T)  # rank 0's rows hold no bad id


def test_a_vocabulary_beyond_65536_loads_from_uint32_shards_exactly_and_counts_its_own_eot(tmp_path):
    """llm.c's uint32 shards (a tokenizer of more than 65,536 ids) reach the model id for id, and the
    documents counted are those of the data's <|endoftext|> (here 69,999), not GPT-2's 50256."""
    eot = 69_999
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 70_000, size=4 * 8 + 1).astype(np.uint32)
    tokens[[0, 5, 20]] = eot
    tokens[[3, 9]] = EOT_TOKEN  # an ordinary id of this vocabulary
    write_shard(tmp_path / "train_000000.bin", tokens)
    loader = TokenLoader([tmp_path / "train_000000.bin"], 4, 8, max_token_id=70_000, eot=eot)
    x, y = loader.next_batch()
    assert x.flatten().tolist() == tokens[:32].tolist() and y.flatten().tolist() == tokens[1:33].tolist()
    assert loader.documents == 3
    swapped = np.where(tokens == eot, EOT_TOKEN, np.where(tokens == EOT_TOKEN, 1, tokens))  # GPT-2's ids
    rows = loader_mod.doc_aligned_rows(tokens, 4, eot).tolist()
    assert rows[:2] == [0, 5] and rows == loader_mod.doc_aligned_rows(swapped, 4).tolist()


def test_an_aligned_loader_starts_its_rows_at_the_datas_own_eot(tmp_path):
    """``align_to_docs`` with the data's <|endoftext|> (``eot``, here 7; GPT-2's 50256 an ordinary id of this
    vocabulary): the rows start where that id starts a document, not where 50256 stands."""
    eot = 7
    rng = np.random.default_rng(2)
    tokens = documents_of(rng, rng.integers(2, 3 * T, 40))
    tokens = np.where(tokens == EOT_TOKEN, eot, np.where(tokens == eot, 8, tokens)).astype(np.uint16)
    tokens[[1, 2 * T + 5]] = EOT_TOKEN  # not a document start in this vocabulary
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    rows = loader_mod.doc_aligned_rows(tokens, T, eot)
    assert tokens[rows[0]] == eot and 1 not in rows
    loader = TokenLoader([path], B, T, align_to_docs=True, eot=eot)
    x, _ = loader.next_batch()
    assert x.tolist() == [tokens[p : p + T].tolist() for p in rows[:B]]


def test_by_default_a_loader_makes_each_batch_in_the_calling_thread_and_none_ahead(shards, monkeypatch):
    """``workers`` defaults to 0: no background thread, each batch made by ``next_batch`` itself in the caller's
    thread, only the batches consumed (nothing made ahead)."""
    made = []
    real = TokenLoader._make
    monkeypatch.setattr(
        TokenLoader, "_make", lambda self, g: made.append((g, threading.current_thread())) or real(self, g)
    )
    loader = TokenLoader(shards, B, T)
    loader.next_batch()
    loader.next_batch()
    loader.close()
    assert made == [(0, threading.current_thread()), (1, threading.current_thread())]
