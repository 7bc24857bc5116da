"""Does Muon (+AdamW for embeddings, head, gains) reach a validation loss sooner than AdamW alone? (issue 7)

Two `gptspeed train` runs (:func:`gptspeed.trainer.fit`) on the same data, model shape, seed,
batches and schedule, differing only in ``--optimizer``; each logs the validation loss every
``--eval-every`` steps with its wall time (``time_s`` in metrics.jsonl). The figure is, for each
optimizer, the steps and seconds it took to first reach the target validation loss (default: the
final validation loss of the AdamW run), and each one's final validation loss.

CPU shape by default (the nano preset: 4 layers, 128 wide, T=128; minutes on a laptop CPU) on
tinyshakespeare; run it on a quiet machine -- the wall times are only comparable when nothing
else competes for the cores. The two runs are minutes each, so they run one after the other, not in
interleaved rounds; the table is printed under the harness's environment line (device, versions,
commit, date, command): paste it into benchmarks/LOG.md.

    python benchmarks/muon_vs_adamw.py [--data DIR] [--out DIR] [--steps 200] [--eval-every 10]
        [--lr 2e-3] [--muon-lr 0.02] [--device cpu] [--target LOSS] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import harness

from gptspeed.runtime import resolve_device
from gptspeed.trainer import build_train_config, fit


def first_reaching(records: list[dict], target: float) -> tuple[int | None, float | None]:
    """``(step, time_s)`` of the first evaluation with ``val_loss <= target``, or (None, None)."""
    for r in records:
        if r.get("val_loss") is not None and r["val_loss"] <= target:
            return r["step"], r["time_s"]
    return None, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        help="prepared data folder (default: tinyshakespeare, prepared into --out; offline, "
        "set GPTSPEED_DATA_MIRROR to a folder holding tinyshakespeare/input.txt)",
    )
    p.add_argument("--out", help="folder for both runs (default: a temporary folder)")
    p.add_argument("--preset", default="nano")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW peak lr (both runs)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", type=float, help="validation loss to reach (default: AdamW's final)")
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)

    out = Path(a.out or tempfile.mkdtemp(prefix="muon-vs-adamw-"))
    out.mkdir(parents=True, exist_ok=True)
    data = a.data
    if data is None:
        from gptspeed.data.prepare import prepare

        data = str(out / "tinyshakespeare")
        if not (Path(data) / "manifest.json").exists():
            prepare("tinyshakespeare", Path(data), progress=False)

    results = {}
    for opt in ("adamw", "muon"):
        run = out / opt
        cfg = build_train_config(
            a.preset,
            dict(
                data=data,
                out=str(run),
                optimizer=opt,
                lr=a.lr,
                muon_lr=a.muon_lr,
                max_steps=a.steps,
                warmup_steps=a.warmup_steps,
                eval_every=a.eval_every,
                eval_tokens=a.eval_tokens,
                save_every=0,
                log_every=a.eval_every,
                device=a.device,
            ),
        )
        summary = fit(cfg, echo=False)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        results[opt] = {"records": records, "final_val_loss": summary["last_val_loss"], "time_s": records[-1]["time_s"]}
    target = a.target if a.target is not None else results["adamw"]["final_val_loss"]

    env = harness.environment(resolve_device(a.device).type)
    md = [
        harness.header(env),
        f"target val loss {target:.4f} | {a.preset} | {a.steps} steps",
        "",
        "| optimizer | final val loss | steps to target | seconds to target | total seconds |",
        "|---|---|---|---|---|",
    ]
    for opt, r in results.items():
        step, secs = first_reaching(r["records"], target)
        r.update(target=target, steps_to_target=step, seconds_to_target=secs)
        md.append(
            f"| {opt} | {r['final_val_loss']:.4f} | {step if step is not None else 'not reached'} | "
            f"{f'{secs:.1f}' if secs is not None else '-'} | {r['time_s']:.1f} |"
        )
    harness.emit(
        "\n".join(md) + "\n",
        {**{k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in results.items()}, "environment": env},
        None,
        a.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
