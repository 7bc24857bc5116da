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
