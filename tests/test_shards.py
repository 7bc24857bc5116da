"""The llm.c / modded-nanogpt shard format (gptspeed.data.shards)."""

import struct

import numpy as np
import pytest

from gptspeed.data.shards import (
    HEADER_BYTES,
    SHARD_MAGIC,
    SHARD_VERSION,
    ShardError,
    read_header,
    read_shard,
    write_shard,
)
from gptspeed.errors import GptspeedError


def raw_shard(path, count, tokens=b"", magic=SHARD_MAGIC, version=SHARD_VERSION):
    header = struct.pack("<256i", magic, version, count, *([0] * 253))
    path.write_bytes(header + tokens)
    return path


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
        (lambda p: raw_shard(p, 2, b"\0" * 4, magic=20240801), "magic 20240801.*not an llm.c"),
        (lambda p: raw_shard(p, 10, b"\0" * 4), "truncated"),
        (lambda p: raw_shard(p, 2, b"\0" * 5), "1 bytes after"),
        (lambda p: raw_shard(p, 2, b"\0" * 6), "2 bytes after"),
        (lambda p: raw_shard(p, -1), "negative"),
        (lambda p: p.write_bytes(b"\0" * 1000), "shorter than the 1024-byte header"),
        (lambda p: raw_shard(p, 2, b"\0" * 4, version=2), "version 2"),
        (lambda p: p.write_bytes(b""), "0 bytes"),
        (lambda p: None, "does not exist"),
    ],
    ids=["magic", "truncated", "odd-extra", "extra", "negative", "short", "version", "empty", "missing"],
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
    from gptspeed.data.shards import MappedShard, ShardError

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
