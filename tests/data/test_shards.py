"""``gptspeed.data.shards``: the token shard file format of llm.c and modded-nanogpt."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gptspeed.data.loader import TokenLoader, iter_eval_batches
from gptspeed.data.shards import (  # noqa: E402
    HEADER_BYTES,
    SHARD_MAGIC,
    SHARD_VERSION,
    MappedShard,
    ShardError,
    read_header,
    read_shard,
    write_shard,
)
from gptspeed.errors import GptspeedError  # noqa: E402

from support.loader_shards import B, T, _val_shard
from support.strategies import HealthCheck, given, settings, st

pytestmark = pytest.mark.usefixtures("one_thread")


def raw_shard(path, count, tokens=b"", magic=SHARD_MAGIC, version=SHARD_VERSION):
    header = struct.pack("<256i", magic, version, count, *([0] * 253))
    path.write_bytes(header + tokens)
    return path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=1200),
    header=st.none()
    | st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
)
def test_fuzz_shard_reader(tmp_path_factory, data, header):
    path = tmp_path_factory.mktemp("fuzz") / "train_000000.bin"
    raw = bytearray(data)
    if header is not None:  # a plausible header, then random bytes
        head = np.zeros(256, dtype="<i4")
        head[:3] = header
        raw = bytearray(head.tobytes()) + raw
    path.write_bytes(bytes(raw))
    try:
        version, count = read_header(path)
        toks = read_shard(path)
    except ShardError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    itemsize = {1: 2, 7: 4}[version]
    assert len(toks) == count == (len(raw) - 1024) // itemsize and toks.dtype == np.dtype(f"<u{itemsize}")


# ------------------------------------------------------------------------------ what a batch reads
def test_a_batch_reads_its_b_t_plus_one_tokens_and_not_one_more(tmp_path):
    """A shard cut back, under the run, to exactly the tokens the next batch reads (2 x 16 + 1)
    still serves that batch: the size check asks for B*T+1 tokens, not more."""
    toks = np.arange(100, 140, dtype=np.uint16)  # 40 tokens: 2 windows of 16 (+1)
    path = tmp_path / "train_000000.bin"
    write_shard(path, toks)
    loader = TokenLoader([path], B, T)
    loader.next_batch()  # opens (maps) the shard
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + 2 * 33)
    x, y = loader.next_batch()
    assert x.flatten().tolist() == list(range(116, 132)) and y.flatten().tolist() == list(range(117, 133)), (
        "the second batch is not tokens 16..32 of the shard"
    )


def test_a_bad_token_is_named_with_its_shard_and_its_place_in_the_shard(tmp_path):
    """Rank 1 of 2 (16 tokens each, 32 a step): its second batch starts at token 32 + 16 = 48; a bad
    id at token 50 is named there, in that shard."""
    toks = np.random.default_rng(0).integers(0, 1000, 200).astype(np.uint16)
    toks[50] = 60000
    path = tmp_path / "train_000000.bin"
    write_shard(path, toks)
    loader = TokenLoader([path], B, T, rank=1, world_size=2, max_token_id=1000)
    loader.next_batch()  # tokens 16..32: fine
    with pytest.raises(GptspeedError) as e:
        loader.next_batch()
    assert str(e.value).startswith(f"{path}: token id 60000 at token 50 is not below the vocabulary size 1000: "), (
        f"the message does not name the shard and the token's place in it: {e.value}"
    )


def test_a_bad_token_in_the_val_split_is_named_with_its_shard_and_its_place_in_the_shard(tmp_path):
    """Two val shards; batches of 2 x 10: the second shard's second batch reads from window 2, token
    20; a bad id at its token 25 is named as that shard's token 25."""
    first = _val_shard(tmp_path / "val_000000.bin", np.arange(50) % 100)
    toks = np.arange(60) % 100
    toks[25] = 5000
    second = _val_shard(tmp_path / "val_000001.bin", toks)
    batches = iter_eval_batches([first, second], 2, 10, max_token_id=1000)
    for _ in range(3):  # shard 0: windows 0-1, 2-3; shard 1: windows 0-1 -- all fine
        next(batches)
    with pytest.raises(GptspeedError) as e:
        next(batches)
    assert str(e.value).startswith(f"{second}: token id 5000 at token 25 is not below the vocabulary size 1000: "), (
        f"the message does not name the val shard and the token's place in it: {e.value}"
    )


def test_round_trip(tmp_path):
    tokens = np.array([0, 1, 50256, 65535, 12345], dtype=np.int64)
    path = tmp_path / "x.bin"
    write_shard(path, tokens)
    assert read_header(path) == (1, 5)
    out = read_shard(path)
    assert isinstance(out, np.memmap)
    assert out.dtype == np.dtype("<u2") and out.shape == (5,)
    np.testing.assert_array_equal(out, tokens)
    with pytest.raises(ValueError):
        out[0] = 1  # read-only


def test_a_uint32_shard_has_llm_c_header_and_its_tokens_read_back_exactly(tmp_path):
    """A vocabulary above 65,536 ids: llm.c's uint32 format (dev/data/data_common.py's "llama-3":
    magic 20240801, version 7, 4 bytes a token), written from a uint32 array and read by every reader."""
    tokens = np.array([0, 65535, 65536, 100_277, 128_255, 2**32 - 1, 7], dtype=np.uint32)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert struct.unpack("<256i", raw[:HEADER_BYTES]) == (20240801, 7, 7, *([0] * 253))
    assert len(raw) == HEADER_BYTES + 4 * 7 and raw[HEADER_BYTES:] == tokens.astype("<u4").tobytes()
    assert read_header(path) == (7, 7)
    out = read_shard(path)
    assert out.dtype == np.dtype("<u4") and out.tolist() == tokens.tolist()
    mapped = MappedShard(path)
    assert mapped.window(2, 5).tolist() == [65536, 100_277, 128_255]
    mapped.close()


def test_a_uint32_shard_written_as_llm_c_writes_it_trains(tmp_path):
    """The header and tokens as llm.c's script lays them out, read by the training loader: ids above
    65,535 arrive whole in the int64 batches."""
    ids = np.arange(70_000, 70_000 + 2 * B * T + 1, dtype="<u4")
    path = raw_shard(tmp_path / "train_000000.bin", len(ids), ids.tobytes(), magic=20240801, version=7)
    x, y = TokenLoader([path], B, T).next_batch()
    assert x.flatten().tolist() == ids[: B * T].tolist() and y.flatten().tolist() == ids[1 : B * T + 1].tolist()


def test_a_uint16_shard_refuses_ids_it_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "x.bin", np.array([65536], dtype=np.int64))
    assert not list(tmp_path.iterdir())


def test_header_bytes(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.array([1, 2, 3], dtype=np.uint16))
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + 6 == 1030
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240520, 1, 3)
    assert all(v == 0 for v in header[3:])
    assert raw[1024:] == struct.pack("<3H", 1, 2, 3)


def test_empty_shard(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.array([], dtype=np.int32))
    assert read_header(path) == (1, 0)
    assert read_shard(path).shape == (0,)


def test_atomic_write_leaves_no_temp(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.arange(10))
    write_shard(path, np.arange(20))  # overwrite
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    assert read_header(path) == (1, 20)


def test_out_of_range_tokens_are_a_bug(tmp_path):
    path = tmp_path / "x.bin"
    for bad in (np.array([65536]), np.array([-1]), np.array([1.5])):
        with pytest.raises(ValueError):
            write_shard(path, bad)
    assert list(tmp_path.iterdir()) == []  # no partial or temp file


def test_failed_write_keeps_old_file_and_removes_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.bin"
    write_shard(path, np.arange(4))

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr("os.fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_shard(path, np.arange(8))
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    assert read_header(path) == (1, 4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: raw_shard(p, 2, b"\0" * 4, magic=20240802), "magic 20240802.*not an llm.c"),
        (lambda p: raw_shard(p, 2, b"\0" * 4, magic=20240801), "magic 20240801 and format version 1, but"),
        (lambda p: raw_shard(p, 2, b"\0" * 4, version=7), "magic 20240520 and format version 7, but"),
        (lambda p: raw_shard(p, 2, b"\0" * 4, magic=20240801, version=7), "truncated"),  # 2 uint32 need 8 bytes
        (lambda p: raw_shard(p, 10, b"\0" * 4), "truncated"),
        (lambda p: raw_shard(p, 2, b"\0" * 5), "1 bytes after"),
        (lambda p: raw_shard(p, 2, b"\0" * 6), "2 bytes after"),
        (lambda p: raw_shard(p, -1), "negative"),
        (lambda p: p.write_bytes(b"\0" * 1000), "shorter than the 1024-byte header"),
        (lambda p: raw_shard(p, 2, b"\0" * 4, version=2), "version 2"),
        (lambda p: p.write_bytes(b""), "0 bytes"),
        (lambda p: None, "does not exist"),
    ],
    ids=[
        "magic",
        "uint32-magic-v1",
        "uint16-magic-v7",
        "uint32-truncated",
        "truncated",
        "odd-extra",
        "extra",
        "negative",
        "short",
        "version",
        "empty",
        "missing",
    ],
)
def test_bad_shards(tmp_path, make, match):
    path = tmp_path / "bad.bin"
    make(path)
    for read in (read_header, read_shard):
        with pytest.raises(ShardError, match=match) as err:
            read(path)
        assert str(path) in str(err.value)
        assert "\n" not in str(err.value)
        assert isinstance(err.value, GptspeedError)


def test_a_mapped_shard_cut_under_its_reader_is_an_error_naming_it(tmp_path):
    """Reading the lost pages of a truncated memory map is SIGBUS (the process dies silently): the
    size is checked first, for the training loader and the eval batches alike."""
    from gptspeed.data.loader import iter_eval_batches
    from gptspeed.data.shards import ShardError

    path = tmp_path / "val_000000.bin"
    write_shard(path, np.arange(4096, dtype=np.uint16))
    shard = MappedShard(path)
    assert shard.window(4000, 5000).tolist() == list(range(4000, 4096))  # clipped to the shard
    batches = iter_eval_batches([path], batch_size=2, seq_len=64)
    next(batches)
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 1000)
    assert shard.window(0, 1000).tolist() == list(range(1000))  # what is still there reads
    with pytest.raises(ShardError, match="val_000000.bin shrank to 3,024 bytes"):
        shard.window(900, 1100)
    with pytest.raises(ShardError, match="shrank"):
        list(batches)
    shard.close()
