"""Every branch a host picks by default, forced on every host (issue 28 item 1).

This project's machines come in two kinds: AVX2-only CPUs, where ``--dtype auto`` is float32 and
compile stays off, and AVX-512 CPUs with native bf16, where auto is bfloat16 and a long run
compiles. The suite used to run only the branch of the machine it ran on, so the README's first
command broke on the other kind (``--softmax data`` sampling under bf16 autocast). Here each
combination trains, checkpoints and resumes bit-identically, whatever the host would choose.
(Sampling, eval, HellaSwag and export in each dtype: tests/test_hf.py, tests/test_kvcache.py.)
"""

import json
import shutil

import pytest
import torch
from conftest import TINY_MODEL, records, train_losses

from gptspeed.trainer import build_train_config, fit

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(
    TINY_MODEL,
    n_layer=1,
    batch_size=4,
    device="cpu",
    eval_every=2,
    eval_tokens=256,
    log_every=1,
    save_every=2,
    keep_checkpoints=3,
    max_steps=3,
    lr=3e-3,
    warmup_steps=1,
)

# (dtype, softmax, loss, compile): each host-dependent choice both ways, and the README quickstart's
# combination on each kind of CPU (nano: --softmax data, the CPU's auto loss = fused; bf16 hosts compile)
BRANCHES = [
    ("float32", "data", "fused", False),
    ("float32", "full", "plain", False),
    ("bfloat16", "data", "fused", True),
    ("bfloat16", "data", "plain", False),
    ("bfloat16", "full", "fused", False),
]


@pytest.mark.parametrize(
    "dtype, softmax, loss, compile",
    BRANCHES,
    ids=["-".join(map(str, b)).replace("True", "compile").replace("False", "eager") for b in BRANCHES],
)
def test_each_branch_trains_and_resumes_bit_identically(
    shakespeare_data, tmp_path, monkeypatch, dtype, softmax, loss, compile
):
    import gptspeed.parallelize as parallelize
    import gptspeed.step as step

    real = parallelize.parallelize  # dynamo traces the model; the "eager" backend keeps it to seconds on a CPU
    monkeypatch.setattr(step, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    settings = dict(BASE, data=str(shakespeare_data), dtype=dtype, softmax=softmax, loss=loss, compile=compile)
    full = tmp_path / "full"
    fit(build_train_config("pico", dict(settings, out=str(full))), echo=False)
    derived = json.loads((full / "config.json").read_text())["derived"]
    assert (derived["dtype"], derived["compile"]) == (dtype, compile)  # the branch asked for ran, not the host's
    ref = train_losses(full)
    assert len(ref) == 3 and all(torch.isfinite(torch.tensor(v)) for v in ref.values())
    vals = [r["val_loss"] for r in records(full) if r.get("val_loss") is not None]
    assert len(vals) == 3 and vals[-1] < vals[0]  # steps 0, 2 and 3 (the last): it learns
    # stopped after its step-2 checkpoint: resume to the end, the same step-3 loss to the bit
    part = tmp_path / "part"
    part.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json", "config.json"):
        shutil.copy(full / name, part / name)
    fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    assert train_losses(part)[3] == ref[3]
