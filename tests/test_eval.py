"""``gptspeed.eval``: ``gptspeed eval``'s figures, printed as strict JSON."""

from __future__ import annotations

import json
import math

import pytest

from support.cli import run_main
from support.hf_models import write_data_pico, write_run_pico

pytestmark = pytest.mark.usefixtures("one_thread")


def strict_json(text: str):
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


def test_eval_of_a_diverged_checkpoint_prints_strict_json(tmp_path):
    run = write_run_pico(tmp_path / "run", poison=float("nan"))
    data = write_data_pico(tmp_path / "data", manifest=False)
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text(json.dumps({"ctx": "A man sits.", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n")
    res = run_main(
        "eval",
        "--run",
        str(run),
        "--data",
        str(data),
        "--max-tokens",
        "256",
        "--hellaswag-file",
        str(hs_file),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)  # "val_loss": NaN was printed before
    assert out["val_loss"] is None and out["perplexity"] is None and out["tokens"] == 256
    assert "val_loss (nan)" in out["note"] and "diverged" in out["note"]
    assert out["hellaswag"]["nan_examples"] == 1 and "hellaswag" in out["note"]
    assert res.stderr.strip().splitlines() == [f"gptspeed eval: note: {out['note']}"]


def test_json_safe_nulls_every_non_finite_figure():
    from gptspeed.eval import json_safe

    out = json_safe({"val_loss": 800.0, "perplexity": math.inf, "tokens": 3, "hellaswag": {"x": [1.0, -math.inf]}})
    assert out["val_loss"] == 800.0 and out["perplexity"] is None and out["hellaswag"]["x"] == [1.0, None]
    assert "perplexity (inf)" in out["note"] and "hellaswag.x[1]" in out["note"]
    json.dumps(out, allow_nan=False)
    assert json_safe({"val_loss": 2.0, "perplexity": math.exp(2.0)}) == {"val_loss": 2.0, "perplexity": math.exp(2.0)}


def test_eval_perplexity_overflow_is_null_not_a_traceback(tmp_path, monkeypatch):
    """A loss above ~709 nats: math.exp raised OverflowError."""
    import gptspeed.eval.val_loss as vl

    monkeypatch.setattr(vl, "evaluate_val", lambda *a, **k: vl.ValFigures(750.0, 64, 3.0))
    run = write_run_pico(tmp_path / "run")
    data = write_data_pico(tmp_path / "data", manifest=False)
    res = run_main("eval", "--run", str(run), "--data", str(data), "--device", "cpu", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)
    assert out["val_loss"] == 750.0 and out["perplexity"] is None and "too large for a float" in out["note"]
