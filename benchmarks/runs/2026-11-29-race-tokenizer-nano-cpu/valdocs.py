"""Which books each prepared folder's val split holds: decode the val shard, split at the EOT, match to files."""
import json, sys, hashlib
from pathlib import Path
import numpy as np
from gptspeed.data.shards import read_shard
from gptspeed import tokenizer as gpt2tok
from tokenizers import Tokenizer

SRC = Path("/work/shared/data/shakespeare-gutenberg")
texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(SRC.glob("*.txt"))}
out = {}
for d in sys.argv[1:]:
    m = json.load(open(f"{d}/manifest.json"))
    ids = read_shard(f"{d}/val_000000.bin").astype(np.int64)
    eot = m["eot_token"]
    if m["tokenizer"] == "gpt2":
        dec = gpt2tok.decode
    else:
        tk = Tokenizer.from_file(f"{d}/tokenizer.json"); dec = lambda x: tk.decode(x, skip_special_tokens=False)
    starts = list(np.flatnonzero(ids == eot)) + [len(ids)]
    docs = []
    for a, b in zip(starts[:-1], starts[1:]):
        t = dec(ids[a + 1:b].tolist())
        name = [n for n, s in texts.items() if s == t]
        docs.append((name[0] if name else "?", len(t.encode()), b - a))
    out[d] = docs
    nbytes = sum(x[1] for x in docs)
    print(d, "first id is eot:", ids[0] == eot, "docs", len(docs), "bytes", nbytes, "tokens", len(ids))
    for x in docs: print("  ", x)
names = [tuple(x[0] for x in v) for v in out.values()]
print("same val documents in every folder:", len(set(names)) == 1)
