"""``gptspeed.eval.bpb``: bits per byte on the val split, checked against a hand computation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import preset
from gptspeed.data.loader import iter_eval_batches
from gptspeed.data.shards import write_shard
from gptspeed.eval.bpb import bytes_table, evaluate_bpb, token_bytes
from gptspeed.eval.val_loss import evaluate_val
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime
from gptspeed.tokenizer import EOT_TOKEN, encode, get_encoding

from support.cli import run_main

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Hi, naïve café 東京 🙂!"


def test_token_bytes_count_each_tokens_utf8_text_as_nanochat_does():
    """Each token's bytes are those of its text decoded alone (U+FFFD, 3 bytes, for a token that
    is part of a character), 0 for <|endoftext|> and the padding ids."""
    nb = token_bytes(50304)
    assert nb.shape == (50304,) and nb[EOT_TOKEN] == 0 and int(nb[50257:].sum()) == 0
    assert nb[encode("Hello")[0]] == 5 and nb[encode(" world")[0]] == 6
    ids = encode("東")  # one character, three bytes, split over tokens
    assert [int(nb[i]) for i in ids] == [len(get_encoding().decode([i]).encode("utf-8")) for i in ids]


def tiny_val(folder, ids):
    folder.mkdir()
    write_shard(folder / "val_000000.bin", np.array(ids, dtype=np.uint16))
    write_shard(folder / "train_000000.bin", np.array(ids, dtype=np.uint16))
    return folder


def test_gptspeed_eval_reports_bits_per_byte_equal_to_a_hand_computation(tmp_path):
    """`gptspeed eval` gave the val loss and perplexity only. It now gives val_bpb: the nats of the
    val targets that have bytes over ln 2 times their bytes, here computed by hand from the model's
    logits over the two windows of a 17-token val split holding an <|endoftext|> (0 bytes, no nats)
    and characters split over tokens."""
    ids = (encode(TEXT) + [EOT_TOKEN] + encode(" ok then, bye now"))[:17]
    assert len(ids) == 17
    data = tiny_val(tmp_path / "data", ids)
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run", {"step": 3, "model": model.state_dict(), "config": cfg.to_dict()})

    enc, nats, nbytes = get_encoding(), 0.0, 0
    for start in (0, 8):  # the windows: x = ids[s : s + 8], y = ids[s + 1 : s + 9]
        x = torch.tensor(ids[start : start + 8])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[0][0].double(), dim=-1)
        for t, target in enumerate(ids[start + 1 : start + 9]):
            b = 0 if target == EOT_TOKEN else len(enc.decode([target]).encode("utf-8"))
            nats += -float(logp[t, target]) if b else 0.0
            nbytes += b
    want = nats / (math.log(2) * nbytes)

    rt = resolve_runtime("cpu", "float32")
    assert evaluate_bpb(model, rt, [data / "val_000000.bin"], 2, 8) == pytest.approx(want, rel=1e-6)
    res = run_main("eval", "--run", str(tmp_path / "run"), "--data", str(data), "--device", "cpu", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tokens"] == 16 and out["val_bpb"] == pytest.approx(want, rel=1e-6)
    assert out["val_bpb"] != pytest.approx(out["val_loss"] / math.log(2), rel=1e-3)  # per byte, not per token


def two_passes(model, shards, batch_size, seq_len):
    """The figures as two passes gave them before one pass did (the reference, as the code was): the
    val loss, the token-weighted mean of each batch's mean loss; then bits per byte, each window's
    logits ``(T, V)`` computed alone and its targets' nats counted where they have bytes."""
    nbytes = token_bytes(model.config.vocab_size)
    total = tokens = nats = count = 0.0
    with torch.no_grad():
        for x, y in iter_eval_batches(shards, batch_size, seq_len, 0):
            total += float(model(x, y)[1].double()) * y.numel()
            tokens += y.numel()
        for x, y in iter_eval_batches(shards, batch_size, seq_len, 0):
            for row in range(x.size(0)):
                ce = F.cross_entropy(model(x[row : row + 1])[0][0].float(), y[row], reduction="none")
                b = nbytes[y[row]]
                nats += float(torch.where(b > 0, ce, torch.zeros_like(ce)).double().sum())
                count += int(b.sum())
    return total / tokens, nats / (math.log(2) * count)


@pytest.mark.parametrize(
    ("loss", "softmax", "softcap"),
    [
        ("plain", "full", 0.0),
        ("fused", "full", 0.0),
        ("fused", "full", 5.0),
        ("plain", "data", 0.0),
        ("fused", "data", 0.0),
    ],
)
def test_one_pass_gives_the_two_passes_val_loss_and_bits_per_byte(tmp_path, loss, softmax, softcap):
    """The val loss and bits per byte of one pass (each batch's forward giving every target's nats)
    equal, to float rounding, those of the two passes they replaced, on every loss path: 3 windows
    in batches of 2 (the last one partial), an <|endoftext|> among the targets (0 bytes, no nats)."""
    ids = (
        encode(TEXT) + [EOT_TOKEN] + encode(" ok then, bye now, said the naïve café owner to the 東京 visitors at noon")
    )[:25]
    assert len(ids) == 25 and EOT_TOKEN in ids[1:]
    data = tiny_val(tmp_path / "data", ids)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=32, loss=loss, softmax=softmax, logit_softcap=softcap)
    )
    if softmax == "data":
        model.set_softmax_ids(torch.tensor(sorted(set(ids))))
    model.eval()
    want_loss, want_bpb = two_passes(model, [data / "val_000000.bin"], 2, 8)
    rt = resolve_runtime("cpu", "float32")
    got = evaluate_val(model, rt, [data / "val_000000.bin"], 2, 8, nbytes=bytes_table(model, rt.device))
    assert got.tokens == 24
    assert got.loss == pytest.approx(want_loss, rel=1e-6) and got.bpb == pytest.approx(want_bpb, rel=1e-6)
    assert got.loss != pytest.approx(got.bpb * math.log(2), rel=1e-3)  # the two sums differ: bytes, and the EOT's nats
