"""The ladder's outputs: a Markdown table (stdout and ``ladder.md``), ``ladder.json`` (every figure
and the environment) and ``ladder.png`` (ms/step per row, speed-up on each bar; matplotlib).
``ladder.md`` and ``ladder.json`` are written after every row (:func:`write_partial`), each
atomically, so a command cut at its limit keeps every finished row."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gptspeed.fileio import write_text_atomic
from gptspeed.metrics import environment as base_environment

__all__ = [
    "environment",
    "say",
    "check_out_dir",
    "make_out_dir",
    "environment_line",
    "table_cell",
    "fmt_bytes",
    "progress_line",
    "vs_prev",
    "markdown",
    "plot",
    "write_partial",
    "write_outputs",
    "write_text_atomic",
]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, command: str) -> dict[str, Any]:
    """:func:`gptspeed.metrics.environment` plus the command line as typed, the NVIDIA driver
    (CUDA only) and the versions of the libraries a row depends on."""
    env = base_environment(device)
    env["command"] = command or env["command"]
    if device.type == "cuda":
        env["driver"] = _nvidia_driver()
        env["cudnn"] = torch.backends.cudnn.version()
    for pkg in ("numpy", "transformers", "matplotlib", "triton"):
        env[pkg] = _version(pkg)
    return env


def say(msg: str) -> None:
    """A progress line on stderr (stdout carries the Markdown table)."""
    print(msg, file=sys.stderr, flush=True)


def check_out_dir(out: str | Path) -> Path:
    """Refuse a bench ``--out`` (the ladder's, ``--verify``'s, ``--profile``'s, ``--tune``'s and
    ``--race``'s) that would mix bench files into what is not theirs, before any work: a file, a
    run folder (checkpoints, or a run's ``config.json`` / ``metrics.jsonl``: a later ``train
    --resume`` would find files it did not write), a data folder (:func:`gptspeed.paths.kind`), or
    a new folder that would be created inside one of those. Reads only. Returns ``Path(out)``.

    Raises:
        GptspeedError: one line naming what ``out`` is.
    """
    from gptspeed.errors import GptspeedError
    from gptspeed.paths import kind, real_path

    path = real_path(out)  # new/../RUN is RUN: checked (and written) as the folder the system will write

    def what(folder: Path) -> str | None:
        k = kind(folder)
        if k == "folder" and any((folder / n).exists() for n in ("config.json", "metrics.jsonl")):
            k = "run folder"  # a run killed before its first checkpoint
        return k if k in ("run folder", "data folder") else None

    if path.is_symlink() and not path.exists():
        raise GptspeedError(f"--out {path} is a broken symbolic link: give the folder to write itself")
    k = kind(path)
    if k in ("file", "text file"):
        raise GptspeedError(f"--out {path} is a file: bench writes its reports into a folder; choose another --out")
    if k == "missing":
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and what(parent):
            raise GptspeedError(
                f"--out {path} would be created inside {parent}, a {what(parent)}: bench never writes "
                "into one; choose an --out outside it (e.g. bench/NAME)"
            )
        return path
    if what(path):
        raise GptspeedError(
            f"--out {path} is a {what(path)}: bench never writes into one; choose another --out (e.g. bench/NAME)"
        )
    return path


def make_out_dir(out: str | Path) -> Path:
    """Create the report folder ``out`` (and its parents) after :func:`check_out_dir`; GptspeedError
    (one line) if it is refused or cannot be created."""
    from gptspeed.errors import GptspeedError

    path = check_out_dir(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptspeedError(f"cannot create --out {path}: {e.strerror or e}") from e
    return path


def environment_line(env: dict[str, Any]) -> str:
    """A report's second line: the device (CUDA and driver versions on a GPU), torch, gptspeed at its
    commit, the date -- from :func:`environment`'s record."""
    commit = (env.get("git_commit") or "unknown")[:12]
    return (
        f"{env['device']} ({env['device_type']}{', CUDA ' + str(env['cuda']) if env.get('cuda') else ''}"
        f"{', driver ' + env['driver'] if env.get('driver') else ''}) · torch {env['torch']} · "
        f"gptspeed {env['gptspeed']} @ {commit} · {env['date']}"
    )


def table_cell(text: object) -> str:
    """``text`` as one Markdown table cell: ``|`` (a column break) written ``/``, newlines as spaces."""
    return str(text).replace("|", "/").replace("\n", " ")


def fmt_bytes(n: int | None) -> str:
    """Bytes as MiB or GiB (binary units), "—" for None."""
    if n is None:
        return "—"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _ms(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def _label(r: dict[str, Any]) -> str:
    return f"{r['name']} (peer)" if r["kind"] == "peer" else r["name"]


def progress_line(r: dict[str, Any]) -> str:
    """One line about a row that just finished (for stderr while the ladder runs)."""
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    return (
        f"{_ms(r['ms_median'])} ms/step (min {_ms(r['ms_min'])}, max {_ms(r['ms_max'])}), "
        f"{r['tokens_per_s']:,.0f} tokens/s, step-0 loss {r['loss_step0']:.4f}, warm-up {r['warmup_s']:.1f} s"
    )


def vs_prev(r: dict[str, Any]) -> str:
    """The "vs prev" cell: ``1.58× (compile)``, ``1.02× (vocab-size; noise: gap 2.0 ms < IQR 5.1 ms)``, or
    ``n/a (differs from the previous row by: compile, vocab-size)``; ``—`` for the first row."""
    if r.get("speedup_prev") is None:
        return r.get("speedup_prev_na") or "—"
    cell = f"{_x(r['speedup_prev'])} ({r['credited_to']}"
    if r.get("noise"):
        n = r["noise"]
        cell += f"; *noise*: gap {_ms(n['gap_ms'])} ms < IQR {_ms(n['spread_ms'])} ms"
    return cell + ")"


def _notes(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}".replace("|", "/")
    check = r["loss_check"]
    if not check["ok"]:
        return f"**FLAGGED**: step-0 loss off by {check['rel_diff']:.1e} relative (tolerance {check['rtol']:.0e})"
    return ""


def markdown(result: dict[str, Any]) -> str:
    """The ladder as a Markdown table with a header (device, shape, data) and a legend."""
    rows = result["rows"]
    lines = [
        *_header(result),
        "| stage | switches | ms/step | IQR | min–max | tokens/s | MFU | peak mem | warm-up s | loss step 0 | loss end "
        "| vs prev | vs first row | notes |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|---|",
        *[_table_row(r) for r in rows],
        "",
        "Rows are cumulative: each adds its change to every row that ran or would run above it; the "
        "switches column says what was on.",
        "",
    ]
    lines += [f"- **{_label(r)}**: {r['description']}" + (f" ({r['source']})" if r.get("source") else "") for r in rows]
    lines += ["", _legend(result)]
    if result["problems"]:
        lines += ["", "**Problems:** " + "; ".join(result["problems"])]
    if not result.get("complete", True):
        pending = [r["name"] for r in rows if r["status"] == "pending"]
        lines += [
            "",
            f"**Incomplete**: written after each row; {len(pending)} row(s) not run yet"
            + (f" ({', '.join(pending)})" if pending else "")
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _header(result: dict[str, Any]) -> list[str]:
    """The table's header lines: the title, the environment, the model and its batch, data and steps, the command."""
    env, c, rows = result["environment"], result["config"], result["rows"]
    ran = [r for r in rows if r["status"] == "ok"]
    params = f" ({ran[0]['params'] / 1e6:.1f}M parameters)" if ran else ""
    data = "synthetic tokens" if c["data"] is None else f"`{c['data']}`"
    accum = c.get("grad_accum") or 1
    accum_note = f", {accum} micro-batches per step" if accum > 1 else ""
    backend = "" if c["compile_backend"] == "inductor" else f"; torch.compile backend **{c['compile_backend']}**"
    return [
        "## gptspeed bench ladder",
        "",
        environment_line(env),
        "",
        f"Model: preset {c['preset']}, L={c['n_layer']} H={c['n_head']} C={c['n_embd']}{params}; "
        f"B={c['batch_size']}, T={c['seq_len']}{accum_note} ({c['batch_size'] * c['seq_len'] * accum:,} tokens/step); data: {data}; "
        f"{c['warmup']} warm-up + {c['steps']} timed steps per row, each row in a fresh process{backend}.",
        "",
        f"Command: `{env['command']}`",
        "",
    ]


def _table_row(r: dict[str, Any]) -> str:
    """One row of the ladder's table: its figures, or dashes and why it did not run."""
    if r["status"] != "ok":
        return f"| {_label(r)} | — | — | — | — | — | — | — | — | — | — | — | — | {_notes(r)} |"
    mfu = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    iqr = "—" if r.get("ms_q25") is None else _ms(r["ms_q75"] - r["ms_q25"])
    return (
        f"| {_label(r)} | {r.get('switches') or '—'} | {_ms(r['ms_median'])} | {iqr} | {_ms(r['ms_min'])}–{_ms(r['ms_max'])} "
        f"| {r['tokens_per_s']:,.0f} | {mfu} | {fmt_bytes(r['peak_mem_bytes'])} | {r['warmup_s']:.1f} "
        f"| {r['loss_step0']:.4f} | {r['loss_last']:.4f} | {vs_prev(r)} | {_x(r['speedup_baseline'])} | {_notes(r)} |"
    )


def _legend(result: dict[str, Any]) -> str:
    """What each column of the ladder's table means, on this device."""
    mem = (
        "peak memory allocated by PyTorch on the GPU"
        if result["environment"]["device_type"] == "cuda"
        else "peak resident memory of the row's process"
    )
    ran = [r for r in result["rows"] if r["status"] == "ok"]
    mfu_note = next((r["peak_flops_source"] for r in ran if r["mfu"] is None), None)
    return (
        "ms/step: median over the timed steps (CUDA events on a GPU, perf_counter on a CPU); IQR: interquartile range "
        "of the timed steps; tokens/s from the median; warm-up s includes compilation; peak mem: "
        f"{mem}. vs prev: speed-up over the previous row that ran, credited to the one switch between them (in "
        "brackets) -- n/a when they differ by more than one, and marked *noise* when either row's IQR is wider than "
        "the gap between the two medians. vs first row: speed-up over the first row that ran, all of this row's "
        "switches together. Step-0 losses must agree with the first row's within the dtype's tolerance (fp32 1e-4, "
        "tf32 2e-3, bf16 / fp16 1e-2, fp8 2e-2 relative)." + (f" MFU: {mfu_note}." if mfu_note else "")
    )


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Bar chart of ms/step per row that ran (peer in another colour), min–max as error bars, the
    speed-up over the baseline on each bar. Returns None, or why no PNG was written (matplotlib
    missing, nothing ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'gptspeed[plot]')"
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    if not rows:
        return "no row ran"
    names = [_label(r) for r in rows]
    ms = [r["ms_median"] for r in rows]
    err = [[m - r["ms_min"] for m, r in zip(ms, rows)], [r["ms_max"] - m for m, r in zip(ms, rows)]]
    colors = ["#d98c2b" if r["kind"] == "peer" else "#3b75af" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    bars = ax.bar(names, ms, color=colors, yerr=err, capsize=3, ecolor="#555555")
    for bar, r in zip(bars, rows):
        label = f"{r['speedup_baseline']:.2f}×"
        if r["speedup_prev"] is not None:
            label += f"\n({r['speedup_prev']:.2f}× prev)"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, r["ms_max"]),
            xytext=(0, 3),  # above the error bar
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    c, env = result["config"], result["environment"]
    ax.set_ylabel("ms / step (median; lower is better)")
    ax.set_title(
        f"gptspeed ladder — {env['device']}\nL={c['n_layer']} H={c['n_head']} C={c['n_embd']}, "
        f"B={c['batch_size']} T={c['seq_len']}, torch {env['torch']}",
        fontsize=9,
    )
    ax.set_ylim(0, max(r["ms_max"] for r in rows) * 1.45)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.text(
        0.99,
        0.98,
        "on each bar: speed-up over the first row\n(and over the row before it)",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=7,
        color="#555555",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_partial(result: dict[str, Any], out: Path) -> str:
    """``ladder.md`` and ``ladder.json`` in ``out`` as they stand, each atomically (a temporary
    file, then a rename: a reader sees the previous version or this one, never a part). Returns
    the Markdown."""
    table = markdown(result)
    write_text_atomic(out / "ladder.md", table)
    write_text_atomic(out / "ladder.json", json.dumps(result, indent=2) + "\n")
    return table


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """The finished ladder: ``ladder.md`` (also printed on stdout), ``ladder.png`` and ``ladder.json`` in ``out``."""
    skipped = plot(result, out / "ladder.png")
    result["plot"] = None if skipped else str(out / "ladder.png")
    if skipped:
        result["plot_skipped"] = skipped
        print(f"gptspeed bench: ladder.png not written: {skipped}", file=sys.stderr)
    print(write_partial(result, out), end="")
