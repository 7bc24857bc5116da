"""``gptspeed.hf``: GPT-2 weights in and out of Hugging Face format."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptspeed import hf  # noqa: E402
from gptspeed.checkpoint import save_checkpoint  # noqa: E402
from gptspeed.config import (
    RECIPES,
    preset,  # noqa: E402
)
from gptspeed.configure import build_train_config
from gptspeed.data.shards import write_shard  # noqa: E402
from gptspeed.errors import GptspeedError  # noqa: E402
from gptspeed.model import GPT, GPTConfig  # noqa: E402
from gptspeed.runtime import resolve_runtime  # noqa: E402
from gptspeed.sample import generate_cached, left_pad, load_model  # noqa: E402

from support.cli import assert_user_error, child_env, run_cli, run_main

pytestmark = pytest.mark.usefixtures("one_thread", "hf_offline")


transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)


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


def write_run(run_dir: Path, seed: int = 0) -> GPT:
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(cfg.model).eval()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    return model


def write_data(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 20_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    return folder


SHAPE_PICO = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A random 2-layer GPT-2 saved by transformers (config.json + model.safetensors)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE_PICO)).eval()
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(folder)
    return folder


def copy_hf(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the HF folder ``src`` with config.json fields and tensors (HF names) replaced."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    sd = load_file(str(src / "model.safetensors"))
    sd.update(tensors or {})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_run_pico(run_dir: Path, poison: float | None = None) -> Path:
    """A run folder with one pico-sized checkpoint (step 7); ``poison`` written into one weight."""
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    if poison is not None:
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = poison
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(run_dir, {"step": 7, "model": model.state_dict(), "config": cfg.to_dict()})
    (run_dir / "metrics.jsonl").write_text('{"step": 7, "train_loss": 9.0}\n')
    return run_dir


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256): to show nothing was touched."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_data_pico(folder: Path, manifest: bool = True) -> Path:
    """Token shards (val: 2,000 tokens) and, with ``manifest``, a manifest.json that only names the
    folder as a data folder (``gptspeed.paths.kind``); without it, eval finds the shards by name."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 2_000, dtype=np.uint16))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({"note": "a prepared data folder"}))
    return folder


# ------------------------------------------------------------ 4. eval prints strict JSON
def strict_json(text: str):
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


# -------------------------------------------------- 5. HF folders: one error path, one line
CONFIG_CASES = {
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8"),
    "a JSON list": (b"[1, 2]", "JSON list"),
    "NaN": (b'{"model_type": "gpt2", "layer_norm_epsilon": NaN}', "not valid JSON"),
    "n_layer a string": ({"n_layer": "2"}, 'n_layer = "2" is not a positive integer'),
    "n_layer true": ({"n_layer": True}, "n_layer = true is not a positive integer"),
    "n_embd a list": ({"n_embd": [32]}, "n_embd = [32]"),
    "epsilon a string": ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon"),
    "tie a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "n_inner a string": ({"n_inner": "128"}, "n_inner"),
    "model_type a list": ({"model_type": ["gpt2"]}, "JSON list model"),
}


def exported(tmp_path):
    """A tiny run's export (an HF GPT-2 folder)."""
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run, {"step": 1, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return run, hf.export_hf(run, tmp_path / "hf")


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


# ------------------------------------------------------------------ 1. export-hf loses nothing
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
    hf.export_hf(run, own)
    (own / hf.EXPORT_MARKER).unlink()
    assert_user_error(run_main("export-hf", "--run", str(run), "--out", str(own), "--force"), hf.EXPORT_MARKER)

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


def test_import_never_writes_into_the_source_or_a_users_folder(hf_folder, tmp_path):
    """import-hf --out the HF folder itself overwrote its config.json (the folder stopped loading)."""
    src = copy_hf(hf_folder, tmp_path / "model")
    before = snapshot(src)
    assert_user_error(run_main("import-hf", str(src), "--out", str(src)), "did not write", "model.safetensors")
    data = write_data_pico(tmp_path / "data")
    assert_user_error(run_main("import-hf", str(src), "--out", str(data)), "data folder")
    assert snapshot(src) == before and sorted(p.name for p in data.iterdir()) == [
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ]
    assert run_main("import-hf", str(src), "--out", str(tmp_path / "run")).returncode == 0


# --------------------------------------------------- 2. non-finite weights and logits: one line
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_import_refuses_non_finite_weights_naming_the_tensor(hf_folder, tmp_path, value):
    from safetensors.torch import load_file

    w = load_file(str(hf_folder / "model.safetensors"))["transformer.h.1.mlp.c_fc.weight"].clone()
    w[3, 5] = value
    bad = copy_hf(hf_folder, tmp_path / "bad", tensors={"transformer.h.1.mlp.c_fc.weight": w})
    res = run_main("import-hf", str(bad), "--out", str(tmp_path / "run"))
    assert_user_error(res, "h.1.mlp.c_fc.weight", "NaN or infinite")
    assert not (tmp_path / "run").exists()
    with pytest.raises(GptspeedError, match="h.1.mlp.c_fc.weight"):  # --init-from reads the same way
        hf.load_hf_model(str(bad))


@pytest.mark.parametrize("kv", [[], ["--no-kv-cache"]])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_sample_of_a_diverged_checkpoint_is_one_line(tmp_path, kv, temperature):
    run = write_run_pico(tmp_path / "run", poison=float("nan"))
    res = run_main(
        "sample",
        "--run",
        str(run),
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--temperature",
        temperature,
        *kv,
    )
    assert_user_error(res, "logits are not finite")


def test_sample_next_refuses_impossible_rows_and_overflowing_temperatures():
    from gptspeed.sample import sample_next

    ok = torch.tensor([[0.0, 1.0, -math.inf]])
    assert sample_next(ok, 0, None, None).tolist() == [1]
    for logits in (
        torch.tensor([[0.0, math.nan]]),
        torch.tensor([[0.0, math.inf]]),
        torch.full((1, 3), -math.inf),
    ):  # every token impossible
        with pytest.raises(GptspeedError, match="not finite"):
            sample_next(logits, 1.0, None, None)
    with pytest.raises(GptspeedError, match="--temperature 1e-40 is too small"):
        sample_next(torch.tensor([[0.0, 30.0]]), 1e-40, 2, None)


# ------------------------------------------------- 3. every tensor used, every parameter filled
def test_import_refuses_a_config_that_does_not_describe_its_weights(hf_folder, tmp_path):
    one = copy_hf(hf_folder, tmp_path / "one", config={"n_layer": 1})  # the tester's case: 12 tensors dropped
    res = run_main("import-hf", str(one), "--out", str(tmp_path / "r1"))
    assert_user_error(res, "12 tensor(s)", "h.1.", "n_layer 1")
    three = copy_hf(hf_folder, tmp_path / "three", config={"n_layer": 3})
    assert_user_error(run_main("import-hf", str(three), "--out", str(tmp_path / "r3")), "lacks 12 tensor(s)", "h.2.")
    wide = copy_hf(hf_folder, tmp_path / "wide", config={"n_embd": 64})
    assert_user_error(
        run_main("import-hf", str(wide), "--out", str(tmp_path / "r4")),
        "28 tensor(s) of the wrong shape",
        "(32, 96) not (64, 192)",
    )
    extra = copy_hf(hf_folder, tmp_path / "extra", tensors={"transformer.h.0.attn.lora_A": torch.zeros(2, 2)})
    assert_user_error(run_main("import-hf", str(extra), "--out", str(tmp_path / "r5")), "h.0.attn.lora_A")
    assert not any((tmp_path / f"r{i}").exists() for i in (1, 3, 4, 5))
    # the causal-mask buffers of the model's own layers are known and dropped
    mask = torch.tril(torch.ones(1, 1, 64, 64))
    buffers = copy_hf(hf_folder, tmp_path / "buffers", tensors={f"h.{i}.attn.bias": mask.clone() for i in range(2)})
    model, _ = hf.load_hf_model(str(buffers))
    assert model.config.n_layer == 2


def test_a_huge_config_over_small_weights_is_refused_before_building_the_model(hf_folder, tmp_path):
    """config.json claiming 10^9 layers: refused by the weights check, not allocated layer by layer."""
    huge = copy_hf(hf_folder, tmp_path / "huge", config={"n_layer": 10**9})
    with pytest.raises(GptspeedError, match="lacks"):
        hf.load_hf_model(str(huge))
    # train --init-from: the shape is checked against the file headers before the run builds its model
    with pytest.raises(GptspeedError, match="lacks 11999999976 tensor"):
        hf.shape_for_init_from(str(huge), preset("pico").model, {})
    one = copy_hf(hf_folder, tmp_path / "one", config={"n_layer": 1})
    with pytest.raises(GptspeedError, match=r"holds 12 tensor\(s\)"):
        hf.shape_for_init_from(str(one), preset("pico").model, {})
    wide = copy_hf(hf_folder, tmp_path / "wide", config={"vocab_size": 10**12})  # wte has 50,257 rows
    with pytest.raises(GptspeedError, match=r"wte.weight \(50257, 32\) not \(1000000000000, 32\)"):
        hf.shape_for_init_from(str(wide), preset("pico").model, {})


def test_init_from_fills_a_softmax_data_model(hf_folder):
    """train --init-from with --softmax data: the model's own softmax_ids buffer is not a weight (it
    was a load_state_dict RuntimeError); every weight is filled and the ids are kept."""
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, softmax="data"))
    model.set_softmax_ids(torch.arange(0, 1000, 3))
    hf.load_hf_weights(model, str(hf_folder))
    ref, _ = hf.load_hf_model(str(hf_folder))
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, ref.transformer.h[1].mlp.c_fc.weight)
    assert model.softmax_ids.tolist() == list(range(0, 1000, 3))


def test_eval_of_a_diverged_checkpoint_prints_strict_json(tmp_path):
    run = write_run_pico(tmp_path / "run", poison=float("nan"))
    data = write_data_pico(tmp_path / "data", manifest=False)
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text(json.dumps({"ctx": "A man sits.", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n")
    res = run_main(
        "eval",
        "--run",
        str(run),
        "--data",
        str(data),
        "--max-tokens",
        "256",
        "--hellaswag-file",
        str(hs_file),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)  # "val_loss": NaN was printed before
    assert out["val_loss"] is None and out["perplexity"] is None and out["tokens"] == 256
    assert "val_loss (nan)" in out["note"] and "diverged" in out["note"]
    assert out["hellaswag"]["nan_examples"] == 1 and "hellaswag" in out["note"]
    assert res.stderr.strip().splitlines() == [f"gptspeed eval: note: {out['note']}"]


def test_json_safe_nulls_every_non_finite_figure():
    from gptspeed.eval import json_safe

    out = json_safe({"val_loss": 800.0, "perplexity": math.inf, "tokens": 3, "hellaswag": {"x": [1.0, -math.inf]}})
    assert out["val_loss"] == 800.0 and out["perplexity"] is None and out["hellaswag"]["x"] == [1.0, None]
    assert "perplexity (inf)" in out["note"] and "hellaswag.x[1]" in out["note"]
    json.dumps(out, allow_nan=False)
    assert json_safe({"val_loss": 2.0, "perplexity": math.exp(2.0)}) == {"val_loss": 2.0, "perplexity": math.exp(2.0)}


def test_eval_perplexity_overflow_is_null_not_a_traceback(tmp_path, monkeypatch):
    """A loss above ~709 nats: math.exp raised OverflowError."""
    import gptspeed.eval.val_loss as vl

    monkeypatch.setattr(vl, "evaluate", lambda *a, **k: (750.0, 64))
    run = write_run_pico(tmp_path / "run")
    data = write_data_pico(tmp_path / "data", manifest=False)
    res = run_main("eval", "--run", str(run), "--data", str(data), "--device", "cpu", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)
    assert out["val_loss"] == 750.0 and out["perplexity"] is None and "too large for a float" in out["note"]


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_json_is_one_line(hf_folder, tmp_path, case):
    content, fragment = CONFIG_CASES[case]
    folder = copy_hf(hf_folder, tmp_path / "m", config=content if isinstance(content, dict) else None)
    if isinstance(content, bytes):
        (folder / "config.json").write_bytes(content)
    assert_user_error(run_main("import-hf", str(folder), "--out", str(tmp_path / "run")), fragment)
    assert not (tmp_path / "run").exists()


def test_config_json_that_is_a_folder_is_one_line(hf_folder, tmp_path):
    folder = copy_hf(hf_folder, tmp_path / "m")
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    assert_user_error(run_main("import-hf", str(folder), "--out", str(tmp_path / "run")), "is a folder")


def test_bad_weights_files_are_one_line(hf_folder, tmp_path):
    data = (hf_folder / "model.safetensors").read_bytes()
    cases = {}
    folder = copy_hf(hf_folder, tmp_path / "dir")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()  # before: "has no weights", although there is a model.safetensors
    cases[folder] = "model.safetensors is a folder"
    folder = copy_hf(hf_folder, tmp_path / "cut")
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases[folder] = "not a readable safetensors file"
    folder = copy_hf(hf_folder, tmp_path / "cutbin")
    (folder / "model.safetensors").unlink()
    buf = io.BytesIO()
    torch.save({"wte.weight": torch.zeros(4, 4)}, buf)
    (folder / "pytorch_model.bin").write_bytes(buf.getvalue()[:100])
    cases[folder] = "not a readable weights-only PyTorch file"
    folder = copy_hf(hf_folder, tmp_path / "index")
    (folder / "model.safetensors").rename(folder / "part-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "../../elsewhere"}}))
    cases[folder] = "shards must be files of the model folder"
    folder = copy_hf(hf_folder, tmp_path / "index2")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": 3}}))
    cases[folder] = "names the shard 3"
    for folder, fragment in cases.items():
        res = run_main("import-hf", str(folder), "--out", str(tmp_path / "run"))
        assert_user_error(res, fragment)
    assert not (tmp_path / "run").exists()


def test_a_fifo_shard_is_refused_not_waited_on(hf_folder, tmp_path):
    """A FIFO named by the index would block the reader forever: a fresh process, with a timeout."""
    folder = copy_hf(hf_folder, tmp_path / "fifo")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "part-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"wte.weight": "part-1.safetensors"}})
    )
    res = run_cli("import-hf", str(folder), "--out", str(tmp_path / "run"), timeout=120)
    assert_user_error(res, "part-1.safetensors is not a regular file")


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


# ---- export of runs with modern switches
EOT = 50256
MODERN = {k: v for k, v in RECIPES["modern"].items() if k in GPTConfig.__dataclass_fields__}
SWITCHES = {
    "rope": dict(pos_emb="rope", rope_theta=500.0),
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"),
    "rmsnorm": dict(norm="rmsnorm"),
    "untied": dict(tie_embeddings=False),
    "softcap": dict(logit_softcap=0.5),  # the logits' scale is ~0.6 here: the cap bends most of them
    "doc_mask": dict(doc_mask=True),
    "value_embeds": dict(value_embeds=2, n_layer=4),  # blocks 0, 1 and 2, 3 share embeddings 0, 1
    "unet_skips": dict(unet_skips=True, n_layer=3),  # block 2 adds block 0's output; block 1 none
    "modern": MODERN,  # --recipe modern's architecture: rotary, QK-norm, ReLU², RMSNorm
    "all": dict(
        MODERN,
        tie_embeddings=False,
        logit_softcap=0.5,
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
    out = hf.export_hf(tmp_path / "run", tmp_path / "hf")
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
    back = load_exported(hf.export_hf(tmp_path / "run", tmp_path / "hf"))
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
        out = hf.export_hf(tmp_path / name, tmp_path / f"{name}-hf")
        fp32_bytes = (out / "model.safetensors").stat().st_size
        hf.export_hf(tmp_path / name, out, dtype="bfloat16", force=True)
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
        hf.export_hf(tmp_path / "gpt2", tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()


def test_zero_init_proj_alone_is_gpt2s_architecture_and_exports_as_gpt2(tmp_path):
    """--zero-init-proj changes the initial weights only: the run is a GPT2LMHeadModel, no code."""
    ours = write_modern_run(tmp_path / "run", zero_init_proj=True)
    out = hf.export_hf(tmp_path / "run", tmp_path / "hf")
    assert not list(out.glob("*.py"))
    back = load_exported(out)
    assert type(back) is transformers.GPT2LMHeadModel
    torch.testing.assert_close(hf_logits(back, IDX), our_logits(ours, IDX)[..., :50257], atol=1e-4, rtol=0)


def test_a_setting_the_export_does_not_compute_is_refused_not_dropped(tmp_path, monkeypatch):
    """A switch added to the model later (a GPTConfig field outside EXPORTED_FIELDS, here QK-norm made
    one) is refused in one line, nothing written -- not exported as a model computing without it;
    a checkpoint tensor the modeling code has no place for is refused too."""
    write_modern_run(tmp_path / "run", qk_norm=True, pos_emb="rope")
    monkeypatch.setattr(hf, "EXPORTED_FIELDS", hf.EXPORTED_FIELDS - {"qk_norm"})
    res = run_main("export-hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert_user_error(res, "uses --qk-norm True, which export-hf does not write yet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    config = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, norm="rmsnorm")
    sd = {**GPT(config).state_dict(), "transformer.h.1.attn.gate": torch.ones(2)}
    with pytest.raises(GptspeedError, match=r"transformer.h.1.attn.gate on one side only"):
        hf._export_contents(config, sd, "float32")


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
