"""Hugging Face interop that would drop what was asked or die in a traceback: --init-from with an
architecture GPT-2's weights cannot take, export-hf onto a full disk. No network."""

import errno
import os

import pytest
import torch
from conftest import assert_user_error, run_main

from gptspeed import hf
from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import GPTConfig, preset
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "switch,named",
    [
        (dict(pos_emb="rope"), "--pos-emb rope"),
        (dict(norm="rmsnorm"), "--norm rmsnorm"),
        (dict(mlp="relu2"), "--mlp relu2"),
        (dict(qk_norm=True), "--qk-norm"),
        (dict(tie_embeddings=False), "--no-tie-embeddings"),
        (dict(zero_init_proj=True), "--zero-init-proj"),
    ],
)
def test_init_from_refuses_an_architecture_gpt2_weights_cannot_take(switch, named, tmp_path):
    """Each switch was silently dropped: the run trained GPT-2's architecture. Refused before the
    source is read (gpt2 here would be a download)."""
    with pytest.raises(
        GptspeedError, match=f"--init-from gpt2 starts from GPT-2's weights, which {named} would not fit"
    ):
        build_train_config("pico", {"init_from": "gpt2", "out": str(tmp_path / "run"), **switch})


def test_init_from_with_a_recipe_or_config_file_switch_is_one_line(tmp_path):
    res = run_main(
        "train", "--preset", "pico", "--recipe", "modern", "--init-from", "gpt2", "--out", str(tmp_path / "a")
    )
    assert_user_error(res, "--pos-emb rope, --norm rmsnorm, --mlp relu2, --qk-norm would not fit")
    conf = tmp_path / "arch.yaml"
    conf.write_text("model:\n  pos_emb: rope\n")
    res = run_main(
        "train", "--preset", "pico", "--config", str(conf), "--init-from", "gpt2", "--out", str(tmp_path / "b")
    )
    assert_user_error(res, "--pos-emb rope would not fit")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def exported(tmp_path):
    """A tiny run's export (an HF GPT-2 folder)."""
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return run, hf.export_hf(run, tmp_path / "hf")


def test_init_from_keeps_the_switches_that_need_no_weights(tmp_path):
    """Document masking, the logit soft-cap and the bf16 residual stream add no tensors: they were
    dropped silently too; now the run has them."""
    _, folder = exported(tmp_path)
    cfg = build_train_config(
        "pico",
        {
            "init_from": str(folder),
            "out": str(tmp_path / "r"),
            "doc_mask": True,
            "logit_softcap": 30.0,
            "residual_dtype": "bfloat16",
            "dtype": "bfloat16",
        },
    )
    m = cfg.model
    assert (m.doc_mask, m.logit_softcap, m.residual_dtype, m.n_layer) == (True, 30.0, "bfloat16", 1)


@pytest.mark.parametrize("where", ["safetensors", "config.json"])
def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, where):
    """safetensors' writer raises a SafetensorError ("No space left on device (os error 28)"), not
    an OSError: it was a traceback. Now one line, and no folder or temporary folder is left."""
    run, _ = exported(tmp_path)
    if where == "safetensors":
        import safetensors.torch
        from safetensors import SafetensorError

        def full(*a, **k):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        real = type(tmp_path).write_text

        def full(self, *a, **k):
            if self.name == "config.json":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, *a, **k)

        monkeypatch.setattr(type(tmp_path), "write_text", full)
    out = tmp_path / "full"
    res = run_main("export-hf", "--run", str(run), "--out", str(out))
    assert_user_error(
        res, f"could not write {out}: No space left on device: free some space", "nothing was written there"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
