"""Every setting declared once (issue 29): each field's choices and range, refused in one line from
every entry point -- a flag, a config file, make_config, and a configuration changed after it was
made, when it is trained -- and everything derived from the declarations (flags, run-defining
settings) agrees with them."""

import dataclasses
import math

import pytest
from conftest import run_main

from gptspeed import api
from gptspeed.config import FIELDS, GROUPS, MAX_COUNT, GPTConfig, preset, run_defining_diff, setting_flag
from gptspeed.errors import GptspeedError


def bad_values(name):
    """Values the declaration of setting ``name`` refuses: outside its choices, below its minimum,
    above its maximum (or, without one, above MAX_COUNT for an integer)."""
    f = FIELDS[name]
    meta, kind = f.metadata, f.type if isinstance(f.type, str) else str(f.type)
    out = []
    if meta.get("choices"):
        out.append("no-such-choice")
    if "min" in meta:
        lo = meta["min"]
        out.append(lo if meta.get("min_open") else (lo - 1 if kind.startswith("int") else lo - 0.5))
    if "max" in meta:
        hi = meta["max"]
        out.append(hi * 2 + 1 if kind.startswith("int") else hi * 2 + 1.0)
    elif kind.startswith("int"):
        out.append(MAX_COUNT + 1)
    if kind.startswith("float") and meta.get("finite"):
        out.append(math.inf)
    return out


CASES = [
    (name, v)
    for name in FIELDS
    for v in bad_values(name)
    if FIELDS[name].metadata.get("parse") != "batch_size" or v != 0
]  # 0 is how --batch-size auto is stored


def test_every_setting_declares_help_and_is_a_flag_or_says_why():
    for name, f in FIELDS.items():
        assert f.metadata.get("help"), name
        assert setting_flag(name).startswith("--"), name
    assert setting_flag("block_size") == "--seq-len" and setting_flag("max_steps") == "--max-steps"
    assert len(CASES) > 40  # most settings declare a rule


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_a_value_a_setting_refuses_is_one_line_from_make_config_and_after_a_change(name, value, tmp_path):
    with pytest.raises(GptspeedError, match=f"{setting_flag(name)}|{name}"):
        api.make_config("pico", **{name: value})
    cfg = api.make_config("pico", out=str(tmp_path / "run"))
    group = next(g for g, cls in GROUPS.items() if name in {f.name for f in dataclasses.fields(cls)})
    setattr(getattr(cfg, group), name, value)  # the notebook habit: changed after make_config
    with pytest.raises(GptspeedError, match=setting_flag(name)) as e:
        api.train(cfg, echo=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "name, value",
    [("optimizer", "lion"), ("on_nan", "ignore"), ("compile_tuning", "fast"), ("lr", -1.0), ("n_layer", 0)],
)
def test_the_issues_cases_from_the_flag_and_a_config_file(name, value, tmp_path):
    """cfg.optim.optimizer = "lion" used to train AdamW without a word (and config.json said lion)."""
    proc = run_main("train", "--preset", "pico", setting_flag(name), str(value), "--out", str(tmp_path / "a"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    (tmp_path / "c.yaml").write_text(f"{name}: {value}\n")
    proc = run_main("train", "--preset", "pico", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_run_defining_settings_come_from_the_declarations():
    a = preset("pico")
    declared = {n for n, f in FIELDS.items() if f.metadata.get("run_defining")}
    assert set(a.run_defining()) == declared
    assert {"lr", "seed", "batch_size", "n_layer", "softmax"} <= declared
    assert not {"max_steps", "device", "dtype", "compile", "log_every", "attention", "loss"} & declared
    for name in sorted(declared):
        b = preset("pico")
        group = next(g for g, cls in GROUPS.items() if name in {f.name for f in dataclasses.fields(cls)})
        old = getattr(getattr(b, group), name)
        new = {
            bool: lambda v: not v,
            int: lambda v: (v or 0) + 1,
            float: lambda v: (v or 0.0) + 0.5,
            str: lambda v: (v or "") + "x",
        }[type(old) if old is not None else float](old)
        setattr(getattr(b, group), name, new)
        expected = f"model.{name}" if name in {f.name for f in dataclasses.fields(GPTConfig)} else name
        assert run_defining_diff(a, b) == [expected], name
