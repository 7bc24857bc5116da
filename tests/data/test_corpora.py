"""``gptspeed.data.corpora``: named corpora and source resolution for ``gptspeed prepare``."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import tarfile
import types

import numpy as np
import pytest
import torch

from gptspeed.data import corpora, find_shards, read_shard
from gptspeed.data.corpora import CORPORA, Archive, Corpus
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN

from support.documents import DOCS, all_tokens, documents, encode, expected_stream, shard_bytes, write_jsonl
from support.settings import STREAM_RUN
from support.training import records


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_formats(tmp_path, fmt):
    path = tmp_path / f"docs.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, DOCS)
    elif fmt == "jsonl.gz":
        write_jsonl(path, DOCS, opener=gzip.open)
    elif fmt == "jsonl.zst":
        import zstandard

        data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), path, row_group_size=7)
    m = prepare(str(path), tmp_path / "out", progress=False)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(DOCS))
    assert m["documents"] == len(DOCS) and m["bad_records"] == 0


def test_folder_of_mixed_formats_and_text_field(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", DOCS[:10], field="content")
    (src / "b.txt").write_text(DOCS[10])
    (src / "c.md").write_text("ignored")
    prepare(str(src), tmp_path / "out", text_field="content", progress=False)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(DOCS[:11]))


def test_shuffle_is_a_seeded_global_permutation(tmp_path):
    # a corpus sorted by topic: 100 "alpha" documents, then 100 "beta" ones
    docs = [f"alpha {i} " + "apple " * (1 + i % 5) for i in range(100)]
    docs += [f"beta {i} " + "banana " * (1 + i % 5) for i in range(100)]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    a = prepare(str(path), tmp_path / "a", shuffle_seed=1, shard_tokens=500, progress=False)
    prepare(str(path), tmp_path / "b", shuffle_seed=1, shard_tokens=500, progress=False)
    prepare(str(path), tmp_path / "c", shuffle_seed=2, shard_tokens=500, progress=False)
    assert a["settings"]["shuffle_seed"] == 1 and a["numpy_version"] == np.__version__
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    ta, tc = all_tokens(tmp_path / "a"), all_tokens(tmp_path / "c")
    assert not np.array_equal(ta, tc) and not np.array_equal(ta, expected_stream(docs))
    # the same documents, each whole
    assert sorted(documents(ta)) == sorted(documents(expected_stream(docs)))
    assert a["documents"] == 200 and a["splits"]["train"]["documents"] + a["splits"]["val"]["documents"] == 200
    # global, not windowed: both topics in val and in the first fifth of train
    alpha, beta = encode("alpha")[0], encode("beta")[0]
    val = np.concatenate([read_shard(p) for p in find_shards(tmp_path / "a", "val")])
    train = np.concatenate([read_shard(p) for p in find_shards(tmp_path / "a", "train")])
    first_words = lambda toks: {d[1] for d in documents(toks)}  # noqa: E731
    assert val[0] == EOT_TOKEN and first_words(val) == {alpha, beta}
    assert first_words(train[: len(train) // 5]) == {alpha, beta}
    assert len(a["splits"]["train"]["shards"]) > 2 and a["splits"]["val"]["tokens"] == len(val)
    assert abs(len(val) - 0.1 * len(ta)) < 0.05 * len(ta)
    assert not list((tmp_path / "a").glob(".stream_*"))  # staging chunks removed


def test_max_tokens(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    m = prepare(str(path), tmp_path / "out", max_tokens=500, progress=False)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 500
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(DOCS)[:500])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_hf_datasets_streaming_on_local_files(tmp_path, fmt):
    import datasets  # noqa: F401  (the test extra installs it)

    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, DOCS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), path)
    m = prepare(f"hf:{path}", tmp_path / "out", max_tokens=800, progress=False)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(DOCS)[:800])
    assert m["settings"]["dataset"] == str(path) and m["files"] == []


def test_named_online_corpora_are_defined():
    from gptspeed.data.corpora import HF_CORPORA

    assert HF_CORPORA["fineweb-edu-10B"].dataset == "HuggingFaceFW/fineweb-edu"
    assert HF_CORPORA["fineweb-edu-10B"].config == "sample-10BT"
    assert HF_CORPORA["tinystories"].dataset == "roneneldan/TinyStories"


def test_stream_loader_windows_and_exact_resume(tmp_path):
    from gptspeed.data.stream import StreamLoader

    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 3)
    stream = expected_stream(DOCS * 3).astype(np.int64)
    a = StreamLoader(f"jsonl:{path}", 2, 16, workers=1)
    G = 32
    for k in range(10):
        x, y = a.next_batch()
        np.testing.assert_array_equal(x.flatten().numpy(), stream[k * G : k * G + G])
        np.testing.assert_array_equal(y.flatten().numpy(), stream[k * G + 1 : k * G + G + 1])
    state = a.state_dict()
    b = StreamLoader(f"jsonl:{path}", 2, 16, workers=2)
    b.load_state_dict(state)
    for _ in range(20):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert a.state_dict() == b.state_dict() and a.documents == b.documents > 0
    with pytest.raises(GptspeedError, match="ended after"):
        for _ in range(10_000):
            a.next_batch()
    b.close()


def test_stream_windows_is_an_iterable_dataset(tmp_path, monkeypatch):
    from gptspeed.data.stream import StreamWindows

    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 2)
    stream = expected_stream(DOCS * 2)
    ds = StreamWindows(f"jsonl:{path}", 50, workers=2)
    assert isinstance(ds, torch.utils.data.IterableDataset)
    items = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert len(items) == (len(stream) - 1) // 50
    for k, (window, docs_in, _doc_index, _doc_offset) in enumerate(items):
        np.testing.assert_array_equal(np.asarray(window), stream[k * 50 : k * 50 + 51])
        assert docs_in == np.count_nonzero(stream[k * 50 : k * 50 + 50] == EOT_TOKEN)
    # the position after a window starts the same stream again from there
    _, _, doc_index, doc_offset = items[3]
    rest = StreamWindows(f"jsonl:{path}", 50, doc_index=doc_index, doc_offset=doc_offset)
    np.testing.assert_array_equal(next(iter(rest))[0], stream[200:251])
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: type("W", (), {"num_workers": 2})())
    with pytest.raises(GptspeedError, match="one ordered stream"):
        next(iter(ds))


def test_train_from_a_jsonl_stream(reference_run):
    """A run streaming a jsonl file counts its documents and its wait for data, and has no val loss (no val split).
    That it resumes to the same losses, to the bit, is a case of tests/system/test_exact_resume.py, on the same
    (shared) run."""
    last = {r["step"]: r for r in records(reference_run(STREAM_RUN))}[6]
    assert last["documents"] > 0 and last.get("val_loss") is None and last["data_wait_ms"] >= 0


def test_shuffle_cut_inside_a_document_when_no_start_is_near(tmp_path):
    docs = ["word " * 400, "short one"]  # no document start within 5% of the 90% mark
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    m = prepare(str(path), tmp_path / "out", shuffle_seed=0, progress=False)
    ta = all_tokens(tmp_path / "out")
    assert sorted(documents(ta)) == sorted(documents(expected_stream(docs)))
    assert m["splits"]["train"]["tokens"] == round(len(ta) * 0.9)


# ------------------------------------------------------------------------------ downloads (through pooch)
class Broken:
    """An answer that sends half of ``body`` (announcing all of it), then the connection breaks."""

    def __init__(self, body: bytes):
        self.body = body


class FakeRaw:
    """What requests streams a body from (a urllib3 response's ``stream``)."""

    def __init__(self, body: bytes, broken: bool):
        self.body, self.broken = body, broken

    def stream(self, chunk_size, decode_content=True):
        import urllib3

        if self.broken:
            yield self.body[: len(self.body) // 2]
            raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")
        for i in range(0, len(self.body), chunk_size or len(self.body) or 1):
            yield self.body[i : i + chunk_size]

    def close(self):
        pass


class FakeWeb:
    """The network, faked under requests (``HTTPAdapter.send``, where requests.get and so pooch's
    downloader end): ``answers[url]`` lists what the successive requests of ``url`` get -- bytes
    (the whole body), :class:`Broken` (half of it, then the connection breaks) or an HTTP status;
    a URL without (further) answers is unreachable. Records each request, and pooch's waits between
    attempts (not slept)."""

    def __init__(self, monkeypatch, answers=None):
        import pooch  # here, not at the top: the GPU machine's bare image collects this file
        import requests

        self.answers = {url: list(a) for url, a in (answers or {}).items()}
        self.requests: list[str] = []
        self.sleeps: list[float] = []
        monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", self.send)
        monkeypatch.setattr(pooch.core, "time", types.SimpleNamespace(sleep=self.sleeps.append))

    def send(self, request, **kwargs):
        import requests

        self.requests.append(request.url)
        queue = self.answers.get(request.url)
        if not queue:
            raise requests.exceptions.ConnectionError("unreachable (a test's fake network)")
        answer = queue.pop(0)
        resp = requests.Response()
        resp.request, resp.url = request, request.url
        resp.status_code = answer if isinstance(answer, int) else 200
        body = answer.body if isinstance(answer, Broken) else answer if isinstance(answer, bytes) else b""
        resp.headers["Content-Length"] = str(len(body))
        resp.raw = FakeRaw(body, isinstance(answer, Broken))
        return resp


URL = "https://example.org/corpus/input.txt"
TEXT = b"Some text to download. " * 200


@pytest.fixture
def one_file_corpus(tmp_path, monkeypatch):
    """A named corpus of one file at :data:`URL` (nothing embedded), an empty mirror, an empty cache."""
    corpus = Corpus(name="web", files={"web/input.txt": hashlib.sha256(TEXT).hexdigest()}, url=URL)
    monkeypatch.setitem(CORPORA, "web", corpus)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "web"


def test_a_download_that_fails_twice_then_succeeds_is_retried_and_hash_checked(one_file_corpus, monkeypatch):
    web = FakeWeb(monkeypatch, {URL: [503, Broken(TEXT), TEXT]})
    assert corpora.corpus_files("web", progress=False) == [one_file_corpus / "input.txt"]
    assert (one_file_corpus / "input.txt").read_bytes() == TEXT
    assert web.requests == [URL] * 3 and web.sleeps == [1, 2]  # pooch's waits
    assert sorted(p.name for p in one_file_corpus.iterdir()) == ["input.txt"]  # no temporary file left
    corpora.corpus_files("web", progress=False)  # in the cache, hash right: no request
    assert web.requests == [URL] * 3


def test_a_cut_or_corrupt_download_never_stands_as_the_file(one_file_corpus, monkeypatch):
    """Every attempt cut short, or whole but other bytes: the file is never written (pooch streams
    into a temporary file renamed only when its sha256 is right), and the error is one line."""
    attempts = 1 + corpora.DOWNLOAD_RETRIES
    for answers in ([Broken(TEXT)] * attempts, [TEXT[:-1] + b"!"] * attempts):
        web = FakeWeb(monkeypatch, {URL: answers})
        with pytest.raises(GptspeedError) as e:
            corpora.corpus_files("web", progress=False)
        assert web.requests == [URL] * attempts
        assert "\n" not in str(e.value) and f"could not download input.txt after {attempts} attempts" in str(e.value)
        assert not one_file_corpus.exists() or list(one_file_corpus.iterdir()) == []
    assert "SHA256 hash of downloaded file" in str(e.value) and hashlib.sha256(TEXT).hexdigest() in str(e.value)
    # a stale cached file is replaced by a good download only
    one_file_corpus.mkdir(parents=True, exist_ok=True)
    (one_file_corpus / "input.txt").write_bytes(b"stale")
    FakeWeb(monkeypatch, {URL: [Broken(TEXT)] * attempts})
    with pytest.raises(GptspeedError):
        corpora.corpus_files("web", progress=False)
    assert [p.name for p in one_file_corpus.iterdir()] == ["input.txt"]
    assert (one_file_corpus / "input.txt").read_bytes() == b"stale"
    FakeWeb(monkeypatch, {URL: [TEXT]})
    assert corpora.corpus_files("web", progress=False)[0].read_bytes() == TEXT


def test_the_mirror_is_used_without_the_network(one_file_corpus, tmp_path, monkeypatch):
    (tmp_path / "mirror" / "web").mkdir(parents=True)
    (tmp_path / "mirror" / "web" / "input.txt").write_bytes(TEXT)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
    web = FakeWeb(monkeypatch, {URL: [TEXT]})
    assert corpora.corpus_files("web", progress=False) == [tmp_path / "mirror" / "web" / "input.txt"]
    assert web.requests == [] and not one_file_corpus.exists()


def test_download_failure_suggests_mirror(tmp_path, monkeypatch):
    """Offline: every attempt at the URL fails, and the one-line error names it and the mirror."""
    # tiny Shakespeare ships with the package; as a corpus that does not, it is downloaded
    monkeypatch.setitem(CORPORA, "tinyshakespeare", dataclasses.replace(CORPORA["tinyshakespeare"], embedded=None))
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    web = FakeWeb(monkeypatch)
    with pytest.raises(GptspeedError) as e:
        prepare("tinyshakespeare", tmp_path / "out", progress=False)
    url = CORPORA["tinyshakespeare"].url
    assert str(e.value) == (
        f"could not download input.txt after 4 attempts per URL ({url}: unreachable (a test's fake "
        "network)): get the files yourself and set GPTSPEED_DATA_MIRROR to a folder holding tinyshakespeare/input.txt"
    )
    assert web.requests == [url] * 4
    assert not (tmp_path / "cache" / "tinyshakespeare").exists() or not any((tmp_path / "cache").rglob("*.txt"))


def test_archive_download_into_cache(tmp_path, monkeypatch):
    """The sdist path: fetch a tar.gz (the first URL gone, the second one answering), verify it,
    extract only listed members safely, then reuse the cache without fetching again."""
    texts = {"a.txt": b"Alpha text. " * 30, "b.txt": b"Beta text. " * 30}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {**texts, "metadata.txt": b"not a document"}.items():
            info = tarfile.TarInfo(f"pkg-1.0/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    urls = ("https://example.org/gone/pkg-1.0.tar.gz", "https://example.org/packages/pkg-1.0.tar.gz")
    corpus = Corpus(
        name="fake",
        files={f"fake/{n}": hashlib.sha256(d).hexdigest() for n, d in texts.items()},
        archive=Archive(urls=urls, sha256=hashlib.sha256(buf.getvalue()).hexdigest(), member_dir="pkg-1.0/texts"),
    )
    monkeypatch.setitem(CORPORA, "fake", corpus)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    web = FakeWeb(monkeypatch, {urls[0]: [404] * 4, urls[1]: [buf.getvalue()]})
    paths = corpora.corpus_files("fake", progress=False)
    cache = tmp_path / "cache"
    assert paths == [cache / "fake" / "a.txt", cache / "fake" / "b.txt"]
    assert [p.read_bytes() for p in paths] == list(texts.values())
    assert web.requests == [urls[0]] * 4 + [urls[1]]
    assert list((cache / ".downloads").iterdir()) == []  # the archive removed once extracted
    # cached and verified: no second fetch
    assert prepare("fake", tmp_path / "out", progress=False)["documents"] == 2
    assert web.requests == [urls[0]] * 4 + [urls[1]]


def test_without_pooch_a_download_is_one_line_naming_it_and_the_mirror(one_file_corpus, monkeypatch):
    """The GPU machine runs the checkout from src/ with carried wheels: a missing pooch is one line."""
    import sys

    monkeypatch.setitem(sys.modules, "pooch", None)  # "import pooch" fails as if not installed
    with pytest.raises(GptspeedError) as e:
        corpora.corpus_files("web", progress=False)
    assert str(e.value) == (
        "downloading input.txt needs the package pooch (a dependency of gptspeed: pip install pooch), "
        "or set GPTSPEED_DATA_MIRROR to a folder holding web/input.txt"
    )


# ------------------------------------------------------------------ fineweb10B: shards tokenized upstream, on the Hub

FINEWEB_VAL, FINEWEB_TRAIN1 = "fineweb_val_000000.bin", "fineweb_train_000001.bin"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_shard_bytes(n: int, seed: int) -> bytes:
    """The bytes of an llm.c shard of ``n`` tokens (an <|endoftext|> every 50), written by gptspeed's write_shard."""
    import tempfile
    from pathlib import Path

    from gptspeed.data import write_shard

    tokens = np.random.default_rng(seed).integers(0, EOT_TOKEN, n)
    tokens[::50] = EOT_TOKEN
    with tempfile.TemporaryDirectory() as d:
        write_shard(Path(d) / "s.bin", tokens)
        return (Path(d) / "s.bin").read_bytes()


class FakeHub:
    """huggingface_hub's ``hf_hub_download``, faked: ``answers[filename]`` lists what the successive calls for that
    file get -- an exception (raised) or bytes (the file, put in a cache laid out as huggingface_hub's:
    ``snapshots/COMMIT/FILE`` a link to ``blobs/SHA256``). A file without (further) answers is unreachable. Records
    each call's file name, and the waits between attempts (not slept)."""

    def __init__(self, monkeypatch, root, answers=None):
        import time

        import huggingface_hub  # here, not at the top: the GPU machine's bare image collects this file

        self.root, self.answers = root, {f: list(a) for f, a in (answers or {}).items()}
        self.calls: list[str] = []
        self.sleeps: list[float] = []
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.download)
        monkeypatch.setattr(time, "sleep", self.sleeps.append)
        monkeypatch.setattr(corpora, "hub_unreachable", lambda: None)  # the fake Hub answers

    def download(self, repo_id, filename, *, repo_type=None, **kwargs):
        assert (repo_id, repo_type) == ("kjj0/fineweb10B-gpt2", "dataset")
        self.calls.append(filename)
        queue = self.answers.get(filename)
        if not queue:
            from huggingface_hub.utils import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(
                "An error happened while trying to locate the file on the Hub\nand we cannot find it"
            )
        answer = queue.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        blob = self.root / "blobs" / hashlib.sha256(answer).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(answer)
        link = self.root / "snapshots" / COMMIT / filename
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(blob)
        return str(link)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty mirror; the fake Hub's cache folder."""
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    return tmp_path / "hub" / "datasets--kjj0--fineweb10B-gpt2"


def test_fineweb10B_is_the_speedruns_shards_on_the_hub():
    c = corpora.SHARD_CORPORA["fineweb10B"]
    assert c.repo == "kjj0/fineweb10B-gpt2" and c.val == (FINEWEB_VAL,)
    assert c.train[0] == FINEWEB_TRAIN1 and c.train[-1] == "fineweb_train_000103.bin" and len(c.train) == 103
    assert c.sums == {}  # not yet recorded: no published hashes, and no network here to read the Hub's


def test_a_hub_download_that_fails_twice_then_succeeds_is_retried(hub_cache, monkeypatch):
    from huggingface_hub.utils import LocalEntryNotFoundError

    data = fake_shard_bytes(300, 0)
    hub = FakeHub(
        monkeypatch, hub_cache, {FINEWEB_VAL: [LocalEntryNotFoundError("no connection"), OSError("reset"), data]}
    )
    [f] = corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert hub.calls == [FINEWEB_VAL] * 3 and hub.sleeps == list(corpora.HUB_RETRY_WAIT_S[:2])
    assert (f.rel, f.origin, f.revision) == (f"fineweb10B/{FINEWEB_VAL}", "hub", COMMIT)
    assert f.path.read_bytes() == data and f.hub_sha256 == hashlib.sha256(data).hexdigest()


def test_a_hub_download_that_always_fails_is_one_line_naming_the_file_and_the_mirror(hub_cache, monkeypatch):
    hub = FakeHub(monkeypatch, hub_cache)
    with pytest.raises(GptspeedError) as e:
        corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL, FINEWEB_TRAIN1], progress=False)
    attempts = 1 + corpora.HUB_RETRIES
    assert hub.calls == [FINEWEB_VAL] * attempts and len(hub.sleeps) == attempts - 1
    assert str(e.value) == (
        f"could not download {FINEWEB_VAL} from the Hugging Face Hub (dataset kjj0/fineweb10B-gpt2) after "
        f"{attempts} attempt(s) (LocalEntryNotFoundError: An error happened while trying to locate the file on the "
        "Hub and we cannot find it): get it yourself, or set GPTSPEED_DATA_MIRROR to a folder holding "
        f"fineweb10B/{FINEWEB_VAL}"
    )


def test_a_file_the_hub_does_not_have_is_not_asked_for_again(hub_cache, monkeypatch):
    from huggingface_hub.utils import EntryNotFoundError

    hub = FakeHub(monkeypatch, hub_cache, {FINEWEB_VAL: [EntryNotFoundError("404: no such file")]})
    with pytest.raises(GptspeedError, match=r"after 1 attempt\(s\) \(EntryNotFoundError: 404: no such file\)"):
        corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert hub.calls == [FINEWEB_VAL] and hub.sleeps == []


def test_the_mirror_is_used_first_and_the_hub_only_for_what_it_lacks(tmp_path, hub_cache, monkeypatch):
    mirror = tmp_path / "mirror"
    (mirror / "fineweb10B").mkdir(parents=True)
    (mirror / "fineweb10B" / FINEWEB_VAL).write_bytes(fake_shard_bytes(300, 0))
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(mirror))
    hub = FakeHub(monkeypatch, hub_cache, {FINEWEB_TRAIN1: [fake_shard_bytes(400, 1)]})
    val, train = corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL, FINEWEB_TRAIN1], progress=False)
    assert (val.origin, val.path) == ("mirror", mirror / "fineweb10B" / FINEWEB_VAL)
    assert train.origin == "hub" and hub.calls == [FINEWEB_TRAIN1]
    hub.answers.clear()
    [val] = corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert val.origin == "mirror" and hub.calls == [FINEWEB_TRAIN1]  # the mirror's file: no call


def test_without_huggingface_hub_a_fineweb10B_download_is_one_line(hub_cache, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # "import huggingface_hub" fails as if not installed
    with pytest.raises(GptspeedError) as e:
        corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert str(e.value) == (
        f"fineweb10B's {FINEWEB_VAL} comes from the Hugging Face Hub through huggingface_hub, which is not installed: "
        f"pip install 'gptspeed[hf]', or set GPTSPEED_DATA_MIRROR to a folder holding fineweb10B/{FINEWEB_VAL}"
    )


def _not_a_file(path, kind: str) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(path.with_name("gone"))


NOT_A_FILE = [
    ("folder", "a folder"),
    ("fifo", "a FIFO"),
    ("dev-zero", "not a regular file"),
    ("broken", "a broken link"),
]


@pytest.mark.parametrize("kind, what", NOT_A_FILE, ids=[k for k, _ in NOT_A_FILE])
def test_a_mirror_entry_that_is_not_a_file_is_named_never_taken_for_absent(tmp_path, monkeypatch, kind, what):
    """A mirror entry that is a folder, a FIFO, a link to /dev/zero or a broken link was taken for an absent
    file (fineweb10B then went to the Hub, a named corpus to the cache): it is one line naming it, before
    anything is read or downloaded."""
    mirror = tmp_path / "mirror"
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(mirror))
    entry = mirror / "fineweb10B" / FINEWEB_VAL
    _not_a_file(entry, kind)
    hub = FakeHub(monkeypatch, tmp_path / "hub", {FINEWEB_VAL: [fake_shard_bytes(300, 0)]})
    with pytest.raises(GptspeedError) as e:
        corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert str(e.value).startswith(f"{entry} in the mirror (GPTSPEED_DATA_MIRROR) is {what}"), e.value
    assert hub.calls == []
    web = mirror / "web" / "input.txt"
    _not_a_file(web, kind)
    monkeypatch.setitem(
        CORPORA, "web", Corpus(name="web", files={"web/input.txt": hashlib.sha256(TEXT).hexdigest()}, url=URL)
    )
    fake_web = FakeWeb(monkeypatch, {URL: [TEXT]})
    with pytest.raises(GptspeedError, match=f"^{web} in the mirror \\(GPTSPEED_DATA_MIRROR\\) is {what}"):
        corpora.corpus_files("web", progress=False)
    assert fake_web.requests == []


@pytest.mark.usefixtures("no_requests")
@pytest.mark.parametrize("mirror", [True, False], ids=["a-mirror-without-the-file", "no-mirror"])
def test_offline_a_shard_the_mirror_lacks_is_said_at_once(tmp_path, monkeypatch, mirror):
    """`prepare fineweb10B` with a shard missing from the mirror spent ~110 s in nested download retries
    before its line; offline (the Hub does not answer one request) it is said at once: no download attempt,
    no wait, unless huggingface_hub's cache holds the file, which is then used."""
    import time

    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    if mirror:
        monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
        (tmp_path / "mirror" / "fineweb10B").mkdir(parents=True)
    else:
        monkeypatch.delenv("GPTSPEED_DATA_MIRROR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls, cached = [], {}

    def download(repo_id, filename, *, repo_type=None, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        if not local_files_only:
            pytest.fail("offline: no download may be attempted")
        if filename not in cached:
            raise LocalEntryNotFoundError("not in the cache")
        return str(cached[filename])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("offline: no wait"))
    with pytest.raises(GptspeedError) as e:
        corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    lacks = f"{tmp_path / 'mirror'} (the mirror) holds no fineweb10B/{FINEWEB_VAL}, and " if mirror else ""
    assert str(e.value).startswith(
        f"cannot get {FINEWEB_VAL}: {lacks}the Hugging Face Hub cannot be reached (https://huggingface.co: "
    ), e.value
    assert str(e.value).endswith(f"or set GPTSPEED_DATA_MIRROR to a folder holding fineweb10B/{FINEWEB_VAL}")
    assert "\n" not in str(e.value) and calls == [True]
    blob = tmp_path / "hub" / "snapshots" / COMMIT / FINEWEB_VAL
    blob.parent.mkdir(parents=True)
    blob.write_bytes(fake_shard_bytes(300, 0))
    cached[FINEWEB_VAL] = blob
    [f] = corpora.shard_corpus_files("fineweb10B", [FINEWEB_VAL], progress=False)
    assert (f.path, f.origin, f.revision) == (blob, "hub", COMMIT)
