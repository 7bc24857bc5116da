"""``--cast-weights-once``: FSDP2 keeps the bf16 (unsharded) weights between the micro-steps of an
optimizer step, so they are cast once a step instead of once a micro-step -- the same losses, to the
bit, with a twentieth of the casts at 4 micro-steps; refused in one line where it cannot apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SRC

from gptspeed.config import preset
from gptspeed.errors import GptspeedError

PROBE = r"""
import json, os, socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1]); s.close()
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
from gptspeed.config import preset
from gptspeed.distributed import finish_process, init_distributed
from gptspeed.runtime import resolve_runtime
from gptspeed.step import TrainStep

casts, dtypes = [0], set()
real = pg.FSDPParamGroup.unshard
def counting(self, *a, **k):  # a fresh unshard: FSDP2's cast (and, over several ranks, all-gather) of the weights
    if self._all_gather_result is None and not self.is_unsharded:
        casts[0] += 1
    return real(self, *a, **k)
pg.FSDPParamGroup.unshard = counting
rt = resolve_runtime(os.environ["PROBE_DEVICE"], "bfloat16", False, "fsdp")
init_distributed(rt)
torch.manual_seed(0)
x = torch.randint(0, 50257, (24, 17), device=rt.device)
out = {}
for keep in (False, True):
    cfg = preset("pico").override(dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=2,
                                       total_batch_tokens=2 * 16 * 4, parallel="fsdp", dtype="bfloat16",
                                       compile=False, cast_weights_once=keep))
    cfg.validate(world_size=1)
    step = TrainStep(cfg, rt)
    step.model.transformer.h[0].register_forward_pre_hook(lambda m, i: dtypes.add(str(m.attn.c_attn.weight.dtype)))
    batches = iter([(x[i:i + 2, :-1], x[i:i + 2, 1:]) for i in range(0, 24, 2)])  # 3 steps of 4 micro-batches
    casts[0], losses = 0, []
    for _ in range(3):
        loss, _, _ = step(lambda: next(batches))
        losses.append(loss.item())
    out[str(keep)] = [casts[0], losses]
out["dtypes"] = sorted(dtypes)
print(json.dumps(out), flush=True)
finish_process(0)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_weights_are_cast_once_a_step_and_the_losses_do_not_change(device):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "PROBE_DEVICE": device,
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (every, losses), (once, kept) = out["False"], out["True"]
    # 3 FSDP groups (2 blocks, the root): per micro-step 3 casts in forward and the 2 blocks' again in
    # backward (resharded after forward) = 5, x 4 micro-steps x 3 steps; kept: 3 a step
    assert every == 5 * 4 * 3 and once == 3 * 3
    assert kept == losses  # the same bf16 weights, cast once instead of four times: the same numbers
    assert out["dtypes"] == ["torch.bfloat16"]  # the blocks compute with FSDP2's bf16 copy


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (dict(cast_weights_once=True), "--parallel auto --dtype auto"),
        (dict(cast_weights_once=True, parallel="fsdp", dtype="float32"), "--parallel fsdp --dtype float32"),
        (dict(cast_weights_once=True, parallel="ddp", dtype="bfloat16"), "--parallel ddp"),
    ],
)
def test_cast_weights_once_is_refused_without_fsdp_and_bf16(settings, fragment):
    cfg = preset("pico").override(settings)
    with pytest.raises(GptspeedError, match="--cast-weights-once keeps FSDP2's bf16 weights") as e:
        cfg.validate(world_size=1)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    preset("pico").override({**settings, "parallel": "fsdp", "dtype": "bfloat16"}).validate(world_size=1)
