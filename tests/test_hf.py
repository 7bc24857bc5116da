"""Hugging Face interop (gptspeed.hf): import, export, --init-from, errors. No network: the HF
models are random transformers GPT2LMHeadModels saved to temporary folders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from conftest import child_env  # noqa: E402

from gptspeed import hf  # noqa: E402
from gptspeed.checkpoint import save_checkpoint  # noqa: E402
from gptspeed.config import preset  # noqa: E402
from gptspeed.data.shards import write_shard  # noqa: E402
from gptspeed.errors import GptspeedError  # noqa: E402
from gptspeed.model import GPT, GPTConfig  # noqa: E402
from gptspeed.runtime import resolve_runtime  # noqa: E402
from gptspeed.sample import load_model  # noqa: E402

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def gptspeed_cli(*args, cwd=None):
    env = child_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "gptspeed", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def assert_one_line_error(res):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], res.stderr


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random GPT-2 in transformers, saved with save_pretrained (model.safetensors)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).eval()
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(folder)
    return model, folder


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def our_logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


IDX = torch.randint(0, 50257, (2, 48), generator=torch.Generator().manual_seed(1))


def test_import_gives_the_same_logits(hf_model):
    ref, folder = hf_model
    ours, info = hf.load_hf_model(str(folder))
    assert ours.config.block_size == 64 and ours.config.vocab_size == 50304
    out = our_logits(ours, IDX)
    assert (out[..., :50257] - hf_logits(ref, IDX)).abs().max() <= 1e-4
    assert torch.isneginf(out[..., 50257:]).all()  # padding rows are never predicted
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_import_pytorch_bin_in_openai_layout(hf_model, tmp_path):
    """OpenAI's files: no `transformer.` prefix, causal-mask buffers, pytorch_model.bin."""
    ref, folder = hf_model
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    for i in range(SHAPE["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours, _ = hf.load_hf_model(str(tmp_path))
    assert (our_logits(ours, IDX)[..., :50257] - hf_logits(ref, IDX)).abs().max() <= 1e-4


def test_import_hf_cli_then_export_hf_cli_round_trip(hf_model, tmp_path):
    ref, folder = hf_model
    run, out = tmp_path / "run", tmp_path / "exported"
    res = gptspeed_cli("import-hf", folder, "--out", run)
    assert res.returncode == 0, res.stderr
    model, ckpt = load_model(run, resolve_runtime("cpu", "float32"))
    assert ckpt["step"] == 0 and "optimizer" not in ckpt
    assert (our_logits(model, IDX)[..., :50257] - hf_logits(ref, IDX)).abs().max() <= 1e-4
    res = gptspeed_cli("export-hf", "--run", run, "--out", out)
    assert res.returncode == 0, res.stderr
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (hf_logits(back, IDX) - hf_logits(ref, IDX)).abs().max() <= 1e-4


def write_run(run_dir: Path, seed: int = 0) -> GPT:
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(cfg.model).eval()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    return model


def test_export_loads_in_transformers_with_same_logits_and_tokenizer(tmp_path):
    ours = write_run(tmp_path / "run")
    out = hf.export_hf(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "merges.txt",
            "model.safetensors",
            "special_tokens_map.json",
            "tokenizer_config.json",
            "vocab.json",
            hf.EXPORT_MARKER,
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
        out = hf.export_hf(tmp_path / "run", tmp_path / "hf")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755
    assert {(p.stat().st_mode & 0o777) for p in out.iterdir()} == {0o644}


def test_export_refuses_to_overwrite_unless_forced(tmp_path):
    """--force replaces an earlier export (atomically: no temporary or old folder left), and an
    empty folder is written into; without --force an earlier export is kept."""
    write_run(tmp_path / "run")
    hf.export_hf(tmp_path / "run", tmp_path / "hf")
    marker = json.loads((tmp_path / "hf" / hf.EXPORT_MARKER).read_text())
    assert marker["step"] == 7 and "model.safetensors" in marker["files"]
    with pytest.raises(GptspeedError, match="already exists"):
        hf.export_hf(tmp_path / "run", tmp_path / "hf")
    before = (tmp_path / "hf" / "model.safetensors").stat().st_ino
    hf.export_hf(tmp_path / "run", tmp_path / "hf", force=True)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_ino != before  # a new folder, renamed in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing left aside
    (tmp_path / "empty").mkdir()
    hf.export_hf(tmp_path / "run", tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_bad_inputs_are_one_line_errors(hf_model, tmp_path):
    _, folder = hf_model
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((folder / "config.json").read_text())
    for source, message in (
        (tmp_path / "missing", "neither a folder"),
        (tmp_path / "noconfig", "no config.json"),
        (tmp_path / "llama", "'llama' model"),
    ):
        res = gptspeed_cli("import-hf", source, "--out", tmp_path / "run")
        assert_one_line_error(res)
        assert message in res.stderr
    with pytest.raises(GptspeedError, match="has no weights"):
        hf.import_hf(str(tmp_path / "noweights"), tmp_path / "run")
    with pytest.raises(GptspeedError, match="does not exist"):
        hf.export_hf(tmp_path / "missing", tmp_path / "x")
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_unsupported_settings_and_untied_head(hf_model, tmp_path):
    ref, folder = hf_model
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(GptspeedError, match="activation_function"):
        hf.read_hf_config(tmp_path)
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    with pytest.raises(GptspeedError, match="not tied"):
        hf.hf_to_gpt_state_dict(sd, hf.gpt_config_from_hf(hf.read_hf_config(folder)), tied=False)


def test_named_model_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("We have no connection\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(GptspeedError, match=r"could not download openai-community/gpt2 .*We have no connection") as e:
        hf.resolve_source("gpt2")
    assert "\n" not in str(e.value)
    with pytest.raises(GptspeedError, match="neither a folder nor a known model name"):
        hf.resolve_source("gpt3")


def write_data(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 20_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    return folder


def test_train_init_from_and_resume_an_imported_run(hf_model, tmp_path):
    from gptspeed.trainer import build_train_config, fit

    ref, folder = hf_model
    data = write_data(tmp_path / "data")
    common = dict(
        data=str(data),
        max_steps=1,
        batch_size=2,
        eval_tokens=256,
        lr=1e-9,
        warmup_steps=0,
        device="cpu",
        dtype="float32",
        compile=False,
    )
    cfg = build_train_config("pico", {**common, "out": str(tmp_path / "a"), "init_from": str(folder), "block_size": 32})
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size) == (2, 32, 32)
    fit(cfg, echo=False)
    model, _ = load_model(tmp_path / "a", resolve_runtime("cpu", "float32"))
    got = model.transformer.h[1].mlp.c_fc.weight
    assert torch.allclose(got, ref.transformer.h[1].mlp.c_fc.weight.t(), atol=1e-6)  # lr 1e-9: barely moved
    with pytest.raises(GptspeedError, match="contradicts"):
        build_train_config("pico", {**common, "out": str(tmp_path / "b"), "init_from": str(folder), "n_layer": 4})

    hf.import_hf(str(folder), tmp_path / "imported")
    cfg = build_train_config(
        None, {**common, "out": str(tmp_path / "imported"), "resume": True, "total_batch_tokens": 2 * 64}
    )
    summary = fit(cfg, echo=False)
    assert summary["step"] == 1 and summary["last_val_loss"] is not None
