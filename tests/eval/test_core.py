"""``gptspeed.eval.core`` and ``core_bundle``: the CORE score (DCLM's in-context tasks, centred against
chance) as nanochat computes it, on a small bundle made here."""

from __future__ import annotations

import hashlib
import json
import math
import random
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

import gptspeed.data.corpora as corpora
from gptspeed.errors import GptspeedError
from gptspeed.eval import core_bundle as cb
from gptspeed.eval.core import (
    centered,
    crop,
    evaluate_core,
    example_rows,
    fewshot,
    load_core,
    render,
    score_rows,
    token_rows,
)

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("one_thread", "no_network")

# Three tasks, one of each type. The stub model below makes its right answers known by design:
# mc 3 of 4 right, schema 2 of 3, lm 2 of 4.
MC = [
    {"query": "2+2=", "choices": ["aa", "cc"], "gold": 0},  # "aa" wins: right
    {"query": "pick", "choices": ["cd", "ab"], "gold": 0},  # "ab" wins: wrong
    {"query": "q3", "choices": ["ba", "bc", "dd"], "gold": 0},  # "ba" wins: right
    {"query": "q4", "choices": ["xx", "ab"], "gold": 1},  # "ab" wins: right
]
SCHEMA = [
    {"context_options": ["the cat", "the dog"], "continuation": "sat", "gold": 0},  # after "t": right
    {"context_options": ["a dog", "a rat"], "continuation": "ran", "gold": 0},  # "a rat" wins: wrong
    {"context_options": ["big hat", "big hog", "big pig"], "continuation": "fell", "gold": 0},  # right
]
LM = [
    {"context": "cat", "continuation": "aaa"},  # " aaa" after "t": every greedy token right
    {"context": "dog", "continuation": "aaa"},  # after "g" the model predicts "a", not " "
    {"context": "bat  ", "continuation": "ab"},  # "b" after "a": the model predicts "a"
    {"context": " hit ", "continuation": "a"},  # right (the context is trimmed)
]
CORE_YAML = """\
icl_tasks:
-
  label: mc_task
  dataset_uri: reasoning/mc.jsonl
  num_fewshot: [1]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "
-
  label: schema_task
  dataset_uri: schema.jsonl
  num_fewshot: [1]
  icl_task_type: schema
-
  label: lm_task
  dataset_uri: lm.jsonl
  num_fewshot: [1]
  icl_task_type: language_modeling
"""
META = "Eval Task,Task Category,Random baseline\nmc_task,reasoning,25\nschema_task,language,50.0\nlm_task,lm,0\n"


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def make_bundle(folder: Path) -> Path:
    """The three-task bundle: core.yaml, eval_meta_data.csv, eval_data/."""
    folder.mkdir(parents=True)
    (folder / "core.yaml").write_text(CORE_YAML)
    (folder / "eval_meta_data.csv").write_text(META)
    write_jsonl(folder / "eval_data" / "reasoning" / "mc.jsonl", MC)
    write_jsonl(folder / "eval_data" / "schema.jsonl", SCHEMA)
    write_jsonl(folder / "eval_data" / "lm.jsonl", LM)
    return folder


def chars(text: str) -> list[int]:
    """A tokenizer of one token per character (its code point), so spans can be counted by hand."""
    return [ord(c) for c in text]


V, BOS = 128, 0


def bigram_logits() -> torch.Tensor:
    """(V, V): the stub's next-token logits after each token: "a" 4, "b" 2, all others 0; after "t",
    " " 6. So the argmax is "a" after anything but "t", and " " after "t"."""
    w = torch.zeros(V, V)
    w[:, ord("a")], w[:, ord("b")] = 4.0, 2.0
    w[ord("t"), ord(" ")] = 6.0
    return w


class Bigram(torch.nn.Module):
    """A stub GPT whose logits at a position depend only on the token there (:func:`bigram_logits`)."""

    def __init__(self, block_size: int = 256):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        self.w = bigram_logits()
        self.calls, self.modes = [], []

    def forward(self, idx, logits_at=None):
        self.calls.append(tuple(idx.shape))
        self.modes.append(self.training)
        logits = self.w[idx]  # (B, T, V)
        return (logits if logits_at is None else logits[logits_at]), None


@pytest.fixture
def bundle(tmp_path):
    return make_bundle(tmp_path / "bundle")


# ------------------------------------------------------------------------------ prompts
def test_prompts_are_rendered_as_nanochats_templates():
    shot = {"query": "Q0", "choices": ["x", "y"], "gold": 1}
    item = {"query": "Q1", "choices": ["a", "b"], "gold": 0}
    assert render("multiple_choice", item, [shot, shot], "\nA: ") == [
        "Q0\nA: y\n\nQ0\nA: y\n\nQ1\nA: a",
        "Q0\nA: y\n\nQ0\nA: y\n\nQ1\nA: b",
    ]
    shot = {"context_options": ["c0", "c1"], "continuation": "k", "gold": 0}
    item = {"context_options": ["u", "v"], "continuation": "w", "gold": 1}
    assert render("schema", item, [shot], " ") == ["c0 k\n\nu w", "c0 k\n\nv w"]
    shot = {"context": "  ctx ", "continuation": "go"}
    item = {"context": "what \n", "continuation": "next"}
    # the contexts trimmed; the prompt without the continuation stripped (its delimiter too)
    assert render("language_modeling", item, [shot], " ") == ["ctx go\n\nwhat", "ctx go\n\nwhat next"]
    assert render("language_modeling", item, [], "\nAnswer: ") == ["what\nAnswer:", "what\nAnswer: next"]


def test_examples_are_shuffled_and_shots_drawn_as_nanochat_does(bundle):
    """random.Random(1337) shuffles 4 examples to the order 1, 0, 3, 2; example 0's shot is
    random.Random(1234).sample of the others: the one at 2 (MC[3]); 3 examples stay in order."""
    (mc, mc_data), (schema, schema_data), (lm, lm_data) = load_core(str(bundle), None)
    assert mc_data == [MC[1], MC[0], MC[3], MC[2]] and schema_data == SCHEMA and lm_data == [LM[1], LM[0], LM[3], LM[2]]
    assert (mc.shots, mc.delimiter, mc.baseline, schema.delimiter, lm.baseline) == (1, "\nAnswer: ", 25.0, " ", 0.0)
    rows = example_rows(mc, mc_data, 0, chars, BOS, 256)
    prompts = ["q4\nAnswer: ab\n\npick\nAnswer: cd", "q4\nAnswer: ab\n\npick\nAnswer: ab"]
    start = 1 + len("q4\nAnswer: ab\n\npick\nAnswer: ")  # the choices share no token
    assert rows == [([BOS, *chars(p)], start, 1 + len(p)) for p in prompts]
    rows = example_rows(schema, schema_data, 0, chars, BOS, 256)  # shot: SCHEMA[2]
    prompts = ["big hat fell\n\nthe cat sat", "big hat fell\n\nthe dog sat"]
    assert rows == [([BOS, *chars(p)], 1 + len(p) - 4, 1 + len(p)) for p in prompts]  # the suffix " sat"
    rows = example_rows(lm, lm_data, 0, chars, BOS, 256)  # example "dog", its shot " hit "
    assert rows == [([BOS, *chars("hit a\n\ndog aaa")], 1 + len("hit a\n\ndog"), 1 + len("hit a\n\ndog aaa"))]
    assert load_core(str(bundle), "lm_task", max_examples=2)[0][1] == [LM[1], LM[0]]  # shuffled, then cut


def test_shots_are_nanochats_sample_of_the_other_examples_never_the_example_itself():
    """nanochat draws example i's shots as random.Random(1234 + i).sample of the list of the other indices."""
    for n, k in [(2, 1), (5, 3), (11, 10), (300, 10)]:
        data = list(range(n))
        for i in {0, 1, n // 2, n - 1}:
            shots = fewshot(data, i, k)
            assert shots == random.Random(1234 + i).sample([j for j in data if j != i], k) and i not in shots
    assert fewshot(data, 3, 0) == []


def test_continuations_are_the_choices_common_prefix_and_the_options_common_suffix():
    rows = token_rows("multiple_choice", ["Q: the cat", "Q: the cow"], chars, BOS)
    assert [(s, e) for _, s, e in rows] == [(1 + 8, 11), (1 + 8, 11)]  # after "Q: the c"
    rows = token_rows("schema", ["x said no", "yy said no"], chars, BOS)
    assert [(s, e) for _, s, e in rows] == [(2, 10), (3, 11)]  # " said no"
    with pytest.raises(GptspeedError, match="not a prefix of those with its continuation"):
        token_rows("language_modeling", ["ab", "abc"], lambda s: [len(s)], BOS)  # a tokenizer merging all


def test_a_sequence_over_the_block_size_keeps_its_last_tokens():
    rows = [(list(range(10)), 6, 10), (list(range(4)), 2, 4), (list(range(10)), 1, 10)]
    assert crop(rows, 6) == [(list(range(4, 10)), 2, 6), (list(range(4)), 2, 4), (list(range(4, 10)), 1, 6)]


# ------------------------------------------------------------------------------ scoring
def test_mean_losses_and_greedy_matches_are_the_models_own():
    model = Bigram()
    logp = torch.log_softmax(bigram_logits(), dim=-1)
    rows = [([BOS, *chars("xt ab")], 3, 6), ([BOS, *chars("q aaa")], 3, 6), ([BOS, *chars("ta")], 2, 2)]
    means, greedy = score_rows(model, rows, "cpu", pad=BOS)
    want = [-(logp[ord("t"), ord(" ")] + logp[ord(" "), ord("a")] + logp[ord("a"), ord("b")]) / 3]
    want.append(-(logp[ord(" "), ord("a")] + 2 * logp[ord("a"), ord("a")]) / 3)
    assert means[:2] == pytest.approx([float(w) for w in want], rel=1e-6) and math.isnan(means[2])  # empty span
    assert greedy == [False, True, True] and model.calls == [(3, 6)]  # one forward, right-padded


def test_accuracies_and_the_centred_score_of_a_model_whose_answers_are_known(bundle):
    model = Bigram()
    result = evaluate_core(model, load_core(str(bundle), None), encode=chars, bos=BOS, device="cpu", batch_examples=3)
    tasks = result["tasks"]
    assert {k: (v["accuracy"], v["examples"]) for k, v in tasks.items()} == {
        "mc_task": (0.75, 4),
        "schema_task": (2 / 3, 3),
        "lm_task": (0.5, 4),
    }
    assert tasks["mc_task"]["centered"] == pytest.approx((0.75 - 0.25) / 0.75)
    assert tasks["schema_task"]["centered"] == pytest.approx((2 / 3 - 0.5) / 0.5)
    assert tasks["lm_task"]["centered"] == pytest.approx(0.5)
    assert result["centered"] == pytest.approx((2 / 3 + 1 / 3 + 0.5) / 3)
    assert len(model.calls) == 2 + 1 + 2  # 3 examples per forward pass
    assert model.modes == [False] * 5 and model.training  # scored in eval mode, its training mode restored


def test_the_centred_accuracy_is_zero_at_chance_and_one_when_all_right():
    assert centered(0.25, 25.0) == 0.0 and centered(1.0, 62.0) == 1.0 and centered(0.5, 0.0) == 0.5
    assert centered(0.1, 25.0) == pytest.approx((0.1 - 0.25) / 0.75)


def test_a_long_prompt_is_scored_on_its_last_block_size_tokens(bundle):
    """Few-shot prompts longer than the block: the model never sees more than block_size tokens, and
    the answers, decided by the continuation's tokens, stay the same."""
    model = Bigram(block_size=12)
    result = evaluate_core(model, load_core(str(bundle), None), encode=chars, bos=BOS, device="cpu")
    assert max(t for _, t in model.calls) == 12
    assert [t["accuracy"] for t in result["tasks"].values()] == [0.75, 2 / 3, 0.5]


# ------------------------------------------------------------------------------ the command
def test_gptspeed_eval_core_on_a_tiny_run_scores_each_example_as_alone(bundle, tmp_path, shakespeare_data):
    """End to end on a run trained 2 steps: the accuracies printed are those of the run's model scoring
    each row alone, unpadded, through its full logits (GPT-2's BPE, <|endoftext|> first)."""
    from gptspeed.sample import load_any_model
    from gptspeed.tokenizer import EOT_TOKEN, encode

    from support.run_folders import train

    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=2)
    res = run_main(
        "eval",
        "--run",
        str(run),
        "--core-bundle",
        str(bundle),
        "--core-tasks",
        "mc_task,lm_task",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)["core"]
    assert list(out["tasks"]) == ["mc_task", "lm_task"] and out["tasks"]["mc_task"]["examples"] == 4

    from gptspeed.runtime import resolve_runtime

    model, _ = load_any_model(resolve_runtime("cpu", "float32"), run, None)
    model.eval()
    for task, data in load_core(str(bundle), "mc_task,lm_task"):
        right = 0
        for i, item in enumerate(data):
            means, greedy = [], []
            for tokens, s, e in example_rows(task, data, i, encode, EOT_TOKEN, model.config.block_size):
                with torch.no_grad():
                    logits = model(torch.tensor([tokens]))[0][0].float()
                target = torch.tensor(tokens[s:e])
                means.append(float(F.cross_entropy(logits[s - 1 : e - 1], target)))
                greedy.append(bool((logits[s - 1 : e - 1].argmax(-1) == target).all()))
            right += greedy[0] if task.kind == "language_modeling" else means.index(min(means)) == item["gold"]
        assert out["tasks"][task.label]["accuracy"] == pytest.approx(right / len(data))
    want = sum(t["centered"] for t in out["tasks"].values()) / 2
    assert out["centered"] == pytest.approx(want)


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("unknown task", ["--core-tasks: no task nope", "mc_task, schema_task, lm_task"]),
        ("not a bundle", ["--core-bundle", "has no core.yaml", "eval_meta_data.csv"]),
        ("bad line", ["schema.jsonl:2 is not a schema example", "context_options"]),
        ("bad type", ["icl_tasks entry 3 (lm_task) has icl_task_type 'generation'"]),
        ("no baseline", ["CORE task schema_task has no random baseline in the bundle's eval_meta_data.csv"]),
        ("bad baseline", ["CORE task mc_task has no random baseline", "a percentage below 100"]),
        ("too few", ["CORE task mc_task takes 1 few-shot examples", "(--max-examples): it needs 2"]),
        ("path out", ["has dataset_uri '../x.jsonl', not a path inside eval_data/"]),
    ],
)
def test_bad_core_input_is_a_one_line_error(bundle, tmp_path, case, fragments):
    args = ["--core-bundle", str(bundle)]
    if case == "unknown task":
        args += ["--core-tasks", "mc_task,nope"]
    elif case == "not a bundle":
        args = ["--core-bundle", str(tmp_path)]
    elif case == "bad line":
        write_jsonl(bundle / "eval_data" / "schema.jsonl", [SCHEMA[0], {"context_options": ["x"], "gold": 0}])
    elif case == "bad type":
        (bundle / "core.yaml").write_text(CORE_YAML.replace("language_modeling", "generation"))
    elif case == "no baseline":
        (bundle / "eval_meta_data.csv").write_text(META.replace("schema_task,", "other,"))
    elif case == "bad baseline":  # a bad value of a task not scored is no error
        (bundle / "eval_meta_data.csv").write_text(
            "\ufeff" + META.replace("mc_task,reasoning,25", "mc_task,r,100") + "x,y,n/a\n"
        )
        assert [t.label for t, _ in load_core(str(bundle), "schema_task,lm_task")] == ["schema_task", "lm_task"]
    elif case == "too few":
        args += ["--max-examples", "1"]
    elif case == "path out":
        (bundle / "core.yaml").write_text(CORE_YAML.replace("dataset_uri: lm.jsonl", "dataset_uri: ../x.jsonl"))
    # no --run: the bundle is read, and refused, before a model is looked for
    assert_user_error(run_main("eval", "--run", str(tmp_path / "no-run"), *args, "--device", "cpu"), *fragments)


def test_the_unpacked_zip_folder_is_a_bundle_too(bundle, tmp_path):
    parent = tmp_path / "unzipped"
    parent.mkdir()
    bundle.rename(parent / "eval_bundle")
    assert [t.label for t in cb.read_tasks(parent)] == ["mc_task", "schema_task", "lm_task"]


# ------------------------------------------------------------------------------ the official bundle
def bundle_zip(path: Path, folder: Path, extra: dict[str, bytes] | None = None) -> Path:
    """``folder`` zipped as nanochat's eval_bundle.zip (its files under eval_bundle/), plus ``extra``."""
    with zipfile.ZipFile(path, "w") as z:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                z.write(f, f"eval_bundle/{f.relative_to(folder).as_posix()}")
        z.writestr("__MACOSX/._core.yaml", b"ignored")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def test_the_official_bundle_is_hash_checked_from_mirror_cache_or_download(bundle, tmp_path, monkeypatch):
    """A fake zip made the official one (its sha256 patched in): from the mirror, unpacked once into the
    cache; else downloaded into the cache; a zip with another hash is refused."""
    fake = bundle_zip(tmp_path / "fake.zip", bundle)
    sha = hashlib.sha256(fake.read_bytes()).hexdigest()
    mirror = tmp_path / "mirror" / "core"
    mirror.mkdir(parents=True)
    (mirror / "eval_bundle.zip").write_bytes(fake.read_bytes())
    monkeypatch.setenv("GPTSPEED_DATA_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(GptspeedError, match=f"has sha256 {sha}, expected {cb.EVAL_BUNDLE_SHA256}"):
        cb.official_bundle()  # not the official file
    monkeypatch.setattr(cb, "EVAL_BUNDLE_SHA256", sha)
    unpacked = tmp_path / "cache" / "core" / "eval_bundle"
    assert cb.official_bundle() == unpacked and (unpacked / cb.STAMP).read_text() == sha + "\n"
    assert (unpacked / "eval_data" / "reasoning" / "mc.jsonl").read_text() == (
        bundle / "eval_data" / "reasoning" / "mc.jsonl"
    ).read_text()
    assert not (unpacked.parent / "__MACOSX").exists() and [p.name for p in unpacked.parent.iterdir()] == [
        "eval_bundle"
    ]
    assert [t.label for t, _ in load_core(None, "lm_task")] == ["lm_task"]

    downloads = []

    def download(urls, dest, digest, hint, progress):
        downloads.append((urls, dest, digest, hint))
        dest.write_bytes(fake.read_bytes())

    monkeypatch.setattr(corpora, "_download", download)
    monkeypatch.delenv("GPTSPEED_DATA_MIRROR")
    assert cb.official_bundle() == unpacked and downloads == []  # unpacked already: nothing fetched
    (unpacked / cb.STAMP).write_text("stale\n")
    assert cb.official_bundle() == unpacked
    cached = tmp_path / "cache" / "core" / "eval_bundle.zip"
    assert downloads == [((cb.EVAL_BUNDLE_URL,), cached, sha, "core/eval_bundle.zip")]
    assert (unpacked / cb.STAMP).read_text() == sha + "\n"


@pytest.mark.parametrize(
    "member, why",
    [
        ("eval_bundle/../../evil.txt", "outside its folder"),
        ("eval_bundle//abs/evil.txt", "outside its folder"),
        ("eval_bundle/a\\..\\evil.txt", "outside its folder"),
    ],
)
def test_a_zip_member_that_would_leave_the_folder_is_refused(bundle, tmp_path, member, why):
    z = bundle_zip(tmp_path / "evil.zip", bundle, {member: b"x"})
    with pytest.raises(GptspeedError, match=why):
        cb.unpack_bundle(z, tmp_path / "out" / "eval_bundle", "h")
    assert not (tmp_path / "evil.txt").exists() and list((tmp_path / "out").iterdir()) == []


def test_a_link_member_and_a_zip_too_large_when_unpacked_are_refused(bundle, tmp_path, monkeypatch):
    link = zipfile.ZipInfo("eval_bundle/eval_data/link.jsonl")
    link.external_attr = 0o120777 << 16  # a symbolic link, to /etc/passwd
    z = bundle_zip(tmp_path / "link.zip", bundle)
    with zipfile.ZipFile(z, "a") as f:
        f.writestr(link, "/etc/passwd")
    with pytest.raises(GptspeedError, match="link.jsonl' is not a file: refused"):
        cb.unpack_bundle(z, tmp_path / "out" / "eval_bundle", "h")
    monkeypatch.setattr(cb, "MAX_BUNDLE_BYTES", 100)
    with pytest.raises(GptspeedError, match="would unpack to .* bytes, more than a CORE bundle's 100: refused"):
        cb.unpack_bundle(bundle_zip(tmp_path / "big.zip", bundle), tmp_path / "out" / "eval_bundle", "h")
    with pytest.raises(GptspeedError, match="holds no eval_bundle/core.yaml"):
        (tmp_path / "empty").mkdir()
        cb.unpack_bundle(bundle_zip(tmp_path / "none.zip", tmp_path / "empty"), tmp_path / "out" / "eval_bundle", "h")
