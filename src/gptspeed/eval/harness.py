"""``gptspeed eval --run RUN --lm-eval TASKS``: any task of EleutherAI's lm-evaluation-harness (Gao et al.,
"A framework for few-shot language model evaluation", https://github.com/EleutherAI/lm-evaluation-harness)
on a run, through its Hugging Face export.

The run is exported (:func:`gptspeed.hf.export.export_hf`) into a temporary folder, which the harness's
own Python API loads and scores: its ``HFLM`` model (``trust_remote_code=True``: a run with architecture
switches carries gptspeed's modeling code) and ``lm_eval.simple_evaluate`` over the named tasks, found by
its ``TaskManager`` (its registry, plus the task YAMLs of ``--lm-eval-include DIR``). The harness is an
optional dependency (``pip install -e '.[eval]'``); nothing here imports it before it is asked for.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptspeed.errors import GptspeedError

INSTALL = "pip install -e '.[eval]'"
"""What a user without the harness runs (pyproject.toml's ``eval`` extra)."""


@dataclass
class HarnessPlan:
    """The checked request of ``--lm-eval``: the task names, and the harness's ``TaskManager`` that found
    them (made before any model is loaded, so a typo costs no export)."""

    tasks: list[str]
    task_manager: Any
    version: str


def _harness():
    """The harness's modules ``(lm_eval, HFLM, TaskManager)``.

    Raises:
        GptspeedError: lm-eval, or what its ``HFLM`` needs (transformers, accelerate), is not installed:
            one line naming :data:`INSTALL`.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise GptspeedError(
            f"--lm-eval needs lm-evaluation-harness and transformers (missing: {e.name or e}): `{INSTALL}`"
        ) from None
    return lm_eval, HFLM, TaskManager


def plan_lm_eval(
    tasks: str | None, include: str | None = None, run_dir: str | Path | None = None, init_from: str | None = None
) -> HarnessPlan | None:
    """Check ``tasks`` (comma-separated task or group names of the harness, e.g.
    ``"hellaswag,arc_easy"``) against the harness's registry plus the task YAMLs under ``include`` (a
    folder, its ``TaskManager`` ``include_path``). None when neither is given.

    Raises:
        GptspeedError: ``include`` without ``tasks``; no ``run_dir``, or a Hugging Face model
            (``init_from``: the harness loads one itself); the harness is not installed; no task named; ``include`` is not a folder;
            a name the harness does not know (each listed).
    """
    if tasks is None:
        if include is not None:
            raise GptspeedError("--lm-eval-include DIR needs --lm-eval TASKS (the tasks to run)")
        return None
    if init_from is not None:
        raise GptspeedError(
            "--lm-eval evaluates a run (--run RUN_DIR); a Hugging Face model is the harness's own input: "
            f"lm_eval --model hf --model_args pretrained={init_from} --tasks {tasks}"
        )
    if run_dir is None:
        raise GptspeedError("--lm-eval evaluates a run: give --run RUN_DIR")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise GptspeedError("--lm-eval needs task names, comma-separated (e.g. --lm-eval hellaswag,arc_easy)")
    if include is not None and not Path(include).expanduser().is_dir():
        raise GptspeedError(f"--lm-eval-include {include} is not a folder (of the harness's task YAMLs)")
    lm_eval, _, TaskManager = _harness()
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines would bury the JSON's stderr note
    tm = TaskManager(include_path=str(Path(include).expanduser()) if include is not None else None)
    unknown = [n for n in names if not tm.match_tasks([n])]
    if unknown:
        where = f" nor under {include}" if include is not None else " (local task YAMLs: --lm-eval-include DIR)"
        raise GptspeedError(f"lm-eval knows no task {', '.join(unknown)}{where}")
    from importlib.metadata import version

    return HarnessPlan(names, tm, version("lm-eval"))


def run_lm_eval(plan: HarnessPlan, run_dir: str | Path, *, device: str, dtype: str, batch_size: int) -> dict:
    """Score the newest checkpoint of ``run_dir`` on ``plan``'s tasks with the harness: the run exported
    in float32 to a temporary folder (deleted after), loaded by ``HFLM`` on ``device`` (``"cpu"``,
    ``"cuda"``, ``"mps"``, as :func:`gptspeed.runtime.resolve_runtime` resolved it), its forward
    passes under autocast in ``dtype`` (``"bfloat16"`` / ``"float16"``; ``"float32"`` / ``"tf32"``: none),
    as gptspeed's own eval runs, ``batch_size`` requests per forward pass.

    Returns:
        ``{"step", "version", "tasks", "results", "n_samples"}``: the checkpoint's step, the harness's
        version, the tasks asked,
        its per-task metrics as it reports them (``results[task]["acc,none"]``, ...; bootstrap
        standard errors not computed, ``"N/A"``) and each task's sample counts.

    Raises:
        GptspeedError: the run cannot be exported (:func:`gptspeed.hf.export.export_hf`).
    """
    from gptspeed.hf.export import EXPORT_MARKER, export_hf

    lm_eval, HFLM, _ = _harness()
    mixed = dtype if dtype in ("bfloat16", "float16") else None
    with tempfile.TemporaryDirectory(prefix="gptspeed-lm-eval-") as tmp:
        folder = export_hf(run_dir, Path(tmp) / "hf")
        lm = HFLM(
            pretrained=str(folder),
            trust_remote_code=True,
            device=device,
            dtype="float32",
            mixed_precision_dtype=mixed,
            batch_size=batch_size,
        )
        out = lm_eval.simple_evaluate(
            model=lm, tasks=plan.tasks, task_manager=plan.task_manager, bootstrap_iters=0, log_samples=False
        )
        step = json.loads((folder / EXPORT_MARKER).read_text()).get("step")
    return {
        "step": step,
        "version": plan.version,
        "tasks": plan.tasks,
        "results": out["results"],
        "n_samples": out.get("n-samples", {}),
    }
