"""``gptspeed consolidate``: a sharded (FSDP2) checkpoint made one file, in one process, without GPUs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from gptspeed.checkpoint.folder import is_run_folder, refuse_foreign_folder
from gptspeed.checkpoint.formats import load_checkpoint, write_checkpoint_file
from gptspeed.checkpoint.paths import CKPT_RE, checkpoint_path, is_sharded, seal_path
from gptspeed.checkpoint.seals import check_checkpoint, latest_valid_checkpoint, read_seal, refuse_checkpoints
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_atomic
from gptspeed.paths import real_path


def _optim_by_index(optim: dict[str, Any], groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_state_dict``'s form) -> the
    index-keyed form ``torch.optim.Optimizer.load_state_dict`` takes: parameters numbered in
    param-group order, as an optimizer built the same way numbers them. ``groups``: the param
    groups of one optimizer (default: all of ``optim``'s)."""
    index: dict[str, int] = {}
    out_groups = []
    for g in optim["param_groups"] if groups is None else groups:
        ids = []
        for name in g["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        out_groups.append({**g, "params": ids})
    return {"state": {index[k]: v for k, v in optim["state"].items() if k in index}, "param_groups": out_groups}


def split_optimizer_state(optim: dict[str, Any], layout: list[list] | None) -> dict[str, Any]:
    """A consolidated (name-keyed) optimizer state -> the optimizer's own ``state_dict`` form:
    one index-keyed dict, or ``{"adamw": ..., "muon": ...}`` for Muon + AdamW, split by
    ``layout`` (``[[name, param groups], ...]`` in optimizer order, from the checkpoint)."""
    if not layout or len(layout) == 1:
        return _optim_by_index(optim)
    out, first = {}, 0
    for name, n_groups in layout:
        out[name] = _optim_by_index(optim, optim["param_groups"][first : first + n_groups])
        first += n_groups
    return out


def _refuse_inside_a_run_or_data_folder(out: Path, where: Path) -> None:
    """GptspeedError when ``where`` (``out`` resolved: the file to write, or the folder) would be
    written inside another run's folder (:func:`~gptspeed.checkpoint.folder.is_run_folder`) or a data
    folder (:func:`gptspeed.data.folder.is_data_folder`): the folder that holds it, or the nearest
    one that exists when it is to be made."""
    from gptspeed.data.folder import is_data_folder

    holder = next((p for p in where.parents if p.exists()), None)
    if where.is_dir():
        holder = where  # an existing folder out: refused as itself (a data folder), or by the run-folder rules
    if holder is None:
        return
    if holder != where and is_run_folder(holder):
        raise GptspeedError(
            f"--out {out} is inside {holder}, another run's folder: consolidate never writes into a run "
            "folder; choose a path outside it"
        )
    if is_data_folder(holder):
        raise GptspeedError(
            f"--out {out} {'is' if holder == where else 'is inside'} {holder}, a prepared data folder: "
            "consolidate never writes into one; choose a path outside it"
        )


def _consolidate_target(out: Path, run_dir: Path, step: int, force: bool) -> Path:
    """The file :func:`consolidate` writes for ``--out out``, after refusing (one GptspeedError
    line each) every ``out`` that would overwrite what is not the user's to lose: a checkpoint's
    name, anything inside the run folder being consolidated, an existing file (without
    ``force``), a file beside it that its seal would replace, a folder with checkpoints, files
    gptspeed did not write, or another run's config.json / metrics.jsonl."""
    import filecmp

    if CKPT_RE.match(out.name.lower()):
        raise GptspeedError(
            f"--out {out} is a checkpoint's name: consolidate never writes over or beside a run's "
            f"checkpoints; name another file (e.g. {out.with_name('model.pt')}) or a new run folder"
        )
    as_file = out.suffix.lower() == ".pt"  # model.PT is a file too, never a folder of that name
    where = (Path(os.path.realpath(out.parent)) / out.name) if as_file else Path(os.path.realpath(out))
    source = Path(os.path.realpath(run_dir))
    if where == source or source in where.parents:
        raise GptspeedError(f"--out {out} is inside {run_dir}, the run being consolidated: choose a path outside it")
    _refuse_inside_a_run_or_data_folder(out, where)
    if not as_file:
        if out.exists() and not out.is_dir():
            raise GptspeedError(
                f"--out {out} is a file: name a FILE.pt to write, or a folder to receive ckpt_{step:08d}.pt"
            )
        refuse_checkpoints(out, "choose a new or empty folder, or a FILE.pt")
        for name in ("config.json", "metrics.jsonl", "tokenizer.json"):  # tokenizer.json: a run of its own tokenizer's
            mine, theirs = run_dir / name, out / name
            if (theirs.exists() or theirs.is_symlink()) and not (
                mine.is_file() and theirs.is_file() and filecmp.cmp(mine, theirs, shallow=False)
            ):
                raise GptspeedError(
                    f"--out {out} already holds a {name} that is not {run_dir}'s: consolidate never "
                    "overwrites another run's files; choose a new or empty folder"
                )
        refuse_foreign_folder(out)
        return checkpoint_path(out, step)
    if out.is_dir():
        raise GptspeedError(
            f"--out {out} is a folder: name a FILE.pt, or a folder without .pt to receive ckpt_{step:08d}.pt"
        )
    seal = seal_path(out)
    if seal.exists() or seal.is_symlink():
        old = read_seal(out)
        if not (seal.is_file() and old is not None and "sha256" in old and "bytes" in old):
            raise GptspeedError(
                f"--out {out} would replace {seal}, which is not a checkpoint's seal: name another file"
            )
    if (out.exists() or out.is_symlink()) and not force:
        raise GptspeedError(f"--out {out} already exists: pass --force to replace it, or name another file")
    return out


def consolidate(run: Path, out: Path, force: bool = False) -> Path:
    """Merge the newest valid sharded (FSDP2) checkpoint of ``run`` (a run folder or a ``.dcp``
    folder) into one single-file checkpoint, in one process and without GPUs: the
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` conversion, read through
    :func:`gptspeed.checkpoint.dcp_reader.load_full` (no pickled code runs, whoever wrote the folder).

    ``out`` ending in ``.pt`` is written as that file (sealed by ``out`` with ``.json``);
    otherwise it is a run folder that receives ``ckpt_{step}.pt`` (and the run's config.json and
    metrics.jsonl), so ``gptspeed sample/eval --run OUT`` and one-process ``train --out OUT
    --resume`` load it. Model weights are full fp32 tensors under the usual names, the optimizer
    state is in the optimizer's own ``state_dict`` form (AdamW, or Muon + AdamW). Returns the
    file written. GptspeedError if ``run`` has no valid sharded checkpoint, or ``out`` is refused
    by :func:`_consolidate_target` (an existing ``out`` file only without ``force``; a checkpoint
    name, a path inside the source run, another run's files never). Every file is written under a
    temporary name and renamed, the checkpoint last.
    """
    from gptspeed.checkpoint.dcp_reader import load_full

    run = Path(run)
    if is_sharded(run):
        src, reason = run, check_checkpoint(run)
        if reason:
            raise GptspeedError(f"checkpoint {run} is not valid: {reason}")
        run_dir = run.parent
    else:
        src, skipped = latest_valid_checkpoint(run)
        run_dir = run
        if src is None:
            why = f": {skipped[0][0].name} is {skipped[0][1]}" if skipped else ""
            raise GptspeedError(f"no valid checkpoint in {run}{why}")
    if not is_sharded(src):
        raise GptspeedError(f"{src} is already a single-file checkpoint: nothing to consolidate")
    meta = load_checkpoint(src, verify=False)
    out = real_path(out)  # new/../victim is victim: checked as the folder the system will write
    target = _consolidate_target(out, run_dir, meta["step"], force)
    full = load_full(src)
    state = {k: v for k, v in meta.items() if k not in ("format", "format_version", "sharded")}
    state["model"] = full["model"]
    if full.get("tail_average"):  # --ema-tail-ratio's average (gptspeed.averaging.PART), sharded like the model
        state["tail_average"] = full["tail_average"]
    state["optimizer"] = split_optimizer_state(full["optimizer"], meta.get("optimizer_layout"))
    state["consolidated_from"] = str(src)
    state["config"] = {**state["config"], "runtime": {**state["config"].get("runtime", {}), "parallel": "auto"}}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target != out:  # a run folder: the run's config.json and metrics.jsonl, then the checkpoint
            for name in ("config.json", "metrics.jsonl", "tokenizer.json"):
                if (run_dir / name).is_file() and not (out / name).exists():
                    with open(run_dir / name, "rb") as src_file:
                        write_atomic(out / name, lambda f, s=src_file: shutil.copyfileobj(s, f))
    except OSError as e:
        raise GptspeedError(f"cannot write to {target.parent}: {e.strerror or e}") from None
    write_checkpoint_file(target, state)
    return target
