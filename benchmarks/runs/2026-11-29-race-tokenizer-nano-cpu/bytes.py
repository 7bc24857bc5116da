"""The text each arm's evaluations cover and each train split's bytes per token, counted as --eval-bpb counts
bytes (gptspeed.eval.bpb.token_bytes: each token decoded alone, as nanochat counts them)."""
import json, sys
import numpy as np
from gptspeed.data.shards import read_shard
from gptspeed.eval.bpb import token_bytes
from gptspeed.bpe import load_tokenizer_dir

ARMS = {"gpt2": 10240, "tok-16384": 8704, "tok-50257": 8064}
res = {}
for arm, n in ARMS.items():
    d = f"data-{arm}"
    tok = None if arm == "gpt2" else load_tokenizer_dir(d)
    nb = token_bytes(50257 if arm == "gpt2" else tok.n_vocab, tok).numpy()
    val = read_shard(f"{d}/val_000000.bin").astype(np.int64)
    train = read_shard(f"{d}/train_000000.bin").astype(np.int64)
    ids_used = len(np.unique(np.concatenate([train, val])))
    r = {"eval_tokens": n, "eval_target_bytes": int(nb[val[1:n + 1]].sum()),
         "val_tokens": len(val), "val_bytes": int(nb[val].sum()),
         "train_tokens": len(train), "train_bytes": int(nb[train].sum()),
         "train_bytes_per_token": float(nb[train].sum() / len(train)),
         "distinct_ids_in_data (the --softmax data ids)": ids_used}
    res[arm] = r
    print(arm, r)
json.dump(res, open("bytes.json", "w"), indent=1)
