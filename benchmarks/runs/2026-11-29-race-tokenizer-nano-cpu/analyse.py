"""Read the nine runs'' metrics.jsonl and write metrics.json + table.md: final val bpb (same text for every arm),
val bpb at equal tokens seen (every evaluation step) and at equal text bytes seen (interpolated in log bytes),
with the one-sided Welch t-test (scipy) that `bench race` uses."""
import json, math
from pathlib import Path
import numpy as np
from scipy import stats
from gptspeed.data.shards import read_shard
from gptspeed.eval.bpb import token_bytes
from gptspeed.bpe import load_tokenizer_dir

ARMS = ["gpt2", "tok-16384", "tok-50257"]
SEEDS = [0, 1, 2]
B_T = 16 * 128


def curve(arm, seed):
    rows = [json.loads(l) for l in open(f"runs/{arm}-seed{seed}/metrics.jsonl")]
    return {r["step"]: r for r in rows if "val_bpb" in r}


def train_bytes_cum(arm):
    d = f"data-{arm}"
    tok = None if arm == "gpt2" else load_tokenizer_dir(d)
    nb = token_bytes(50257 if arm == "gpt2" else tok.n_vocab, tok).numpy()
    t = read_shard(f"{d}/train_000000.bin").astype(np.int64)
    return np.concatenate([[0], np.cumsum(nb[t])])  # bytes of the first k train tokens (sequential reading)


def welch_less(a, b):  # p that mean(a) < mean(b), one-sided Welch
    return float(stats.ttest_ind(a, b, equal_var=False, alternative="less").pvalue)


out = {"arms": {}}
curves = {a: [curve(a, s) for s in SEEDS] for a in ARMS}
steps = sorted(set.intersection(*[set(c) for a in ARMS for c in curves[a]]))
for a in ARMS:
    cum = train_bytes_cum(a)
    final = [c[steps[-1]] for c in curves[a]]
    bytes_seen = {s: int(cum[min(len(cum) - 1, s * B_T)]) for s in steps}
    out["arms"][a] = {
        "last_step_each_run": [max(c) for c in curves[a]],
        "compared_at_step": steps[-1],
        "final_val_bpb": [f["val_bpb"] for f in final],
        "final_val_loss": [f["val_loss"] for f in final],
        "bpb_by_step": {s: [c[s]["val_bpb"] for c in curves[a]] for s in steps},
        "train_bytes_seen_by_step": bytes_seen,
    }
g = out["arms"]["gpt2"]
target_bytes = g["train_bytes_seen_by_step"][steps[-1]]  # what gpt2 read in its whole run
for a in ARMS:
    r = out["arms"][a]
    r["final_mean"], r["final_std"] = float(np.mean(r["final_val_bpb"])), float(np.std(r["final_val_bpb"], ddof=1))
    if a != "gpt2":
        r["p_lower_than_gpt2"] = welch_less(r["final_val_bpb"], g["final_val_bpb"])
        r["p_gpt2_lower"] = welch_less(g["final_val_bpb"], r["final_val_bpb"])
    # bpb at gpt2's total bytes read: per seed, interpolated linearly in log(bytes) between evaluations
    xs = np.log([r["train_bytes_seen_by_step"][s] for s in steps])
    per_seed = [float(np.interp(math.log(target_bytes), xs, [r["bpb_by_step"][s][i] for s in steps])) for i in range(3)]
    r["bpb_at_gpt2_final_bytes"] = per_seed
for a in ARMS[1:]:
    r = out["arms"][a]
    r["p_at_equal_bytes_lower_than_gpt2"] = welch_less(r["bpb_at_gpt2_final_bytes"], g["bpb_at_gpt2_final_bytes"])
out["steps"] = steps
out["gpt2_final_train_bytes"] = target_bytes
json.dump(out, open("metrics.json", "w"), indent=1)

L = [f"Compared at step {steps[-1]} of 350 (the last evaluation every run has reached)", "",
     "| arm | val bpb (3 seeds) | val loss (nats/token) | p (lower bpb than gpt2) | p (gpt2 lower) | train text read | val bpb after reading the text gpt2 read |",
     "|---|---|---|---|---|---|---|"]
for a in ARMS:
    r = out["arms"][a]
    eb = r["bpb_at_gpt2_final_bytes"]
    L.append(f"| {a} | {r['final_mean']:.4f} ± {r['final_std']:.4f} ({', '.join(f'{x:.4f}' for x in r['final_val_bpb'])}) | "
             f"{np.mean(r['final_val_loss']):.4f} | {r.get('p_lower_than_gpt2', float('nan')):.2g} | {r.get('p_gpt2_lower', float('nan')):.2g} | "
             f"{r['train_bytes_seen_by_step'][steps[-1]]:,} B | {np.mean(eb):.4f} ± {np.std(eb, ddof=1):.4f}" +
             (f" (p lower {r['p_at_equal_bytes_lower_than_gpt2']:.2g})" if a != "gpt2" else "") + " |")
L += ["", "val bpb (mean of 3 seeds) at equal tokens seen (step x 2,048 tokens):", "",
      "| step | tokens | " + " | ".join(ARMS) + " |", "|---|---|" + "---|" * len(ARMS)]
for s in steps:
    L.append(f"| {s} | {s * B_T:,} | " + " | ".join(f"{np.mean(out['arms'][a]['bpb_by_step'][s]):.4f}" for a in ARMS) + " |")
Path("table.md").write_text("\n".join(L) + "\n")
print("\n".join(L))
