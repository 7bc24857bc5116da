"""``gptspeed.plot``: training curves as a picture: ``gptspeed plot RUN_DIR [RUN_DIR ...] --out loss.png [--panels loss,tps,lr]``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gptspeed.cli import main
from gptspeed.errors import GptspeedError
from gptspeed.plot import draw_runs, parse_panels, plot_runs, read_metrics

from support.cli import child_env

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install -e '.[plot]')"
)


def write_metrics(run: Path, resumed: bool = False, speed: float = 1000.0) -> Path:
    run.mkdir(parents=True)
    recs = [{"step": 0, "tokens": 0, "time_s": 0.5, "val_loss": 10.9}]
    recs += [
        {
            "step": s,
            "tokens": 512 * s,
            "time_s": 1.0 * s,
            "train_loss": 10 - s / 10,
            "lr": 1e-4 * s,
            "tokens_per_s": speed + s,
            "includes_warmup": s == 1,
        }
        for s in range(1, 11)
    ]
    recs.append({"step": 10, "tokens": 5120, "time_s": 10.5, "train_loss": 9.0, "val_loss": 9.1})
    if resumed:  # the clock restarts at a resume
        recs += [
            {"step": s, "tokens": 512 * s, "time_s": 1.0 * (s - 10), "train_loss": 9 - s / 100} for s in range(11, 15)
        ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 15, "tok')
    return run


@needs_matplotlib
def test_plot_writes_a_png(tmp_path):
    a = write_metrics(tmp_path / "a")
    b = write_metrics(tmp_path / "b", resumed=True)
    out = plot_runs([a, b], tmp_path / "pics" / "loss.png", title="a vs b")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list((tmp_path / "pics").glob(".*"))


def test_wall_time_is_cumulative_across_resumes(tmp_path):
    records = read_metrics(write_metrics(tmp_path / "r", resumed=True))
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and times[-1] == pytest.approx(10.5 + 4.0)
    assert len(records) == 16  # the cut-off last line is skipped


def test_missing_metrics_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptspeedError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    env = child_env(OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "gptspeed", "plot", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "does not exist" in res.stderr


@needs_matplotlib
def test_panels_draw_tokens_per_second_and_learning_rate(tmp_path):
    """--panels loss,tps,lr: four axes (loss against tokens and wall time, tokens/s, lr), each run
    one colour in every panel, named by its folder in the legend; tokens/s leaves out the warm-up
    interval; the values drawn are the records' own."""
    import matplotlib.pyplot as plt

    a = write_metrics(tmp_path / "fast", speed=2000.0)
    b = write_metrics(tmp_path / "slow", resumed=True)
    fig = draw_runs([a, b], "loss,tps,lr")
    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_xlabel() for ax in axes] == ["tokens", "wall time (min)", "tokens", "tokens"]
        assert "tokens/s" in axes[2].get_ylabel() and axes[3].get_ylabel() == "learning rate"
        tps, lr = axes[2].get_lines(), axes[3].get_lines()
        assert [line.get_label() for line in tps] == ["fast", "slow"] == [line.get_label() for line in lr]
        assert list(tps[0].get_xdata()) == [512 * s for s in range(2, 11)]  # step 1 is warm-up
        assert list(tps[0].get_ydata()) == [2000.0 + s for s in range(2, 11)]
        assert list(lr[1].get_xdata())[:10] == [512 * s for s in range(1, 11)]
        assert list(lr[1].get_ydata())[:10] == pytest.approx([1e-4 * s for s in range(1, 11)])
        colours = {line.get_label(): line.get_color() for line in tps}
        loss_lines = axes[0].get_lines()
        assert {line.get_label(): line.get_color() for line in loss_lines}["fast train"] == colours["fast"]
        legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
        assert legend == ["fast train", "fast val", "slow train", "slow val"]
    finally:
        plt.close(fig)
    fig = draw_runs([a], ["lr"])  # one panel: the legend goes on it
    try:
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert len(visible) == 1 and [t.get_text() for t in visible[0].get_legend().get_texts()] == ["fast"]
    finally:
        plt.close(fig)
    out = tmp_path / "all.png"
    assert main(["plot", str(a), str(b), "--panels", "tps,lr,loss", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_panel_is_one_line(tmp_path, capsys):
    assert parse_panels("loss, LR,loss") == ["loss", "lr"]
    with pytest.raises(GptspeedError, match=r"unknown panel 'tsp' \(did you mean 'tps'\?\): choose from loss, tps, lr"):
        parse_panels("loss,tsp")
    with pytest.raises(GptspeedError, match="name at least one"):
        parse_panels(" , ")
    run = write_metrics(tmp_path / "r")
    assert main(["plot", str(run), "--panels", "speed", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gptspeed plot: error: --panels: unknown panel 'speed'")
    assert not (tmp_path / "x.png").exists()


@needs_matplotlib
def test_plot_never_writes_over_a_runs_or_a_data_folders_files_and_needs_force_for_any_other(tmp_path):
    """``plot --out`` used to replace any file: a run's newest checkpoint or its metrics.jsonl (the
    run then cannot resume). As consolidate and export-hf: never a run's or a data folder's own file,
    not even with --force; --force for any other file that exists; a folder or a device is one line."""
    from support.cli import assert_user_error, run_main

    run = write_metrics(tmp_path / "run")
    data = tmp_path / "data"
    data.mkdir()
    own = {
        run / "config.json": b"{}",
        run / "ckpt_00000010.pt": b"weights",
        run / "ckpt_00000010.json": b"{}",
        run / ".gptspeed.lock": b"",
        data / "manifest.json": b"{}",
        data / "train_000000.bin": b"tokens",
    }
    for path, content in own.items():
        path.write_bytes(content)
    own[run / "metrics.jsonl"] = (run / "metrics.jsonl").read_bytes()
    for path in own:
        assert_user_error(run_main("plot", str(run), "--out", str(path), "--force"), "plot never writes one")
    assert {p: p.read_bytes() for p in own} == own, "a run's or a data folder's file was written over"

    other = tmp_path / "loss.png"
    other.write_bytes(b"an earlier figure")
    assert_user_error(run_main("plot", str(run), "--out", str(other)), "already exists: pass --force")
    assert other.read_bytes() == b"an earlier figure"
    assert_user_error(run_main("plot", str(run), "--out", str(tmp_path), "--force"), "is a folder")
    if Path("/dev/null").exists():
        assert_user_error(run_main("plot", str(run), "--out", "/dev/null", "--force"), "not a regular file")
    assert run_main("plot", str(run), "--out", str(other), "--force").returncode == 0
    assert other.read_bytes()[:4] == b"\x89PNG"
    assert run_main("plot", str(run), "--out", str(run / "loss.png")).returncode == 0  # a new file beside the run's


@needs_matplotlib
def test_plot_of_extreme_values_and_odd_names_draws_without_a_traceback(tmp_path):
    """NaN, Infinity, 1e308 and a 400-digit integer in metrics.jsonl (JSON from Python can hold them)
    and a folder or title with matplotlib's mathtext ``$`` used to end in a traceback: such values
    are left out of the curves, the names drawn as written."""
    from support.cli import run_main

    run = tmp_path / "a$\\frac$"
    run.mkdir()
    lines = ['{"step": 0, "tokens": 0, "time_s": 0, "val_loss": 10.0}']
    for step, v in enumerate(["NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1" + "0" * 400, "true"], 1):
        lines.append(
            f'{{"step": {step}, "tokens": {v}, "time_s": {v}, "train_loss": {v}, "val_loss": {v}, '
            f'"lr": {v}, "tokens_per_s": {v}}}'
        )
    lines.append('{"step": 9, "tokens": 4608, "time_s": 9.0, "train_loss": 5.0, "lr": 1e-3, "tokens_per_s": 512}')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "x.png"
    proc = run_main("plot", str(run), "--panels", "loss,tps,lr", "--title", "$\\frac$ 100$", "--out", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    from gptspeed.plot import _series

    assert _series(read_metrics(run), "tokens", "train_loss") == ([4608.0], [5.0])


def test_plot_out_through_a_missing_folder_is_checked_as_the_file_it_names(tmp_path, monkeypatch):
    """`plot --out nothere/../loss.png` replaced ./loss.png without --force (checked as written, the path
    did not exist; once plot made nothere, it named ./loss.png), and made the folder nothere: the path is
    resolved first, the existing file needs --force, and no folder is made to climb out of."""
    run = write_metrics(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.png").write_bytes(b"the user's picture")
    with pytest.raises(GptspeedError, match=f"--out {tmp_path / 'loss.png'} already exists: pass --force"):
        plot_runs([run], "nothere/../loss.png")
    assert (tmp_path / "loss.png").read_bytes() == b"the user's picture" and not (tmp_path / "nothere").exists()
    with pytest.raises(GptspeedError, match="is the name of a run's or a data folder's own file"):
        plot_runs([run], "nothere/../run/metrics.jsonl", force=True)
    assert plot_runs([run], "nothere/../loss.png", force=True) == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "nothere").exists()
