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
    field_type,
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


def test_tilde_is_expanded_in_each_folder_of_an_inline_mixture(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = preset("pico").override({"data": "~/web=0.7, ~/code=0.3"})
    assert cfg.train.data == f"{tmp_path}/web=0.7,{tmp_path}/code=0.3"
    (tmp_path / "lr=3").mkdir()  # a folder whose name holds "=" stays one path
    assert preset("pico").override({"data": "~/lr=3"}).train.data == f"{tmp_path}/lr=3"


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


# ------------------------------------------------------------------ no setting accepted only to do nothing
def refused(settings: dict, *needles: str, preset_name: str = "pico") -> str:
    """The one line ``build_train_config`` refuses ``settings`` (given as flags would be) with, holding each
    of ``needles``."""
    with pytest.raises(GptspeedError) as e:
        build_train_config(preset_name, settings)
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line
    return line


@pytest.mark.parametrize("data", ["jsonl:/some/docs.jsonl", "hf:some/dataset"])
def test_random_sampling_of_a_stream_is_refused(data):
    """A stream is read in order: ``--sampling random`` was accepted and did nothing (issue 56)."""
    refused(dict(data=data, sampling="random"), "--sampling random acts only with --data a prepared folder", data)
    assert build_train_config("pico", dict(data=data, sampling="sequential")).train.sampling == "sequential"
    assert build_train_config("pico", dict(sampling="random")).train.sampling == "random"  # tiny Shakespeare


@pytest.mark.parametrize(
    "start, steps",
    [
        (dict(seq_len_start=16), "--seq-len-warmup-steps"),
        (dict(batch_start_tokens=64), "--batch-warmup-steps"),
        (dict(attn_window_start=128), "--attn-window"),
        (dict(muon_momentum_start=0.5, optimizer="muon"), "--muon-momentum-warmup"),
    ],
)
def test_a_warm_ups_start_without_its_steps_is_refused(start, steps):
    """Each warm-up's start setting did nothing without the setting that turns the warm-up on (issue 56)."""
    name = next(iter(start))
    refused(start, f"{setting_flag(name)} {start[name]} does nothing without {steps}", f"drop {setting_flag(name)}")


def test_a_sequence_length_warm_up_that_starts_at_the_full_length_is_refused():
    """``--seq-len-start`` at or above ``--seq-len`` -- or rounded up to it: the warm-up trains at halvings of
    --seq-len -- warmed up nothing; so did ``--seq-len-warmup-steps`` alone where the default start (64) is
    the preset's whole length (pico's 64). A start that acts is accepted."""
    warm = dict(seq_len_warmup_steps=10)
    refused(dict(warm, seq_len_start=64), "--seq-len-start 64 is not below --seq-len 64", "lower --seq-len-start")
    refused(dict(warm, seq_len_start=500), "--seq-len-start 500 (rounded up to a halving of --seq-len: 64)")
    refused(dict(warm, seq_len_start=40), "--seq-len-start 40 (rounded up to a halving of --seq-len: 64)")
    refused(warm, "--seq-len-start 64 is not below --seq-len 64")  # the default start, given by nobody
    refused(dict(warm, block_size=63, seq_len_start=8), "--seq-len 63", "raise --seq-len")  # no halving of 63
    assert build_train_config("pico", dict(warm, seq_len_start=32)).train.seq_len_start == 32


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(batch_warmup_steps=10), "--batch-start-tokens unset (512 in effect) is not below --total-batch-tokens"),
        (dict(batch_warmup_steps=10, total_batch_tokens=4096, batch_start_tokens=4096), "is not below"),
        (dict(attn_window=256, block_size=256, attn_window_start=200), "--attn-window-start 200 (rounded up"),
        (dict(attn_window=64, attn_window_start=32), "the window would not grow; raise --attn-window"),
    ],
)
def test_a_batch_or_window_warm_up_that_starts_at_its_end_is_refused(settings, message):
    """A batch warm-up from one micro-batch to a global batch of one micro-batch, or from the full batch, and a
    window warm-up whose start rounds up (to 128 tokens) to the window, changed nothing."""
    refused(settings, message)


@pytest.mark.parametrize(
    "settings, flag",
    [
        (dict(batch_warmup_steps=50, total_batch_tokens=4096), "--batch-warmup-steps 50"),
        (dict(batch_warmup_steps=500, total_batch_tokens=4096), "--batch-warmup-steps 500"),
        (dict(seq_len_warmup_steps=50, seq_len_start=16), "--seq-len-warmup-steps 50"),
        (dict(muon_momentum_warmup=80, optimizer="muon"), "--muon-momentum-warmup 80"),
    ],
)
def test_a_warm_up_as_long_as_the_run_or_longer_is_refused(settings, flag):
    """A warm-up of ``--max-steps`` or more (pico: 50) never reaches its end value: the run never trains at its
    full batch or length, Muon never at its momentum. Refused; the learning rate's warm-up longer than the run
    stays a warning at the start (a preset's warm-up meets a smoke test's short --max-steps:
    test_start_line_says_why_and_warns_of_a_warmup_longer_than_the_run)."""
    refused(settings, f"{flag} is not below --max-steps 50", "lower", "or raise --max-steps")
    assert build_train_config("pico", dict(settings, max_steps=1000)).train.max_steps == 1000
    assert build_train_config("pico", dict(warmup_steps=80)).optim.warmup_steps == 80


def test_a_decay_ratio_under_the_cosine_schedule_is_refused():
    """``--decay-ratio`` shapes the WSD schedule's cooldown; the cosine schedule ignored it (issue 56)."""
    refused(dict(decay_ratio=0.3), "--decay-ratio 0.3 acts only with --lr-schedule wsd", "cosine")
    assert build_train_config("pico", dict(decay_ratio=0.3, lr_schedule="wsd")).optim.decay_ratio == 0.3


def test_a_target_val_loss_without_evaluations_is_refused():
    """``--stop-at-val-loss`` on a stream (no val split) or with ``--eval-every 0`` (evaluated only at the
    end, where the run ends anyway) never stopped a run early."""
    refused(dict(stop_at_val_loss=3.5, data="jsonl:/d.jsonl"), "--stop-at-val-loss 3.5 acts only with --data a prep")
    refused(dict(stop_at_val_loss=3.5, eval_every=0), "--stop-at-val-loss 3.5 does nothing without --eval-every")
    assert build_train_config("pico", dict(stop_at_val_loss=3.5)).train.stop_at_val_loss == 3.5


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("rope_theta", 1e-300, "--rope-theta must be a finite number above 1, got 1e-300: the frequencies"),
        ("rope_theta", 1.0, "--rope-theta must be a finite number above 1"),
        ("logit_softcap", 1e-30, "--logit-softcap must be 0 (off) or at least 1, got 1e-30: a cap under 1"),
        ("logit_softcap", 0.5, "--logit-softcap must be 0 (off) or at least 1"),
        ("logit_softcap", -15.0, "--logit-softcap must be 0 (off) or at least 1"),
    ],
)
def test_a_rotary_base_or_soft_cap_out_of_its_sane_range_is_refused(name, value, message):
    """``--rope-theta 1e-300`` was accepted (and diverged, with advice about the learning rate): RoPE's
    frequencies base^(-2i/d) decrease only for a base above 1. ``--logit-softcap 1e-30`` was accepted: a cap
    under 1 keeps every logit within +-1, a near-uniform prediction. Refused by the model's own declaration."""
    with pytest.raises(GptspeedError) as e:
        GPTConfig(pos_emb="rope", **{name: value}).validate()
    assert str(e.value).startswith(message)
    refused({name: value, "pos_emb": "rope"}, message)
    GPTConfig(pos_emb="rope", rope_theta=1.5, logit_softcap=1.0).validate()
    GPTConfig(logit_softcap=0.0).validate()  # off


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(force_resume=True), "--force-resume does nothing without --resume: add --resume"),
        (dict(warmup_steps=3, warmup_ratio=0.1), "--warmup-steps 3 does nothing: --warmup-ratio 0.1 replaces it"),
        (dict(embed_lr=1e-3, embed_lr_ratio=2.0), "--embed-lr 0.001 does nothing: --embed-lr-ratio 2.0 replaces it"),
        (dict(scalar_lr=1e-3, scalar_lr_ratio=2.0), "--scalar-lr 0.001 does nothing"),
        (dict(hellaswag_examples=100), "--hellaswag-examples 100 does nothing without --hellaswag-every"),
        (
            dict(wandb_project="p"),
            "--wandb-project p acts only with --log-to naming wandb; this run has --log-to jsonl",
        ),
        (dict(wandb_run_name="r"), "add wandb to --log-to, or drop --wandb-run-name"),
        (dict(text_field="body"), "--text-field body acts only with --data a jsonl:/hf: stream"),
        (dict(split="validation", data="jsonl:/d.jsonl"), "--split validation acts only with --data an hf: stream"),
        (dict(hf_name="sample-10BT", data="jsonl:/d.jsonl"), "--hf-name sample-10BT acts only with --data an hf:"),
        (dict(rope_theta=500.0), "--rope-theta 500.0 acts only with --pos-emb rope; this run has --pos-emb learned"),
        (dict(muon_lr=0.05), "--muon-lr 0.05 acts only with --optimizer muon; this run has --optimizer adamw"),
        (dict(muon_momentum=0.9), "--muon-momentum 0.9 acts only with --optimizer muon"),
        (dict(muon_momentum_warmup=10), "--muon-momentum-warmup 10 acts only with --optimizer muon"),
        (dict(eval_every=10, data="hf:x"), "--eval-every 10 acts only with --data a prepared folder"),
        (dict(eval_tokens=4096, data="jsonl:/d.jsonl"), "--eval-tokens 4096 acts only with --data a prepared folder"),
        (
            dict(threads=8, device="cuda"),
            "--threads 8 acts only with --device cpu (or auto on a machine without a GPU)",
        ),
    ],
)
def test_every_other_setting_that_would_do_nothing_is_refused(settings, message):
    """The same class, looked for among every setting: one that acts only with another on, another value, or
    when another does not replace it."""
    refused(settings, message)


def test_each_setting_that_needs_another_is_refused_without_it_by_its_declaration_alone():
    """The rule comes from the declaration (``needs=``), not from a list: every setting declaring one, given
    alone at another value, is refused naming both flags -- the next switch with a companion gets it by
    declaring it."""
    needing = {n: f for n, f in FIELDS.items() if f.metadata.get("needs")}
    assert {"seq_len_start", "batch_start_tokens", "attn_window_start", "muon_momentum_start"} <= set(needing)
    for name, f in needing.items():
        default, kind = f.default, field_type(next(c for c in GROUPS.values() if f in dataclasses.fields(c)), name)
        value = {bool: True, int: (default or 0) + 1, float: (default or 0.5) / 2}[kind]
        value = 20.0 if name == "ema_horizon" else value  # a time constant of more than one step
        extra = {"optimizer": "muon"} if name == "muon_momentum_start" else {}
        extra |= {"eval_every": 0} if f.metadata["needs"] == "eval_every" else {}
        refused({name: value, **extra}, setting_flag(name), setting_flag(f.metadata["needs"]))


def test_every_preset_with_every_recipe_validates_and_keeps_its_own_settings():
    """A preset's or a recipe's own values are theirs: never refused, only what the user gives that does
    nothing. A recipe's setting the user's flags make inert is dropped back to the preset's (``--recipe modern
    --lr-schedule cosine``: its --decay-ratio 0.4), so --print-config of it reads back as the same run."""
    from gptspeed.config import PRESETS, RECIPES

    for p in PRESETS:
        for r in RECIPES:
            cfg = build_train_config(p, {}, recipe_name=r)
            assert all(cfg.optim.__dict__[k] == v for k, v in RECIPES[r].items() if k in cfg.optim.__dict__), (p, r)
            cfg.validate(world_size=1, given=RECIPES[r])  # the recipe's settings, as if given: each acts here
    cosine = build_train_config("pico", {"lr_schedule": "cosine"}, recipe_name="modern")
    assert cosine.optim.decay_ratio == preset("pico").optim.decay_ratio and cosine.optim.optimizer == "muon"
    refused({"lr_schedule": "cosine", "decay_ratio": 0.4}, "--decay-ratio 0.4 acts only with --lr-schedule wsd")
    adamw = build_train_config("nano", {"optimizer": "adamw"}, recipe_name="speedrun")
    assert adamw.optim.warmup_ratio == 0.02 and adamw.optim.embed_lr_ratio == 3.0


def test_a_print_config_file_reads_back_and_a_config_files_own_inert_setting_is_refused(tmp_path):
    """A --config file from --print-config names every setting, most at the values they had: only those it
    changes are the user's (checked); a file that asks for random sampling of a stream is refused."""
    from gptspeed.config import config_to_yaml

    cosine = build_train_config("pico", {"lr_schedule": "cosine"}, recipe_name="modern")
    (tmp_path / "printed.yaml").write_text(config_to_yaml(cosine))
    assert build_train_config(None, {}, str(tmp_path / "printed.yaml")) == cosine
    (tmp_path / "mine.yaml").write_text("data: jsonl:/d.jsonl\ntrain:\n  sampling: random\n")
    with pytest.raises(GptspeedError, match="--sampling random acts only with --data a prepared folder"):
        build_train_config("pico", {}, str(tmp_path / "mine.yaml"))


def test_a_setting_made_inert_after_make_config_is_refused_by_train(tmp_path):
    """The notebook habit: ``cfg.optim.decay_ratio = 0.3`` after make_config of a cosine run counts as the
    user's and is refused by train() in one line, before anything is written; a preset's own value left
    alone is not (pico's warm-up steps beside a ratio the user set)."""
    cfg = api.make_config("pico", out=str(tmp_path / "run"), warmup_ratio=0.1)
    cfg.optim.decay_ratio = 0.3
    with pytest.raises(GptspeedError, match="--decay-ratio 0.3 acts only with --lr-schedule wsd"):
        api.train(cfg, echo=False)
    assert not (tmp_path / "run").exists()
    cfg.optim.lr_schedule = "wsd"
    cfg.validate_if_changed()
    fresh = preset("pico")
    fresh.train.sampling, fresh.train.data = "random", "jsonl:/d.jsonl"  # never validated: off the preset = given
    with pytest.raises(GptspeedError, match="--sampling random acts only"):
        fresh.validate()


def test_the_value_in_effect_is_what_the_warm_ups_schedules_start_from():
    """value_in_effect rounds a warm-up's start as gptspeed.schedules does at step 0 (the halvings of
    --seq-len, the window's multiples of 128 tokens, whole micro-batches), so a start is refused exactly when
    the warm-up would change nothing; and config's stream prefixes are data.sources'."""
    from gptspeed import schedules
    from gptspeed.config import STREAM_PREFIXES, value_in_effect
    from gptspeed.data import sources

    assert STREAM_PREFIXES == sources.STREAM_PREFIXES
    for T in (16, 48, 63, 64):
        for start in (1, 5, 8, 16, 17, 32, 40, 63, 64, 100):
            cfg = preset("pico").override(dict(block_size=T, seq_len_start=start, seq_len_warmup_steps=10))
            assert value_in_effect(cfg, "seq_len_start") == schedules.seq_len_at(0, cfg), (T, start)
    for W in (16, 128, 200, 256, 1792):
        for start in (1, 64, 128, 129, 200, 256, 2000):
            cfg = preset("pico").override(dict(block_size=2048, attn_window=W, attn_window_start=start))
            assert value_in_effect(cfg, "attn_window_start") == schedules.attn_window_at(0, cfg), (W, start)
    for total in (None, 512, 2048, 4096):
        for start in (None, 1, 511, 512, 1000, 1024, 5000):
            cfg = preset("pico").override(
                dict(total_batch_tokens=total, batch_start_tokens=start, batch_warmup_steps=9)
            )
            for world in (1, 2):
                if (total or 512 * world) % (512 * world):
                    continue
                micro = 512 * world
                assert (
                    value_in_effect(cfg, "batch_start_tokens", world) == schedules.grad_accum_at(0, cfg, world) * micro
                )
                assert value_in_effect(cfg, "total_batch_tokens", world) == cfg.grad_accum_steps(world) * micro
