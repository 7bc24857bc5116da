"""``gptspeed.data.tokenize``: documents -> GPT-2 token arrays, in parallel threads, in document order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gptspeed.data import tokenize as T
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

TEXTS = [
    "Hello world",
    "",
    "a literal <|endoftext|> stays text",
    "   \n\n  ",
    "naïve café — 日本語 🙂",
    "O Romeo, Romeo! wherefore art thou Romeo?\n" * 50,
]


def reference(text: str) -> np.ndarray:
    ids = get_encoding().encode_ordinary(text)
    return np.array([EOT_TOKEN, *ids] if ids else [], dtype=np.uint16)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_document_is_eot_then_encode_ordinary(text):
    doc = T.encode_document(text)
    assert doc.dtype == np.uint16
    np.testing.assert_array_equal(doc, reference(text))
    if text:
        assert EOT_TOKEN not in doc[1:].tolist()  # a literal "<|endoftext|>" never becomes the separator


def test_each_thread_has_its_own_encoding():
    seen = []

    def grab():
        seen.append((T.thread_encoding(), T.thread_encoding()))

    threads = [threading.Thread(target=grab) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a1, a2), (b1, b2) = seen
    assert a1 is a2 and b1 is b2 and a1 is not b1  # cached per thread, distinct across threads
    assert (
        a1.encode_ordinary("per thread")
        == b1.encode_ordinary("per thread")
        == get_encoding().encode_ordinary("per thread")
    )


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_give_the_same_stream_in_order(workers, monkeypatch):
    monkeypatch.setattr(T, "BATCH_DOCS", 3)  # many small batches: order across threads matters
    docs = [f"document {i} " * (i % 7) for i in range(100)]
    one = list(T.tokenize_stream(iter(docs), 1))
    many = list(T.tokenize_stream(iter(docs), workers))
    assert len(one) == len(many) == 100
    for a, b, text in zip(one, many, docs):
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(a, reference(text))


def test_reader_error_reaches_the_caller_and_early_stop_is_clean(monkeypatch):
    monkeypatch.setattr(T, "BATCH_DOCS", 2)

    def docs():
        yield from ["one", "two", "three"]
        raise GptspeedError("bad record in f.jsonl line 4")

    with pytest.raises(GptspeedError, match="line 4"):
        list(T.tokenize_stream(docs(), 2))
    stream = T.tokenize_stream(iter(["x y z"] * 1000), 2)
    first = next(stream)
    stream.close()  # the consumer stops (max_tokens, Ctrl-C): no hang, pending work dropped
    np.testing.assert_array_equal(first, reference("x y z"))
    assert list(T.tokenize_stream(iter(["after"]), 2))[0].tolist() == reference("after").tolist()


def test_no_document_is_encoded_after_the_stream_is_closed(monkeypatch):
    """Closing the stream early (an error or Ctrl-C in prepare) waits for the batches already
    encoding: none calls the encoder afterwards (a prepare run next would see them)."""
    import time

    monkeypatch.setattr(T, "BATCH_DOCS", 2)
    real, calls = T.encode_document, []

    def slow(text):
        time.sleep(0.02)
        calls.append(text)
        return real(text)

    monkeypatch.setattr(T, "encode_document", slow)
    stream = T.tokenize_stream(iter(["x y z"] * 200), 2)
    next(stream)
    stream.close()
    done = len(calls)
    time.sleep(0.3)  # a batch of 2 still encoding would finish within 0.04 s
    assert len(calls) == done < 200


def test_default_workers_is_the_usable_cpu_count(monkeypatch):
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert T.default_workers() == 3
    monkeypatch.delattr(T.os, "sched_getaffinity")  # macOS / Windows
    monkeypatch.setattr(T.os, "cpu_count", lambda: None)
    assert T.default_workers() == 1


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_threads():
    import os

    docs = ["fork me"] * 10
    parent = list(T.tokenize_stream(iter(docs), 2))  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:  # child: the inherited pool has no threads; this must not hang
        try:
            child = list(T.tokenize_stream(iter(docs), 2))
            os._exit(0 if all(np.array_equal(a, b) for a, b in zip(parent, child)) else 1)
        except BaseException:
            os._exit(2)
    import signal
    import time

    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung waiting on its parent's tokenizer threads")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_prepare_command_does_not_import_torch(tmp_path):
    """`gptspeed prepare` builds only the flags it needs: no torch import (seconds of start-up)."""
    from support.cli import run_python

    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question. " * 20)
    code = (
        "import sys; from gptspeed.cli import main; "
        f"rc = main(['prepare', {str(tmp_path / 'a.txt')!r}, '--out', {str(tmp_path / 'd')!r}, '--no-progress']); "
        "print(rc, 'torch' in sys.modules)"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["0", "False"]
    assert (tmp_path / "d" / "manifest.json").is_file()
