"""Training curves as a picture: ``gptspeed plot RUN_DIR [RUN_DIR ...] --out loss.png [--panels loss,tps,lr]``.

Panels (``--panels``, default ``loss``): ``loss`` is two -- loss against tokens seen (which
switches learn better per token) and against wall time (which get there sooner), train loss a
solid line, val loss dashed with markers; ``tps`` is training throughput (tokens/s) against
tokens; ``lr`` the learning rate against tokens. One colour per run, in every panel; the legend
names each run by its folder. Reads each run's ``metrics.jsonl`` (records with ``step``,
``tokens``, ``time_s``, ``train_loss``, ``val_loss``, ``tokens_per_s``, ``lr``); drawn with
matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
import math
import os
import re
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
    if not path.exists():
        raise GptspeedError(f"{run_dir} has no metrics.jsonl: train it first (`gptspeed train --out {run_dir}`)")
    from gptspeed.fileio import read_user_text

    records, offset, last = [], 0.0, 0.0
    for line in read_user_text(path, "metrics log", max_bytes=1 << 30).splitlines():  # a FIFO or a folder: one line
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):  # a line cut short by a crash, or one that is not a record
            continue
        if not isinstance(r, dict):
            continue
        t = _number(r.get("time_s"))  # a non-finite or absurd time is left out, never added to the offset
        if t is not None:
            if t + offset < last:  # resumed: the clock started again
                offset = last
            r["time_s"] = last = t + offset
        records.append(r)
    if not records:
        raise GptspeedError(f"{path} holds no records")
    return records


#: the largest value drawn: float32's largest (every figure a run logs is measured in float32 or
#: counted below 2**53); beyond it -- 1e308, a 400-digit integer -- matplotlib cannot place its ticks
MAX_DRAWN = 3.4028234663852886e38


def _number(v: Any) -> float | None:
    """``v`` as a float to draw, or None: not a number (a string, a bool), not finite (NaN and
    Infinity, which JSON from Python may hold), or beyond :data:`MAX_DRAWN`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer beyond float's range
        return None
    return f if math.isfinite(f) and abs(f) <= MAX_DRAWN else None


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """The points ``(record[x], record[y])`` of the records holding both as drawable numbers
    (:func:`_number`); the others are left out."""
    pts = [(_number(r.get(x)), _number(r.get(y))) for r in records]
    pts = [p for p in pts if p[0] is not None and p[1] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


PANELS = ("loss", "tps", "lr")  # --panels; loss draws two axes (against tokens and against wall time)


def parse_panels(panels: str | list[str] | tuple[str, ...]) -> list[str]:
    """``--panels``: names from :data:`PANELS`, comma-separated or a list, order kept, repeats
    dropped. GptspeedError (naming the nearest valid panel) for an unknown one or none."""
    from gptspeed.config import did_you_mean

    names = [p.strip().lower() for p in (panels.split(",") if isinstance(panels, str) else panels)]
    chosen: list[str] = []
    for name in filter(None, names):
        if name not in PANELS:
            raise GptspeedError(
                f"--panels: unknown panel {name!r}{did_you_mean(name, PANELS)}: choose from {', '.join(PANELS)}"
            )
        if name not in chosen:
            chosen.append(name)
    if not chosen:
        raise GptspeedError(f"--panels: name at least one of {', '.join(PANELS)}")
    return chosen


def draw_runs(run_dirs: list[str | Path], panels: str | list[str] = "loss", *, title: str | None = None):
    """The matplotlib ``Figure`` of ``run_dirs``'s curves, one axes per panel (``loss`` gives two):
    ``panels`` as :func:`parse_panels` reads them. Each run is one colour, labelled with its folder's
    name (its whole path when two runs share a name). In the ``tps`` panel the first interval of
    each process, whose time includes compilation and warm-up (``includes_warmup``), is left out.

    Raises:
        GptspeedError: a run without metrics (see :func:`read_metrics`), an unknown panel, or
            matplotlib missing.
    """
    chosen = parse_panels(panels)
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
    kinds = [k for p in chosen for k in (("loss_tokens", "loss_time") if p == "loss" else (p,))]
    ncols = min(2, len(kinds))
    nrows = -(-len(kinds) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), constrained_layout=True, squeeze=False)
    axes = dict(zip(kinds, grid.flat))
    for spare in list(grid.flat)[len(kinds) :]:
        spare.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10
    for (_, records), name, color in zip(runs, names, colors):
        for kind, ax in axes.items():
            if kind in ("loss_tokens", "loss_time"):
                x, scale = ("tokens", 1.0) if kind == "loss_tokens" else ("time_s", 1 / 60)
                xs, ys = _series(records, x, "train_loss")
                ax.plot([v * scale for v in xs], ys, color=color, lw=1.2, label=f"{name} train")
                xs, ys = _series(records, x, "val_loss")
                ax.plot(
                    [v * scale for v in xs], ys, color=color, lw=1.2, ls="--", marker="o", ms=3, label=f"{name} val"
                )
            elif kind == "tps":
                xs, ys = _series([r for r in records if not r.get("includes_warmup")], "tokens", "tokens_per_s")
                ax.plot(xs, ys, color=color, lw=1.2, marker=".", ms=4, label=name)
            else:
                xs, ys = _series(records, "tokens", "lr")
                ax.plot(xs, ys, color=color, lw=1.2, label=name)
    labels = {
        "loss_tokens": ("tokens", "loss (nats/token)"),
        "loss_time": ("wall time (min)", "loss (nats/token)"),
        "tps": ("tokens", "training tokens/s (warm-up intervals left out)"),
        "lr": ("tokens", "learning rate"),
    }
    for kind, ax in axes.items():
        ax.set_xlabel(labels[kind][0])
        ax.set_ylabel(labels[kind][1])
        ax.grid(True, alpha=0.3)
    if "lr" in axes:
        axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    legend = next(iter(axes.values())).legend(fontsize=8)
    for text in legend.get_texts():  # a folder named a$\frac$ is drawn as written, not parsed as mathtext
        text.set_parse_math(False)
    if title:
        fig.suptitle(title, parse_math=False)
    return fig


#: names gptspeed gives a run's files (checkpoints, seals, config.json, metrics.jsonl, the lock, the
#: trackers') and a data folder's (manifest.json, shards, prepare's progress file and lock): never a plot's
_DATA_NAMES = re.compile(r"^(manifest\.json|\.prepare-progress\.json|\.prepare\.lock|.*\.bin)$")


def check_plot_target(out: str | Path, force: bool = False) -> None:
    """Refuse a ``plot --out`` that would lose a file, before anything is drawn: the name of a
    run's or a data folder's own file (``metrics.jsonl``, ``ckpt_00000100.pt``, ``manifest.json``,
    a ``.bin`` shard, ...: even with ``force``), a folder, something that is not a regular file
    (``/dev/null``, a FIFO: even with ``force``), or an existing file without ``force`` (as
    ``consolidate`` and ``export-hf`` refuse). A symbolic link is replaced itself, never its target.

    Raises:
        GptspeedError: one line naming ``out`` and what to do.
    """
    import stat

    from gptspeed.checkpoint.paths import OWN_NAMES, STALE_NAMES
    from gptspeed.paths import real_path

    out = real_path(out)  # new/../loss.png is ./loss.png: checked as the file the system will write
    if OWN_NAMES.match(out.name) or STALE_NAMES.match(out.name) or _DATA_NAMES.match(out.name):
        raise GptspeedError(
            f"--out {out}: {out.name!r} is the name of a run's or a data folder's own file; plot "
            "never writes one, even with --force: name a .png (e.g. loss.png)"
        )
    if not os.path.lexists(out):
        return
    if out.is_dir() and not out.is_symlink():
        raise GptspeedError(f"--out {out} is a folder: name the PNG file to write (e.g. {out / 'loss.png'})")
    if not out.is_symlink() and not stat.S_ISREG(out.lstat().st_mode):
        raise GptspeedError(
            f"--out {out} is not a regular file (a device, a FIFO, a socket): plot never replaces "
            "it, even with --force; name a .png"
        )
    if not force:
        raise GptspeedError(f"--out {out} already exists: pass --force to replace it, or name another file")


def plot_runs(
    run_dirs: list[str | Path],
    out: str | Path,
    *,
    title: str | None = None,
    panels: str | list[str] = "loss",
    force: bool = False,
) -> Path:
    """Draw ``run_dirs``'s curves (:func:`draw_runs`: ``panels`` from ``loss``, ``tps``, ``lr``)
    into the PNG ``out`` (written to a temporary file, then renamed). ``out`` is checked first
    (:func:`check_plot_target`): an existing file is replaced only with ``force``, and never a
    run's or a data folder's own file. Returns ``out``.

    Raises:
        GptspeedError: a run without metrics (see :func:`read_metrics`), an unknown panel,
            matplotlib missing, an ``out`` refused, or not writable.
    """
    from gptspeed.paths import real_path

    check_plot_target(out, force)
    fig = draw_runs(run_dirs, panels, title=title)
    import matplotlib.pyplot as plt

    out = real_path(out)  # as check_plot_target saw it: no folder made only to climb out of it
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, lambda f: fig.savefig(f, dpi=120, format="png"))
    except OSError as e:
        raise GptspeedError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return out
