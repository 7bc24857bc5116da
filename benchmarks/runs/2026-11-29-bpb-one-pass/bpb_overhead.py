"""The one pass with and without the bytes table (bits per byte on top of the val loss), interleaved:
the pico run after 50 steps, 8192 val tokens in batches of 8 x 64, --dtype auto, 5 rounds."""
import json
import statistics as st
import time

from gptspeed.data import find_shards
from gptspeed.eval.bpb import bytes_table
from gptspeed.eval.val_loss import evaluate_val
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_model

rt = resolve_runtime("cpu", "auto", compile=False)
model, _ = load_model("run", rt)
shards = find_shards("cache/prepared/tinyshakespeare", "val")
nbytes = bytes_table(model, rt.device)
evaluate_val(model, rt, shards, 8, 64, 8192, nbytes=nbytes)  # warm-up
times = {"loss only": [], "loss and bpb": []}
for _ in range(5):
    for name, nb in (("loss only", None), ("loss and bpb", nbytes)):
        t = time.perf_counter()
        evaluate_val(model, rt, shards, 8, 64, 8192, nbytes=nb)
        times[name].append(time.perf_counter() - t)
print(json.dumps({"dtype": rt.dtype, "wall": times, "median": {k: st.median(v) for k, v in times.items()}}))
