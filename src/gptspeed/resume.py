"""Resolve, then freeze: the configuration a run trains with, and the checkpoint it continues.

:func:`resolve_run` turns what the user gave -- a configuration built from preset, file and flags
(:func:`gptspeed.configure.build_train_config`), the world size, the run folder's checkpoints and,
for ``--batch-size auto``, a probe on the device -- into the final :class:`~gptspeed.config.RunConfig`
and a :class:`ResumePoint`, *before* the trainer and its checkpointer exist. The checkpointer
stores that configuration once; nothing rewrites it afterwards. The policies live here, not in the
training loop: which checkpoint a ``--resume`` takes (:func:`find_resume_point`), whether it may
(:func:`check_resume`: the same run, the same data, the right format), and the global batch a run
keeps when resumed with another number of processes (:func:`keep_global_batch`).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptspeed.checkpoint import (
    data_changed,
    is_sharded,
    latest_valid_checkpoint,
    list_checkpoints,
    read_seal,
    refuse_checkpoints,
    started_run,
)
from gptspeed.config import AUTO_BATCH_SIZE, RunConfig, run_defining_diff
from gptspeed.errors import GptspeedError


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts. ``path``: the checkpoint to load (None: a new run); ``kind``: ``full``
    (a training checkpoint) or ``weights`` (``gptspeed import-hf``'s: the model only, training
    starts at step 0); ``world_size``: the processes it was written by; ``run_id``: the run's id
    (a resumed run keeps its own; a new run draws one)."""

    path: Path | None
    kind: str | None
    world_size: int | None
    run_id: str

    @property
    def continues(self) -> bool:
        """Whether the run continues a training checkpoint (not a new run, not imported weights)."""
        return self.kind == "full"


def resolve_run(
    cfg: RunConfig, rt, data_identity: dict[str, Any] | None, *, say: Callable[..., None] = print
) -> tuple[RunConfig, ResumePoint]:
    """The final configuration (a copy: ``cfg`` is not changed) and resume point of a run on the
    resolved runtime ``rt``, whose folder is locked already. ``data_identity``: the training data's
    (:attr:`gptspeed.data.train_data.TrainData.identity`), compared with a checkpoint's.

    ``cfg`` is valid: validated where it was resolved (:func:`gptspeed.configure.build_train_config`,
    or :func:`gptspeed.api.train` for a configuration a user may have changed since). In order: the
    resume point (refusing a changed run, :func:`find_resume_point`); the global batch kept
    (:func:`keep_global_batch`); ``--batch-size auto`` probed on the device
    (:func:`gptspeed.step.auto_batch_size`) and the configuration it changed validated (the FP8
    shape rule needs B). Raises GptspeedError for anything the user can fix."""
    cfg = copy.deepcopy(cfg)
    point = find_resume_point(cfg, rt, data_identity, say=say)
    if point.continues and rt.device_type == "cpu":
        note_other_thread_count(Path(cfg.train.out), cfg.runtime.threads, say)
    keep_global_batch(cfg, point, rt.world_size)
    if cfg.train.batch_size == AUTO_BATCH_SIZE:
        from gptspeed.step import auto_batch_size

        cfg.train.batch_size = auto_batch_size(cfg, rt, say)
        cfg.validate(rt.world_size)
    return cfg, point


def find_resume_point(
    cfg: RunConfig, rt, data_identity: dict[str, Any] | None, *, say: Callable[..., None] = print
) -> ResumePoint:
    """Without ``--resume``: a new run, refusing a folder that already holds checkpoints. With it:
    the newest valid checkpoint of the run folder (saying which newer ones were skipped, and why),
    checked to continue this run (:func:`check_resume`); when there is none, the run its
    ``config.json`` recorded restarts from step 0 (:func:`restart_point`), or a new run starts --
    unless the folder holds checkpoints that cannot be verified, which are never written over."""
    t = cfg.train
    run_dir = Path(t.out)
    new = ResumePoint(None, None, None, uuid.uuid4().hex)
    if not t.resume:
        refuse_checkpoints(run_dir, "pass --resume to continue it, or choose another --out")
        return new
    path, skipped = latest_valid_checkpoint(run_dir)
    for bad_path, reason in skipped:
        say(f"skipping {bad_path.name}: {reason}")
    if path is None:
        found = [p.name for p in list_checkpoints(run_dir)]
        if found and (run_dir / "metrics.jsonl").is_file():
            found.append("metrics.jsonl")
        # never write over checkpoints that cannot be verified; a run killed before its first save
        # (a metrics.jsonl, no checkpoint) is started again, as resuming it means
        if found:
            raise GptspeedError(
                f"--resume: {run_dir} holds {', '.join(found[:4])}{' ...' if len(found) > 4 else ''} "
                "but no checkpoint that can be verified (each is unsealed or damaged): refusing to "
                "write over them; move them away, or choose another --out"
            )
        started = started_run(run_dir)
        if started is None:
            say(f"--resume: no checkpoint in {run_dir}, starting a new run")
            return new
        return restart_point(run_dir, *started, cfg, data_identity, force=t.force_resume, say=say)
    seal = check_resume(
        path, cfg, data_identity, sharded=rt.parallel == "fsdp", world_size=rt.world_size, force=t.force_resume, say=say
    )
    kind = seal.get("kind", "full")
    run_id = seal.get("run_id") if kind == "full" and isinstance(seal.get("run_id"), str) else new.run_id
    return ResumePoint(path, kind, int(seal.get("world_size", 1)), run_id)


def restart_point(
    run_dir: Path,
    recorded: RunConfig,
    derived: dict[str, Any],
    cfg: RunConfig,
    data_identity: dict[str, Any] | None,
    *,
    force: bool,
    say: Callable[..., None] = print,
) -> ResumePoint:
    """The resume point of a run killed before its first checkpoint, whose ``config.json`` recorded
    ``recorded`` and ``derived`` at its start (:func:`gptspeed.checkpoint.started_run`): it restarts
    from step 0 under its own run id -- refused (GptspeedError), unless ``force``, when ``cfg``
    changes a run-defining setting or the data, so config.json is never written over by another run."""
    changed = run_defining_diff(recorded, cfg)
    if data_changed(derived.get("data"), data_identity):
        changed.append("data")
    if changed and not force:
        raise GptspeedError(
            f"--resume: {run_dir} has no checkpoint yet, and its config.json records another run "
            f"(changed: {', '.join(changed)}): use the original settings, a new --out, or --force-resume "
            "to restart it with these"
        )
    how = f" with changed {', '.join(changed)} (--force-resume)" if changed else ""
    say(f"--resume: no checkpoint in {run_dir} yet: restarting the run of its config.json from step 0{how}")
    run_id = derived.get("run_id")
    return ResumePoint(None, None, None, run_id if isinstance(run_id, str) and run_id else uuid.uuid4().hex)


def note_other_thread_count(run_dir: Path, threads: int, say: Callable[..., None] = print) -> None:
    """Say so when a CPU run resumes with another number of intra-op threads than its config.json
    recorded at the last start (``environment.threads``; ``threads``: ``--threads``, 0 for PyTorch's
    default, which follows the CPU affinity a scheduler gives): MKL's and PyTorch's reductions split
    their work by the thread count, so the losses may then differ from an uninterrupted run's in
    their last bits (docs/reliability.md, exact resume)."""
    import torch

    from gptspeed.fileio import read_user_json

    try:
        env = read_user_json(run_dir / "config.json", "run configuration", max_bytes=1 << 20).get("environment")
    except GptspeedError:
        return
    before = env.get("threads") if isinstance(env, dict) else None
    now = threads or torch.get_num_threads()
    if isinstance(before, int) and not isinstance(before, bool) and before != now:
        say(
            f"note: {run_dir} ran with {before} CPU threads and resumes with {now}: its losses may differ from an "
            f"uninterrupted run's in the last bits; --threads {before} keeps them bit-identical"
        )


def check_resume(
    path: Path,
    cfg: RunConfig,
    data_identity: dict[str, Any] | None,
    *,
    sharded: bool,
    world_size: int,
    force: bool,
    say: Callable[..., None] = print,
) -> dict[str, Any]:
    """Refuse (GptspeedError) to resume ``path`` when it would not continue the same run: a
    run-defining setting changed (:func:`gptspeed.config.run_defining_diff`), other data, or the
    other format (a sharded checkpoint needs ``--parallel fsdp``, a single file needs it off). A
    weights-only checkpoint need only match the model shape. With ``force`` the changes are said
    instead. Reads the seal only. Returns it."""
    seal = read_seal(path) or {}
    if not isinstance(seal.get("config"), dict):
        raise GptspeedError(
            f"checkpoint {path} was written by an older gptspeed (its seal holds no configuration): "
            "resume it with the gptspeed that wrote it"
        )
    full = seal.get("kind") == "full"
    if full:
        if sharded and not is_sharded(path):
            raise GptspeedError(
                f"cannot resume the single-file checkpoint {path.name} with --parallel fsdp: "
                "resume it with --parallel ddp (or one process), or start a new --out"
            )
        if not sharded and is_sharded(path):
            raise GptspeedError(
                f"{path.name} is a sharded (FSDP) checkpoint: resume with --parallel fsdp, or make a "
                f"single file with `gptspeed consolidate --run {path.parent} --out NEW_RUN`"
            )
        if seal.get("world_size", 1) != world_size:  # the loader re-shards its position or refuses (naming both)
            say(f"resuming {path.name} (world size {seal.get('world_size', 1)}) with world size {world_size}")
    changed = run_defining_diff(RunConfig.from_dict(seal["config"], f"checkpoint {path}"), cfg)
    if not full:  # weights only: only the model must match
        changed = [c for c in changed if c.startswith("model.")]
    elif data_changed(seal.get("data"), data_identity):
        changed.append("data")
    if changed and not force:
        raise GptspeedError(
            f"cannot resume {path.name} with a different configuration ({', '.join(changed)}): "
            "use the original settings, a new --out, or --force-resume"
        )
    if changed:
        say(f"--force-resume: continuing {path.name} with changed {', '.join(changed)}")
    return seal


def keep_global_batch(cfg: RunConfig, point: ResumePoint, world_size: int) -> None:
    """Record in ``cfg`` the global batch a run starts with (``--total-batch-tokens`` left unset:
    B x T x the world size the run started with), so that a resume with another number of processes
    keeps it by adjusting the gradient accumulation -- or is refused in one line when it cannot."""
    t = cfg.train
    if t.batch_size == AUTO_BATCH_SIZE:
        return
    if t.total_batch_tokens is None:
        t.total_batch_tokens = t.batch_size * cfg.model.block_size * (point.world_size or world_size)
    try:
        cfg.grad_accum_steps(world_size)
    except GptspeedError:
        if point.path is None:
            raise
        per = t.batch_size * cfg.model.block_size * world_size
        raise GptspeedError(
            f"cannot resume {point.path.name} with {world_size} process(es): its global batch of "
            f"{t.total_batch_tokens:,} tokens is not a multiple of --batch-size x --seq-len x processes = {per:,}; "
            f"resume with {point.world_size or 1} process(es), or with --force-resume and a --batch-size or "
            "--total-batch-tokens that fits (the run then changes)"
        ) from None
