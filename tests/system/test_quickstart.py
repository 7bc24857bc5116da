"""The first ten minutes: tiny Shakespeare ships inside the package (sha256-checked), and the README's first command runs from it."""

from __future__ import annotations

import hashlib
import json
import lzma
import urllib.request

import pytest

from gptspeed.data.corpora import CORPORA, DEFAULT_CORPUS, EMBEDDED_DIR

from support.cli import run_main
from support.paths import SHARED_DATA

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """No mirror, an empty cache, and any download attempt fails the test."""
    monkeypatch.delenv("GPTSPEED_DATA_MIRROR", raising=False)
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))

    def no_network(*a, **k):
        raise AssertionError("the network was used")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    return tmp_path / "cache"


def test_the_embedded_corpus_is_tiny_shakespeare_by_its_sha256():
    corpus = CORPORA[DEFAULT_CORPUS]
    text = lzma.decompress((EMBEDDED_DIR / corpus.embedded).read_bytes())
    digest = hashlib.sha256(text).hexdigest()
    assert digest == corpus.files["tinyshakespeare/input.txt"]
    sums = SHARED_DATA / "SHA256SUMS"
    if sums.exists():  # the independent record beside the shared copy of the corpus
        listed = dict(reversed(line.split()) for line in sums.read_text().splitlines() if line.strip())
        assert listed["tinyshakespeare/input.txt"] == digest
    assert text.startswith(b"First Citizen:\nBefore we proceed any further, hear me speak.")


def test_train_without_data_prepares_the_embedded_corpus_once_and_trains_on_it(tmp_path, offline_cache):
    args = [
        "train",
        "--preset",
        "pico",
        "--n-layer",
        "1",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--device",
        "cpu",
        "--softmax",
        "data",
    ]  # as the nano preset
    first = run_main(*args, "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    prepared = offline_cache / "prepared" / "tinyshakespeare"
    assert f"no --data: preparing tinyshakespeare (shipped with gptspeed) into {prepared} once" in first.stdout
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert (manifest["splits"]["train"]["tokens"], manifest["splits"]["val"]["tokens"]) == (304_223, 33_803)
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["train"]["data"] == str(prepared)  # so --resume finds it again

    second = run_main(*args, "--out", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert f"no --data: training on tinyshakespeare (shipped with gptspeed), prepared in {prepared}" in second.stdout
    resumed = run_main("train", "--out", str(tmp_path / "a"), "--resume", "--max-steps", "3")
    assert resumed.returncode == 0 and "resumed from step 2" in resumed.stdout, resumed.stderr

    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_model

    model, _ = load_model(tmp_path / "a", resolve_runtime("cpu", "float32", compile=False))
    assert model.softmax_ids.numel() == 11_707  # the distinct GPT-2 tokens of tiny Shakespeare
    export = run_main("export-hf", "--run", str(tmp_path / "a"), "--out", str(tmp_path / "hf"))
    assert export.returncode == 0, export.stderr  # refused until issue 54: its ids travel in config.json
    assert len(json.loads((tmp_path / "hf" / "config.json").read_text())["softmax_ids"]) == 11_707


def test_prepare_tinyshakespeare_needs_no_network_nor_mirror(tmp_path, offline_cache):
    proc = run_main("prepare", "tinyshakespeare", "--out", str(tmp_path / "ts"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert (offline_cache / "tinyshakespeare" / "input.txt").is_file()  # the embedded copy, written to the cache
