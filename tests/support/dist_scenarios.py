"""Run by tests/test_distributed.py under torchrun (2 ranks, gloo, CPU): the GPU-path defects of
each as a scenario sharing one process group (one launch instead of five). Every rank
writes what it saw to OUT/rank<r>.json; the tests compare it with one-process references.

usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/support/dist_scenarios.py DATA OUT HELLASWAG_JSONL
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.*: run as a file by torchrun
from gptspeed.configure import build_train_config
from gptspeed.data import find_shards
from gptspeed.distributed import finish_process, init_distributed
from gptspeed.eval import hellaswag as hs
from gptspeed.eval.val_loss import evaluate
from gptspeed.runtime import Runtime, resolve_runtime
from gptspeed.step import TrainStep
from gptspeed.trainer import Trainer

from support.shapes import DIST_RUN  # noqa: E402


def muon_fsdp(data: str, out: Path) -> dict:
    """FSDP2 + Muon: steps, HellaSwag during training, sharded checkpoints, then a resume."""
    run = out / "muon_fsdp"
    base = dict(
        DIST_RUN,
        data=data,
        out=str(run),
        optimizer="muon",
        parallel="fsdp",
        save_every=1,
        max_steps=2,
        hellaswag_every=1,
        hellaswag_examples=4,
    )
    rt = resolve_runtime("cpu", "float32", False, "fsdp")
    Trainer(build_train_config("pico", base), rt, echo=False).train()
    resumed = Trainer(
        build_train_config(None, dict(out=str(run), resume=True, max_steps=3, parallel="fsdp")), rt, echo=False
    ).train()
    return {"resumed_step": resumed["step"]}


def eval_uneven(data: str, rt: Runtime) -> dict:
    """FSDP2 val loss over 3 batches on 2 ranks (one rank runs a dummy forward)."""
    cfg = build_train_config("pico", dict(DIST_RUN, data=data, parallel="fsdp"))
    trainer = TrainStep(cfg, dataclasses.replace(rt, parallel="fsdp"))
    loss, n = evaluate(trainer.train_model, trainer.rt, find_shards(data, "val"), 4, 32, max_tokens=3 * 4 * 32)
    return {"val_loss": loss, "tokens": n}


def fp16_fsdp(data: str, rt: Runtime) -> dict:
    """float16 + FSDP2: an overflow in one rank's gradient shard makes every rank skip the step."""
    fp16 = dataclasses.replace(rt, dtype="float16", autocast_dtype=torch.float16, parallel="fsdp")
    trainer = TrainStep(build_train_config("pico", dict(DIST_RUN, data=data)), fp16)
    x = torch.randint(0, 50257, (4, 32), generator=torch.Generator().manual_seed(0))
    seen = {}
    for step in range(2):
        loss = trainer.forward_backward(x, x, last_micro_step=True)
        if step == 1 and rt.rank == 1:
            trainer.params[0].grad.to_local().view(-1)[0] = float("inf")  # this rank's shard only
        before = [p.to_local().clone() for p in trainer.params]
        trainer.optimizer_step(loss)
        changed = any(not torch.equal(b, p.to_local()) for b, p in zip(before, trainer.params))
        seen[f"step{step}"] = {"changed": changed, "scale": float(trainer.scaler.get_scale())}
    return seen


def batch_agree(rt: Runtime) -> dict:
    """--batch-size auto: ranks that would fit different sizes probe in lockstep and agree."""
    from gptspeed.batchsize import agreed_largest_fitting
    from gptspeed.step import agree_min

    limit_here = 40 if rt.rank == 0 else 24
    probed = []

    def fits(b):
        probed.append(b)
        return b <= limit_here

    return {"fit": agreed_largest_fitting(fits, lambda v: agree_min(rt, v)), "probed": probed}


MODERN = dict(
    pos_emb="rope",
    qk_norm=True,
    mlp="relu2",
    norm="rmsnorm",
    tie_embeddings=False,
    zero_init_proj=True,
    logit_softcap=15.0,
    doc_mask=True,
    value_embeds=1,
    unet_skips=True,
    attn_window=8,
    embed_lr=3e-3,
    head_lr=1e-3,
    scalar_lr=2e-3,
    lr_schedule="wsd",
)


def modern_fsdp(data: str, out: Path) -> dict:
    """FSDP2 with every switch of the modern switches (the doc mask included): 2 steps, compared by the test with
    one process."""
    cfg = build_train_config(
        "pico",
        dict(DIST_RUN, **MODERN, data=data, out=str(out / "modern_fsdp"), parallel="fsdp", save_every=0, max_steps=2),
    )
    return Trainer(cfg, resolve_runtime("cpu", "float32", False, "fsdp"), echo=False).train()


def muon_ddp(data: str, out: Path) -> dict:
    """DDP + Muon: a checkpoint every step, compared with one process by the test."""
    run = out / "muon_ddp"
    cfg = build_train_config(
        "pico", dict(DIST_RUN, data=data, out=str(run), optimizer="muon", parallel="ddp", save_every=1, max_steps=2)
    )
    return Trainer(cfg, resolve_runtime("cpu", "float32", False, "ddp"), echo=False).train()


def main() -> None:
    data, out, hellaswag_jsonl = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    hs.hellaswag_file = lambda progress=True: hellaswag_jsonl  # a small file in HellaSwag's format
    rt = resolve_runtime("cpu", "float32", False, "fsdp")
    init_distributed(rt)
    torch.set_num_threads(1)
    scenarios = {
        "muon_fsdp": lambda: muon_fsdp(data, out),
        "eval_uneven": lambda: eval_uneven(data, rt),
        "fp16_fsdp": lambda: fp16_fsdp(data, rt),
        "batch_agree": lambda: batch_agree(rt),
        "muon_ddp": lambda: muon_ddp(data, out),
        "modern_fsdp": lambda: modern_fsdp(data, out),
    }
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(scenarios)
    seen = {}
    for name in only:
        print(f"rank {rt.rank}: {name}", flush=True)
        seen[name] = scenarios[name]()
    (out / f"rank{rt.rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()
    finish_process(0)  # as gptspeed's command ends: no SIGABRT from gloo's threads in the teardown


if __name__ == "__main__":
    main()
