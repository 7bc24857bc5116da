"""Hostile and careless inputs to the Hugging Face commands and the read-only ones (issue 28):
export-hf never destroys what it did not write, import-hf uses every tensor or refuses, non-finite
weights and logits are one line, eval prints strict JSON, every HF file is read through one error
path. No network: the HF models are random transformers GPT-2s saved to temporary folders."""

import hashlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from conftest import assert_user_error, run_cli, run_main  # noqa: E402

from gptspeed import hf  # noqa: E402
from gptspeed.checkpoint import save_checkpoint  # noqa: E402
from gptspeed.config import preset  # noqa: E402
from gptspeed.data.shards import write_shard  # noqa: E402
from gptspeed.errors import GptspeedError  # noqa: E402
from gptspeed.model import GPT, GPTConfig  # noqa: E402

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A random 2-layer GPT-2 saved by transformers (config.json + model.safetensors)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).eval()
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


def write_run(run_dir: Path, poison: float | None = None) -> Path:
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


def write_data(folder: Path, manifest: bool = True) -> Path:
    """Token shards (val: 2,000 tokens) and, with ``manifest``, a manifest.json that only names the
    folder as a data folder (``gptspeed.paths.kind``); without it, eval finds the shards by name."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_shard(folder / "train_000000.bin", rng.integers(0, 50257, 4_000, dtype=np.uint16))
    write_shard(folder / "val_000000.bin", rng.integers(0, 50257, 2_000, dtype=np.uint16))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({"note": "a prepared data folder"}))
    return folder


# ------------------------------------------------------------------ 1. export-hf loses nothing
def test_export_never_writes_over_its_run_or_a_data_folder_even_with_force(tmp_path):
    run = write_run(tmp_path / "runs" / "r")
    data = write_data(tmp_path / "data")
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
    other = write_run(tmp_path / "other")  # another run, named as --out: a run folder
    res = run_main("export-hf", "--run", str(run), "--out", str(other), "--force")
    assert_user_error(res, "run folder", "ckpt_00000007.pt")
    assert snapshot(run) == before_run and snapshot(data) == before_data
    assert not (run / "hf").exists() and not (data / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "other", "runs"]  # no temporary left


def test_export_force_replaces_only_an_earlier_export(tmp_path):
    run = write_run(tmp_path / "run")
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
    data = write_data(tmp_path / "data")
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
    run = write_run(tmp_path / "run", poison=float("nan"))
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


# ------------------------------------------------------------ 4. eval prints strict JSON
def strict_json(text: str):
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


def test_eval_of_a_diverged_checkpoint_prints_strict_json(tmp_path):
    run = write_run(tmp_path / "run", poison=float("nan"))
    data = write_data(tmp_path / "data", manifest=False)
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
    run = write_run(tmp_path / "run")
    data = write_data(tmp_path / "data", manifest=False)
    res = run_main("eval", "--run", str(run), "--data", str(data), "--device", "cpu", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)
    assert out["val_loss"] == 750.0 and out["perplexity"] is None and "too large for a float" in out["note"]


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
