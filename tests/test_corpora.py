"""Corpora at scale: source formats, parallel tokenization, shuffle, resume, bad records."""

import gzip
import json

import numpy as np
import pytest

from gptspeed.data import find_shards, read_shard
from gptspeed.data.prepare import PROGRESS_NAME, prepare
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN, get_encoding

DOCS = [f"Document number {i}. " + "Some words here, and more words. " * (3 + i % 7) for i in range(40)]


def encode(text):
    return get_encoding().encode_ordinary(text)


def expected_stream(docs):
    return np.concatenate([[EOT_TOKEN, *encode(d)] for d in docs if d]).astype(np.uint16)


def all_tokens(out):
    return np.concatenate([np.concatenate([read_shard(p) for p in find_shards(out, s)]) for s in ("train", "val")])


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_formats(tmp_path, fmt):
    path = tmp_path / f"docs.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, DOCS)
    elif fmt == "jsonl.gz":
        write_jsonl(path, DOCS, opener=gzip.open)
    elif fmt == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        pa = pytest.importorskip("pyarrow")
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


def test_workers_give_identical_shards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 20)
    one = prepare(str(path), tmp_path / "w1", shard_tokens=3000, progress=False, workers=1)
    two = prepare(str(path), tmp_path / "w2", shard_tokens=3000, progress=False, workers=2)
    assert len(one["splits"]["train"]["shards"]) > 2
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")
    assert one["splits"] == two["splits"]


def test_shuffle_is_a_seeded_permutation(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    a = prepare(str(path), tmp_path / "a", shuffle_seed=1, progress=False)
    prepare(str(path), tmp_path / "b", shuffle_seed=1, progress=False)
    prepare(str(path), tmp_path / "c", shuffle_seed=2, progress=False)
    assert a["settings"]["shuffle_seed"] == 1
    ta, tb, tc = (all_tokens(tmp_path / x) for x in "abc")
    np.testing.assert_array_equal(ta, tb)
    assert not np.array_equal(ta, tc) and not np.array_equal(ta, expected_stream(DOCS))
    assert sorted(ta.tolist()) == sorted(expected_stream(DOCS).tolist())


def test_resume_skips_finished_chunks(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    ref = prepare(str(path), tmp_path / "ref", shard_tokens=2000, progress=False)
    import gptspeed.data.prepare as P

    real, calls = P.write_shard, []

    def crash_on_third(p, tokens):
        calls.append(p.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(p, tokens)

    monkeypatch.setattr(P, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(path), tmp_path / "out", shard_tokens=2000, progress=False)
    state = json.loads((tmp_path / "out" / PROGRESS_NAME).read_text())
    assert len(state["chunks"]) == 2 and not (tmp_path / "out" / "manifest.json").exists()
    encoded = []
    real_encode = P.encode_documents
    monkeypatch.setattr(P, "write_shard", real)
    monkeypatch.setattr(P, "encode_documents", lambda texts: encoded.extend(texts) or real_encode(texts))
    m = prepare(str(path), tmp_path / "out", shard_tokens=2000, progress=False)
    assert len(encoded) < len(DOCS) * 10 - 5  # the documents of finished chunks were not tokenized again
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    assert m["splits"] == ref["splits"] and m["documents"] == ref["documents"]
    assert not (tmp_path / "out" / PROGRESS_NAME).exists()


def test_max_tokens(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    m = prepare(str(path), tmp_path / "out", max_tokens=500, progress=False)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 500
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(DOCS)[:500])


def test_bad_records_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:5]]
    lines[2] = '{"text": "broken'
    lines.insert(4, json.dumps({"body": "no text field"}))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(GptspeedError, match=r"d\.jsonl:3: not valid JSON.*--skip-bad"):
        prepare(str(path), tmp_path / "o1", progress=False)
    lines[2] = json.dumps({"text": DOCS[2]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(GptspeedError, match=r"d\.jsonl:5: no string field 'text'"):
        prepare(str(path), tmp_path / "o2", progress=False)
    lines[2] = "not json"
    path.write_text("\n".join(lines) + "\n")
    m = prepare(str(path), tmp_path / "o3", skip_bad=True, progress=False)
    assert m["bad_records"] == 2 and m["documents"] == 4
    np.testing.assert_array_equal(all_tokens(tmp_path / "o3"), expected_stream([DOCS[0], DOCS[1], DOCS[3], DOCS[4]]))


def test_parquet_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": DOCS[:3]}), tmp_path / "d.parquet")
    with pytest.raises(GptspeedError, match=r"d\.parquet: no column 'text'.*--text-field"):
        prepare(str(tmp_path / "d.parquet"), tmp_path / "o", progress=False)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_hf_datasets_streaming_on_local_files(tmp_path, fmt):
    pytest.importorskip("datasets")
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
    from gptspeed.data.prepare import HF_CORPORA

    assert HF_CORPORA["fineweb-edu-10B"].dataset == "HuggingFaceFW/fineweb-edu"
    assert HF_CORPORA["fineweb-edu-10B"].config == "sample-10BT"
    assert HF_CORPORA["tinystories"].dataset == "roneneldan/TinyStories"
