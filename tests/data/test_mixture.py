"""``gptspeed.data.mixture``: weighted mixtures of prepared folders -- batches in proportion, deterministic,
resumed exactly, ranks disjoint, each source's val loss reported, bad input one line."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from gptspeed.data.mixture import blend, is_mixture, parse_mixture
from gptspeed.data.shards import write_shard
from gptspeed.data.train_data import MixtureData, find_mixture
from gptspeed.errors import GptspeedError
from gptspeed.tokenizer import EOT_TOKEN

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("one_thread")

T = 8
#: each source's tokens lie in its own thousand (source d: 1000 * (d + 1) ...), so a row names its source
SIZES = {"web": 3000, "code": 1100, "books": 700}


def _folder(root, name: str, d: int, n: int, *, val: bool = True):
    """A folder of shards without a manifest (GPT-2's tokenizer, as llm.c's folders): ``n`` train tokens
    and 200 val tokens of source ``d``, a document start every 50 tokens."""
    folder = root / name
    folder.mkdir()
    for split, count in (("train", n), ("val", 200 if val else 0)):
        if count:
            toks = 1000 * (d + 1) + np.arange(count) % 997
            toks[::50] = EOT_TOKEN
            write_shard(folder / f"{split}_000000.bin", toks)
    return folder


@pytest.fixture
def folders(tmp_path):
    return {name: _folder(tmp_path, name, d, n) for d, (name, n) in enumerate(SIZES.items())}


def _mixture(folders, weights=(0.5, 0.3, 0.2)) -> MixtureData:
    return find_mixture(",".join(f"{folders[n]}={w}" for n, w in zip(SIZES, weights)))


def _source(x: torch.Tensor) -> np.ndarray:
    """The source of each row of ``x`` ``(B, T)``: the thousand its tokens (other than <|endoftext|>) lie in."""
    toks = x.numpy()
    return np.array([int(row[row != EOT_TOKEN].max()) // 1000 - 1 for row in toks])


def _batches(loader, n: int) -> list[torch.Tensor]:
    return [torch.cat(loader.next_batch(), dim=1) for _ in range(n)]


# ------------------------------------------------------------------------------------------ proportions
@pytest.mark.parametrize("seed", range(5))
def test_the_blend_keeps_every_prefix_within_two_rows_of_each_sources_share(seed):
    rng = random.Random(seed)
    K = rng.randint(2, 8)
    raw = [rng.random() ** 3 for _ in range(K)]
    weights = [w / sum(raw) for w in raw]
    sources, rows, after = blend(weights, [0] * K, 3000)
    counts = np.zeros(K)
    for n, d in enumerate(sources, 1):
        assert rows[n - 1] == counts[d]  # each source's rows in order, none skipped
        counts[d] += 1
        assert np.abs(counts - np.array(weights) * n).max() < 2
    assert after == counts.astype(int).tolist()


def test_batches_hold_each_source_in_proportion_in_every_micro_batch(folders):
    weights = np.array([0.5, 0.3, 0.2])
    loader = _mixture(folders).loader(4, T)
    seen = np.zeros(3)
    for n in range(1, 301):
        per_batch = np.bincount(_source(loader.next_batch()[0]), minlength=3)
        assert np.abs(per_batch - weights * 4).max() < 4
        seen += per_batch
        assert np.abs(seen - weights * 4 * n).max() < 2  # over many steps: every source passes through epochs
    assert loader.epoch >= 1 and loader.counts == seen.astype(int).tolist()


def test_a_source_of_weight_zero_gives_no_rows():
    sources, _, after = blend([0.6, 0.0, 0.4], [0, 0, 0], 100)
    assert 1 not in sources and after == [60, 0, 40]


def test_documents_are_counted_per_source_and_add_up(folders):
    loader = _mixture(folders).loader(4, T)
    batches = _batches(loader, 50)
    rows = torch.cat([b[:, :T] for b in batches])  # the inputs: a row's T tokens
    by = loader.documents_by_source
    for d, name in enumerate(SIZES):
        assert by[name] == int((rows[torch.from_numpy(_source(rows) == d)] == EOT_TOKEN).sum())
    assert sum(by.values()) == loader.documents > 0


# -------------------------------------------------------------------------------------- determinism, resume
@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_the_same_seed_gives_the_same_batches_and_the_seed_orders_rows_with_random_sampling(folders, sampling):
    def run(seed):
        return _batches(_mixture(folders).loader(4, T, sampling=sampling, seed=seed), 40)

    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, other)) == (sampling == "sequential")


@pytest.mark.parametrize("at", [1, 37, 113])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loader_reads_the_batches_of_an_uninterrupted_one(folders, at, workers):
    uninterrupted = _mixture(folders).loader(4, T, sampling="random", seed=3, workers=workers)
    whole = _batches(uninterrupted, at + 30)
    first = _mixture(folders).loader(4, T, sampling="random", seed=3, workers=workers)
    _batches(first, at)
    state = json.loads(json.dumps(first.state_dict()))  # plain data, as a checkpoint holds it
    first.close()
    resumed = _mixture(folders).loader(4, T, sampling="random", seed=3, workers=workers)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(whole[at:], _batches(resumed, 30)))
    assert resumed.state_dict() == uninterrupted.state_dict()  # rows and documents, per source too


def test_rewind_reads_the_same_batches_again(folders):
    loader = _mixture(folders).loader(4, T, workers=1)
    _batches(loader, 5)
    mark = loader.mark()
    ahead = _batches(loader, 3)
    loader.rewind(mark)
    assert all(torch.equal(a, b) for a, b in zip(ahead, _batches(loader, 3)))


@pytest.mark.parametrize(
    "change, differs",
    [({"weights": (0.2, 0.3, 0.5)}, "weights"), ({"seed": 4}, "seed"), ({"seq_len": 4}, "seq_len")],
)
def test_a_position_of_another_mixture_is_refused_naming_what_differs(folders, change, differs):
    state = _mixture(folders).loader(4, T, sampling="random", seed=3).state_dict()
    data = _mixture(folders, change.get("weights", (0.5, 0.3, 0.2)))
    other = data.loader(4, change.get("seq_len", T), sampling="random", seed=change.get("seed", 3))
    with pytest.raises(GptspeedError, match=f"another mixture .*{differs}"):
        other.load_state_dict(state)


# ------------------------------------------------------------------------------------------------- ranks
@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_ranks_read_disjoint_rows_that_make_up_the_one_process_batch(folders, sampling):
    one = _mixture(folders).loader(4, T, sampling=sampling)
    ranks = [_mixture(folders).loader(2, T, rank=r, world_size=2, sampling=sampling) for r in (0, 1)]
    for _ in range(60):
        pair = [r.next_batch()[0] for r in ranks]
        assert torch.equal(torch.cat(pair), one.next_batch()[0])
    assert ranks[0].documents == ranks[1].documents == one.documents  # each counts the job's documents


def test_a_position_saved_by_two_ranks_resumes_in_one_process(folders):
    """The rows are numbered for the whole job: a resume with another world size reads on from there."""
    ranks = [_mixture(folders).loader(2, T, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(7):
        [r.next_batch() for r in ranks]
    whole = _mixture(folders).loader(4, T)
    _batches(whole, 7)
    one = _mixture(folders).loader(4, T)
    one.load_state_dict(ranks[0].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_batches(whole, 10), _batches(one, 10)))


# ------------------------------------------------------------------------------------------------ parsing
def test_a_mixture_file_names_its_sources_and_reads_paths_beside_it(folders, tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n  - {path: web, weight: 3}\n  - {path: code, weight: 1, name: python}\n")
    assert [(s.name, s.weight) for s in parse_mixture(str(mix))] == [("web", 3.0), ("python", 1.0)]
    data = find_mixture(str(mix))
    assert [s.name for s in data.sources] == ["web", "python"] and data.has_val
    assert data.identity["mixture"][1]["name"] == "python"


def test_a_folder_stays_one_folder_whatever_its_name_holds(tmp_path):
    odd = tmp_path / "lr=3e-4"
    odd.mkdir()
    assert not is_mixture(str(odd)) and is_mixture(f"{odd}=1") and is_mixture("mix.yml")
    assert not is_mixture("jsonl:a=b.jsonl") and not is_mixture(str(tmp_path))


BAD = [
    ("{web}=seven,{code}=0.3", "is 'seven', not a number"),
    ("{web}=nan,{code}=0.3", "not a number"),
    ("{web},{code}=0.3", "is not PATH=WEIGHT"),
    ("{web}=-0.5,{code}=0.3", "weights must be 0 or more"),
    ("{web}=0,{code}=0", "sum to 0"),
    ("{web}=0.5,{web}/=0.3", "given twice"),
    ("{web}=0.5,{other}=0.5", "different tokenizers"),
    ("{web}=0.5,{noval}=0.5", "mixture source noval: no val shards"),
    ("{web}=0.5,jsonl:x.jsonl=0.5", "is a stream"),
    ("{web}=0.5,{tmp}/nothere=0.5", "not a prepared folder"),
]


@pytest.fixture
def bad_folders(folders, tmp_path):
    """The sources a mixture refuses: another tokenizer's folder (a prepared one, its manifest naming another
    tokenizer) and a folder without a val split."""
    from gptspeed.data.prepare import prepare

    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"Document {i}: to be or not to be."}) + "\n" for i in range(200)))
    prepare(str(text), tmp_path / "tok", progress=False)
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    manifest.update(tokenizer="mytok", tokenizer_kind="hf", tokenizer_sha256="ab" * 32, eot_token=0, n_vocab=4096)
    (tmp_path / "tok" / "manifest.json").write_text(json.dumps(manifest))
    return {**folders, "other": tmp_path / "tok", "noval": _folder(tmp_path, "noval", 1, 500, val=False)}


@pytest.mark.parametrize("spec, says", BAD)
def test_bad_mixtures_are_one_line_before_training(bad_folders, tmp_path, spec, says):
    spec = spec.format(**bad_folders, tmp=tmp_path)
    proc = run_main("train", "--preset", "pico", "--data", spec, "--out", str(tmp_path / "run"), "--device", "cpu")
    assert_user_error(proc, says)
    assert not (tmp_path / "run").exists()


def test_different_tokenizers_are_named_both(bad_folders):
    with pytest.raises(GptspeedError) as e:
        find_mixture(f"{bad_folders['web']}=1,{bad_folders['other']}=1")
    said = "web: GPT-2's BPE (gpt2), <|endoftext|> 50256, 50,257 ids; tok: mytok (sha256 abababababab), <|endoftext|> 0, 4,096 ids"
    assert said in str(e.value)


def test_sources_of_one_tokenizer_prepared_from_two_places_mix(bad_folders, tmp_path):
    """A tokenizer is its sha256, vocabulary and <|endoftext|>: the TOK_DIR prepare was given may differ."""
    moved = tmp_path / "moved"
    shutil.copytree(bad_folders["other"], moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    (moved / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": "/elsewhere/mytok"}))
    mix = find_mixture(f"{bad_folders['other']}=1,{moved}=1")
    try:
        assert mix.tokenizer.identity == "sha256:" + "ab" * 32 and mix.eot == 0
        assert mix.tokenizer_folder is mix.sources[0].data
    finally:
        mix.close()
    (moved / "manifest.json").write_text(json.dumps({**manifest, "eot_token": 1}))
    with pytest.raises(
        GptspeedError, match=r"<\|endoftext\|> 0, 4,096 ids; moved: mytok \(sha256 abababababab\), <\|endoftext\|> 1"
    ):
        find_mixture(f"{bad_folders['other']}=1,{moved}=1")


def test_a_bad_mixture_file_is_one_line(tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n  - {path: web}\n")
    with pytest.raises(GptspeedError, match="source 1 must be a mapping of path and weight"):
        parse_mixture(str(mix))
    mix.write_text("weights: [1]\n")
    with pytest.raises(GptspeedError, match="must hold only 'sources'"):
        parse_mixture(str(mix))
    (tmp_path / "web").mkdir()
    mix.write_text("sources:\n  - {path: web, weight: 1, name: a b}\n")
    with pytest.raises(GptspeedError, match="its name 'a b' is not 1-64 letters"):
        parse_mixture(str(mix))
    with pytest.raises(GptspeedError, match="mixture file .*nothere.yaml does not exist"):
        parse_mixture(str(tmp_path / "nothere.yaml"))


# ------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two small folders prepared by ``gptspeed prepare`` (GPT-2's BPE): tiny Shakespeare's first and second
    30,000 characters, one document per paragraph."""
    import lzma

    from gptspeed.data.corpora import EMBEDDED_DIR
    from gptspeed.data.prepare import prepare

    root = tmp_path_factory.mktemp("mixture")
    text = lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()
    for name, part in (("first", text[:30_000]), ("second", text[30_000:60_000])):
        docs = root / f"{name}.jsonl"
        docs.write_text("".join(json.dumps({"text": p}) + "\n" for p in part.split("\n\n") if p.strip()))
        prepare(str(docs), root / name, progress=False)
    return root


RUN = (
    *("--preset", "pico", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32"),
    *("--batch-size", "4", "--max-steps", "4", "--eval-every", "2", "--eval-tokens", "128", "--eval-bpb"),
    *("--log-every", "1", "--save-every", "2", "--keep-checkpoints", "5", "--device", "cpu", "--threads", "1"),
)


def test_a_mixture_run_logs_each_sources_val_loss_and_documents_and_resumes_exactly(prepared, tmp_path):
    from support.training import records

    data = f"{prepared / 'first'}=0.75,{prepared / 'second'}=0.25"
    proc = run_main("train", *RUN, "--data", data, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    logged = records(tmp_path / "run")
    evaluated = [r for r in logged if r.get("val_loss") is not None]
    assert [r["step"] for r in evaluated] == [0, 2, 4]
    for r in evaluated:
        assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/first"] + 0.25 * r["val_loss/second"])
        assert r["val_loss/first"] != r["val_loss/second"]
    for r in evaluated[1:]:  # --eval-bpb: at the evaluations after the first step
        assert r["val_bpb"] == pytest.approx(0.75 * r["val_bpb/first"] + 0.25 * r["val_bpb/second"])
    last = logged[-1]
    assert last["documents/first"] + last["documents/second"] == last["documents"] > 0
    assert f"val {last['val_loss']:.4f} (first {last['val_loss/first']:.4f}, second " in proc.stdout

    run = tmp_path / "resumed"  # stopped right after its checkpoint of step 2, resumed
    run.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json"):
        (run / name).write_bytes((tmp_path / "run" / name).read_bytes())
    proc = run_main("train", "--out", str(run), "--resume")
    assert proc.returncode == 0 and "resumed from step 2" in proc.stdout, proc.stderr
    again = {r["step"]: r for r in records(run)}
    for r in logged[-2:]:  # steps 3 and 4, to the bit
        assert {k: v for k, v in again[r["step"]].items() if k.startswith(("train_loss", "val_", "documents"))} == {
            k: v for k, v in r.items() if k.startswith(("train_loss", "val_", "documents"))
        }
