"""Time one training evaluation with --eval-bpb (Trainer.evaluate, then evals.bpb, as trainlog calls them)
on the pico preset over tiny Shakespeare: 4 evaluations, the first with any compile."""
import json
import sys
import time

from gptspeed.configure import build_train_config
from gptspeed.runtime import resolve_runtime
from gptspeed.trainer import Trainer

cfg = build_train_config(
    "pico", {"data": "cache/prepared/tinyshakespeare", "out": sys.argv[1], "eval_bpb": True, "device": "cpu"}
)
rt = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.parallel)
tr = Trainer(cfg, rt, echo=False)
wall, cpu = [], []
for _ in range(4):
    w, c = time.perf_counter(), time.process_time()
    loss = tr.evaluate()
    bpb = tr.evals.bpb()
    wall.append(time.perf_counter() - w)
    cpu.append(time.process_time() - c)
print(json.dumps({"compile": rt.compile, "dtype": rt.dtype, "wall": wall, "cpu": cpu, "loss": loss, "bpb": bpb}))
