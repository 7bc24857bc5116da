"""``gptspeed.eval.hellaswag``: hellaSwag (Zellers et al. 2019, "HellaSwag: Can a Machine Really Finish Your Sentence?"), scored by completion likelihood as build-nanogpt's ``hellaswag.py`` and llm.c do."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import gptspeed.data.corpora as corpora
from gptspeed.errors import GptspeedError
from gptspeed.eval import hellaswag as hs
from gptspeed.eval.hellaswag import HellaSwagItem, evaluate_hellaswag, score_items
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import Runtime
from gptspeed.tokenizer import encode

from support.cli import child_env
from support.host_reads import Batches, _step

pytestmark = pytest.mark.usefixtures("one_thread", "no_network")


@pytest.fixture(autouse=True)
def _no_mirror(monkeypatch):
    """No corpus mirror either: HellaSwag's file comes from the test or is an error."""
    monkeypatch.delenv("GPTSPEED_DATA_MIRROR", raising=False)


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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our GPT with the same weights, its folder). A wide init makes the
    likelihoods of the endings differ clearly."""
    from gptspeed.hf.load import load_hf_model

    torch.manual_seed(0)
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
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


S = 24  # block size


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=S)).eval()


def random_items(n: int, seed: int, label=None) -> list[HellaSwagItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ctx = tuple(torch.randint(0, 50000, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist())
        endings = tuple(
            tuple(torch.randint(0, 50000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
            for _ in range(4)
        )
        items.append(HellaSwagItem(ctx=ctx, endings=endings, label=0 if label is None else label))
    return items


def ending_losses(model, item: HellaSwagItem, autocast=None) -> list[tuple[float, int]]:
    """(summed cross-entropy, tokens) of each ending: the model run on ctx + ending alone, every
    ending token predicted from all before it (ctx cropped from the left to the block size)."""
    out = []
    for end in item.endings:
        toks = list(item.ctx) + list(end)
        drop = max(0, len(toks) - S)
        toks = toks[drop:]
        start = max(len(item.ctx) - drop, 1)
        with torch.no_grad(), autocast if autocast is not None else torch.autocast("cpu", enabled=False):
            logits = model(torch.tensor([toks]))[0][0].float()
        ce = F.cross_entropy(logits[start - 1 : len(toks) - 1], torch.tensor(toks[start:]), reduction="sum")
        out.append((float(ce), len(toks) - start))
    return out


def labelled(model, items, norm: bool) -> list[HellaSwagItem]:
    """``items`` with the label the model's own losses make right (lowest total, or lowest mean)."""
    out = []
    for it in items:
        losses = ending_losses(model, it)
        key = [t / n if norm else t for t, n in losses]
        out.append(HellaSwagItem(it.ctx, it.endings, key.index(min(key))))
    return out


class FakeDist:
    """torch.distributed for one rank of ``world`` whose peers' counts are ``others``."""

    def __init__(self, rank, world, others):
        self.rank, self.world, self.others, self.reduced = rank, world, others, []

    def install(self, monkeypatch):
        import torch.distributed as dist

        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda: self.rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: self.world)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_reduce(self, t, op=None):
        self.reduced.append(t.clone())
        t += self.others


# ------------------------------------------------------------------------------ the file
def write_jsonl_lines(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


EX = {"ctx": "A man sits.", "endings": ["a", "b", "c", "d"], "label": 2}


@pytest.fixture
def official(tmp_path, monkeypatch):
    """A small file made the official one (its sha256 patched in), a mirror and a cache folder."""
    path = write_jsonl_lines(tmp_path / "file.jsonl", [EX, EX])
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(hs, "HELLASWAG_VAL_SHA256", sha)
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "cache"))
    downloads = []
    monkeypatch.setattr(corpora, "_download", lambda *a: downloads.append(a))
    return path, sha, downloads


def sys_utf8_mode() -> bool:
    import sys

    return bool(sys.flags.utf8_mode)


@pytest.mark.usefixtures("eager_compile")
def test_hellaswag_in_blocks_mode_does_not_recompile():
    """HellaSwag's rows have their own lengths; in --compile-mode blocks they used to recompile
    every block. Now it runs eagerly."""
    from torch._dynamo.utils import counters

    from gptspeed.eval.hellaswag import HellaSwagItem, evaluate_hellaswag

    counters.clear()
    t = _step("compile-blocks")
    batches = Batches("cpu")
    t(batches.next_batch)
    graphs = counters["stats"]["unique_graphs"]
    items = [
        HellaSwagItem(ctx=tuple(range(1, 4 + k)), endings=tuple((5,) * (1 + e) for e in range(4)), label=k % 4)
        for k in range(6)
    ]
    result = evaluate_hellaswag(t.model, items, device="cpu", batch_examples=2)
    assert result["examples"] == 6
    t(batches.next_batch)
    assert counters["stats"]["unique_graphs"] == graphs


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

    # the download, through pooch: its HTTP fetch faked (offline for the first 4 attempts, then the file)
    import pooch  # here, not at the top: the GPU machine's bare image collects this file
    import requests

    fetched = []

    def fetch(downloader, url, output_file, pooch_, check_only=False):
        fetched.append(url)
        if len(fetched) <= 4:
            raise requests.exceptions.ConnectionError("offline")
        Path(output_file).write_bytes(data)

    monkeypatch.setattr(pooch.HTTPDownloader, "__call__", fetch)
    monkeypatch.setattr(pooch.core, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    monkeypatch.delenv("GPTSPEED_DATA_MIRROR")
    with pytest.raises(GptspeedError) as e:  # offline, nothing cached: each of the 4 attempts failed
        hs.hellaswag_file(progress=False)
    assert str(e.value) == (
        f"could not download hellaswag_val.jsonl after 4 attempts per URL ({hs.HELLASWAG_VAL_URL}: offline): "
        "get the files yourself and set GPTSPEED_DATA_MIRROR to a folder holding hellaswag/hellaswag_val.jsonl"
    )
    got = hs.hellaswag_file(progress=False)
    assert got == tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl" and got.read_bytes() == data
    assert fetched == [hs.HELLASWAG_VAL_URL] * 5
    assert hs.hellaswag_file(progress=False) == got and len(fetched) == 5  # cached, hash right: not fetched again


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


# ------------------------------------------------------------------------------ scoring
def test_score_items_is_each_ending_scored_alone(model):
    items = random_items(5, 1) + [HellaSwagItem(ctx=(7,), endings=((1, 2), (3,), (4, 5, 6), (8,)), label=0)]
    total, count = score_items(model, items, "cpu")
    for i, it in enumerate(items):
        for j, (t, n) in enumerate(ending_losses(model, it)):
            assert int(count[i, j]) == n
            assert float(total[i, j]) == pytest.approx(t, rel=1e-4, abs=1e-4)
    assert count[-1].tolist() == [2, 1, 3, 1]  # a one-token context: every ending token is scored


def test_score_items_under_autocast_scores_in_the_autocast_dtype(model):
    items = random_items(3, 2)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    total, _ = score_items(model, items, "cpu", bf16)
    total32, _ = score_items(model, items, "cpu")
    ref = torch.tensor(
        [[t for t, _ in ending_losses(model, it, torch.autocast("cpu", dtype=torch.bfloat16))] for it in items]
    )
    assert torch.allclose(total, ref, rtol=1e-3, atol=1e-3) and not torch.equal(total, total32)


def test_score_items_makes_every_tensor_on_the_device_asked_for(model, monkeypatch):
    """On a GPU the rows, the ending ids and the sums must be on the GPU with the model (a CPU
    tensor mixed in raises there): here the model is on meta (a device other than the CPU, shapes
    only) and so must be what score_items returns. meta has no bincount kernel: a stand-in gives
    the counts' shape and device."""
    import copy

    on_meta = copy.deepcopy(model).to("meta")
    real = torch.bincount
    monkeypatch.setattr(
        torch,
        "bincount",
        lambda t, minlength=0: (
            real(t, minlength=minlength) if not t.is_meta else torch.zeros(minlength, dtype=torch.long, device=t.device)
        ),
    )
    total, count = score_items(on_meta, random_items(3, 2), "meta")
    assert total.device.type == count.device.type == "meta", "score_items left its sums off the device asked for"
    assert total.shape == count.shape == (3, 4)


def test_evaluate_makes_its_counters_and_labels_on_the_device_asked_for(model):
    """With the default device set elsewhere (meta: no data) the counts are the same: the rows
    score_items stages on the host and the counters and labels evaluate_hellaswag makes are put on
    ``device``, not on the default device (on a GPU, CPU labels could not be compared with the
    GPU's losses; rows staged through a CUDA default device would cost a copy each)."""
    items = labelled(model, random_items(5, 7), False)
    want = evaluate_hellaswag(model, items, device="cpu", batch_examples=2)
    with torch.device("meta"):
        got = evaluate_hellaswag(model, items, device="cpu", batch_examples=2)
    keys = ("examples", "correct", "correct_norm", "nan_examples")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (
        "evaluate_hellaswag's counts depend on the default device"
    )
    assert (want["examples"], want["correct"], want["nan_examples"]) == (5, 5, 0)  # labels: the model's own best


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_accuracies_count_the_models_own_best_endings(model, batch):
    """Labels set to the model's own lowest total loss: every example right by ``acc``; set to
    the lowest mean: right by ``acc_norm``; at any batch size, counted over all batches."""
    items = random_items(7, 3)
    by_total, by_mean = labelled(model, items, False), labelled(model, items, True)
    r = evaluate_hellaswag(model, by_total, device="cpu", batch_examples=batch)
    assert (r["examples"], r["correct"], r["acc"], r["nan_examples"]) == (7, 7, 1.0, 0)
    assert type(r["examples"]) is int and type(r["correct"]) is int
    r = evaluate_hellaswag(model, by_mean, device="cpu", batch_examples=batch)
    assert (r["correct_norm"], r["acc_norm"]) == (7, 1.0)
    differ = sum(a.label != b.label for a, b in zip(by_total, by_mean))
    assert r["correct"] == 7 - differ and r["acc"] == pytest.approx((7 - differ) / 7)


def test_the_mean_divides_by_the_scored_tokens_one_token_endings_included(model):
    """Endings of 1 token next to longer ones: the mean of a 1-token ending is its loss itself."""
    items = [
        HellaSwagItem(ctx=c, endings=((11,), (12, 13, 14), (15,), (16, 17)), label=0)
        for c in ((1, 2, 3), (4, 5), (6,), (9, 8, 7, 6))
    ]
    by_mean = labelled(model, items, True)
    assert evaluate_hellaswag(model, by_mean, device="cpu", batch_examples=2)["correct_norm"] == 4


def test_one_example_accuracy_is_its_own_count(model):
    item = labelled(model, random_items(1, 4), False)
    r = evaluate_hellaswag(model, item, device="cpu")
    assert r["acc"] == 1.0 and r["examples"] == 1
    assert evaluate_hellaswag(model, [], device="cpu")["acc"] == 0.0


def test_batches_go_longest_first_and_batch_size_one_is_allowed(model, monkeypatch):
    items = random_items(6, 5)
    seen = []
    real = hs.score_items
    monkeypatch.setattr(
        hs,
        "score_items",
        lambda m, batch, *a: (
            seen.append([max(len(it.ctx) + len(e) for e in it.endings) for it in batch]) or real(m, batch, *a)
        ),
    )
    evaluate_hellaswag(model, items, device="cpu", batch_examples=1)
    lengths = [s[0] for s in seen]
    assert len(seen) == 6 and lengths == sorted(lengths, reverse=True)
    with pytest.raises(GptspeedError, match="^HellaSwag batch must be at least 1 example, got 0$"):
        evaluate_hellaswag(model, items, device="cpu", batch_examples=0)


def test_a_diverged_model_counts_its_nan_examples_over_every_batch(model):
    import copy

    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.transformer.ln_f.weight.fill_(float("nan"))
    r = evaluate_hellaswag(bad, random_items(5, 6), device="cpu", batch_examples=2)
    assert r["nan_examples"] == 5


def test_the_mode_is_restored_and_the_timing_is_the_calls(model, monkeypatch):
    import time

    model.train()
    t0 = time.perf_counter()
    r = evaluate_hellaswag(model, random_items(3, 7), device="cpu")
    wall = time.perf_counter() - t0
    assert model.training
    model.eval()
    assert 0 < r["seconds"] <= wall and r["examples_per_s"] == pytest.approx(3 / r["seconds"])
    assert set(r) == {
        "examples",
        "correct",
        "correct_norm",
        "acc",
        "acc_norm",
        "seconds",
        "examples_per_s",
        "nan_examples",
    }
    monkeypatch.setattr(hs.time, "perf_counter", lambda: 5.0)  # a clock that did not move: no rate
    r = evaluate_hellaswag(model, random_items(2, 7), device="cpu")
    assert r["seconds"] == 0 and r["examples_per_s"] is None


def test_ranks_take_every_world_size_th_example_and_sum_their_counts(model, monkeypatch):
    items = labelled(model, random_items(7, 8), False)
    alone = [evaluate_hellaswag(model, items[r::2], device="cpu") for r in (0, 1)]
    fake = FakeDist(
        rank=1, world=2, others=torch.tensor([alone[0]["examples"], alone[0]["correct"], alone[0]["correct_norm"], 0])
    )
    fake.install(monkeypatch)
    r = evaluate_hellaswag(model, items, device="cpu")  # rank and world size from torch.distributed
    assert len(fake.reduced) == 1 and fake.reduced[0].tolist() == [3, 3, alone[1]["correct_norm"], 0]
    assert (r["examples"], r["correct"]) == (7, 7)
    fake.reduced.clear()
    r = evaluate_hellaswag(model, items, device="cpu", rank=0, world_size=1)  # given: no peers to add
    assert fake.reduced == [] and r["examples"] == 7


def test_no_all_reduce_without_torch_distributed(model, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("all_reduce in one process"))
    assert evaluate_hellaswag(model, random_items(3, 9), device="cpu", rank=0, world_size=3)["examples"] == 1


def test_the_training_hook_scores_under_the_runs_autocast(model, monkeypatch):
    from gptspeed.config import preset

    seen = []
    monkeypatch.setattr(hs, "load_hellaswag", lambda max_examples, tokenizer=None: random_items(2, 10))
    monkeypatch.setattr(
        hs,
        "evaluate_hellaswag",
        lambda m, items, **kw: seen.append(kw) or {"acc_norm": 0.5, "acc": 0.25, "examples": 2},
    )
    cfg = preset("pico").override(dict(hellaswag_every=5, hellaswag_examples=2))
    rt = Runtime(device=torch.device("cpu"), dtype="bfloat16", autocast_dtype=torch.bfloat16, compile=False)
    out = hs.hellaswag_hook(cfg, rt)(model)
    assert out == {"hellaswag_acc_norm": 0.5, "hellaswag_acc": 0.25, "hellaswag_examples": 2}
    (kw,) = seen
    assert kw["device"] == rt.device and isinstance(kw["autocast"], torch.autocast)
    assert kw["autocast"].fast_dtype == torch.bfloat16


def test_read_examples_skips_blank_lines_and_stops_at_max_examples(tmp_path):
    path = write_jsonl_lines(tmp_path / "h.jsonl", [EX, "", "   ", dict(EX, label="1"), EX])
    assert [e["label"] for e in hs.read_examples(path)] == [2, "1", 2]
    assert len(hs.read_examples(path, max_examples=2)) == 2


@pytest.mark.parametrize(
    "bad",
    [dict(EX, label=4), dict(EX, label=-1), dict(EX, endings=["a"] * 3), "{not json", dict(EX, ctx=3), {"ctx": "x"}],
)
def test_read_examples_names_the_line_that_is_not_an_example(tmp_path, bad):
    path = write_jsonl_lines(tmp_path / "h.jsonl", [EX, bad])
    with pytest.raises(GptspeedError, match=rf"^{path}:2 is not a HellaSwag example \(ctx, 4 endings, label 0-3\)$"):
        hs.read_examples(path)


def test_read_examples_of_a_file_it_cannot_read_or_that_holds_nothing(tmp_path):
    with pytest.raises(GptspeedError, match=rf"^cannot read HellaSwag file {tmp_path}: Is a directory$"):
        hs.read_examples(tmp_path)
    (tmp_path / "latin.jsonl").write_bytes(b'{"ctx": "caf\xe9"}\n')
    with pytest.raises(GptspeedError, match=rf"^cannot read HellaSwag file {tmp_path / 'latin.jsonl'}: 'utf-8' codec"):
        hs.read_examples(tmp_path / "latin.jsonl")
    with pytest.raises(GptspeedError, match=rf"^{tmp_path / 'empty.jsonl'} holds no HellaSwag examples$"):
        hs.read_examples(write_jsonl_lines(tmp_path / "empty.jsonl", [""]))


def test_the_mirrors_file_is_used_when_its_hash_is_right(official, tmp_path):
    path, sha, downloads = official
    (tmp_path / "mirror" / "hellaswag").mkdir(parents=True)
    good = tmp_path / "mirror" / "hellaswag" / "hellaswag_val.jsonl"
    good.write_bytes(path.read_bytes())
    assert hs.hellaswag_file() == good and downloads == []
    good.write_text("tampered\n")
    actual = hashlib.sha256(b"tampered\n").hexdigest()
    with pytest.raises(GptspeedError) as e:
        hs.hellaswag_file()
    assert str(e.value) == (
        f"{good} has sha256 {actual}, expected {sha}: replace it with the official file or unset GPTSPEED_DATA_MIRROR"
    )


def test_the_cache_is_used_when_its_hash_is_right_else_downloaded_again(official, tmp_path):
    path, sha, downloads = official
    cached = tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl"
    assert hs.hellaswag_file() == cached
    assert downloads == [((hs.HELLASWAG_VAL_URL,), cached, sha, "hellaswag/hellaswag_val.jsonl", True)]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(path.read_bytes())
    downloads.clear()
    assert hs.hellaswag_file(progress=False) == cached and downloads == []
    cached.write_text("stale\n")
    hs.hellaswag_file(progress=False)
    assert downloads == [((hs.HELLASWAG_VAL_URL,), cached, sha, "hellaswag/hellaswag_val.jsonl", False)]


def test_load_hellaswag_reads_the_official_file_with_progress_by_default(official, monkeypatch):
    path, _, _ = official
    asked = []
    monkeypatch.setattr(hs, "hellaswag_file", lambda progress: asked.append(progress) or path)
    items = hs.load_hellaswag()
    assert asked == [True] and len(items) == 2 and items[0].label == 2
    assert len(hs.load_hellaswag(max_examples=1, progress=False)) == 1 and asked == [True, False]


def test_the_autocast_given_is_the_one_every_batch_is_scored_under(model, monkeypatch):
    seen = []
    real = hs.score_items
    monkeypatch.setattr(
        hs,
        "score_items",
        lambda m, batch, device, autocast: seen.append((device, autocast)) or real(m, batch, device, autocast),
    )
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    evaluate_hellaswag(model, random_items(3, 11), device="cpu", autocast=bf16, batch_examples=2)
    assert seen == [("cpu", bf16), ("cpu", bf16)]


def test_one_example_right_by_its_mean_is_all_right(model):
    item = labelled(model, random_items(1, 12), True)
    assert evaluate_hellaswag(model, item, device="cpu")["acc_norm"] == 1.0


# ------------------------------------------------------------------------------ round 2
def test_an_ending_with_nothing_before_it_is_scored_with_zero_tokens_even_in_the_last_row(model):
    """An empty context and a one-token ending: that token has nothing to be predicted from, so
    its ending counts 0 tokens and 0 loss -- also when it is the batch's very last row (the
    counts are still (N, 4), not cut short)."""
    items = [
        HellaSwagItem(ctx=(5, 6), endings=((1, 2), (3,), (4, 5), (8,)), label=0),
        HellaSwagItem(ctx=(), endings=((11, 12, 13), (14, 15), (16, 17), (18,)), label=0),
    ]
    total, count = score_items(model, items, "cpu")
    assert total.shape == count.shape == (2, 4)
    assert count.tolist() == [[2, 1, 2, 1], [2, 1, 1, 0]]
    assert float(total[1, 3]) == 0.0
    scored = [(0, j) for j in range(4)] + [(1, j) for j in range(3)]  # each ending alone, as it is scored
    for i, j in scored:
        t, n = ending_losses(model, HellaSwagItem(items[i].ctx, (items[i].endings[j],) * 4, 0))[0]
        assert int(count[i, j]) == n and float(total[i, j]) == pytest.approx(t, rel=1e-4, abs=1e-4)


def test_the_default_batch_is_16_examples(model, monkeypatch):
    """evaluate_hellaswag's documented default: 16 examples (64 rows) per forward, which bounds the
    memory the in-training evaluation takes."""
    sizes = []
    real = hs.score_items
    monkeypatch.setattr(hs, "score_items", lambda m, batch, *a: sizes.append(len(batch)) or real(m, batch, *a))
    r = evaluate_hellaswag(model, random_items(17, 6), device="cpu")
    assert sizes == [16, 1] and r["examples"] == 17


def test_read_examples_reads_utf8_whatever_the_locale(tmp_path):
    """The HellaSwag file is UTF-8: it reads the same under an ASCII (C) locale, where open()'s
    default encoding would refuse its non-ASCII text."""
    import locale

    ex = dict(EX, ctx="Un café près de la mer —", endings=["é", "ü", "ß", "€"])
    path = tmp_path / "h.jsonl"
    path.write_bytes((json.dumps(ex, ensure_ascii=False) + "\n").encode("utf-8"))
    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        if sys_utf8_mode() or locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            pytest.skip("this interpreter reads files as UTF-8 by default (UTF-8 mode)")
        got = hs.read_examples(path)
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert got == [ex]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_score_items_on_cuda_matches_the_cpu_with_either_default_device(model):
    """On a GPU: the rows staged on the host and copied once, the sums on the GPU, equal to the
    CPU's (fp32, within the GPU's matmul rounding), with the default device the CPU or the GPU."""
    import copy

    items = random_items(6, 11)
    want, want_n = score_items(model, items, "cpu")
    on_gpu = copy.deepcopy(model).to("cuda")
    for default in ("cpu", "cuda"):
        with torch.device(default):
            total, count = score_items(on_gpu, items, "cuda")
        assert total.device.type == count.device.type == "cuda", default
        assert torch.equal(count.cpu(), want_n), default
        torch.testing.assert_close(total.cpu(), want, rtol=1e-3, atol=1e-3)


def test_examples_are_tokenized_with_the_runs_tokenizer_when_given(tmp_path):
    """A run of its own tokenizer (``tokenizer``: its ``encode``) scores HellaSwag in that tokenizer's ids: the
    context and each ending (with its leading space) as it encodes them, from a file or one example; without
    one, GPT-2's."""
    tok = types.SimpleNamespace(encode=lambda text: [len(text), ord(text[0])])
    want = HellaSwagItem(ctx=(11, ord("A")), endings=tuple((2, ord(" ")) for _ in "abcd"), label=2)
    assert hs.render(EX, tok) == want
    assert hs.load_hellaswag(write_jsonl_lines(tmp_path / "val.jsonl", [EX, EX]), tokenizer=tok) == [want, want]
    assert hs.render(EX).ctx == tuple(encode("A man sits."))


def test_the_training_hook_loads_the_examples_with_the_runs_tokenizer(monkeypatch):
    """``hellaswag_hook`` (``--hellaswag-every``) tokenizes its examples once, with the run's tokenizer it is
    given (None: GPT-2's), and as many as ``--hellaswag-examples``."""
    asked = []
    monkeypatch.setattr(hs, "load_hellaswag", lambda **kw: asked.append(kw) or [])
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(hellaswag_every=5, hellaswag_examples=3))
    tok = types.SimpleNamespace(encode=lambda text: [1])
    assert hs.hellaswag_hook(cfg, Runtime(torch.device("cpu"), "float32", None, False), tok) is not None
    assert asked == [{"max_examples": 3, "tokenizer": tok}]
