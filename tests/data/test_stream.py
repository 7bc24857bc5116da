"""``gptspeed.data.stream``: training straight from a ``.jsonl`` file or a Hugging Face dataset, without token shards."""

from __future__ import annotations

import pytest

from support.records import DOCS, expected_stream, lines_of


# ----------------------------------------------------------------------------- 10. streams
def test_a_stream_ends_with_its_true_batch_count(tmp_path):
    """The line said "ended after 3 batches" after 10+ were trained: it read the consumed count in
    the producer thread, which runs ahead. Now it is the batches the consumer got, and tokens."""
    from gptspeed.data.shards import ShardError
    from gptspeed.data.stream import StreamLoader

    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS))
    n = (len(expected_stream(DOCS)) - 1) // 32
    loader = StreamLoader(f"jsonl:{path}", 2, 16, workers=1, prefetch=n + 1)
    loader.next_batch()
    loader._prefetcher._threads[0].join(timeout=60)  # the producer reached the end, one batch consumed
    for _ in range(n - 1):
        loader.next_batch()
    with pytest.raises(ShardError, match=rf"ended after {n:,} batches of 2x16 tokens \({n * 32:,} tokens in all"):
        loader.next_batch()
    loader.close()


def test_a_failing_source_is_a_stream_error_naming_it(tmp_path, monkeypatch):
    """Any exception of the source (here a RuntimeError after some documents), a bad record, or a
    truncated file is a StreamError (a ShardError, which the trainer saves before) in one line."""
    import gptspeed.data.stream as stream_mod
    from gptspeed.data.stream import StreamError, StreamLoader

    def flaky(*a, **k):
        yield from DOCS[:10]
        raise RuntimeError("connection reset\nsecond line")

    monkeypatch.setattr(stream_mod, "iter_stream_documents", flaky)
    loader = StreamLoader("hf:some/dataset", 2, 16)
    with pytest.raises(StreamError, match=r"^the stream hf:some/dataset failed: RuntimeError: connection reset$"):
        for _ in range(1000):
            loader.next_batch()
    monkeypatch.undo()
    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS[:5]) + b"{broken\n")
    loader = StreamLoader(f"jsonl:{path}", 2, 16)
    with pytest.raises(StreamError, match=r"d\.jsonl:6: not valid JSON.*streaming training stops at a bad record"):
        for _ in range(1000):
            loader.next_batch()
