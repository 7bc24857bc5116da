"""The tail average's effect, seed by seed, from the race in ../2026-11-29-race-ema-nano-cpu (machine shared, losses
only): each arm's final val loss (race.json), the one-sided Welch t-test that modern-ema's is lower, and, paired,
each modern-ema run's final checkpoint evaluated as its raw weights and as the blend on the race's val tokens (its
raw weights are also checked bit-identical to the modern run of the same seed: the switch does not change training).

    python benchmarks/runs/2026-11-29-ema-paired-nano-cpu/paired.py DATA_DIR > benchmarks/runs/2026-11-29-ema-paired-nano-cpu/paired.json
"""

import json
import sys
from pathlib import Path

import torch
from scipy import stats

from gptspeed.averaging import PART, readout_state
from gptspeed.checkpoint import load_latest_run
from gptspeed.data import find_shards
from gptspeed.eval.val_loss import evaluate
from gptspeed.model import GPT
from gptspeed.runtime import resolve_runtime

RACE = Path(__file__).resolve().parent.parent / "2026-11-29-race-ema-nano-cpu"


def val_loss(cfg, state, rt, shards, tokens):
    model = GPT(cfg.model)
    model.load_state_dict(state)
    return evaluate(model.to(rt.device).eval(), rt, shards, 16, cfg.model.block_size, tokens)[0]


def main(data: str) -> dict:
    race = json.loads((RACE / "race.json").read_text())
    finals = {a["name"]: [r["final_val_loss"] for r in a["runs"]] for a in race["arms"]}
    out = {"final_val_loss": finals, "eval_tokens": race["eval_tokens"], "paired": []}
    if len(finals.get("modern", [])) > 1 and len(finals.get("modern-ema", [])) > 1:
        t = stats.ttest_ind(finals["modern-ema"], finals["modern"], equal_var=False, alternative="less")
        out["welch_p_ema_lower"] = float(t.pvalue)
    rt = resolve_runtime("cpu", "auto", compile=False)
    shards = find_shards(Path(data), "val")
    for run in sorted((RACE / "runs").glob("modern-ema-seed*")):
        if not list(run.glob("ckpt_*.pt")):
            continue  # still training
        ckpt, cfg = load_latest_run(run)
        raw = {k: v.clone() for k, v in ckpt["model"].items()}
        twin = RACE / "runs" / run.name.replace("modern-ema", "modern")
        same = None
        if twin.is_dir():
            other = load_latest_run(twin)[0]["model"]
            same = all(torch.equal(raw[k], other[k]) for k in raw)
        row = {"run": run.name, "step": ckpt["step"], "has_average": bool(ckpt.get(PART)), "raw_equals_modern": same}
        row["raw"] = val_loss(cfg, raw, rt, shards, race["eval_tokens"])
        row["blend"] = val_loss(cfg, readout_state(ckpt), rt, shards, race["eval_tokens"])
        row["blend_minus_raw"] = row["blend"] - row["raw"]
        out["paired"].append(row)
    diffs = [r["blend_minus_raw"] for r in out["paired"]]
    if len(diffs) > 1:
        out["paired_t_p_blend_lower"] = float(stats.ttest_1samp(diffs, 0.0, alternative="less").pvalue)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=2))
