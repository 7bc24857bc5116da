"""Loss curves as a picture: ``gptspeed plot RUN_DIR [RUN_DIR ...] --out loss.png``.

Two panels: loss against tokens seen (which switches learn better per token) and against wall
time (which get there sooner). Train loss is a solid line, val loss dashed with markers, one
colour per run. Reads each run's ``metrics.jsonl`` (records with ``step``, ``tokens``,
``time_s``, ``train_loss``, ``val_loss``); drawn with matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_atomic


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in file order; lines cut short by a crash are skipped.

    ``time_s`` restarts near 0 when a run is resumed (it is measured from the start of each
    ``fit``): records after such a drop are shifted by the time reached before it, so
    ``time_s`` here is the cumulative training wall time in seconds.

    Raises:
        GptspeedError: the folder or its metrics.jsonl is missing, or it holds no record.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise GptspeedError(f"run folder {run_dir} does not exist")
    if not path.is_file():
        raise GptspeedError(f"{run_dir} has no metrics.jsonl: train it first (`gptspeed train --out {run_dir}`)")
    records, offset, last = [], 0.0, 0.0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(r, dict):
            continue
        t = r.get("time_s")
        if isinstance(t, (int, float)):
            if t + offset < last:  # resumed: the clock started again
                offset = last
            r["time_s"] = last = t + offset
        records.append(r)
    if not records:
        raise GptspeedError(f"{path} holds no records")
    return records


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in records if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Draw train/val loss of ``run_dirs`` against tokens and against wall time (minutes) into
    the PNG ``out`` (written to a temporary file, then renamed). Returns ``out``.

    Raises:
        GptspeedError: a run without metrics (see :func:`read_metrics`), matplotlib missing, or
            ``out`` not writable.
    """
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GptspeedError("plot needs matplotlib: `pip install matplotlib` (or gptspeed[plot])") from None
    names = [d.name or str(d) for d, _ in runs]
    if len(set(names)) < len(names):  # two runs called "out" in different folders: show more path
        names = [str(d) for d, _ in runs]
    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for (run_dir, records), name, color in zip(runs, names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        for ax, x, scale in ((ax_tok, "tokens", 1.0), (ax_time, "time_s", 1 / 60)):
            xs, ys = _series(records, x, "train_loss")
            ax.plot([v * scale for v in xs], ys, color=color, lw=1.2, label=f"{name} train")
            xs, ys = _series(records, x, "val_loss")
            ax.plot([v * scale for v in xs], ys, color=color, lw=1.2, ls="--", marker="o", ms=3, label=f"{name} val")
    ax_tok.set_xlabel("tokens")
    ax_time.set_xlabel("wall time (min)")
    for ax in (ax_tok, ax_time):
        ax.set_ylabel("loss (nats/token)")
        ax.grid(True, alpha=0.3)
    ax_tok.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, lambda f: fig.savefig(f, dpi=120, format="png"))
    except OSError as e:
        raise GptspeedError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return out
