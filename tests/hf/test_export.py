"""``gptspeed.hf.export``: a run out to Hugging Face format (``export-hf``)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import RECIPES, preset
from gptspeed.errors import GptspeedError
from gptspeed.hf.export import EXPORT_MARKER, _export_contents, export_hf
from gptspeed.model import GPT, GPTConfig
from gptspeed.sample import generate_cached, left_pad

from support.cli import assert_user_error, run_main
from support.hf_models import (
    IDX,
    exported,
    hf_logits,
    our_logits,
    snapshot,
    undeclare,
    write_data_pico,
    write_run,
    write_run_pico,
)

pytestmark = pytest.mark.usefixtures("one_thread", "hf_offline")


transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


def test_export_loads_in_transformers_with_same_logits_and_tokenizer(tmp_path):
    ours = write_run(tmp_path / "run")
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "merges.txt",
            "model.safetensors",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.json",
            EXPORT_MARKER,
        ]
    )
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert back.config.vocab_size == 50257 and back.config.n_positions == 64
    assert (hf_logits(back, IDX) - our_logits(ours, IDX)[..., :50257]).abs().max() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256
    assert not list(tmp_path.glob(".hf.*"))  # no temporary folder left behind


def test_export_files_get_the_users_umask(tmp_path):
    """Not 0600 files in a 0700 folder (tempfile.mkdtemp's): what every other written file gets."""
    write_run(tmp_path / "run")
    old = os.umask(0o022)
    try:
        out = export_hf(tmp_path / "run", tmp_path / "hf")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755
    assert {(p.stat().st_mode & 0o777) for p in out.iterdir()} == {0o644}


def test_export_refuses_to_overwrite_unless_forced(tmp_path):
    """--force replaces an earlier export (atomically: no temporary or old folder left), and an
    empty folder is written into; without --force an earlier export is kept."""
    write_run(tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf")
    marker = json.loads((tmp_path / "hf" / EXPORT_MARKER).read_text())
    assert marker["step"] == 7 and "model.safetensors" in marker["files"]
    with pytest.raises(GptspeedError, match="already exists"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    before = (tmp_path / "hf" / "model.safetensors").stat().st_ino
    export_hf(tmp_path / "run", tmp_path / "hf", force=True)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_ino != before  # a new folder, renamed in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing left aside
    (tmp_path / "empty").mkdir()
    export_hf(tmp_path / "run", tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_export_never_writes_over_its_run_or_a_data_folder_even_with_force(tmp_path):
    run = write_run_pico(tmp_path / "runs" / "r")
    data = write_data_pico(tmp_path / "data")
    before_run, before_data = snapshot(run), snapshot(data)
    cases = [
        (run, "the --run folder"),  # the tester's case: deleted the checkpoints
        (tmp_path / "runs", "holding the --run folder"),
        (data, "data folder"),  # deleted its shards
        (run / "hf", "would be written into"),  # a new folder inside the run
        (data / "hf", "would be written into"),
    ]
    for out, fragment in cases:
        for force in ([], ["--force"]):
            res = run_main("export-hf", "--run", str(run), "--out", str(out), *force)
            assert_user_error(res, fragment)
    other = write_run_pico(tmp_path / "other")  # another run, named as --out: a run folder
    res = run_main("export-hf", "--run", str(run), "--out", str(other), "--force")
    assert_user_error(res, "run folder", "ckpt_00000007.pt")
    assert snapshot(run) == before_run and snapshot(data) == before_data
    assert not (run / "hf").exists() and not (data / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "other", "runs"]  # no temporary left


def test_export_into_a_folder_holding_some_bin_file_is_not_refused_as_a_data_folder(tmp_path):
    """export-hf --out NEW was refused when NEW's parent held any *.bin file ("a data folder"): a
    downloads folder with a firmware.bin or another model's pytorch_model.bin. Only a folder gptspeed
    reads as data (a manifest.json, or shards named as gptspeed's / llm.c's) is one."""
    write_run_pico(tmp_path / "run")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / "firmware.bin").write_bytes(b"\0" * 64)
    (downloads / "pytorch_model.bin").write_bytes(b"\0" * 64)
    res = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(downloads / "hf"))
    assert res.returncode == 0, res.stderr
    assert (downloads / "hf" / "model.safetensors").is_file()
    shards = write_data_pico(tmp_path / "shards", manifest=False)  # llm.c's names, no manifest: data
    res = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(shards / "hf"))
    assert_user_error(res, "data folder", "val_000000.bin")


def test_export_force_replaces_only_an_earlier_export(tmp_path):
    run = write_run_pico(tmp_path / "run")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    res = run_main("export-hf", "--run", str(run), "--out", str(user), "--force")
    assert_user_error(res, "not an earlier export", "notes.txt")
    assert (user / "notes.txt").read_text() == "my notes"

    # a user's own HF folder with exactly the files an export writes, but no marker: not ours
    own = tmp_path / "own-hf"
    export_hf(run, own)
    (own / EXPORT_MARKER).unlink()
    assert_user_error(run_main("export-hf", "--run", str(run), "--out", str(own), "--force"), EXPORT_MARKER)

    out = tmp_path / "hf"
    assert run_main("export-hf", "--run", str(run), "--out", str(out)).returncode == 0
    (out / "README.md").write_text("my model card")  # the user added a file: no longer only ours
    assert_user_error(run_main("export-hf", "--run", str(run), "--out", str(out), "--force"), "README.md")
    (out / "README.md").unlink()
    with open(out / "config.json", "a") as f:  # the user edited an exported file
        f.write(" ")
    assert_user_error(run_main("export-hf", "--run", str(run), "--out", str(out), "--force"), "config.json")
    assert (out / "config.json").read_text().endswith(" ")

    (tmp_path / "file").write_text("x")
    assert_user_error(run_main("export-hf", "--run", str(run), "--out", str(tmp_path / "file"), "--force"), "is a file")
    os.symlink(run, tmp_path / "link")
    assert_user_error(
        run_main("export-hf", "--run", str(run), "--out", str(tmp_path / "link"), "--force"), "symbolic link"
    )
    assert (tmp_path / "file").read_text() == "x" and (run / "ckpt_00000007.pt").is_file()


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


EOT = 50256

MODERN = {k: v for k, v in RECIPES["modern"].items() if k in GPTConfig.__dataclass_fields__}

SWITCHES = {
    "rope": dict(pos_emb="rope", rope_theta=500.0),
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"),
    "rmsnorm": dict(norm="rmsnorm"),
    "untied": dict(tie_embeddings=False),
    "softcap": dict(logit_softcap=1.0),  # the least cap accepted; the logits' scale is ~0.6 here: it bends them
    "doc_mask": dict(doc_mask=True),
    "value_embeds": dict(value_embeds=2, n_layer=4),  # blocks 0, 1 and 2, 3 share embeddings 0, 1
    "unet_skips": dict(unet_skips=True, n_layer=3),  # block 2 adds block 0's output; block 1 none
    "modern": MODERN,  # --recipe modern's architecture: rotary, QK-norm, ReLU², RMSNorm
    "all": dict(
        MODERN,
        tie_embeddings=False,
        logit_softcap=1.0,
        doc_mask=True,
        zero_init_proj=True,
        value_embeds=1,
        unet_skips=True,
        n_layer=4,
    ),
}

IDX_DOCS = IDX.clone()
IDX_DOCS[0, [5, 20, 33]] = EOT  # documents: [0, 5) [5, 20) [20, 33) [33, 48)
IDX_DOCS[1, [0, 40]] = EOT


def write_modern_run(run_dir: Path, **switches) -> GPT:
    """A run folder holding a tiny GPT with ``switches`` at step 7, every weight moved off its
    initialisation (zero-initialised projections, unit norm gains and zero biases would hide a
    tensor the export dropped or misnamed)."""
    cfg = preset("pico")
    cfg.model = GPTConfig(**{**dict(block_size=64, n_layer=2, n_head=2, n_embd=32), **switches})
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    run_dir.mkdir(parents=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    return model


def load_exported(out: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


@pytest.mark.parametrize("case", list(SWITCHES))
def test_an_export_with_each_switch_computes_gptspeeds_logits_in_transformers(case, tmp_path):
    """Each switch alone, --recipe modern's and all of them: AutoModelForCausalLM loads the export
    (its own modeling code, trust_remote_code) and gives gptspeed's logits on tokens holding EOTs,
    its loss, and with generate() (through a KV cache) the logits and greedy tokens of gptspeed's
    sampler, left-padded prompts included. Before, export-hf refused every such run."""
    ours = write_modern_run(tmp_path / "run", **SWITCHES[case])
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gptspeed_gpt" and config["dtype"] == config["torch_dtype"] == "float32"
    assert {"modeling_gptspeed.py", "configuration_gptspeed.py"} <= {p.name for p in out.iterdir()}
    back = load_exported(out)
    assert type(back).__name__ == "GptspeedForCausalLM" and back.config.vocab_size == 50257
    want = our_logits(ours, IDX_DOCS)[..., :50257]
    torch.testing.assert_close(hf_logits(back, IDX_DOCS), want, atol=1e-5, rtol=0)
    with torch.no_grad():
        loss = back(IDX_DOCS, labels=IDX_DOCS).loss
        torch.testing.assert_close(loss, ours(IDX_DOCS[:, :-1], IDX_DOCS[:, 1:])[1], atol=1e-5, rtol=0)
        gen = back.generate(
            IDX[:, :8], max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    seq = gen.sequences
    torch.testing.assert_close(
        torch.stack(gen.logits, 1), our_logits(ours, seq[:, :-1])[:, 7:, :50257], atol=1e-5, rtol=0
    )
    idx, pad = left_pad([[5, 6, 7, EOT, 9, 10, 11], [100, 200]])
    mask = (torch.arange(idx.size(1))[None] >= pad[:, None]).long()
    theirs = back.generate(idx, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=EOT)
    assert (
        theirs[:, idx.size(1) :].tolist()
        == torch.stack(list(generate_cached(ours, idx, 5, temperature=0, pad=pad)), 1).tolist()
    )


def test_a_doc_mask_export_attends_within_documents_with_and_without_a_kv_cache(tmp_path):
    """The document mask is part of the exported model, as of gptspeed's (training, eval and sample
    all apply it): the logits differ from causal attention over the same tokens. With a KV cache the
    EOTs of the cached tokens still bound the documents: a prefill in chunks across documents, and
    greedy generation after a prompt holding an EOT, give gptspeed's logits."""
    from transformers.cache_utils import DynamicCache

    ours = write_modern_run(tmp_path / "run", doc_mask=True, pos_emb="rope")
    back = load_exported(export_hf(tmp_path / "run", tmp_path / "hf"))
    causal = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, pos_emb="rope")).eval()
    causal.load_state_dict(ours.state_dict())
    want = our_logits(ours, IDX_DOCS)[..., :50257]
    got = hf_logits(back, IDX_DOCS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - our_logits(causal, IDX_DOCS)[..., :50257]).abs().max() > 0.1  # the mask is not a no-op
    cache = DynamicCache()
    with torch.no_grad():
        parts = [back(IDX_DOCS[:, a:b], cache=cache).logits for a, b in ((0, 12), (12, 30), (30, 31), (31, 48))]
    torch.testing.assert_close(torch.cat(parts, 1), want, atol=1e-5, rtol=0)  # each chunk after an EOT
    prompt = torch.tensor([[5, 6, EOT, 9, 10, 11, 12, 13], [7, 8, 9, EOT, 10, 11, 12, 14]])
    with torch.no_grad():
        gen = back.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert back.config.use_cache and gen.sequences.shape == (2, 14)
    ref = our_logits(ours, gen.sequences[:, :-1])[:, 7:, :50257]
    torch.testing.assert_close(torch.stack(gen.logits, 1), ref, atol=1e-5, rtol=0)


def test_a_bfloat16_export_stores_bf16_and_computes_gptspeeds_logits_to_bf16_rounding(tmp_path):
    """--dtype bfloat16: half the bytes (GPT-2 XL is 6 GB in fp32), every tensor bf16, config.json's
    dtype saying so; transformers loads it in bf16, its logits gptspeed's fp32 ones to bf16 rounding
    (within 2x, at most 3x, of gptspeed's own error under bf16 autocast: the export computes all in
    bf16). Both the modern and the GPT-2 layouts; it replaces an earlier fp32 export with --force."""
    from safetensors import safe_open

    modern = write_modern_run(tmp_path / "modern", **SWITCHES["all"])
    gpt2 = write_modern_run(tmp_path / "gpt2")
    for name, ours in (("modern", modern), ("gpt2", gpt2)):
        out = export_hf(tmp_path / name, tmp_path / f"{name}-hf")
        fp32_bytes = (out / "model.safetensors").stat().st_size
        export_hf(tmp_path / name, out, dtype="bfloat16", force=True)
        with safe_open(str(out / "model.safetensors"), framework="pt") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
        assert (out / "model.safetensors").stat().st_size < 0.51 * fp32_bytes
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == "bfloat16"
        back = load_exported(out)  # in bf16: transformers 5 loads config.json's dtype (4.x: fp32 unless asked)
        assert back.dtype == torch.bfloat16 or int(transformers.__version__.split(".")[0]) < 5
        back = back.to(torch.bfloat16)
        want = our_logits(ours, IDX_DOCS)[..., :50257]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # gptspeed's own bf16 error: the yardstick
            own = our_logits(ours, IDX_DOCS)[..., :50257].float()
        err, own_err = (hf_logits(back, IDX_DOCS).float() - want).abs(), (own - want).abs()
        assert err.mean() < 2 * own_err.mean() and err.max() < 3 * own_err.max() < 0.2, (name, err.max())
    with pytest.raises(GptspeedError, match="--dtype float16: choose one of float32, bfloat16"):
        export_hf(tmp_path / "gpt2", tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()


def test_zero_init_proj_alone_is_gpt2s_architecture_and_exports_as_gpt2(tmp_path):
    """--zero-init-proj changes the initial weights only: the run is a GPT2LMHeadModel, no code."""
    ours = write_modern_run(tmp_path / "run", zero_init_proj=True)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    assert not list(out.glob("*.py"))
    back = load_exported(out)
    assert type(back) is transformers.GPT2LMHeadModel
    torch.testing.assert_close(hf_logits(back, IDX), our_logits(ours, IDX)[..., :50257], atol=1e-4, rtol=0)


def test_a_setting_the_export_does_not_compute_is_refused_not_dropped(tmp_path, monkeypatch):
    """A switch added to the model later (a GPTConfig field without an ``export=`` declaration, here
    QK-norm's removed) is refused in one line, nothing written -- not exported as a model computing
    without it; a checkpoint tensor the modeling code has no place for is refused too."""
    write_modern_run(tmp_path / "run", qk_norm=True, pos_emb="rope")
    undeclare(monkeypatch, GPTConfig, "qk_norm", "export")
    res = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert_user_error(res, "uses --qk-norm True, which export-hf does not write yet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    config = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, norm="rmsnorm")
    sd = {**GPT(config).state_dict(), "transformer.h.1.attn.gate": torch.ones(2)}
    with pytest.raises(GptspeedError, match=r"transformer.h.1.attn.gate on one side only"):
        _export_contents(config, sd, "float32")


def test_export_hf_dtype_flag_reaches_the_export_and_refuses_float16(tmp_path):
    from safetensors import safe_open

    write_run(tmp_path / "run")
    proc = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    proc = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "f16"), "--dtype", "float16")
    assert proc.returncode != 0 and "invalid choice: 'float16'" in proc.stderr and not (tmp_path / "f16").exists()


TEXTS = ["Hello world", "  two spaces\n\nand\ttabs", "naïve café 東京 🙂", "It's 2026: don't; we'll", "x" * 300]


def test_the_export_has_a_tokenizer_json_that_encodes_as_gptspeed_and_no_path_of_the_machine(tmp_path):
    """tokenizer.json (the fast tokenizer, read by tools that do not go through save_pretrained)
    was missing; the marker recorded the run's path as typed (an absolute path travels with a
    folder pushed to a hub). Now tokenizers' own reader and transformers' fast tokenizer encode as
    gptspeed does, a literal <|endoftext|> being one token there (seven for gptspeed's
    encoder, which reads it as text), and
    no file of the export holds the run's absolute path."""
    from tokenizers import Tokenizer

    from gptspeed.tokenizer import encode

    write_run(tmp_path / "run")
    out = export_hf((tmp_path / "run").resolve(), tmp_path / "hf")
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.is_fast
    for text in TEXTS:
        assert fast.encode(text).ids == auto(text)["input_ids"] == encode(text), text
        assert fast.decode(encode(text)) == text
    assert fast.encode("a<|endoftext|>b").ids == [64, 50256, 65]
    assert len(encode("<|endoftext|>")) == 7  # "<", "|", "end", "of", "text", "|", ">"
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["run"] == "run"
    for f in out.iterdir():
        assert str(tmp_path) not in f.read_bytes().decode("utf-8", "replace"), f.name


def write_softmax_data_run(run_dir: Path, **switches) -> tuple[GPT, torch.Tensor]:
    """A run as the quickstart's ``--preset nano`` trains it (``--softmax data``), tiny: its head
    covers the ids of IDX and the EOT only. Returns the model and those ids."""
    ids = torch.unique(torch.cat((IDX.flatten(), torch.tensor([EOT]))))
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, softmax="data", **switches)
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    model.set_softmax_ids(ids)
    run_dir.mkdir(parents=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    return model, ids


@pytest.mark.parametrize("switches", [{}, dict(logit_softcap=15.0, tie_embeddings=False)], ids=["gpt2", "switches"])
def test_a_softmax_data_run_exports_with_its_unseen_tokens_at_probability_zero(switches, tmp_path):
    """The quickstart's model (--preset nano: --softmax data) was refused with a message that named
    nothing to do. Now it exports through gptspeed's modeling code, its data's ids in config.json:
    transformers gives gptspeed's logits, -inf (probability 0) at every other id, the same loss,
    and greedy generation never produces an unseen id."""
    assert preset("nano").model.softmax == "data"
    ours, ids = write_softmax_data_run(tmp_path / "run", **switches)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gptspeed_gpt" and config["softmax_ids"] == ids.tolist()
    back = load_exported(out)
    theirs, want = hf_logits(back, IDX), our_logits(ours, IDX)[..., :50257]
    torch.testing.assert_close(theirs, want, atol=1e-5, rtol=0)
    unseen = torch.ones(50257, dtype=torch.bool)
    unseen[ids] = False
    assert bool(torch.isneginf(theirs[..., unseen]).all()) and bool(torch.isfinite(theirs[..., ids]).all())
    with torch.no_grad():
        loss = back(IDX, labels=IDX).loss
    torch.testing.assert_close(loss, ours(IDX[:, :-1], IDX[:, 1:])[1], atol=1e-5, rtol=0)
    new = back.generate(IDX[:, :4], max_new_tokens=6, do_sample=False)[:, 4:]
    assert bool(torch.isin(new, ids).all())
    back.resize_token_embeddings(50257 + 2)  # a token added for fine-tuning is not masked
    logits = hf_logits(back, torch.tensor([[1, 50258]]))
    assert logits.shape[-1] == 50259 and bool(torch.isfinite(logits[..., 50257:]).all())
    assert bool(torch.isneginf(logits[..., :50257][..., unseen]).all())


def test_a_speedrun_export_resizes_its_embeddings_checkpoints_gradients_and_takes_sdpa(tmp_path):
    """Fine-tuning a modern or speedrun export broke: after resize_token_embeddings any new id raised
    IndexError (the value embeddings kept their rows); gradient_checkpointing_enable() and
    attn_implementation="sdpa" raised ValueError. Now the new ids run through every embedding, the
    checkpointed gradients equal the plain ones, and an sdpa load computes the same logits."""
    write_modern_run(tmp_path / "run", **SWITCHES["all"])
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, attn_implementation="sdpa")
    torch.testing.assert_close(hf_logits(sdpa.eval(), IDX), hf_logits(load_exported(out), IDX), atol=0, rtol=0)
    grads, calls = [], []
    for checkpointing in (False, True):
        model = load_exported(out)
        torch.manual_seed(0)  # the new rows are drawn around the old ones' mean
        model.resize_token_embeddings(50257 + 3)
        count = []
        model.transformer.h[0].register_forward_pre_hook(lambda *a: count.append(1))
        assert all(e.num_embeddings == 50260 for e in (model.transformer.wte, *model.transformer.ve))
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        idx = IDX.clone()
        idx[:, 5] = 50259  # a new token
        loss = model(idx, labels=idx, use_cache=False).loss
        loss.backward()
        assert torch.isfinite(loss)
        calls.append(len(count))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls == [1, 2]  # checkpointed: the block ran again in the backward pass
    assert grads[0].keys() == grads[1].keys() and "transformer.ve.0.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_run_on_its_own_tokenizer_exports_it_for_auto_tokenizer_and_init_from_refuses_other_data(tmp_path):
    """A run trained on data of its own tokenizer ships that tokenizer.json (a PreTrainedTokenizerFast whose
    bos/eos is the data's <|endoftext|>) and config.json's vocabulary and eos ids from it: AutoTokenizer loads
    it offline and round-trips text to gptspeed's ids; --init-from the export on GPT-2's data is one line."""
    import gptspeed
    from gptspeed.run_tokenizer import run_tokenizer

    from support.tokdata import TOK_VOCAB, make_tokenizer_data, train_tokenizer_run

    root = make_tokenizer_data(tmp_path)
    run = train_tokenizer_run(root)
    tok = run_tokenizer(run)
    out = export_hf(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"]) == (TOK_VOCAB, tok.eot, tok.eot)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.is_fast and auto.eos_token_id == tok.eot and len(auto) == TOK_VOCAB
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ids == tok.encode(text) and auto.decode(ids) == text, text
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.get_output_embeddings().weight.shape[0] == TOK_VOCAB
    with pytest.raises(GptspeedError, match=r"--init-from .* takes the tokenizer.json of sha256 .* GPT-2's BPE"):
        gptspeed.make_config("pico", data=str(root / "gpt2"), init_from=str(out), out=str(tmp_path / "again"))
    cfg = gptspeed.make_config("pico", data=str(root / "data"), init_from=str(out), out=str(tmp_path / "again"))
    assert (cfg.model.valid_vocab_size, cfg.model.tokenizer) == (TOK_VOCAB, "sha256:" + tok.sha256)  # its own data


def test_a_tiktoken_run_exports_a_tokenizer_json_that_encodes_as_tiktoken_and_comes_back(tmp_path, monkeypatch):
    """A run on data prepared with a tiktoken encoding could not be exported (no tokenizer.json). Its export now
    carries the encoding converted by transformers' TikTokenConverter: AutoTokenizer encodes every text to tiktoken's
    ids (<|endoftext|> at tiktoken's 301, past a gap) and decodes it back exactly; import-hf brings back the
    run's logits and the encoding by name."""
    import gptspeed
    from gptspeed.data.prepare import prepare
    from gptspeed.hf.load import import_hf
    from gptspeed.run_tokenizer import run_tokenizer
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_model

    from support.hf_models import our_logits
    from support.shapes import QUICK_RUN
    from support.tokdata import TIKTOKEN_EOT, TIKTOKEN_NAME, offer_tiny_tiktoken

    tok = offer_tiny_tiktoken(monkeypatch)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"{t} {i}"}) + "\n" for i in range(60) for t in TEXTS))
    prepare(str(src), tmp_path / "data", shard_tokens=8192, progress=False, tokenizer=TIKTOKEN_NAME)
    settings = dict(QUICK_RUN, data=str(tmp_path / "data"), out=str(tmp_path / "run"), max_steps=2, dtype="float32")
    gptspeed.train(gptspeed.make_config("pico", **settings), echo=False)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["gptspeed_tokenizer"], config["vocab_size"], config["eos_token_id"]) == (TIKTOKEN_NAME, 302, 301)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.eos_token_id == TIKTOKEN_EOT
    for text in [*TEXTS, "ROMEO: 東京 x\r\n  y 12345678"]:
        ids = auto(text)["input_ids"]
        assert ids == tok.encode(text) and auto.decode(ids) == text, text
    import_hf(str(out), tmp_path / "back")
    trained, _ = load_model(tmp_path / "run", resolve_runtime("cpu", "float32"))
    back, _ = load_model(tmp_path / "back", resolve_runtime("cpu", "float32"))
    assert (back.config.tokenizer, back.config.valid_vocab_size, back.config.eot_token) == (TIKTOKEN_NAME, 302, 301)
    idx = torch.tensor([tok.encode("Hello world, it's 2026")])
    torch.testing.assert_close(our_logits(back, idx), our_logits(trained, idx), atol=1e-5, rtol=0)
    assert run_tokenizer(tmp_path / "back") is tok
