"""Experiment trackers: every metrics record also goes to TensorBoard and/or Weights & Biases.

``--log-to tensorboard,wandb`` (``metrics.jsonl`` is always written; see :class:`gptspeed.metrics.RunLog`).
Each tracker is the tracker's own library used as its documentation says -- nothing re-implemented:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package:
  ``pip install 'gptspeed[tensorboard]'``) writing event files to ``RUN_DIR/tensorboard``; one
  scalar per numeric field of a record, tagged with the field's name and placed at the record's
  ``step``; the resolved configuration as hyperparameters (the HParams dashboard) and as YAML text.
  ``purge_step`` makes TensorBoard hide the events of steps a resume redoes (and, for a new run,
  anything an earlier failed attempt in the folder logged).
- ``wandb``: ``wandb.init(project=--wandb-project, name=--wandb-run-name or the run folder's
  name, dir=RUN_DIR, config=the resolved configuration)`` (on ``--resume`` also ``id=`` the kept
  id and ``resume="allow"``); records are
  logged with their own field names and ``step`` as the x-axis (``define_metric``), so the steps
  a resume redoes are logged again rather than refused by W&B's monotonic step. The run id is kept
  in ``RUN_DIR/wandb_run_id``: ``--resume`` continues the same W&B run. ``WANDB_MODE=offline``
  (and every other ``WANDB_*`` variable) is read by wandb itself.

Only rank 0 has trackers (it alone has a :class:`~gptspeed.metrics.RunLog`). A tracker that cannot
start -- its package missing, not logged in, no network -- is one line on stderr at start and the
run goes on without it; one that fails later is dropped by the RunLog with one line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from gptspeed.config import parse_log_to
from gptspeed.fileio import write_text_atomic

WANDB_ID_FILE = "wandb_run_id"  # RUN_DIR/wandb_run_id: the W&B run a --resume continues
TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard: TensorBoard's event files


class Tracker(Protocol):
    """What :class:`gptspeed.metrics.RunLog` needs of a tracker."""

    name: str

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics record (``metrics.jsonl``'s fields; ``step`` is its x-axis)."""

    def close(self) -> None:
        """Flush and finish; called once at the end of training."""


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record (bools as 0/1), ``step`` and None values left out."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"n_layer": 2}}`` -> ``{"model.n_layer": 2}`` (nested dicts joined with dots)."""
    flat: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


class TensorBoardTracker:
    """Records as TensorBoard scalars in ``RUN_DIR/tensorboard`` through
    ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        run_dir: the run folder.
        config: the resolved configuration (``RunConfig.to_dict()``), written as hyperparameters.
        resume_step: the checkpoint step a resume continues from (None for a new run): events of
            later steps, which are about to be redone, are purged (``SummaryWriter(purge_step=)``);
            a new run purges from step 0 (what a failed earlier attempt in this folder logged).

    Raises:
        ImportError: the ``tensorboard`` package is not installed.
    """

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=0 if resume_step is None else resume_step + 1)
        exp, ssi, self._session_end = hparams(
            {k: v for k, v in flatten(config).items() if isinstance(v, (bool, int, float, str))},
            {"train_loss": 0.0, "val_loss": 0.0},
        )  # the metrics the HParams table shows (their tags)
        self.writer.file_writer.add_summary(exp)
        self.writer.file_writer.add_summary(ssi)
        from gptspeed.config import RunConfig, config_to_yaml

        text = config_to_yaml(RunConfig.from_dict(config))
        self.writer.add_text("config", "".join("    " + line + "\n" for line in text.splitlines()))
        self.writer.flush()

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a record is rare (one per log step): make it visible at once

    def close(self) -> None:
        self.writer.file_writer.add_summary(self._session_end)
        self.writer.close()


class WandbTracker:
    """Records logged to a Weights & Biases run through ``wandb.init`` / ``run.log``.

    Args:
        run_dir: the run folder (wandb writes its files under ``RUN_DIR/wandb``).
        config: the resolved configuration (``RunConfig.to_dict()``): the W&B run's config; its
            ``train.wandb_project`` and ``train.wandb_run_name`` name the project and run.
        resume_step: not None when resuming: the run id in ``RUN_DIR/wandb_run_id`` is reused
            (``resume="allow"``), so the W&B run continues; otherwise wandb makes a new id.

    Raises:
        ImportError: wandb is not installed; whatever ``wandb.init`` raises (not logged in:
            ``wandb.errors.UsageError``; network errors).
    """

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None = None):
        import wandb

        run_dir = Path(run_dir)
        train = config.get("train", {})
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else None
        self.run = wandb.init(
            project=train.get("wandb_project") or "gptspeed",
            name=train.get("wandb_run_name") or run_dir.resolve().name,
            id=run_id or None,
            resume="allow" if run_id else None,
            dir=str(run_dir),
            config=config,
            job_type="train",
        )
        write_text_atomic(id_file, self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # x-axis = the record's step, not wandb's own counter

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if v is not None})

    def close(self) -> None:
        self.run.finish()


# name -> how to open it; tests put failing trackers here
TRACKERS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
INSTALL = {"tensorboard": "pip install 'gptspeed[tensorboard]'", "wandb": "pip install 'gptspeed[wandb]'"}


def open_trackers(
    names: str | Iterable[str],
    run_dir: str | Path,
    config: dict[str, Any],
    resume_step: int | None = None,
    say: Callable[..., Any] = print,
) -> list[Tracker]:
    """The trackers ``names`` asks for (``--log-to``: ``"tensorboard,wandb"`` or a list; ``jsonl``
    is the RunLog's own file and opens nothing), each started for ``run_dir``.

    Args:
        names: tracker names (see :data:`gptspeed.config.TRACKERS`).
        run_dir: the run folder (must exist).
        config: the resolved configuration, ``RunConfig.to_dict()`` form.
        resume_step: the step of the checkpoint a resume continues from, None for a new run.
        say: where the one line naming a started tracker goes (the console, on rank 0).

    Returns the trackers that started. One that cannot start (package missing, not logged in,
    network) is reported in one line on stderr and left out; nothing is raised for it.

    Raises:
        GptspeedError: an unknown tracker name.
    """
    if isinstance(names, str):
        names = parse_log_to(names)
    started: list[Tracker] = []
    for name in names:
        if name == "jsonl":
            continue
        try:
            started.append(TRACKERS[name](Path(run_dir), config, resume_step))
        except ImportError as e:
            _warn(
                f"gptspeed: --log-to {name}: not used ({name} cannot be imported -- {INSTALL[name]}: "
                f"{one_line(e)}); training goes on with metrics.jsonl"
            )
            continue
        except Exception as e:  # noqa: BLE001 -- not logged in, network, a bad setting: never stop the run
            _warn(f"gptspeed: --log-to {name}: not used ({one_line(e)}); training goes on with metrics.jsonl")
            continue
        if name == "tensorboard":
            say(f"tensorboard: logging to {started[-1].log_dir} (view: tensorboard --logdir {Path(run_dir)})")
    return started


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
