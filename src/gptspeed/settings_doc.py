"""docs/settings.md, written from the settings' declarations.

Every setting of ``gptspeed train`` is declared once, as a field of a configuration dataclass whose
metadata :func:`gptspeed.config._f` fills (flag, help, choices, range, whether it defines the run).
This module renders those declarations as Markdown: one table per group, in the order and grouping of
:data:`gptspeed.config.GROUPS`, then the presets and the recipes. Nothing here restates a setting:
a new setting, a changed default or help text changes the page. A metadata key this module does not
know is shown as ``key: value`` in the "also" column, so a new kind of declaration appears on the
page without a change here.

Run ``python -m gptspeed.settings_doc > docs/settings.md`` to rewrite the page;
``tests/test_settings_doc.py`` fails while the page and the declarations differ.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

from gptspeed import config

#: The command that rewrites docs/settings.md (quoted by the test that checks the page).
COMMAND = "python -m gptspeed.settings_doc > docs/settings.md"

# the metadata keys rendered in a column of their own (or only --help's: metavar); any other key goes to the "also"
# column
_RENDERED = frozenset(
    {"help", "flag", "cli", "choices", "min", "max", "min_open", "finite", "text", "max_note", "run_defining", "kind"}
    | {"parse", "path", "min_note", "off", "metavar", *config.COMPANION_KEYS}
)
_TYPE_WORDS = {int: "an integer", float: "a number", str: "text", bool: "on or off"}


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: ``|`` and ``*`` escaped, no line break."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("*", "\\*")


def _code(text: str) -> str:
    return f"`{text}`"


def _flag(f: dataclasses.Field) -> str:
    """The flag column: ``--x``, ``--x / --no-x`` for an on/off switch, or a note for a setting that
    only a config file or the Python API sets."""
    meta = f.metadata
    if not meta.get("cli", True):
        return "no flag (`--config` file, Python API)"
    flag = config.setting_flag(f.name)
    if meta.get("kind") == "bool":
        return f"{_code(flag)} / {_code('--no-' + flag[2:])}"
    return _code(flag)


def _default(f: dataclasses.Field) -> str:
    """The field's own default as a user writes it: on/off, unset, a number or a word; ``required``
    for a field without one."""
    value = f.default
    if value is dataclasses.MISSING:
        return "required" if f.default_factory is dataclasses.MISSING else _code(f.default_factory())
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "":
        return "unset"
    if f.metadata.get("parse") == "batch_size" and value == config.AUTO_BATCH_SIZE:
        return "auto"
    return _code(value)


def _number(value: float) -> str:
    """A bound as the error lines write it: thousands separated, a whole float without its ``.0``."""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:g}"
    return f"{value:,.0f}"


def _values(cls: type, f: dataclasses.Field) -> str:
    """What the setting accepts: its choices, or its type and range as the validation checks them
    (:func:`gptspeed.config._check_range`: ``text`` says it in words where declared)."""
    meta = f.metadata
    if meta.get("choices"):
        return " | ".join(_code(c) for c in meta["choices"])
    kind = config.field_type(cls, f.name)
    if meta.get("kind") in ("bool", "flag") or kind is bool:
        return "on or off"
    if meta.get("path"):
        return "a path (`~` is expanded)"
    lo, hi, note = meta.get("min"), meta.get("max"), meta.get("max_note")
    if meta.get("min_note"):
        return f"{meta.get('text') or _TYPE_WORDS[kind]} ({meta['min_note']})"
    if meta.get("text"):
        words = meta["text"] + (f"; at most {_number(hi)} ({note})" if hi is not None and note else "")
    elif lo is not None and hi is not None:
        words = f"{_TYPE_WORDS[kind]} from {_number(lo)} to {_number(hi)}" + (f" ({note})" if note else "")
    elif lo is not None:
        words = f"{_TYPE_WORDS[kind]} {'>' if meta.get('min_open') else '≥'} {_number(lo)}"
    else:
        words = _TYPE_WORDS[kind]
    return words + (", or `auto`" if meta.get("parse") == "batch_size" else "")


def _also(f: dataclasses.Field) -> str:
    """Every other declared property of the field, ``key: value`` (``key`` alone when it is True)."""
    extra = {k: v for k, v in f.metadata.items() if k not in _RENDERED}
    return "; ".join(k.replace("_", " ") if v is True else f"{k.replace('_', ' ')}: {v}" for k, v in extra.items())


def settings_table(cls: type) -> str:
    """The Markdown table of every field of configuration dataclass ``cls`` (any dataclass whose fields
    carry :func:`gptspeed.config._f` metadata): flag, key (its name in a config file and the Python
    API), default, accepted values, whether it defines the run, help, what it acts with
    (:func:`gptspeed.config.companions_text`: a setting given without it is refused), and any other
    declared property."""
    fields = dataclasses.fields(cls)
    acts = any(config.companions_text(f.metadata) for f in fields)  # the columns only where some field declares
    also = any(_also(f) for f in fields)
    head = ["flag", "key", "default", "values", "defines the run", "what it does"]
    head += ["acts with"] * acts + ["also"] * also
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in fields:
        cells = [
            _flag(f),
            _code(f.name),
            _default(f),
            _values(cls, f),
            "yes" if f.metadata.get("run_defining") else "no",
            f.metadata.get("help", ""),
        ]
        cells += [config.companions_text(f.metadata)] * acts + [_also(f)] * also
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def _as_flags(settings: dict[str, Any]) -> str:
    """Settings as the ``gptspeed train`` flags that give them (``--qk-norm``, ``--lr 0.002``)."""

    def one(name: str, value: Any) -> str:
        if isinstance(value, bool):
            return config.setting_flag(name) if value else "--no-" + config.setting_flag(name)[2:]
        return f"{config.setting_flag(name)} {value}"

    return " ".join(one(k, v) for k, v in settings.items())


def _preset_settings(cfg: config.RunConfig) -> dict[str, Any]:
    """The settings in which preset ``cfg`` differs from the fields' own defaults."""
    out = {}
    for group, cls in config.GROUPS.items():
        for f in dataclasses.fields(cls):
            value = getattr(cfg.groups()[group], f.name)
            if value != f.default:
                out[f.name] = value
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def presets_table() -> str:
    """The presets (:data:`gptspeed.config.PRESETS`): shape, parameters (counted by
    :meth:`gptspeed.config.GPTConfig.num_params`), learning rate, batch, and every setting each sets."""
    rows = [
        "| preset | n_layer | n_head | n_embd | seq_len | parameters | lr | micro-batch | tokens/step | steps "
        "| what it sets (where it differs from the defaults) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, cfg in config.PRESETS.items():
        m, t = cfg.model, cfg.train
        tokens = t.total_batch_tokens or t.batch_size * m.block_size
        cells = (
            _code(name),
            m.n_layer,
            m.n_head,
            m.n_embd,
            m.block_size,
            _count(m.num_params()),
            f"{cfg.optim.lr:g}",
            t.batch_size,
            f"{tokens:,}",
            f"{t.max_steps:,}",
            _code(_as_flags(_preset_settings(cfg))),
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def recipes_table() -> str:
    """The recipes (:data:`gptspeed.config.RECIPES`) as the flags each one gives."""
    rows = ["| recipe | the settings it applies |", "|---|---|"]
    for name, settings in config.RECIPES.items():
        rows.append(f"| {_code(name)} | {_cell(_code(_as_flags(settings)) if settings else 'none: as the presets')} |")
    return "\n".join(rows)


def _docstring(cls: type) -> str:
    """The class's docstring as Markdown paragraphs (reST's ````code```` as Markdown's `` `code` ``)."""
    paragraphs = (inspect.getdoc(cls) or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()).replace("``", "`") for p in paragraphs if p.strip())


def settings_markdown() -> str:
    """The whole of docs/settings.md, from :data:`gptspeed.config.GROUPS`, ``PRESETS`` and ``RECIPES``."""
    parts = [
        "# Settings",
        "",
        f"Generated from the declarations in `src/gptspeed/config/` by `{COMMAND}`; do not edit it by hand "
        "(`tests/test_settings_doc.py` fails while it differs from them).",
        "",
        "Every setting is a `gptspeed train` flag, a key of a `--config` YAML or JSON file (flat, or under its "
        "group as `--print-config` writes it) and a keyword of `gptspeed.make_config`. They apply in this "
        "order: the preset (`--preset`, default `gpt2`), the recipe (`--recipe`), the `--config` file, then "
        "the flags; with `--resume`, the run's own configuration comes first. The defaults below are the "
        "fields' own; a preset sets some of them (the [presets](#presets) table). *Defines the run*: a "
        "`--resume` that changes it is refused unless `--force-resume`. *Acts with*: what the setting does "
        "nothing without (a setting it needs on, values another must have, a setting that replaces it, the end "
        "value its warm-up's start must be below); given without it -- by a flag, a `--config` file or "
        "`make_config` -- it is refused before the first step, while a preset's or recipe's own value is not. "
        "`$GPTSPEED_CACHE` is `~/.cache/gptspeed` unless set.",
    ]
    for group, cls in config.GROUPS.items():
        parts += ["", f"## {group}", "", f"`{cls.__name__}`: {_docstring(cls)}", "", settings_table(cls)]
    parts += ["", "## Presets", "", presets_table(), "", "## Recipes", "", recipes_table(), ""]
    return "\n".join(parts)


def main() -> None:
    """Print :func:`settings_markdown` (``python -m gptspeed.settings_doc > docs/settings.md``)."""
    sys.stdout.write(settings_markdown())


if __name__ == "__main__":
    main()
