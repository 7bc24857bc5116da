"""``gptspeed.eval.harness``: ``gptspeed eval --lm-eval TASKS``, lm-evaluation-harness on a run's export."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest

from gptspeed.errors import GptspeedError
from gptspeed.eval import evaluate_run
from gptspeed.eval.harness import INSTALL, plan_lm_eval
from gptspeed.eval.hellaswag import load_hellaswag, score_items
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_any_model

from support.cli import assert_user_error, run_main
from support.hf_models import write_data_pico
from support.runs import train_args

pytestmark = pytest.mark.usefixtures("one_thread", "hf_offline")

EXAMPLES = [
    ("The king is dead, and", ["long live the king", "the sea is blue", "a horse", "my kingdom"], 0),
    ("To be, or not to be:", ["that is the question", "he said", "apples", "the end of the line"], 0),
    ("Now is the winter of", ["our discontent", "green cheese", "the world", "all my hopes today"], 1),
    ("Friends, Romans,", ["countrymen", "lend me your ears", "the grass", "and so on and on"], 2),
    ("All the world's a", ["stage", "stone", "stair of gold", "play within a play"], 3),
    ("A horse! a horse!", ["my kingdom for a horse", "a cat", "the rain in Spain", "now"], 0),
]
"""(context, four endings, the right one): HellaSwag's format, and the harness's tasks made of it."""

TASKS = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{ctx}}}}"
{target}
metric_list:
{metrics}
"""


def write_tasks(folder: Path) -> Path:
    """A multiple-choice task (``gs_choice``: acc, acc_norm) and a loglikelihood task of the right
    endings (``gs_right``: perplexity) over :data:`EXAMPLES`, in the harness's YAML format, their data
    a jsonl beside them, which is also in HellaSwag's format, for gptspeed's own scoring. The harness
    puts a space between a context and each choice, but none before a loglikelihood target: the
    target holds it, as HellaSwag's endings are scored (``" " + ending``)."""
    folder.mkdir()
    data = folder / "examples.jsonl"
    rows = [{"ctx": c, "endings": e, "label": y, "right": " " + e[y]} for c, e, y in EXAMPLES]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    choice = 'doc_to_choice: "{{endings}}"\ndoc_to_target: "{{label}}"'
    for name, output_type, target, metrics in (
        ("gs_choice", "multiple_choice", choice, ["acc", "acc_norm"]),
        ("gs_right", "loglikelihood", 'doc_to_target: "{{right}}"', ["perplexity"]),
    ):
        listed = "\n".join(
            f"  - metric: {m}\n    aggregation: {'perplexity' if m == 'perplexity' else 'mean'}" for m in metrics
        )
        text = TASKS.format(name=name, data=data, output_type=output_type, target=target, metrics=listed)
        (folder / f"{name}.yaml").write_text(text)
    return data


@pytest.fixture
def local_tasks_only(monkeypatch):
    """The harness's TaskManager without its own registry (thousands of YAMLs, seconds to index on every
    call): the tests' tasks are local, under ``include_path``; Hugging Face's datasets offline."""
    tasks = pytest.importorskip("lm_eval.tasks", reason=f"lm-evaluation-harness is not installed ({INSTALL})")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files: nothing to fetch
    monkeypatch.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run of ``gptspeed train --preset pico`` (2 steps, 64-token windows) on random tokens."""
    where = tmp_path_factory.mktemp("lm_eval")
    data = write_data_pico(where / "data", manifest=False)
    res = run_main(*train_args(data, where / "run", "--seq-len", "64"))
    assert res.returncode == 0, res.stderr
    return where / "run"


def test_the_harness_scores_a_run_as_gptspeed_does(trained_run, tmp_path, local_tasks_only):
    pytest.importorskip("accelerate", reason=f"the harness's HFLM needs accelerate ({INSTALL})")
    data = write_tasks(tmp_path / "tasks")
    result = evaluate_run(
        trained_run,
        lm_eval="gs_choice,gs_right",
        lm_eval_include=str(tmp_path / "tasks"),
        device="cpu",
        dtype="float32",
        batch_size=4,
    )
    assert result["run"] == str(trained_run) and result["step"] == 2
    got = result["lm_eval"]["results"]
    assert result["lm_eval"]["n_samples"]["gs_choice"]["effective"] == len(EXAMPLES)

    # gptspeed's own: the summed loss (nats) of each ending after its context, the HellaSwag scorer's
    model, _ = load_any_model(resolve_runtime("cpu", "float32", compile=False), trained_run)
    total, _ = score_items(model, load_hellaswag(data), "cpu")  # (examples, 4)
    labels = [y for _, _, y in EXAMPLES]
    chars = [[len(e) for e in endings] for _, endings, _ in EXAMPLES]  # the harness normalises by characters
    acc = sum(int(row.argmin()) == y for row, y in zip(total, labels)) / len(EXAMPLES)
    acc_norm = sum(
        max(range(4), key=lambda i: -float(row[i]) / n[i]) == y for row, n, y in zip(total, chars, labels)
    ) / len(EXAMPLES)
    perplexity = math.exp(sum(float(row[y]) for row, y in zip(total, labels)) / len(EXAMPLES))
    assert got["gs_choice"]["acc,none"] == acc
    assert got["gs_choice"]["acc_norm,none"] == acc_norm
    assert got["gs_right"]["perplexity,none"] == pytest.approx(perplexity, rel=1e-5)
    assert 0 < acc < 1 or 0 < acc_norm < 1  # the scores discriminate: a wrong score would be seen


def test_a_missing_harness_is_one_line_naming_the_extra(trained_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    res = run_main("eval", "--run", str(trained_run), "--lm-eval", "hellaswag", "--device", "cpu")
    assert_user_error(res, INSTALL)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(tasks=None, include="x"), "--lm-eval-include DIR needs --lm-eval"),
        (dict(tasks=" , ", run_dir="r"), "needs task names"),
        (dict(tasks="hellaswag", init_from="gpt2"), "lm_eval --model hf --model_args pretrained=gpt2"),
        (dict(tasks="hellaswag"), "give --run RUN_DIR"),
        (dict(tasks="hellaswag", run_dir="r", include="no/such/folder"), "is not a folder"),
    ],
)
def test_a_request_the_harness_cannot_run_is_refused_before_any_export(kwargs, says):
    with pytest.raises(GptspeedError, match=says.replace("(", r"\(")):
        plan_lm_eval(**kwargs)


def test_a_task_the_harness_does_not_know_is_named(tmp_path, local_tasks_only):
    write_tasks(tmp_path / "tasks")
    assert plan_lm_eval("gs_right", str(tmp_path / "tasks"), "r").tasks == ["gs_right"]
    with pytest.raises(GptspeedError, match="knows no task gs_nothing, gs_typo nor under"):
        plan_lm_eval("gs_right,gs_nothing,gs_typo", str(tmp_path / "tasks"), "r")
