"""``gptspeed.api``: the library API, for notebooks and scripts: the same code ``gptspeed train`` and ``gptspeed sample`` run (:func:`gptspeed.trainer.fit`, :func:`gptspeed.sample.sample_text`), no subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

import gptspeed
import gptspeed.api
from gptspeed.errors import GptspeedError

from support.cli import run_python
from support.paths import ROOT
from support.shapes import QUICK_RUN

pytestmark = pytest.mark.usefixtures("one_thread")


# what the README example's settings are overridden with: a one-block, 32-wide model, 3 steps
OVERRIDES = dict(QUICK_RUN, max_steps=3, save_every=0)


def readme_example() -> str:
    """The first ```python block of the "In a notebook or script" section of docs/training.md."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("## In a notebook or script") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def notebook(shakespeare_data, tmp_path_factory):
    """The README example executed as written, in a folder where ``data/tinyshakespeare`` is the
    prepared test corpus; ``make_config`` adds :data:`OVERRIDES` to what the example asks for. Returns
    the example's variables, what it printed and its folder."""
    where = tmp_path_factory.mktemp("notebook")
    (where / "data").mkdir()
    (where / "data" / "tinyshakespeare").symlink_to(shakespeare_data)
    real = gptspeed.api.make_config
    asked = {}

    def tiny_make_config(preset=None, **settings):
        asked.update(settings, preset=preset)
        return real(preset, **{**settings, **OVERRIDES})

    out = io.StringIO()
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        mp.setattr(gptspeed.api, "make_config", tiny_make_config)
        with contextlib.redirect_stdout(out):
            exec(compile(readme_example(), "docs/training.md", "exec"), namespace)
    return namespace, out.getvalue(), where, asked


def tiny_run(tmp_path):
    from gptspeed.checkpoint import save_checkpoint
    from gptspeed.config import GPTConfig, preset
    from gptspeed.model import GPT

    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(tmp_path, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return tmp_path


def test_readme_notebook_example_runs(notebook):
    ns, printed, where, asked = notebook
    assert asked["data"] == "data/tinyshakespeare" and asked["preset"] == "nano"  # the example's own settings
    assert ns["summary"]["step"] == 3 and ns["summary"]["interrupted"] is None
    assert ns["summary"]["last_val_loss"] is not None
    run = ns["run"]
    assert run.step == 3 and run.config.model.n_embd == 32 and run.config.preset == "nano"
    assert ns["curve"] == [
        (r["tokens"], r["train_loss"])
        for r in map(json.loads, (where / "runs/notebook/metrics.jsonl").read_text().splitlines())
        if "train_loss" in r
    ]
    assert [tokens for tokens, _ in ns["curve"]] == [128, 256, 384]
    assert isinstance(ns["text"], str) and ns["text"]
    assert f"3 {ns['summary']['last_val_loss']}\n" in printed and "\nROMEO:" + ns["text"] + "\n" in printed


def test_generate_of_no_prompts_is_no_samples(notebook, monkeypatch):
    """`Run.generate([])` returned one sample (of "\\n") for no prompts; as a list comprehension over no
    prompts it is an empty list, without loading the model, after the arguments are checked."""
    import gptspeed.sample

    ns, _, where, _ = notebook
    run = gptspeed.load_run(str(where / "runs/notebook"), device="cpu")
    monkeypatch.setattr(gptspeed.sample, "load_model", lambda *a, **k: pytest.fail("no prompt needs no model"))
    assert run.generate([]) == [] and run.generate((), num_samples=3) == []
    with pytest.raises(GptspeedError, match="--num-samples >= 1"):
        run.generate([], num_samples=0)


def test_generate_is_what_gptspeed_sample_draws(notebook):
    """Run.generate is `gptspeed sample`'s code: the same seed draws the same text, several prompts
    give a list; a second call reuses the loaded model."""
    from gptspeed.sample import sample_text

    ns, _, where, _ = notebook
    run_dir = str(where / "runs/notebook")
    run = gptspeed.load_run(run_dir, device="cpu")
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=50, seed=7)
    want = sample_text(run=run_dir, prompts=["ROMEO:", "To be"], device="cpu", out=io.StringIO(), **kw)
    assert run.generate(["ROMEO:", "To be"], **kw) == want
    model = run._loaded[0]
    assert (
        run.generate("ROMEO:", **kw)
        == sample_text(run=run_dir, prompts=["ROMEO:"], device="cpu", out=io.StringIO(), **kw)[0]
    )
    assert run._loaded[0] is model
    assert len(run.generate("ROMEO:", num_samples=2, **kw)) == 2


def test_metrics_and_config_of_a_run(notebook):
    ns, _, where, _ = notebook
    run = gptspeed.load_run(where / "runs/notebook")
    records = run.metrics()
    assert [r["step"] for r in records] == [0, 1, 2, 3] and "val_loss" in records[0]
    assert run.config.train.max_steps == 3 and run.config.train.out == "runs/notebook"
    assert "step=3" in repr(run)


def test_api_errors_are_user_errors(tmp_path):
    with pytest.raises(GptspeedError, match=r"unknown setting 'n_layr' \(did you mean 'n_layer'\?\)"):
        gptspeed.make_config("pico", n_layr=2)
    with pytest.raises(GptspeedError, match="lr must be float"):
        gptspeed.make_config("pico", lr="fast")
    with pytest.raises(GptspeedError, match="unknown preset 'picoo'"):
        gptspeed.make_config("picoo")
    with pytest.raises(GptspeedError, match="n_embd .* must be divisible by n_head"):
        gptspeed.make_config("pico", n_embd=33)
    with pytest.raises(GptspeedError, match="takes a RunConfig"):
        gptspeed.train({"n_layer": 2})
    with pytest.raises(GptspeedError, match="--out is required"):
        gptspeed.train(gptspeed.make_config("pico", device="cpu"))  # before the default data is prepared
    with pytest.raises(GptspeedError, match="does not exist"):
        gptspeed.load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptspeedError, match="not a run folder"):
        gptspeed.load_run(tmp_path / "empty")


def test_import_gptspeed_imports_no_torch():
    """The API is there at `import gptspeed`, but its modules (and torch) load only when used."""
    code = (
        "import sys, gptspeed; cfg = gptspeed.make_config('pico', n_layer=1); "
        "print(type(cfg).__name__, callable(gptspeed.train), callable(gptspeed.load_run), 'torch' in sys.modules)"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["RunConfig", "True", "True", "False"]
    with pytest.raises(AttributeError):
        gptspeed.no_such_thing  # noqa: B018


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: setattr(c, "model", None), "config.model must be a GPTConfig"),
        (lambda c: setattr(c, "train", {}), "config.train must be a TrainConfig"),
        (lambda c: setattr(c.model, "nlayer", 2), r"config.model.nlayer is not a setting \(did you mean 'n_layer'\?\)"),
        (lambda c: setattr(c, "preset", 3), "config.preset must be a string"),
    ],
)
def test_train_on_a_config_changed_into_something_else_is_one_line(tmp_path, change, message):
    """`cfg.model.nlayer = 2` (a typo) trained the preset's layers without a word; a group set to
    None or a dict was an AttributeError / TypeError."""
    cfg = gptspeed.make_config("pico", out=str(tmp_path / "run"), data=str(tmp_path / "none"), device="cpu")
    change(cfg)
    with pytest.raises(GptspeedError, match=message):
        gptspeed.train(cfg, echo=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "content,message",
    [
        ("[]", "holds a JSON list, not a JSON object"),
        ("NaN", "NaN is not JSON"),
        ('"run"', "holds a JSON str"),
        ('{"a":' * 50000 + "1" + "}" * 50000, "nested too deeply"),
        (None, "is a folder"),
        ("fifo", "not a regular file"),
    ],
)
def test_load_run_on_a_hostile_config_json_is_one_line(tmp_path, content, message):
    """A list, NaN or a string was an AttributeError, deep nesting a RecursionError; a FIFO would
    have blocked the read forever."""
    run = tmp_path / "run"
    run.mkdir()
    if content is None:
        (run / "config.json").mkdir()
    elif content == "fifo":
        os.mkfifo(run / "config.json")
    else:
        (run / "config.json").write_text(content)
    with pytest.raises(GptspeedError, match=message):
        gptspeed.load_run(run)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt=None), "prompt must be a text or a list of texts, got None"),
        (dict(prompt=["a", 3]), "prompt must be a text or a list of texts"),
        (dict(max_new_tokens="3"), "--max-new-tokens must be an integer"),
        (dict(max_new_tokens=10**12), "--max-new-tokens must be at most 1,048,576"),
        (dict(temperature=None), "--temperature must be a number"),
        (dict(top_k=1.5), "--top-k must be an integer"),
        (dict(num_samples=1.5), "--num-samples must be an integer"),
        (dict(kv_cache="no"), "kv_cache must be True or False"),
        (dict(max_new_tokens=1, num_samples=10**9), "sampling 1,000,000,000 rows of up to 2 tokens needs at least"),
    ],
)
def test_generate_with_bad_arguments_is_one_line(tmp_path, kwargs, message):
    """Each was a TypeError from a comparison or from torch (a string kv_cache was taken as True);
    a billion samples allocated until the kernel killed the process."""
    run = gptspeed.load_run(tiny_run(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(GptspeedError, match=message):
        run.generate(**{"prompt": "a", **kwargs})


def test_load_run_refuses_a_device_or_dtype_it_does_not_know(tmp_path):
    """--dtype fp7 sampled silently in float32; None as the folder was a TypeError."""
    with pytest.raises(GptspeedError, match="unknown dtype 'fp7'"):
        gptspeed.load_run(tmp_path, dtype="fp7")
    with pytest.raises(GptspeedError, match="takes a run folder's path, got NoneType"):
        gptspeed.load_run(None)
