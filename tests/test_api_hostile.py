"""The Python API given what a notebook can give it: a configuration changed into something else,
a hostile config.json, sampling arguments of the wrong type. One GptspeedError line each, never
a TypeError / AttributeError / RecursionError from inside, nor a process killed for its memory."""

import os

import pytest

import gptspeed
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")


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


def tiny_run(tmp_path):
    from gptspeed.checkpoint import save_checkpoint
    from gptspeed.config import GPTConfig, preset
    from gptspeed.model import GPT

    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(tmp_path, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return tmp_path


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
