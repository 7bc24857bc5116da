"""The run's configuration: :class:`RunConfig` = the four groups of settings, indexed by name; its validation,
with the rules between settings each declares (:func:`check_companions`); a configuration applied, compared
and written; the presets and the recipes.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from gptspeed.config.checks import (
    FIELDS,
    GROUPS,
    _typed,
    check_fields,
    did_you_mean,
    parse_log_to,
    setting_flag,
)
from gptspeed.config.declare import ATTN_WINDOW_MULTIPLE, AUTO_BATCH_SIZE, MAX_GRAD_ACCUM, _shown
from gptspeed.config.model import GPTConfig
from gptspeed.config.optim import OptimConfig
from gptspeed.config.runtime import RuntimeConfig
from gptspeed.config.train import TrainConfig
from gptspeed.configio import config_yaml, read_config_file
from gptspeed.errors import GptspeedError, show_value

# the index of the settings: gptspeed.config.checks declares GROUPS and FIELDS, the groups are known here
GROUPS.update(model=GPTConfig, optim=OptimConfig, train=TrainConfig, runtime=RuntimeConfig)
FIELDS.update({f.name: f for cls in GROUPS.values() for f in dataclasses.fields(cls)})
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
# every companion a setting declares is a setting (a misspelt one would switch its rule off)
assert all(
    other in FIELDS
    for f in FIELDS.values()
    for other in [f.metadata.get(k) for k in ("needs", "replaced_by", "starts")]
    + [*(f.metadata.get("only_with") or {})]
    + [(f.metadata.get("below") or ("max_steps",))[0]]
    if other is not None
), "a companion names no setting"
# Settings that name a file or folder (``path=True``): expand_path_setting expands their ``~``
PATH_SETTINGS = frozenset(name for name, f in FIELDS.items() if f.metadata.get("path"))


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    preset: str = "gpt2"

    def groups(self):
        return {"model": self.model, "optim": self.optim, "train": self.train, "runtime": self.runtime}

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.train.batch_size * self.model.block_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, source: str = "configuration") -> RunConfig:
        """Rebuild from :meth:`to_dict` output (a checkpoint's or config.json's). Raises
        GptspeedError naming ``source`` for anything malformed: not a dict, a group that is not an
        object, an unknown field (or one of another group), a value of the wrong type. A missing
        group or field takes its default; top-level keys other than the four groups and ``preset``
        (``derived``, ``environment``, an imported model's ``source``) are not settings: ignored."""
        if not isinstance(d, dict):
            raise GptspeedError(f"{source}: expected a JSON object, got {type(d).__name__}")
        built = {}
        for name, cls_ in GROUPS.items():
            values = d.get(name, {})
            if not isinstance(values, dict):
                raise GptspeedError(f"{source}: '{name}' must be an object, got {type(values).__name__}")
            built[name] = cls_(**{k: _typed(cls_, k, v, source) for k, v in values.items()})
        preset_name = d.get("preset", "custom")
        if not isinstance(preset_name, str):
            raise GptspeedError(f"{source}: 'preset' must be a string")
        return cls(**built, preset=preset_name)

    def apply_file(self, path: str) -> RunConfig:
        """A copy with the settings of a config file applied (:func:`read_config_file`: YAML, or
        JSON for a ``.json`` file): nested like config.json (``{"model": {"n_layer": 4}, "optim":
        {...}}``) or flat (``{"n_layer": 4, "lr": 1e-3}``); ``preset``, ``derived`` and
        ``environment`` are not settings and are ignored here. Raises GptspeedError (one line) for
        an unreadable file, an unknown setting (naming the nearest valid one) or a wrong type."""
        source = f"config file {path}"
        flat: dict[str, Any] = {}
        for k, v in read_config_file(path).items():
            if k in self.groups():
                if not isinstance(v, dict):
                    raise GptspeedError(f"{source}: {k!r} must be a mapping of settings, got {v!r}"[:300])
                flat.update(v)
            elif k not in ("preset", "derived", "environment"):
                flat[k] = v
        return self.override(check_settings(flat, source))

    def override(self, values: dict[str, Any]) -> RunConfig:
        """A copy with fields replaced by name (flat: ``{"n_layer": 4, "lr": 1e-3}``). Every value a
        configuration gets from a preset's user -- a flag, a config file, :func:`gptspeed.api.make_config`
        -- comes through here: a path-valued setting has its ``~`` expanded (:func:`expand_path_setting`)."""
        cfg = copy.deepcopy(self)
        for name, value in values.items():
            for group in cfg.groups().values():
                if name in {f.name for f in dataclasses.fields(group)}:
                    setattr(group, name, expand_path_setting(name, value))
                    break
            else:
                raise KeyError(name)
        return cfg

    def warmup_steps(self) -> int:
        """Warm-up steps in effect: ``round(warmup_ratio * max_steps)`` when a ratio is given, else
        ``optim.warmup_steps``."""
        if self.optim.warmup_ratio is not None:
            return round(self.optim.warmup_ratio * self.train.max_steps)
        return self.optim.warmup_steps

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-steps per optimizer step; raises GptspeedError if the batch does not divide."""
        per_step = self.tokens_per_micro_batch * world_size
        total = self.train.total_batch_tokens or per_step
        if total % per_step != 0:
            raise GptspeedError(
                f"--total-batch-tokens {total} is not a multiple of batch_size * seq_len * world_size "
                f"= {self.train.batch_size} * {self.model.block_size} * {world_size} = {per_step}"
            )
        if total // per_step > MAX_GRAD_ACCUM:
            raise GptspeedError(
                f"--total-batch-tokens {total:,} takes {total // per_step:,} micro-batches of batch_size * seq_len * "
                f"world_size = {per_step:,} tokens per optimizer step, more than {MAX_GRAD_ACCUM:,}: lower "
                "--total-batch-tokens or raise --batch-size"
            )
        return total // per_step

    def validate(self, world_size: int | None = None, given: collections.abc.Collection[str] | None = None) -> None:
        """Check everything that can be checked before touching data or devices, for ``world_size``
        processes (None: as torchrun's environment says, :func:`world_from_env`): every field's
        declared type, choices and range (:func:`check_fields`), then the rules between fields, then
        that no setting the user gave does nothing (:func:`check_companions`; ``given``: their names,
        default :meth:`user_settings`).
        Called once, where a configuration is resolved (:func:`gptspeed.configure.build_train_config`;
        :func:`gptspeed.api.train`, whose configuration a user may have changed since; the bench's
        rungs and tuned configurations; :func:`gptspeed.resume.resolve_run` after ``--batch-size
        auto`` sets B): what runs it relies on it. GptspeedError naming the setting."""
        if world_size is None:
            world_size = world_from_env()[1]
        self.model.validate()
        for group in (self.optim, self.train, self.runtime):
            check_fields(group)
        t, r = self.train, self.runtime
        if self.runtime.fp8:
            from gptspeed.fp8 import check_fp8_shapes  # imports torch: only when --fp8 is asked for

            check_fp8_shapes(t.batch_size, self.model.block_size, self.model)
        if self.runtime.fp8_lm_head:
            from gptspeed.fp8 import check_fp8_lm_head  # imports torch: only when --fp8-lm-head is asked for

            check_fp8_lm_head(t.batch_size, self.model.block_size, self.model)
        if self.model.residual_dtype == "bfloat16" and r.dtype not in ("auto", "bfloat16"):
            raise GptspeedError(
                f"--residual-dtype bfloat16 needs bf16 autocast; this run has --dtype {r.dtype}: use "
                "--dtype bfloat16, or --residual-dtype float32"
            )
        if r.cast_weights_once and (r.parallel != "fsdp" or r.dtype not in ("auto", "bfloat16")):
            raise GptspeedError(
                f"--cast-weights-once keeps FSDP2's bf16 weights between micro-steps: it needs "
                f"--parallel fsdp (one process may use it) and --dtype bfloat16; this run has "
                f"--parallel {r.parallel} --dtype {r.dtype}"
            )
        if self.optim.group_lr("head") is not None and self.model.tie_embeddings:
            raise GptspeedError(
                "--head-lr is the untied LM head's learning rate; this run ties the head to the token "
                "embedding: add --no-tie-embeddings, or use --embed-lr for the tied weight"
            )
        parse_log_to(t.log_to)
        check_tail_average(t)
        if r.sdpa_backend != "auto" and self.model.attention != "sdpa":
            raise GptspeedError(
                f"--sdpa-backend {r.sdpa_backend} chooses the kernel of --attention sdpa; this run "
                f"has --attention {self.model.attention}"
            )
        if t.batch_size == AUTO_BATCH_SIZE:
            if t.total_batch_tokens is None:
                raise GptspeedError("--batch-size auto needs --total-batch-tokens (the global batch to keep)")
            if t.total_batch_tokens % (self.model.block_size * world_size):
                raise GptspeedError(
                    f"--total-batch-tokens {t.total_batch_tokens} is not a multiple of seq_len * "
                    f"world_size = {self.model.block_size * world_size}"
                )
        else:
            self.grad_accum_steps(world_size)
        names = self.user_settings(given)
        check_companions(self, names, world_size)
        self._validated_as = (world_size, self.to_dict())  # what validate_if_changed compares
        self._given = names

    def user_settings(self, given: collections.abc.Collection[str] | None = None) -> frozenset[str]:
        """The settings the user gave, by name: ``given`` where the caller knows them
        (:func:`gptspeed.configure.build_train_config`: the flags, a config file's changed values); else
        those of the last :meth:`validate` and any changed since (``cfg.optim.decay_ratio = 0.3`` after
        :func:`gptspeed.api.make_config`); else, for a configuration never validated, those differing
        from its preset's (the defaults where its preset is none of :data:`PRESETS`)."""
        if given is not None:
            return frozenset(name for name in given if name in FIELDS)
        before = getattr(self, "_validated_as", None)
        if before is not None:
            return getattr(self, "_given", frozenset()) | {
                name for name in FIELDS if before[1][_GROUP_OF[name]][name] != _value(self, name)
            }
        return frozenset(changed_settings(PRESETS.get(self.preset) or RunConfig(), self))

    def validate_if_changed(self, world_size: int | None = None) -> None:
        """:meth:`validate`, unless it passed on this configuration as it is now (no setting changed
        since) for as many processes: :func:`gptspeed.api.train` takes a configuration that was
        resolved and validated by :func:`gptspeed.api.make_config`, and that its user may have
        changed since (``cfg.optim.optimizer = "lion"``). GptspeedError as :meth:`validate`."""
        if world_size is None:
            world_size = world_from_env()[1]
        if getattr(self, "_validated_as", None) != (world_size, self.to_dict()):
            self.validate(world_size)

    def run_defining(self) -> dict[str, Any]:
        """The settings that define the run (declared ``run_defining``), by name: a resume that
        changes one of them would not continue the same run (:func:`run_defining_diff`)."""
        return {
            name: getattr(group, name)
            for group in self.groups().values()
            for name, f in {f.name: f for f in dataclasses.fields(group)}.items()
            if f.metadata.get("run_defining")
        }


# how a warm-up's schedule rounds a start value (gptspeed.schedules), for value_in_effect's error lines
_ROUNDED = {
    "seq_len_start": "rounded up to a halving of --seq-len",
    "attn_window_start": f"rounded up to a multiple of {ATTN_WINDOW_MULTIPLE} tokens, at most --attn-window",
    "batch_start_tokens": "rounded down to whole micro-batches of --batch-size x --seq-len x processes",
}


def value_in_effect(cfg: RunConfig, name: str, world_size: int = 1) -> Any:
    """The value setting ``name`` takes in the run ``cfg`` describes, where a warm-up's schedule rounds it
    (:mod:`gptspeed.schedules` at step 0; ``tests/test_config.py`` checks they agree): ``--seq-len-start`` up
    to a halving of ``--seq-len``; ``--attn-window-start`` up to a multiple of :data:`ATTN_WINDOW_MULTIPLE`
    tokens, at most the window; ``--batch-start-tokens`` (default one micro-batch) in whole micro-batches of
    ``world_size`` processes, at least one and at most the full batch; ``--total-batch-tokens``, default one
    micro-batch a process -- both None while ``--batch-size auto`` leaves the micro-batch unknown. Any other
    setting: its value."""
    m, t = cfg.model, cfg.train
    if name == "seq_len_start":
        T, start = m.block_size, min(t.seq_len_start, m.block_size)
        return min(T >> k for k in range(T.bit_length()) if (T >> k) << k == T and T >> k >= start)
    if name == "attn_window_start":
        W, step = m.attn_window, ATTN_WINDOW_MULTIPLE
        return min(W, -(-min(m.attn_window_start, W) // step) * step)
    if name in ("batch_start_tokens", "total_batch_tokens"):
        micro = t.batch_size * m.block_size * world_size
        if not micro:
            return None
        full = max(1, (t.total_batch_tokens or micro) // micro)
        start = min(full, max(1, (t.batch_start_tokens or micro) // micro))
        return (full if name == "total_batch_tokens" else start) * micro
    return _value(cfg, name)


def check_tail_average(t: TrainConfig) -> None:
    """GptspeedError when ``--ema-tail-ratio`` is on but its tail holds fewer than 2 of ``--max-steps``: the
    average would be the last weights, so the setting would do nothing."""
    if t.ema_tail_ratio and round(t.ema_tail_ratio * t.max_steps) < 2:
        raise GptspeedError(
            f"--ema-tail-ratio {t.ema_tail_ratio:g} of --max-steps {t.max_steps} averages "
            f"{round(t.ema_tail_ratio * t.max_steps)} step(s), so it would change nothing: "
            f"give at least {2 / t.max_steps:.3g}, or drop it"
        )


def setting_on(cfg: RunConfig, name: str) -> bool:
    """Whether setting ``name`` is on in ``cfg``: not None, off, 0 or empty, nor its declared ``off`` value
    (``--sampling sequential``)."""
    value, meta = _value(cfg, name), FIELDS[name].metadata
    return value not in (None, False, 0, "") and not ("off" in meta and value == meta["off"])


def _value(cfg: RunConfig, name: str) -> Any:
    return getattr(getattr(cfg, _GROUP_OF[name]), name)


def _as_flag(name: str, value: Any) -> str:
    """Setting ``name`` at ``value`` as its flag says it: ``--seq-len-start 32``, ``--unet-skips``, ``--no-qk-norm``."""
    flag = setting_flag(name)
    if isinstance(value, bool):
        off = "--no-" + flag[2:] if FIELDS[name].metadata.get("kind") == "bool" else f"no {flag}"
        return flag if value else off
    return f"{flag} unset" if value in (None, "") else f"{flag} {value}"


def inert_reason(cfg: RunConfig, name: str) -> str | None:
    """Why setting ``name`` does nothing in ``cfg`` by what it declares it acts with (``needs``,
    ``only_with``, ``replaced_by``; :func:`_f`), as the one line :func:`check_companions` raises (what is
    wrong, what to do); None when it acts."""
    meta, this, flag = FIELDS[name].metadata, _as_flag(name, _value(cfg, name)), setting_flag(name)
    needs = meta.get("needs")
    if needs and not setting_on(cfg, needs):
        nflag, nvalue = setting_flag(needs), _value(cfg, needs)
        has = "" if isinstance(nvalue, bool) else f" (this run has {_as_flag(needs, nvalue)})"
        return f"{this} does nothing without {nflag}{has}: {'add' if isinstance(nvalue, bool) else 'set'} {nflag}, or drop {flag}"
    for other, where in (meta.get("only_with") or {}).items():
        if not where.test(value := _value(cfg, other)):
            oflag = setting_flag(other)
            fix = where.fix or f"give {oflag} {where}"
            return (
                f"{this} acts only with {oflag} {where}; this run has {_as_flag(other, value)}: {fix}, or drop {flag}"
            )
    replaced_by = meta.get("replaced_by")
    if replaced_by and setting_on(cfg, replaced_by):
        return f"{this} does nothing: {_as_flag(replaced_by, _value(cfg, replaced_by))} replaces it; give one of them"
    return None


def _below_reason(cfg: RunConfig, name: str, world_size: int) -> str | None:
    """The one line when setting ``name``'s value in effect is not below the setting its ``below`` names
    (:func:`value_in_effect`), or None."""
    target, why = FIELDS[name].metadata["below"]
    x, y = value_in_effect(cfg, name, world_size), value_in_effect(cfg, target, world_size)
    if x is None or y is None or x < y:
        return None

    def shown(n: str, effect: Any) -> str:
        raw = _value(cfg, n)
        if raw is None:
            return f"{setting_flag(n)} unset ({effect:,} in effect)"
        return _as_flag(n, raw) + (f" ({_ROUNDED[n]}: {effect:,})" if effect != raw else "")

    flag, tflag = setting_flag(name), setting_flag(target)
    least = copy.deepcopy(cfg)  # at its least value: does lowering it help at all?
    setattr(getattr(least, _GROUP_OF[name]), name, FIELDS[name].metadata.get("min", 0))
    fix = f"lower {flag} or raise {tflag}" if value_in_effect(least, name, world_size) < y else f"raise {tflag}"
    return f"{shown(name, x)} is not below {shown(target, y)}: {why}; {fix}"


def _given_on(cfg: RunConfig, name: str) -> bool:
    """Whether a given setting asks for something: not None or False, nor its declared ``off`` value."""
    value, meta = _value(cfg, name), FIELDS[name].metadata
    return value is not None and value is not False and not ("off" in meta and value == meta["off"])


def check_companions(cfg: RunConfig, given: collections.abc.Collection[str], world_size: int = 1) -> None:
    """GptspeedError (one line: what is wrong, what to do) for a setting the user gave (``given``: the
    names set by a flag, a ``--config`` file or a make_config keyword) that would do nothing in ``cfg``, as
    each setting declares (:data:`COMPANION_KEYS`): without the setting it ``needs`` on, without the values
    its ``only_with`` names, beside the setting it is ``replaced_by``, or -- given, or the warm-up whose
    start it ``starts`` given -- not ``below`` the setting it warms up to. A setting given at its ``off``
    value asks for nothing. What a preset or recipe set and the user did not give is not checked: it is
    theirs (docs/reliability.md)."""
    started_by = {f.metadata["starts"]: name for name, f in FIELDS.items() if f.metadata.get("starts")}
    for name, f in FIELDS.items():
        meta = f.metadata
        own = name in given and _given_on(cfg, name)
        if own and (why := inert_reason(cfg, name)):
            raise GptspeedError(why)
        needs, warm_up = meta.get("needs"), started_by.get(name)
        acts = setting_on(cfg, needs) if needs else own
        asked = own or (warm_up in given and setting_on(cfg, warm_up))
        if meta.get("below") and acts and asked and (why := _below_reason(cfg, name, world_size)):
            raise GptspeedError(why)


def drop_inert(cfg: RunConfig, names: collections.abc.Collection[str], base: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with each setting of ``names`` that does nothing in it (:func:`inert_reason`) set
    back to its value in ``base``: a recipe's setting the user's own made inert (``--recipe modern
    --lr-schedule cosine``: the recipe's ``--decay-ratio``) is not kept, so the configuration holds nothing
    that does nothing, and its ``--print-config`` reads back as the same run."""
    out = copy.deepcopy(cfg)
    for name in names:
        if _given_on(out, name) and inert_reason(out, name):
            setattr(getattr(out, _GROUP_OF[name]), name, _value(base, name))
    return out


def companions_text(meta: Any) -> str:
    """What a setting's declaration (its field's ``meta``) says it acts with (:data:`COMPANION_KEYS`), in
    words, for docs/settings.md: "only with --lr-schedule wsd", "needs --seq-len-warmup-steps", "replaced by
    --warmup-ratio", "below --seq-len"; empty when it acts alone."""
    parts = [f"needs `{setting_flag(meta['needs'])}`"] if meta.get("needs") else []
    parts += [f"only with `{setting_flag(k)}` {w}" for k, w in (meta.get("only_with") or {}).items()]
    parts += [f"replaced by `{setting_flag(meta['replaced_by'])}`"] if meta.get("replaced_by") else []
    if meta.get("below"):
        parts.append(f"below `{setting_flag(meta['below'][0])}` (else {meta['below'][1]})")
    parts += [f"warms up from `{setting_flag(meta['starts'])}`"] if meta.get("starts") else []
    unless = f"unless `{_shown(meta['off'])}`: " if parts and "off" in meta else ""  # its off value asks nothing
    return unless + "; ".join(parts)


def changed_settings(a: RunConfig, b: RunConfig) -> set[str]:
    """The names of the settings whose values differ between ``a`` and ``b``."""
    return {name for name in FIELDS if _value(a, name) != _value(b, name)}


def expand_path_setting(name: str, value: Any) -> Any:
    """``value`` of setting ``name`` with a leading ``~`` expanded (``os.path.expanduser``) when the
    setting is a path (``path=True`` in its field: ``out``, ``data``, ``init_from``); for
    ``data``, the path after ``jsonl:`` too (``hf:NAME`` is a dataset name, left alone), and each
    folder of an inline mixture (``~/a=0.7,~/b=0.3``: :mod:`gptspeed.data.mixture`). Other
    settings and non-strings are returned unchanged."""
    if not isinstance(value, str) or name not in PATH_SETTINGS:
        return value
    if name == "data" and value.startswith("jsonl:"):
        return "jsonl:" + os.path.expanduser(value[len("jsonl:") :])
    if name == "data" and value.startswith("hf:"):
        return value
    if name == "data" and "=" in value and not os.path.isdir(os.path.expanduser(value)):  # a mixture: each folder's
        return ",".join(os.path.expanduser(part.strip()) for part in value.split(","))
    return os.path.expanduser(value)


def check_settings(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Flat settings (``{"n_layer": 4, "lr": 1e-3}``) checked against the configuration's
    fields: returned with their values typed (an int for a float field becomes a float, ``auto``
    for ``batch_size`` becomes :data:`AUTO_BATCH_SIZE`). Raises GptspeedError (one line, naming
    ``source``) for an unknown name -- with the nearest valid one -- or a value of the wrong type."""
    owners = {
        f.name: cls for cls in (GPTConfig, OptimConfig, TrainConfig, RuntimeConfig) for f in dataclasses.fields(cls)
    }
    checked = {}
    for k, v in values.items():
        if not isinstance(k, str) or k not in owners:
            raise GptspeedError(f"{source}: unknown setting {show_value(k)}{did_you_mean(str(k)[:100])}"[:300])
        checked[k] = _typed(owners[k], k, v, source)
    return checked


def config_to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as the YAML file ``gptspeed train --print-config`` prints: every setting, nested by
    group (model, optim, train, runtime) under the preset's name, so that ``--config FILE``
    reproduces the run (:func:`gptspeed.configio.config_yaml`). ``--batch-size auto`` is written as ``auto``."""
    d = cfg.to_dict()
    if d["train"]["batch_size"] == AUTO_BATCH_SIZE:
        d["train"]["batch_size"] = "auto"
    return config_yaml({"preset": d.pop("preset"), **d})


def run_defining_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Names of the run-defining settings (declared ``run_defining=True``, :meth:`RunConfig.run_defining`)
    that differ between ``a`` and ``b``; a model setting is named ``model.NAME``."""
    ra, rb = a.run_defining(), b.run_defining()
    model = {f.name for f in dataclasses.fields(GPTConfig)}
    return [f"model.{k}" if k in model else k for k in ra if ra[k] != rb[k]]


def world_from_env() -> tuple[int, int]:
    """``(rank, world_size)`` as torchrun sets them (RANK, WORLD_SIZE); ``(0, 1)`` without torchrun.
    GptspeedError if they are not integers or the rank is out of range."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise GptspeedError(f"RANK / WORLD_SIZE are not integers ({e}): launch with torchrun") from e
    if world < 1 or not 0 <= rank < world:
        raise GptspeedError(f"RANK {rank} / WORLD_SIZE {world} are inconsistent: launch with torchrun")
    return rank, world


# ---------------------------------------------------------------------------------------- presets
def _preset(model: dict, optim: dict | None = None, train: dict | None = None) -> RunConfig:
    return RunConfig(model=GPTConfig(**model), optim=OptimConfig(**(optim or {})), train=TrainConfig(**(train or {})))


# GPT-2 shapes from Radford et al. 2019 (table 2); learning rates from GPT-3 (Brown et al. 2020,
# table 2.1) for the same sizes; 524,288 tokens per step and 715 warm-up steps as build-nanogpt
# (GPT-3's 0.5M batch and 375M warm-up tokens); 19,073 steps = 10B tokens.
_GPT2_TRAIN = dict(total_batch_tokens=524_288, max_steps=19_073)
PRESETS: dict[str, RunConfig] = {
    # seconds on a CPU: for tests and smoke runs
    "pico": _preset(
        dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
        dict(lr=1e-3, warmup_steps=5),
        dict(batch_size=8, max_steps=50, log_every=5, eval_every=25, eval_tokens=2048, save_every=0),
    ),
    # minutes on a laptop CPU: the README's quickstart on tinyshakespeare
    # --softmax data: tiny Shakespeare holds 11,707 of GPT-2's 50,257 tokens, and the full LM head was ~89% of a
    # step's FLOPs; the 4x cheaper head buys 350 steps in the time 200 took (benchmarks/LOG.md, "quickstart")
    "nano": _preset(
        dict(n_layer=4, n_head=4, n_embd=128, block_size=128, softmax="data"),
        dict(lr=2e-3, warmup_steps=20),
        dict(batch_size=16, max_steps=350, log_every=10, eval_every=175, eval_tokens=32768, save_every=175),
    ),
    "gpt2": _preset(dict(n_layer=12, n_head=12, n_embd=768), dict(lr=6e-4), dict(batch_size=16, **_GPT2_TRAIN)),
    "gpt2-medium": _preset(dict(n_layer=24, n_head=16, n_embd=1024), dict(lr=3e-4), dict(batch_size=16, **_GPT2_TRAIN)),
    "gpt2-large": _preset(dict(n_layer=36, n_head=20, n_embd=1280), dict(lr=2.5e-4), dict(batch_size=8, **_GPT2_TRAIN)),
    "gpt2-xl": _preset(dict(n_layer=48, n_head=25, n_embd=1600), dict(lr=2e-4), dict(batch_size=4, **_GPT2_TRAIN)),
}
for _name, _cfg in PRESETS.items():
    _cfg.preset = _name


# Named recipes (``gptspeed train --recipe NAME``, bench race's arms): settings applied on top of the preset,
# before a config file and the flags. gpt2: the architecture and schedule of GPT-2 as the presets have them.
# modern: Muon with the speedrun lineage's architecture switches, the combination that won the race on the CPU at
# the nano preset (benchmarks/LOG.md, "Time to quality"; alone, QK-norm and RMSNorm did not help there): rotary
# positions, QK-norm, ReLU², RMSNorm, a WSD schedule. Muon refuses float16, so on a GPU without bf16 it needs
# --dtype float32 (or --optimizer adamw). Left out
# because they lost there: the untied head (1.05x the step time), logit soft-capping (1.19x); with zero-initialised
# projections, the three together took more steps to the target, not fewer (docs/race.md). Each stays a switch.
RECIPES: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "modern": dict(
        optimizer="muon", pos_emb="rope", qk_norm=True, mlp="relu2", norm="rmsnorm", lr_schedule="wsd", decay_ratio=0.4
    ),
}
# modern + the speedrun's value embeddings and per-group Adam rates, with a short warm-up (the speedrun's Muon runs
# without one). Tuned at the nano preset on a 100-step budget (docs/race.md): rates of 6e-3 (3x nano's --lr) and a 2-step
# warm-up, declared relative to --lr and --max-steps so they scale with the preset (at gpt2: 1.8e-3, 2% of the steps)
RECIPES["speedrun"] = dict(
    RECIPES["modern"], value_embeds=1, embed_lr_ratio=3.0, scalar_lr_ratio=3.0, warmup_ratio=0.02
)
# a recipe's setting on the left yields to the one on the right given by a config file or a flag, which it would replace
RECIPE_YIELDS = {f"{g}_lr_ratio": f"{g}_lr" for g in ("embed", "head", "scalar")} | {"warmup_ratio": "warmup_steps"}


def recipe(name: str, given: collections.abc.Collection[str] = ()) -> dict[str, Any]:
    """The settings of recipe ``name`` (:data:`RECIPES`), less those that would replace a setting in
    ``given`` (the flat names a config file and the flags set after it: :data:`RECIPE_YIELDS`, so
    ``--recipe speedrun --warmup-steps 5`` warms up over 5 steps); GptspeedError naming the recipes for
    another name."""
    if name not in RECIPES:
        raise GptspeedError(
            f"unknown recipe {name!r}: choose one of {', '.join(RECIPES)}{did_you_mean(name, list(RECIPES))}"
        )
    return {k: v for k, v in RECIPES[name].items() if RECIPE_YIELDS.get(k) not in given}


def preset(name: str) -> RunConfig:
    """A fresh copy of the named preset; GptspeedError for an unknown name."""
    if name not in PRESETS:
        raise GptspeedError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
