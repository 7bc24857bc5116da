"""docs/settings.md is written from the settings' declarations (gptspeed.settings_doc) and kept current."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from gptspeed import config
from gptspeed.config import _f
from gptspeed.settings_doc import COMMAND, presets_table, recipes_table, settings_markdown, settings_table

from support.cli import child_env
from support.paths import ROOT


def rows(table: str, key: int = 1) -> dict[str, list[str]]:
    """The rows of a generated table by their ``key`` cell (default the second, a setting's name), each
    split into its cells, unescaped."""
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").replace("\\|", "\0").split("|")]
        out[cells[key].strip("`")] = [c.replace("\0", "|").replace("\\*", "*") for c in cells]
    return out


def test_docs_settings_md_is_the_page_the_declarations_generate():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == settings_markdown(), f"docs/settings.md is out of date with config.py: run `{COMMAND}`"


def test_every_setting_is_listed_in_its_group_with_flag_default_and_help():
    page = settings_markdown()
    for group, cls in config.GROUPS.items():
        section = page[page.index(f"\n## {group}\n") :].split("\n## ")[1]
        assert settings_table(cls) in section
        table = rows(settings_table(cls))
        assert list(table) == [f.name for f in dataclasses.fields(cls)]  # every field, in declaration order
        for f in dataclasses.fields(cls):
            flag, _, default, values, defining, help_text = table[f.name][:6]
            assert help_text == " ".join(f.metadata["help"].split())
            assert defining == ("yes" if f.metadata["run_defining"] else "no")
            if f.metadata["cli"]:
                assert flag.startswith(f"`{config.setting_flag(f.name)}`")
    by_key = {k: v for cls in config.GROUPS.values() for k, v in rows(settings_table(cls)).items()}
    assert by_key["block_size"][0] == "`--seq-len`" and by_key["block_size"][2] == "`1024`"
    assert by_key["qk_norm"][0] == "`--qk-norm` / `--no-qk-norm`" and by_key["qk_norm"][2] == "off"
    assert by_key["batch_size"][3] == "an integer ≥ 1, or `auto`"
    assert by_key["lr"][3] == "a positive finite number"
    assert by_key["dtype"][3] == "`auto` | `float32` | `tf32` | `bfloat16` | `float16`"
    assert by_key["threads"][3] == "an integer from 0 to 4,096 (more than any CPU has)"
    assert by_key["valid_vocab_size"][0].startswith("no flag")


def test_a_metadata_key_the_page_does_not_know_gets_an_also_column():
    @dataclasses.dataclass
    class Known:
        width: int = _f(8, "how wide", min=1)

    @dataclasses.dataclass
    class Declared:
        name: str = _f(dataclasses.MISSING, "what it is called", positional=True)
        width: int = _f(8, "how wide", min=1, gpt2_weights="compatible")
        depth: int = _f(2, "how deep", min=1, exported=True)

    assert "also" not in settings_table(Known).splitlines()[0]
    table = rows(settings_table(Declared))
    assert settings_table(Declared).splitlines()[0].endswith("| also |")
    assert table["width"][-1] == "gpt2 weights: compatible" and table["depth"][-1] == "exported"
    assert table["name"][2] == "required" and table["name"][-1] == "positional"


def test_presets_and_recipes_are_listed_with_what_they_set():
    presets = rows(presets_table(), key=0)
    assert list(presets) == list(config.PRESETS)
    nano, gpt2 = presets["nano"], presets["gpt2"]
    assert nano[1:5] == ["4", "4", "128", "128"] and nano[5] == "7.25M" and nano[9] == "350"
    assert "--softmax data" in nano[10]
    assert gpt2[5] == "124.48M" and gpt2[8] == "524,288" and gpt2[10] == "`--total-batch-tokens 524288`"
    recipes = recipes_table()
    assert "| `modern` | `--optimizer muon --pos-emb rope --qk-norm --mlp relu2 --norm rmsnorm" in recipes
    assert set(config.RECIPES) == {line.split("`")[1] for line in recipes.splitlines()[2:]}


def test_the_module_prints_the_page():
    out = subprocess.run(
        [sys.executable, "-m", "gptspeed.settings_doc"], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert out.returncode == 0 and out.stdout == settings_markdown() and not out.stderr


def test_what_a_setting_acts_with_is_its_own_column_from_the_declaration():
    """A setting's companions (needs=, only_with=, replaced_by=, below=, starts=; config.check_companions refuses
    it given without them) are shown in words in an "acts with" column, not as raw metadata in "also"; a
    setting's ``off`` value is the one that asks for nothing."""

    @dataclasses.dataclass
    class Declared:
        steps: int = _f(0, "warm-up steps", min=0, off=0, below=("lr", "too long"), starts="start")
        start: int = _f(4, "the first value", min=1, needs="steps")
        lr: float = _f(1.0, "a rate", min=0, only_with={"optimizer": ("muon", "adamw")}, replaced_by="steps")

    table = rows(settings_table(Declared))
    assert settings_table(Declared).splitlines()[0].endswith("| what it does | acts with |")
    assert table["start"][-1] == "needs `--steps`"
    assert table["steps"][-1] == "unless `0`: below `--lr` (else too long); warms up from `--start`"
    assert table["lr"][-1] == "only with `--optimizer` muon | adamw; replaced by `--steps`"
    optim = rows(settings_table(config.OptimConfig))
    assert optim["decay_ratio"][-1] == "only with `--lr-schedule` wsd"
