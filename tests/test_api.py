"""The library API (gptspeed.make_config / train / load_run), and the notebook example of docs/training.md
run as written (with a tiny model)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
from conftest import ROOT, TINY_MODEL, run_python

import gptspeed
import gptspeed.api
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")

# what the README example's settings are overridden with: a one-block, 32-wide model, 3 steps
TINY = dict(
    TINY_MODEL,
    batch_size=4,
    warmup_steps=2,
    max_steps=3,
    log_every=1,
    eval_every=0,
    eval_tokens=512,
    save_every=0,
    device="cpu",
)


def readme_example() -> str:
    """The first ```python block of the "In a notebook or script" section of docs/training.md."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("## In a notebook or script") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def notebook(shakespeare_data, tmp_path_factory):
    """The README example executed as written, in a folder where ``data/tinyshakespeare`` is the
    prepared test corpus; ``make_config`` adds :data:`TINY` to what the example asks for. Returns
    the example's variables, what it printed and its folder."""
    where = tmp_path_factory.mktemp("notebook")
    (where / "data").mkdir()
    (where / "data" / "tinyshakespeare").symlink_to(shakespeare_data)
    real = gptspeed.api.make_config
    asked = {}

    def tiny_make_config(preset=None, **settings):
        asked.update(settings, preset=preset)
        return real(preset, **{**settings, **TINY})

    out = io.StringIO()
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        mp.setattr(gptspeed.api, "make_config", tiny_make_config)
        with contextlib.redirect_stdout(out):
            exec(compile(readme_example(), "docs/training.md", "exec"), namespace)
    return namespace, out.getvalue(), where, asked


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
