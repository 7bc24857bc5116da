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


# ----------------------------------------------------------------------------- a tokenizer of the user's
def _encoded(tok, docs):
    """The stream ``tok`` should give: each document as ``[tok.eot, *tok.encode(text)]``, laid end to end."""
    import numpy as np

    return np.concatenate([[tok.eot, *tok.encode(d)] for d in docs]).astype(np.int64)


def test_a_stream_encodes_with_the_tokenizer_given_and_resumes_exactly_with_it(tmp_path):
    """Each document is the tokenizer's ``<|endoftext|>`` and ids (not GPT-2's); the position taken after 5
    batches continues in a loader with other workers to the same batches, and names the tokenizer: a loader
    of another one (here GPT-2's) refuses it, as a GPT-2 stream's position is refused by this one."""
    import numpy as np
    import torch

    from gptspeed.data.stream import StreamLoader
    from gptspeed.errors import GptspeedError

    from support.tokdata import tiny_tiktoken

    tok = tiny_tiktoken()
    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS * 2))
    stream = _encoded(tok, DOCS * 2)
    a = StreamLoader(f"jsonl:{path}", 2, 16, workers=1, tokenizer=tok)
    for k in range(5):
        x, y = a.next_batch()
        np.testing.assert_array_equal(x.flatten().numpy(), stream[k * 32 : k * 32 + 32])
        np.testing.assert_array_equal(y.flatten().numpy(), stream[k * 32 + 1 : k * 32 + 33])
    assert a.documents == np.count_nonzero(stream[:160] == tok.eot) > 0
    state = a.state_dict()
    assert state["tokenizer_sha256"] == tok.sha256
    b = StreamLoader(f"jsonl:{path}", 2, 16, workers=2, tokenizer=tok)
    b.load_state_dict(state)
    for _ in range(10):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert a.state_dict() == b.state_dict()
    a.close(), b.close()
    with pytest.raises(GptspeedError, match="another tokenizer than this stream's"):
        StreamLoader(f"jsonl:{path}", 2, 16).load_state_dict(state)
    gpt2_state = StreamLoader(f"jsonl:{path}", 2, 16).state_dict()
    with pytest.raises(GptspeedError, match="another tokenizer than this stream's"):
        StreamLoader(f"jsonl:{path}", 2, 16, tokenizer=tok).load_state_dict(gpt2_state)


def test_ids_of_a_vocabulary_beyond_65536_stay_whole_in_a_stream(tmp_path):
    """A vocabulary of 70,000 ids (<|endoftext|> 69,999): the windows are uint32, the id arrives whole in the
    batches (a uint16 on the way would make it 4,463) and counts the documents."""
    import numpy as np

    from gptspeed.data.stream import StreamLoader, StreamWindows

    from support.tokdata import tiny_tiktoken

    tok = tiny_tiktoken(eot=69_999, name="wide_tiktoken")
    assert tok.n_vocab == 70_000
    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS))
    stream = _encoded(tok, DOCS)
    window, docs_in, _, _ = next(iter(StreamWindows(f"jsonl:{path}", 64, tokenizer=tok)))
    assert window.dtype == np.uint32 and docs_in == np.count_nonzero(stream[:64] == 69_999) > 0
    np.testing.assert_array_equal(window, stream[:65])
    x, _ = StreamLoader(f"jsonl:{path}", 2, 32, tokenizer=tok).next_batch()
    assert int(x[0, 0]) == 69_999 and int(x.max()) == 69_999
