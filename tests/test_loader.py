import numpy as np
import pytest
import torch

from gptspeed.data.loader import TokenLoader, iter_eval_batches
from gptspeed.data.shards import write_shard
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN


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
