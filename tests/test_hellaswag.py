"""HellaSwag scoring (gptspeed.eval.hellaswag) on examples in the official jsonl format, whose
answers come from the model's own likelihoods computed independently, one ending at a time, with
transformers' GPT-2 holding the same weights. No network."""

import hashlib
import io
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from gptspeed.errors import GptspeedError
from gptspeed.eval import hellaswag as hs
from gptspeed.tokenizer import encode

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from conftest import child_env  # noqa: E402

CONTEXTS = [
    ("Roof shingle removal", "A man is sitting on a roof.", "he"),
    ("Clean and jerk", "A lady walks to a barbell. She bends down and grabs the pole.", "the lady"),
    ("Baking cookies", "A woman puts a tray into the oven.", "She"),
    ("Playing guitar", "A boy sits on a bed holding a guitar.", "he"),
    ("Washing a car", "A man sprays the car with a hose.", "then he"),
    ("Walking the dog", "A girl leads a dog down the street on a leash.", "the dog"),
]
ENDINGS = [
    [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof.",
    ],
    [
        "swings and lands in her arms.",
        "pulls the barbell over her shoulders.",
        "pulls up the barbell.",
        "stands and lifts the weight over her head.",
    ],
    ["closes the door and sets a timer.", "eats the tray.", "sings to the cat in a loud voice all day long.", "waits."],
    ["plays a few chords.", "throws the guitar out of the window and runs away.", "sleeps.", "tunes the strings."],
    ["scrubs the wheels with a brush.", "dries it.", "drives away.", "washes the windows and the roof carefully."],
    ["sniffs a tree.", "barks.", "runs after a ball thrown by a kid in the park.", "sits."],
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise OSError("the network must not be used in tests")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GPTSPEED_DATA_MIRROR", raising=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our GPT with the same weights, its folder). A wide init makes the
    likelihoods of the endings differ clearly."""
    from gptspeed.hf import load_hf_model

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, initializer_range=0.3)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("hs") / "model"
    ref.save_pretrained(folder)
    ours, _ = load_hf_model(str(folder))
    return ref, ours, folder


def reference_losses(ref, ctx: str, endings: list[str]) -> tuple[list[float], list[float]]:
    """Total and mean loss of each ending, one unpadded sequence at a time (build-nanogpt's method)."""
    total, mean = [], []
    for end in endings:
        c, e = encode(ctx), encode(" " + end)
        x = torch.tensor([c + e])
        with torch.no_grad():
            logits = ref(x).logits[0]
        loss = F.cross_entropy(logits[len(c) - 1 : -1], x[0, len(c) :], reduction="none")
        total.append(loss.sum().item())
        mean.append(loss.mean().item())
    return total, mean


def write_jsonl(path: Path, labels: list[int]) -> Path:
    with open(path, "w") as f:
        for i, ((activity, a, b), endings, label) in enumerate(zip(CONTEXTS, ENDINGS, labels)):
            f.write(
                json.dumps(
                    {
                        "ind": i,
                        "activity_label": activity,
                        "ctx_a": a,
                        "ctx_b": b,
                        "ctx": f"{a} {b}",
                        "split": "val",
                        "split_type": "indomain",
                        "label": label,
                        "endings": endings,
                        "source_id": f"test~{i}",
                    }
                )
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def expected(models):
    """Per example: argmin of total loss, argmin of mean loss, and the margins of those choices."""
    ref = models[0]
    out = []
    for (_, a, b), endings in zip(CONTEXTS, ENDINGS):
        total, mean = reference_losses(ref, f"{a} {b}", endings)
        out.append(
            (int(np.argmin(total)), int(np.argmin(mean)), sorted(total)[1] - min(total), sorted(mean)[1] - min(mean))
        )
    assert all(m_tot > 1e-3 and m_mean > 1e-4 for *_, m_tot, m_mean in out), "ambiguous test example"
    return out


def test_accuracy_matches_the_models_own_likelihoods(models, expected, tmp_path):
    _, ours, _ = models
    # labels: the mean-loss choice for the first 4 examples, something else for the last 2
    labels = [e[1] if i < 4 else (e[1] + 1) % 4 for i, e in enumerate(expected)]
    items = hs.load_hellaswag(write_jsonl(tmp_path / "val.jsonl", labels))
    r = hs.evaluate_hellaswag(ours, items, device="cpu", batch_examples=4)  # 2 batches, padded rows
    assert r["examples"] == 6
    assert r["correct_norm"] == 4 and r["acc_norm"] == pytest.approx(4 / 6)
    assert r["correct"] == sum(e[0] == label for e, label in zip(expected, labels))
    total, count = hs.score_items(ours, items, "cpu")
    ref_total = [reference_losses(models[0], f"{a} {b}", e)[0] for (_, a, b), e in zip(CONTEXTS, ENDINGS)]
    assert torch.allclose(total, torch.tensor(ref_total), atol=1e-3)
    assert count.tolist() == [[len(encode(" " + e)) for e in endings] for endings in ENDINGS]


def test_spread_over_ranks_adds_up(models, expected, tmp_path):
    _, ours, _ = models
    items = hs.load_hellaswag(write_jsonl(tmp_path / "val.jsonl", [e[1] for e in expected]))
    parts = [hs.evaluate_hellaswag(ours, items, device="cpu", rank=r, world_size=2) for r in (0, 1)]
    assert [p["examples"] for p in parts] == [3, 3]
    assert sum(p["correct_norm"] for p in parts) == 6


def test_rows_longer_than_block_size_lose_tokens_from_the_left(models):
    from gptspeed.model import GPT, GPTConfig

    torch.manual_seed(0)
    short = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=16)).eval()
    item = hs.render({"ctx": "word " * 30, "endings": ["a b c.", "d.", "e f.", "g h i j."], "label": 0})
    total, count = hs.score_items(short, [item], "cpu")
    assert count.tolist() == [[len(e) for e in item.endings]] and torch.isfinite(total).all()


def test_official_file_from_mirror_cache_or_download_is_hash_checked(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "x.jsonl", [0] * 6)
    data = path.read_bytes()
    mirror = tmp_path / "mirror" / "hellaswag"
    mirror.mkdir(parents=True)
    (mirror / "hellaswag_val.jsonl").write_bytes(data)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(GptspeedError, match="sha256"):  # not the official file
        hs.hellaswag_file()
    monkeypatch.setattr(hs, "HELLASWAG_VAL_SHA256", hashlib.sha256(data).hexdigest())
    assert hs.hellaswag_file() == mirror / "hellaswag_val.jsonl"
    assert len(hs.load_hellaswag(max_examples=2)) == 2

    monkeypatch.delenv("GPTSPEED_DATA_MIRROR")
    with pytest.raises(GptspeedError, match="GPTSPEED_DATA_MIRROR"):  # offline, nothing cached
        hs.hellaswag_file(progress=False)

    class Response(io.BytesIO):
        headers = {"Content-Length": str(len(data))}

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: Response(data))
    got = hs.hellaswag_file(progress=False)
    assert got == tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl" and got.read_bytes() == data


def test_bad_file_is_a_one_line_error(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    with pytest.raises(GptspeedError, match=r"bad.jsonl:1 is not a HellaSwag example"):
        hs.load_hellaswag(tmp_path / "bad.jsonl")


def test_eval_cli_prints_json(models, expected, tmp_path):
    _, _, folder = models
    path = write_jsonl(tmp_path / "val.jsonl", [e[1] for e in expected])
    env = child_env(OMP_NUM_THREADS="1", GPTSPEED_CACHE=str(tmp_path / "c"))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptspeed",
            "eval",
            "--init-from",
            str(folder),
            "--hellaswag-file",
            str(path),
            "--max-examples",
            "5",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["hellaswag"]["examples"] == 5 and out["hellaswag"]["acc_norm"] == 1.0


def test_hellaswag_every_during_training(models, expected, tmp_path, monkeypatch):
    from gptspeed.data.shards import write_shard
    from gptspeed.trainer import build_train_config, fit

    path = write_jsonl(tmp_path / "val.jsonl", [e[1] for e in expected])
    monkeypatch.setattr(hs, "hellaswag_file", lambda progress=True: path)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, 50257, 10_000, dtype=np.uint16))
    write_shard(data / "val_000000.bin", rng.integers(0, 50257, 2_000, dtype=np.uint16))
    cfg = build_train_config(
        "pico",
        dict(
            data=str(data),
            out=str(tmp_path / "run"),
            max_steps=2,
            batch_size=2,
            eval_tokens=128,
            n_embd=32,
            block_size=32,
            hellaswag_every=1,
            hellaswag_examples=4,
            log_every=5,
            device="cpu",
            dtype="float32",
        ),
    )
    fit(cfg, echo=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    with_hs = [r for r in records if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in with_hs] == [1, 2] and all(r["hellaswag_examples"] == 4 for r in with_hs)
