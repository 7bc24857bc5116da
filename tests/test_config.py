"""``gptspeed.config``: run configuration: dataclasses, presets and validation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gptspeed import api
from gptspeed.cli import main
from gptspeed.config import (
    EXPORT_KINDS,
    FIELDS,
    GROUPS,
    INIT_FROM_KINDS,
    MAX_COUNT,
    GPTConfig,
    RunConfig,  # noqa: E402
    _f,
    preset,
    run_defining_diff,
    setting_flag,
    settings_off_default,
)
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError

from support.cli import run_main
from support.strategies import HealthCheck, given, json_values, settings, st
from support.training import records

pytestmark = pytest.mark.usefixtures("one_thread")


FLAGS = [
    "--preset",
    "pico",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--max-steps",
    "3",
    "--log-every",
    "1",
    "--eval-every",
    "2",
    "--eval-tokens",
    "512",
    "--lr",
    "3e-3",
    "--device",
    "cpu",
]


FUZZED_FIELDS = [
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "lr",
    "batch_size",
    "dtype",
    "compile",
    "resume",
    "on_nan",
    "vocab_size",
    "attention",
    "total_batch_tokens",
    "nonsense",
]


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


def test_printed_yaml_config_reproduces_the_run(shakespeare_data, tmp_path, capsys):
    """`train FLAGS --print-config` prints YAML and trains nothing; `train --config that.yaml`
    (with only --out changed) trains the same run: the same configuration and, on the CPU,
    bit-identical losses."""
    a, b = tmp_path / "a", tmp_path / "b"
    flags = [*FLAGS, "--data", str(shakespeare_data)]
    assert main(["train", *flags, "--out", str(a), "--print-config"]) == 0
    text = capsys.readouterr().out
    assert not a.exists()  # printing trains nothing
    (tmp_path / "run.yaml").write_text(text)
    assert "\npreset: pico\n" in text and "\n  n_embd: 32\n" in text and "\n  lr: 0.003\n" in text
    assert main(["train", *flags, "--out", str(a)]) == 0
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(b)]) == 0
    conf_a, conf_b = (json.loads((d / "config.json").read_text()) for d in (a, b))
    conf_b["train"]["out"] = conf_a["train"]["out"]
    for group in ("preset", "model", "optim", "train", "runtime"):
        assert conf_b[group] == conf_a[group], group
    ra, rb = records(a), records(b)
    assert [r["step"] for r in ra] == [0, 1, 2, 3]
    assert [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rb] == [
        (r["step"], r.get("train_loss"), r.get("val_loss")) for r in ra
    ]


# ---------------------------------------------------------------------------------- ~ in paths
def test_tilde_is_expanded_in_every_path_setting_from_yaml_flags_and_the_api(tmp_path, monkeypatch):
    """`out: ~/runs/a` created a folder named `~` in the working directory, and `data: ~/...` "did
    not exist". Every path-valued setting (out, data -- also after jsonl: --, init_from) has its
    `~` expanded where values enter the configuration, whichever way they come."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    conf = tmp_path / "run.yaml"
    conf.write_text("out: ~/runs/a\ndata: ~/data/ts\ninit_from: ~/gpt2-folder\n")
    cfg = preset("pico").apply_file(str(conf))  # (build_train_config would load init_from's shape)
    assert (cfg.train.out, cfg.train.data, cfg.train.init_from) == (
        f"{home}/runs/a",
        f"{home}/data/ts",
        f"{home}/gpt2-folder",
    )
    conf.write_text("out: ~/runs/a\ndata: ~/data/ts\n")
    cfg = build_train_config("pico", {}, str(conf))
    assert (cfg.train.out, cfg.train.data) == (f"{home}/runs/a", f"{home}/data/ts")
    cfg = preset("pico").override({"out": "~/b", "data": "jsonl:~/docs.jsonl"})
    assert (cfg.train.out, cfg.train.data) == (f"{home}/b", f"jsonl:{home}/docs.jsonl")
    assert preset("pico").override({"data": "hf:~user/set"}).train.data == "hf:~user/set"  # a dataset name
    assert preset("pico").override({"wandb_run_name": "~x"}).train.wandb_run_name == "~x"  # not a path


def test_num_params_matches_the_model():
    from gptspeed.config import GPTConfig
    from gptspeed.model import GPT

    for shape in (
        dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
        dict(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=50257, attention="manual", softmax="data"),
    ):
        cfg = GPTConfig(**shape)
        model = GPT(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
        assert cfg.buffer_bytes() == sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 4096 bytes. Error code 12 (Cannot allocate memory)"
        ),
        MemoryError(),
        "torch.OutOfMemoryError",
    ],
)
def test_out_of_memory_while_building_is_one_line(monkeypatch, error):
    """Memory taken by another process between the estimate and the build: torch's allocator error
    became a traceback; now a GptspeedError with the size. Other errors pass through unchanged."""
    import torch

    import gptspeed.step as step

    if error == "torch.OutOfMemoryError":
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(step, "GPT", fail)
    with pytest.raises(GptspeedError, match=r"out of memory while building the model \(3,323,648 parameters") as e:
        step.build_model(preset("pico"))
    assert "\n" not in str(e.value)

    def bug(*a, **k):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(step, "GPT", bug)
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        step.build_model(preset("pico"))


@settings(max_examples=200, deadline=None)
@given(
    d=st.dictionaries(
        st.sampled_from(["model", "optim", "train", "runtime", "preset"]),
        st.dictionaries(st.sampled_from(FUZZED_FIELDS), json_values, max_size=4) | json_values,
        max_size=5,
    )
)
def test_fuzz_config_from_dict(d):
    try:
        cfg = RunConfig.from_dict(d, "fuzz")
        cfg.validate()
    except GptspeedError as e:
        assert "\n" not in str(e)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(max_size=200)
    | st.dictionaries(st.sampled_from(FUZZED_FIELDS), json_values, max_size=4).map(json.dumps)
)
def test_fuzz_config_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_text(text)
    try:
        preset("pico").apply_file(str(path)).validate()
    except GptspeedError as e:
        assert "\n" not in str(e).strip()


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


def test_head_lr_needs_an_untied_head_and_every_group_rate_is_positive():
    base = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)
    with pytest.raises(GptspeedError, match=r"--head-lr is the untied LM head's learning rate; .* --no-tie-embeddings"):
        preset("pico").override(dict(base, head_lr=0.008)).validate()
    preset("pico").override(dict(base, head_lr=0.008, tie_embeddings=False)).validate()
    with pytest.raises(GptspeedError, match=r"--head-lr is the untied LM head's learning rate"):
        preset("pico").override(dict(base, head_lr_ratio=3.0)).validate()
    for flag in ("embed_lr", "head_lr", "scalar_lr", "embed_lr_ratio", "head_lr_ratio", "scalar_lr_ratio"):
        with pytest.raises(GptspeedError, match=f"--{flag.replace('_', '-')} must be a positive finite number"):
            preset("pico").override(dict(base, tie_embeddings=False, **{flag: 0.0})).validate()
    with pytest.raises(GptspeedError, match="--muon-momentum-start must be in"):
        preset("pico").override(dict(base, muon_momentum_start=1.5)).validate()


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"train": {"lr": 0.1}}, "run.json: unknown setting 'lr' (a setting of the 'optim' group)"),
        ({"model": {"max_steps": 3}}, "run.json: unknown setting 'max_steps' (a setting of the 'train' group)"),
        ({"optim": {"lrr": 0.1}}, "run.json: unknown setting 'lrr' (did you mean 'lr'?)"),
    ],
)
def test_a_setting_in_the_wrong_group_of_a_configuration_names_its_group(doc, message):
    """A configuration (config.json, a checkpoint's) with a setting under another group is refused in
    one line naming the group it belongs to; a misspelt one gets the nearest name."""
    with pytest.raises(GptspeedError) as e:
        RunConfig.from_dict(doc, "run.json")
    assert str(e.value) == message


def test_a_configuration_ignores_what_is_not_a_setting_and_defaults_what_is_missing():
    """derived, environment and an imported model's source sit beside the groups in config.json: not
    settings, ignored; a missing group takes its defaults."""
    cfg = RunConfig.from_dict({"model": {"n_layer": 3}, "derived": {}, "environment": {}, "source": {}}, "run.json")
    assert cfg.model.n_layer == 3 and cfg.optim == RunConfig().optim and cfg.preset == "custom"


@dataclasses.dataclass
class _WithANewSwitch(GPTConfig):
    new_switch: bool = _f(False, "a switch declared without init_from= or export=", kind="bool")


def test_a_model_setting_without_a_declaration_is_off_gpt2_for_init_from_and_export():
    """Fail closed: a field with no ``init_from=`` / ``export=`` counts once off its default -- for
    --init-from, for export-hf, and among non_gpt2_switches -- and not at its default."""
    off = _WithANewSwitch(new_switch=True)
    assert settings_off_default(off, "init_from", INIT_FROM_KINDS) == ["new_switch"]
    assert settings_off_default(off, "export", EXPORT_KINDS) == ["new_switch"]
    assert off.non_gpt2_switches() == ["--new-switch True"]
    at_default = _WithANewSwitch()
    assert settings_off_default(at_default, "init_from", INIT_FROM_KINDS) == [] == at_default.non_gpt2_switches()


def test_the_declarations_say_which_settings_gpt2_weights_take_and_which_export_as_gpt2():
    """What --init-from refuses and what makes an export gptspeed's own code, read from config.py's
    declarations; a declaration of an unknown kind is a programming error."""
    every = GPTConfig(
        pos_emb="rope", qk_norm=True, mlp="relu2", norm="rmsnorm", tie_embeddings=False, zero_init_proj=True,
        logit_softcap=30.0, doc_mask=True, value_embeds=1, unet_skips=True, attn_window=512, attn_window_start=256,
        attention="manual", residual_dtype="bfloat16", softmax="data", rope_theta=500.0, n_layer=4, block_size=512,
    )  # fmt: skip
    assert settings_off_default(every, "init_from", INIT_FROM_KINDS) == [
        "pos_emb", "qk_norm", "mlp", "norm", "tie_embeddings", "zero_init_proj", "value_embeds", "unet_skips",
    ]  # fmt: skip
    assert [s.split()[0] for s in every.non_gpt2_switches()] == [
        "--pos-emb", "--qk-norm", "--mlp", "--norm", "--tie-embeddings", "--logit-softcap", "--doc-mask",
        "--value-embeds", "--unet-skips", "--attn-window", "--attn-window-start",
    ]  # fmt: skip
    assert settings_off_default(every, "export", EXPORT_KINDS) == ["attn_window", "attn_window_start"]
    with pytest.raises(AssertionError):
        _f(0, "a setting", init_from="maybe")


def test_a_run_is_validated_once_where_its_configuration_is_resolved(tmp_path, monkeypatch):
    """``gptspeed train`` and ``make_config`` + ``train()`` check a configuration once, where
    build_train_config resolves it: the training code relies on it (it checked it twice, three times
    from Python). A setting changed after make_config is checked again (and refused in one line:
    test_a_value_a_setting_refuses_is_one_line_from_make_config_and_after_a_change)."""
    from support.hf_models import write_data

    calls = []
    real = RunConfig.validate
    monkeypatch.setattr(RunConfig, "validate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    data = write_data(tmp_path / "data")
    flags = dict(max_steps=1, batch_size=2, n_layer=1, block_size=32, eval_tokens=64, device="cpu", dtype="float32")
    args = [x for k, v in flags.items() for x in (setting_flag(k), str(v))]
    res = run_main("train", "--preset", "pico", "--data", str(data), "--out", str(tmp_path / "a"), *args)
    assert res.returncode == 0, res.stderr
    assert len(calls) == 1
    cfg = api.make_config("pico", data=str(data), out=str(tmp_path / "b"), **flags)
    api.train(cfg, echo=False)
    assert len(calls) == 2
    cfg = api.make_config("pico", data=str(data), out=str(tmp_path / "c"), **flags)
    cfg.optim.lr = 1e-4  # the notebook habit
    api.train(cfg, echo=False)
    assert len(calls) == 4
