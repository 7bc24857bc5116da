"""A setting's value checked against its declaration (:func:`check_fields`, :func:`_typed`), its flag
(:func:`setting_flag`), and the values parsed from the command line (``--seed``, ``--batch-size``, ``--log-to``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gptspeed.config.declare import AUTO_BATCH_SIZE, MAX_COUNT, MAX_SEED, TRACKERS
from gptspeed.errors import GptspeedError, show_value

# Every setting's group and field by name. gptspeed.config.run fills them once the four groups are declared; they
# live here, below the groups, because the groups' own checks read them (GPTConfig.validate: check_fields,
# setting_flag). Importing any module of gptspeed.config imports the package first, so every group is in them
# before either is read.
GROUPS: dict[str, type] = {}
#: every setting by name -> its dataclass field (names are unique across the groups)
FIELDS: dict[str, dataclasses.Field] = {}


def check_fields(group: Any) -> None:
    """Every field of one configuration group (``GPTConfig``, ``OptimConfig``, ...) against what it
    declares (:func:`_f`): its type and choices (:func:`_typed`), then, for a number, the range --
    an integer without a range of its own at most :data:`MAX_COUNT` and every float finite, so no
    count reaches a tensor, a timer, an allocation or an error message out of range. GptspeedError,
    one line naming the flag."""
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        if value is None and _accepts_none(type(group), f.name):
            continue
        if value == AUTO_BATCH_SIZE and f.metadata.get("parse") == "batch_size":
            continue  # --batch-size auto: resolved on the device before training
        flag = setting_flag(f.name)
        _typed(type(group), f.name, value, flag, context=False)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        meta = f.metadata
        if isinstance(value, int) and "max" not in meta and value > MAX_COUNT:
            raise GptspeedError(f"{flag} must be at most {MAX_COUNT:,} (2**53), got {show_value(value)}")
        _check_range(flag, value, meta)
        if isinstance(value, float) and not math.isfinite(value):
            raise GptspeedError(f"{flag} must be a finite number, got {value}")


def _check_range(flag: str, value: float, meta: Any) -> None:
    """GptspeedError when ``value`` is outside the range a field declares (``min``, ``min_open``,
    ``finite``, ``max``; ``text`` says what it must be, ``max_note`` why the maximum, ``min_note`` why the
    minimum); its ``off`` value is accepted outside it."""
    if "off" in meta and value == meta["off"]:
        return
    lo, hi = meta.get("min"), meta.get("max")
    low = lo is not None and (value <= lo if meta.get("min_open") else value < lo)
    if low or (meta.get("finite") and not math.isfinite(value)):
        default = "at least 1" if lo == 1 else "0 or more" if lo == 0 else f"at least {lo}"
        why = f": {meta['min_note']}" if low and meta.get("min_note") else ""
        raise GptspeedError(f"{flag} must be {meta.get('text') or default}, got {show_value(value)}{why}")
    if hi is not None and (value >= hi if meta.get("text", "").endswith(")") else value > hi):
        if meta.get("max_note") or not meta.get("text"):
            note = f" ({meta['max_note']})" if meta.get("max_note") else ""
            raise GptspeedError(f"{flag} must be at most {hi:,.0f}{note}, got {show_value(value)}")
        raise GptspeedError(f"{flag} must be {meta['text']}, got {show_value(value)}")


def settings_off_default(config: Any, key: str, accepted: tuple[str, ...]) -> list[str]:
    """The names of the fields of the dataclass instance ``config`` (its own class's fields: a subclass's
    too) whose value is not their default and whose declaration ``key`` in the field's metadata
    (``init_from`` / ``export``, :func:`_f`) is not in ``accepted``. An undeclared field counts: what
    ``--init-from`` and ``export-hf`` refuse fails closed for a setting added without a declaration."""
    return [
        f.name
        for f in dataclasses.fields(config)
        if f.metadata.get(key) not in accepted and getattr(config, f.name) != _field_default(f)
    ]


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def setting_flag(name: str) -> str:
    """The command-line flag of setting ``name`` (``block_size`` -> ``--seq-len``, ``max_steps`` -> ``--max-steps``)."""
    f = FIELDS.get(name)
    return (f.metadata.get("flag") if f is not None else None) or "--" + name.replace("_", "-")


def check_seed(seed: Any, flag: str = "--seed") -> int:
    """``seed`` if it is an integer from 0 to :data:`MAX_SEED`, which every consumer takes
    (``torch.manual_seed``, ``torch.Generator.manual_seed``, ``numpy.random.default_rng``, the
    loader's ``--sampling random``); else GptspeedError naming ``flag``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise GptspeedError(f"{flag} must be an integer from 0 to {MAX_SEED:,} (2**63 - 1), got {show_value(seed)}")
    return seed


def field_type(cls, name: str) -> type:
    """The Python type of field ``name`` of configuration dataclass ``cls`` (``int``, ``float``,
    ``str`` or ``bool``): the first member of its annotation (``int | None`` -> ``int``). The
    one place annotations are read: the CLI's argument types and :func:`_typed` both use it."""
    ann = {f.name: f for f in dataclasses.fields(cls)}[name].type
    ann = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    return {"int": int, "float": float, "str": str, "bool": bool}[ann.split("|")[0].strip()]


def _accepts_none(cls, name: str) -> bool:
    ann = {f.name: f for f in dataclasses.fields(cls)}[name].type
    return "None" in (ann if isinstance(ann, str) else str(ann))


def _typed(cls, name: str, value: Any, source: str, context: bool = True) -> Any:
    """``value`` checked against the annotation and the ``choices`` of field ``name`` of dataclass
    ``cls``; GptspeedError "SOURCE: NAME must be ..." (with ``context=False``: "SOURCE must be ...",
    ``source`` being the flag, and a float's range left to :func:`check_fields`)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        home = [
            g for g, c in GROUPS.items() if cls in GROUPS.values() and name in {f.name for f in dataclasses.fields(c)}
        ]
        hint = f" (a setting of the '{home[0]}' group)" if home else did_you_mean(str(name)[:100])
        raise GptspeedError(f"{source}: unknown setting {show_value(name)}{hint}"[:300])
    if value is None and _accepts_none(cls, name):
        return None
    if value == "auto" and fields[name].metadata.get("parse") == "batch_size":
        return AUTO_BATCH_SIZE
    what = f"{source}: {name}" if context else source
    base = field_type(cls, name)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[base]
    if not ok:
        raise GptspeedError(f"{what} must be {base.__name__}, got {show_value(value)}"[:300])
    if base is float:
        value = float(value)
        if context and not math.isfinite(value):
            raise GptspeedError(f"{what} must be a finite number, got {value}")
    choices = fields[name].metadata.get("choices")
    if choices and value not in choices:
        raise GptspeedError(f"{what} must be one of {', '.join(choices)}, got {show_value(value)}"[:300])
    return value


def did_you_mean(name: str, candidates: tuple[str, ...] | list[str] | None = None) -> str:
    """`` (did you mean 'x'?)`` naming the nearest of ``candidates`` (default: every setting's
    name, where a model flag's own name -- ``seq_len`` for ``--seq-len`` -- leads to its
    setting), or nothing."""
    import difflib

    if candidates is None:
        aliases = {f.metadata["flag"][2:].replace("-", "_"): n for n, f in FIELDS.items() if f.metadata.get("flag")}
        if aliases.get(name, name) != name:
            return f" (did you mean {aliases[name]!r}?)"
        candidates = list(FIELDS)
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_log_to(text: str) -> tuple[str, ...]:
    """The trackers ``--log-to`` names besides ``jsonl`` (which is always on): ``text`` is
    comma-separated (``"tensorboard,wandb"``; case, blanks and repeats ignored), the order kept.
    Raises GptspeedError naming the nearest valid tracker for an unknown one."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in TRACKERS:
            raise GptspeedError(
                f"--log-to: unknown tracker {name!r}{did_you_mean(name, TRACKERS)}: choose from {', '.join(TRACKERS)}"
            )
        if name != "jsonl" and name not in names:
            names.append(name)
    return tuple(names)


def parse_batch_size(text: str) -> int:
    """CLI type for ``--batch-size``: a positive integer, or ``auto`` (stored as
    :data:`AUTO_BATCH_SIZE` = 0). ``argparse.ArgumentTypeError`` (argparse's one-line usage error)
    for anything else."""
    import argparse

    if text == "auto":
        return AUTO_BATCH_SIZE
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r}")
    return value


def parse_seed(text: str) -> int:
    """CLI type of every seed flag (``sample --seed``, ``prepare --shuffle-seed``, ``bench --seed``):
    an integer from 0 to :data:`MAX_SEED` (:func:`check_seed`); ``argparse.ArgumentTypeError`` (argparse's
    one-line usage error) for anything else. ``train --seed`` is checked by :meth:`RunConfig.validate`."""
    import argparse

    try:
        return check_seed(int(text))
    except (ValueError, GptspeedError):
        raise argparse.ArgumentTypeError(
            f"must be an integer from 0 to {MAX_SEED:,} (2**63 - 1), got {text[:40]!r}"
        ) from None
