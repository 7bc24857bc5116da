"""The library API, for notebooks and scripts: the same code ``gptspeed train`` and ``gptspeed
sample`` run (:func:`gptspeed.trainer.fit`, :func:`gptspeed.sample.sample_text`), no subprocess.

::

    import gptspeed

    cfg = gptspeed.make_config("nano", data="data/tinyshakespeare", out="runs/nb", max_steps=50)
    summary = gptspeed.train(cfg)                 # {"step", "last_train_loss", "last_val_loss", ...}
    run = gptspeed.load_run("runs/nb")
    run.metrics()                                 # the records of metrics.jsonl
    run.generate("ROMEO:", max_new_tokens=50)     # the continuation, as text

Importing this module imports no torch; :func:`train` and :meth:`Run.generate` do, when called.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from gptspeed.config import RunConfig, check_settings
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError


def make_config(preset: str | None = None, *, config_file: str | Path | None = None, **settings: Any) -> RunConfig:
    """A run configuration, built as ``gptspeed train`` builds it: the preset (default ``gpt2``,
    or the config file's ``preset:``), then ``config_file`` (YAML or JSON), then ``settings`` --
    the flags' names with underscores (``n_layer=4, lr=1e-3, max_steps=100, data=..., out=...,
    log_to="tensorboard"``). With ``resume=True`` and a checkpoint in ``out``, the checkpoint's
    configuration is the base, as for ``gptspeed train --out RUN --resume``.

    Raises:
        GptspeedError: an unknown preset, an unknown setting (the nearest valid one named), a value
            of the wrong type, an unreadable config file, or a configuration that does not validate.
    """
    checked = check_settings(settings, "make_config")
    return build_train_config(preset, checked, str(config_file) if config_file is not None else None)


def train(config: RunConfig, *, echo: bool = True) -> dict[str, Any]:
    """Train as ``config`` says -- what ``gptspeed train`` runs: the data is checked, then
    :func:`gptspeed.trainer.fit`. ``config`` is validated again here, before anything else: a field
    changed after :func:`make_config` (``cfg.optim.optimizer = "lion"``) is refused in one line as
    a flag would be. Console lines are printed when ``echo``.

    Returns the summary: ``step`` (optimizer steps done), ``last_train_loss`` and
    ``last_val_loss`` (nats/token, None when not measured), ``skipped_steps``, ``interrupted``
    (the signal number that stopped training, or None), ``run_dir``.

    Raises:
        GptspeedError: anything the user can fix (no ``data`` / ``out``, bad data, a run folder
            that holds another run, ...) and training that diverges with ``on_nan="stop"``.
    """
    from gptspeed.data.train_data import train_data_for

    if not isinstance(config, RunConfig):
        raise GptspeedError(f"train() takes a RunConfig (gptspeed.make_config(...)), got {type(config).__name__}")
    check_config_shape(config)
    config.validate_if_changed()  # a setting changed since make_config; the data is checked before importing torch
    t = config.train
    if t.data:
        train_data_for(t).close()  # checked before importing torch; the trainer finds (and locks) it again
    from gptspeed.trainer import fit

    return fit(config, echo=echo)


def check_config_shape(config: RunConfig) -> None:
    """GptspeedError (one line) when a configuration was changed into something that is not one:
    a group replaced (``cfg.model = None``), an attribute that is no setting (``cfg.model.nlayer =
    4``, a typo that would train the default silently), a preset that is not a string. The
    settings' values are :meth:`RunConfig.validate`'s business."""
    import dataclasses

    from gptspeed.config import GROUPS, did_you_mean

    for name, cls in {"": RunConfig, **GROUPS}.items():
        obj = getattr(config, name) if name else config
        where = f"config.{name}" if name else "config"
        if type(obj) is not cls:
            raise GptspeedError(f"{where} must be a {cls.__name__} (as make_config made it), got {type(obj).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in vars(obj) if k not in fields and not k.startswith("_")]  # _: gptspeed's own
        if unknown:
            raise GptspeedError(
                f"{where}.{unknown[0]} is not a setting{did_you_mean(unknown[0], fields)}: set one of "
                f"{cls.__name__}'s fields, or pass it to make_config"
            )
    if not isinstance(config.preset, str):
        raise GptspeedError(f"config.preset must be a string, got {type(config.preset).__name__}")


class Run:
    """A run folder, read: its configuration, metrics and model.

    Attributes:
        run_dir: the folder (``Path``).
        config: the :class:`~gptspeed.config.RunConfig` of its newest valid checkpoint (from the
            checkpoint's seal, no loading), or of ``config.json`` when it has no checkpoint yet.
        step: optimizer steps of that checkpoint (None without one).

    The model is loaded (from the newest valid checkpoint, sha256-checked) at the first
    :meth:`generate` and kept.
    """

    def __init__(self, run_dir: str | Path, *, device: str = "auto", dtype: str = "auto"):
        from gptspeed.checkpoint import newest_run_config, read_seal
        from gptspeed.config import DEVICES, DTYPES

        if not isinstance(run_dir, (str, os.PathLike)):
            raise GptspeedError(f"load_run takes a run folder's path, got {type(run_dir).__name__}")
        for what, value, choices in (("device", device, DEVICES), ("dtype", dtype, DTYPES)):
            if value not in choices:
                raise GptspeedError(f"load_run: unknown {what} {value!r}: use one of {', '.join(choices)}"[:300])
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise GptspeedError(
                f"run folder {run_dir} {'is not a folder' if self.run_dir.exists() else 'does not exist'}"
            )
        self.device, self.dtype = device, dtype
        self._loaded = None
        ckpt, config = newest_run_config(self.run_dir)
        self.checkpoint = ckpt
        if ckpt is not None:
            self.config = config
            seal = read_seal(ckpt) or {}
            self.step = seal.get("step")
        elif os.path.lexists(self.run_dir / "config.json"):  # a folder, a FIFO, hostile JSON: one line
            from gptspeed.fileio import read_user_json

            raw = read_user_json(self.run_dir / "config.json", "run configuration", max_bytes=1 << 20)
            self.config = RunConfig.from_dict(
                {k: v for k, v in raw.items() if k not in ("derived", "environment")}, f"{self.run_dir}/config.json"
            )
            self.step = None
        else:
            raise GptspeedError(f"{run_dir} holds neither a checkpoint nor a config.json: not a run folder")

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, preset={self.config.preset!r}, step={self.step})"

    def metrics(self) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` in file order (fields: docs/formats.md, "metrics.jsonl";
        ``time_s`` cumulative over resumes). GptspeedError when there are none."""
        from gptspeed.plot import read_metrics

        return read_metrics(self.run_dir)

    def generate(
        self,
        prompt: str | list[str] = "\n",
        *,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int = 200,
        num_samples: int = 1,
        seed: int = 1337,
        kv_cache: bool = True,
    ) -> str | list[str]:
        """Continue ``prompt`` -- what ``gptspeed sample --run RUN_DIR`` does
        (:func:`gptspeed.sample.sample_text`; the same seed draws the same tokens).

        Args:
            prompt: a text, or a list of texts generated together in one batch.
            max_new_tokens: tokens generated per sample.
            temperature: softmax temperature; 0 is greedy.
            top_k: sample among the k most likely tokens (0 = all).
            num_samples: samples per prompt.
            seed: the sampling generator's seed.
            kv_cache: use the KV cache (False: recompute every position, equal-length prompts only).

        Returns the generated text without the prompt: a ``str`` for one prompt and one sample,
        else a list (prompt by prompt, ``num_samples`` each) -- an empty list for an empty list of
        prompts (as ``[f(p) for p in []]``; the arguments are checked, no model is loaded).

        Raises:
            GptspeedError: bad numbers, an empty prompt, or no valid checkpoint to load.
        """
        from gptspeed.runtime import resolve_runtime
        from gptspeed.sample import check_sample_arguments, load_model, sample_text

        if not isinstance(prompt, (str, list, tuple)) or not all(isinstance(p, str) for p in prompt):
            raise GptspeedError(f"generate: prompt must be a text or a list of texts, got {prompt!r}"[:300])
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        check_sample_arguments(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            num_samples=num_samples,
            kv_cache=kv_cache,
        )  # before the model loads
        if not prompts:
            return []  # no prompt, no sample (sample_text would continue "\n" as the CLI does without --prompt)
        if self._loaded is None:
            model, ckpt = load_model(self.run_dir, resolve_runtime(self.device, self.dtype, compile=False))
            self._loaded = (model, {"run": str(self.run_dir), "step": ckpt["step"]})
        texts = sample_text(
            run=str(self.run_dir),
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            num_samples=num_samples,
            seed=seed,
            device=self.device,
            dtype=self.dtype,
            kv_cache=kv_cache,
            out=io.StringIO(),
            loaded=self._loaded,
        )
        return texts[0] if isinstance(prompt, str) and num_samples == 1 else texts


def load_run(run_dir: str | Path, *, device: str = "auto", dtype: str = "auto") -> Run:
    """The run in ``run_dir`` (:class:`Run`): ``.config``, ``.step``, ``.metrics()``,
    ``.generate(prompt, ...)``. ``device`` / ``dtype`` are those of ``gptspeed sample``
    (``auto``: cuda > mps > cpu; bf16 on GPUs that have it).

    Raises:
        GptspeedError: the folder does not exist or holds no run.
    """
    return Run(run_dir, device=device, dtype=dtype)
