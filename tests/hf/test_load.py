"""``gptspeed.hf.load``: GPT-2 weights in from Hugging Face format (``import-hf``, ``--init-from``)."""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pytest
import torch

from gptspeed.config import _f, preset
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError
from gptspeed.hf.export import export_hf
from gptspeed.hf.load import (
    gpt_config_from_hf,
    hf_to_gpt_state_dict,
    import_hf,
    load_hf_model,
    load_hf_weights,
    read_hf_config,
    resolve_source,
    shape_for_init_from,
)
from gptspeed.model import GPT, GPTConfig
from gptspeed.runtime import resolve_runtime
from gptspeed.sample import load_model

from support.cli import assert_user_error, run_cli, run_main
from support.hf_models import (
    IDX,
    TINY_HF_GPT2,
    assert_one_line_error,
    copy_hf,
    exported,
    gptspeed_cli,
    hf_logits,
    our_logits,
    snapshot,
    undeclare,
    write_data,
    write_data_pico,
)

pytestmark = pytest.mark.usefixtures("one_thread", "hf_offline")


transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


def test_import_gives_the_same_logits(hf_model):
    ref, folder = hf_model
    ours, info = load_hf_model(str(folder))
    assert ours.config.block_size == 64 and ours.config.vocab_size == 50304
    out = our_logits(ours, IDX)
    assert (out[..., :50257] - hf_logits(ref, IDX)).abs().max() <= 1e-4
    assert torch.isneginf(out[..., 50257:]).all()  # padding rows are never predicted
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_import_pytorch_bin_in_openai_layout(hf_model, tmp_path):
    """OpenAI's files: no `transformer.` prefix, causal-mask buffers, pytorch_model.bin."""
    ref, folder = hf_model
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    for i in range(TINY_HF_GPT2["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours, _ = load_hf_model(str(tmp_path))
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
        import_hf(str(tmp_path / "noweights"), tmp_path / "run")
    with pytest.raises(GptspeedError, match="does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "x")
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_unsupported_settings_and_untied_head(hf_model, tmp_path):
    ref, folder = hf_model
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(GptspeedError, match="activation_function"):
        read_hf_config(tmp_path)
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    with pytest.raises(GptspeedError, match="not tied"):
        hf_to_gpt_state_dict(sd, gpt_config_from_hf(read_hf_config(folder)), tied=False)


def test_named_model_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("We have no connection\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(GptspeedError, match=r"could not download openai-community/gpt2 .*We have no connection") as e:
        resolve_source("gpt2")
    assert "\n" not in str(e.value)
    with pytest.raises(GptspeedError, match="neither a folder nor a known model name"):
        resolve_source("gpt3")


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

    import_hf(str(folder), tmp_path / "imported")
    cfg = build_train_config(
        None, {**common, "out": str(tmp_path / "imported"), "resume": True, "total_batch_tokens": 2 * 64}
    )
    summary = fit(cfg, echo=False)
    assert summary["step"] == 1 and summary["last_val_loss"] is not None


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
    through = tmp_path / "nothere" / ".." / "model"  # a missing folder and back: the HF folder itself
    assert_user_error(run_main("import-hf", str(src), "--out", str(through)), "did not write", "model.safetensors")
    assert snapshot(src) == before and not (tmp_path / "nothere").exists()
    assert run_main("import-hf", str(src), "--out", str(tmp_path / "run")).returncode == 0


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
        load_hf_model(str(bad))


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
    model, _ = load_hf_model(str(buffers))
    assert model.config.n_layer == 2


def test_a_huge_config_over_small_weights_is_refused_before_building_the_model(hf_folder, tmp_path):
    """config.json claiming 10^9 layers: refused by the weights check, not allocated layer by layer."""
    huge = copy_hf(hf_folder, tmp_path / "huge", config={"n_layer": 10**9})
    with pytest.raises(GptspeedError, match="lacks"):
        load_hf_model(str(huge))
    # train --init-from: the shape is checked against the file headers before the run builds its model
    with pytest.raises(GptspeedError, match="lacks 11999999976 tensor"):
        shape_for_init_from(str(huge), preset("pico").model, {})
    one = copy_hf(hf_folder, tmp_path / "one", config={"n_layer": 1})
    with pytest.raises(GptspeedError, match=r"holds 12 tensor\(s\)"):
        shape_for_init_from(str(one), preset("pico").model, {})
    wide = copy_hf(hf_folder, tmp_path / "wide", config={"vocab_size": 10**12})  # wte has 50,257 rows
    with pytest.raises(GptspeedError, match=r"wte.weight \(50257, 32\) not \(1000000000000, 32\)"):
        shape_for_init_from(str(wide), preset("pico").model, {})


def test_init_from_fills_a_softmax_data_model(hf_folder):
    """train --init-from with --softmax data: the model's own softmax_ids buffer is not a weight (it
    was a load_state_dict RuntimeError); every weight is filled and the ids are kept."""
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, softmax="data"))
    model.set_softmax_ids(torch.arange(0, 1000, 3))
    load_hf_weights(model, str(hf_folder))
    ref, _ = load_hf_model(str(hf_folder))
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, ref.transformer.h[1].mlp.c_fc.weight)
    assert model.softmax_ids.tolist() == list(range(0, 1000, 3))


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
    assert_user_error(res, "--pos-emb rope, --qk-norm, --mlp relu2, --norm rmsnorm would not fit")
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


@dataclasses.dataclass
class WithANewSwitch(GPTConfig):
    """GPTConfig with a switch added later, declared without ``init_from=`` / ``export=``."""

    new_switch: bool = _f(False, "a switch added after --init-from was written", kind="bool")
    new_width: int = _f(0, "a number added after --init-from was written", min=0)


def test_init_from_refuses_a_setting_added_without_a_declaration(tmp_path):
    """Fail closed: a model setting nobody declared compatible with GPT-2's weights is refused by
    --init-from off its default, in one line naming its flag -- before the source is read (gpt2
    would be a download) -- and accepted at its default."""
    for switch, named in (({"new_switch": True}, "--new-switch"), ({"new_width": 3}, "--new-width 3")):
        with pytest.raises(GptspeedError, match=f"--init-from gpt2 starts from GPT-2's weights, which {named} would"):
            shape_for_init_from("gpt2", WithANewSwitch(block_size=32, **switch), {})
    assert shape_for_init_from(str(exported(tmp_path)[1]), WithANewSwitch(), {}).n_layer == 1


def test_init_from_refuses_a_setting_whose_declaration_is_removed_through_the_cli(hf_folder, tmp_path, monkeypatch):
    """The declaration, not a list in gptspeed.hf, decides: --doc-mask without its ``init_from=``
    is refused as a switch added without one would be."""
    args = ("train", "--preset", "pico", "--init-from", str(hf_folder), "--out", str(tmp_path / "r"), "--doc-mask")
    assert run_main(*args, "--print-config").returncode == 0
    undeclare(monkeypatch, GPTConfig, "doc_mask", "init_from")
    res = run_main(*args, "--print-config")
    assert_user_error(res, f"--init-from {hf_folder} starts from GPT-2's weights, which --doc-mask would not fit")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "flags,named",
    [(["--value-embeds", "1"], "--value-embeds 1"), (["--unet-skips"], "--unet-skips")],
)
def test_init_from_refuses_value_embeddings_and_unet_skips(hf_folder, tmp_path, flags, named):
    """Value embeddings and U-net skips have tensors GPT-2's weights do not: --init-from dropped
    them silently (config.json recorded 0 / false); now one line naming the flag, nothing written."""
    out = tmp_path / "r"
    res = run_main("train", "--preset", "pico", "--init-from", str(hf_folder), "--out", str(out), *flags)
    assert_user_error(res, f"which {named} would not fit")
    assert not out.exists()


def test_init_from_honours_the_attention_window(hf_model, tmp_path):
    """--attn-window is a mask, no tensors: --init-from dropped it (config.json recorded 0); now the
    run trains with the window from GPT-2's weights, and its config.json records it."""
    ref, folder = hf_model
    data, out = write_data(tmp_path / "data"), tmp_path / "r"
    args = ["--preset", "pico", "--init-from", str(folder), "--data", str(data), "--out", str(out)]
    args += ["--seq-len", "32", "--attn-window", "16", "--max-steps", "1"]  # a fixed window: no start to grow from
    args += ["--batch-size", "2", "--lr", "1e-9", "--warmup-steps", "0", "--eval-tokens", "64"]
    res = run_main("train", *args, "--device", "cpu", "--dtype", "float32", "--no-compile")
    assert res.returncode == 0, res.stderr
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["attn_window"], model["n_layer"]) == (16, 2)
    loaded, _ = load_model(out, resolve_runtime("cpu", "float32"))
    assert loaded.config.attn_window == 16
    got = loaded.transformer.h[1].mlp.c_fc.weight
    assert torch.allclose(got, ref.transformer.h[1].mlp.c_fc.weight.t(), atol=1e-6)  # GPT-2's, barely moved


ROUND_TRIP = {
    "speedrun": dict(
        pos_emb="rope",
        qk_norm=True,
        mlp="relu2",
        norm="rmsnorm",
        tie_embeddings=False,
        logit_softcap=15.0,
        doc_mask=True,
        value_embeds=1,
        unet_skips=True,
    ),
    "softmax data": dict(softmax="data"),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_a_trained_run_with_switches_comes_back_from_its_export_with_the_same_logits(case, tmp_path):
    """import-hf and --init-from refused gptspeed's own exports (model_type 'gptspeed_gpt'). Now a
    pico run trained with switches (or --softmax data, the quickstart's), exported, comes back
    through `gptspeed import-hf` with its switches from the export's config.json and gptspeed's
    logits to 1e-5; `--init-from` the export builds the same architecture, and a flag that
    contradicts it is refused."""
    from gptspeed.trainer import fit

    data = write_data_pico(tmp_path / "data", manifest=False)
    common = dict(data=str(data), max_steps=2, batch_size=2, eval_tokens=128, device="cpu", dtype="float32")
    arch = dict(block_size=32, n_layer=2, n_head=2, n_embd=32, **ROUND_TRIP[case])
    fit(build_train_config("pico", {**common, **arch, "compile": False, "out": str(tmp_path / "run")}), echo=False)
    trained, _ = load_model(tmp_path / "run", resolve_runtime("cpu", "float32"))
    export_hf(tmp_path / "run", tmp_path / "hf")
    res = gptspeed_cli("import-hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert res.returncode == 0, res.stderr
    back, ckpt = load_model(tmp_path / "back", resolve_runtime("cpu", "float32"))
    assert ckpt["step"] == 0
    for name, value in ROUND_TRIP[case].items():
        assert getattr(back.config, name) == value, name
    idx = IDX[:, :32]
    torch.testing.assert_close(our_logits(back, idx), our_logits(trained, idx), atol=1e-5, rtol=0)
    if case == "softmax data":
        assert torch.equal(back.softmax_ids, trained.softmax_ids)
    cfg = build_train_config("pico", {**common, "init_from": str(tmp_path / "hf"), "out": str(tmp_path / "again")})
    assert all(getattr(cfg.model, n) == v for n, v in ROUND_TRIP[case].items())
    model = GPT(cfg.model)
    load_hf_weights(model, str(tmp_path / "hf"))
    torch.testing.assert_close(our_logits(model.eval(), idx), our_logits(trained, idx), atol=1e-5, rtol=0)
    flag = {"speedrun": {"pos_emb": "learned"}, "softmax data": {"softmax": "full"}}[case]
    with pytest.raises(GptspeedError, match="contradicts --init-from"):
        build_train_config("pico", {**common, **flag, "init_from": str(tmp_path / "hf"), "out": str(tmp_path / "c")})


def test_an_untied_gpt2_imports_as_an_untied_head_and_inits_an_untied_run(tmp_path):
    """An untied GPT-2 checkpoint (tie_word_embeddings false, an lm_head of its own) was refused,
    although gptspeed trains untied heads. It now imports as --no-tie-embeddings, with its logits."""
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_HF_GPT2, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        ref.lm_head.weight.normal_(0, 0.1)
    ref.save_pretrained(tmp_path / "untied")
    ours, _ = load_hf_model(str(tmp_path / "untied"))
    assert not ours.config.tie_embeddings and ours.lm_head.weight is not ours.transformer.wte.weight
    torch.testing.assert_close(our_logits(ours, IDX)[..., :50257], hf_logits(ref, IDX), atol=1e-5, rtol=0)
    cfg = build_train_config("pico", {"init_from": str(tmp_path / "untied"), "out": str(tmp_path / "run")})
    assert not cfg.model.tie_embeddings
    model = GPT(cfg.model)
    load_hf_weights(model, str(tmp_path / "untied"))
    torch.testing.assert_close(our_logits(model.eval(), IDX)[..., :50257], hf_logits(ref, IDX), atol=1e-5, rtol=0)


def test_import_hf_never_writes_into_a_folder_a_live_train_holds(hf_folder, tmp_path):
    """import-hf --out wrote a step-0 checkpoint into a folder a live train was writing. It takes the
    run folder's lock, as train does: refused in one line naming the holder, nothing written."""
    from gptspeed.checkpoint.folder import run_lock

    out = tmp_path / "live"
    out.mkdir()
    lock = run_lock(out).acquire()  # a train writing there
    try:
        before = snapshot(out)
        res = gptspeed_cli("import-hf", hf_folder, "--out", out)
        assert_one_line_error(res)
        assert "is being written by" in res.stderr
        assert snapshot(out) == before
    finally:
        lock.release()
    assert gptspeed_cli("import-hf", hf_folder, "--out", out).returncode == 0  # once it is free


@pytest.fixture(scope="module")
def tokdata(tmp_path_factory):
    """A 300-id tokenizer trained on tiny Shakespeare and that text prepared with it (tests/support/tokdata.py)."""
    from support.tokdata import make_tokenizer_data

    return make_tokenizer_data(tmp_path_factory.mktemp("tokdata"))


@pytest.mark.parametrize("switches", [{}, {"pos_emb": "rope", "tie_embeddings": False}], ids=["gpt2", "switches"])
def test_an_export_of_a_run_on_its_own_tokenizer_comes_back_with_it_and_the_same_logits(tokdata, switches, tmp_path):
    """import-hf refused an export of a run on its own 300-id tokenizer (vocab_size below GPT-2's 50,257) and
    --init-from it was "not yet". Now import-hf gives the run's logits, vocabulary and <|endoftext|>, its
    tokenizer.json kept in the run folder (sample decodes with it); --init-from it on data of that tokenizer trains."""
    import gptspeed
    from gptspeed.run_tokenizer import RUN_TOKENIZER_FILE, run_tokenizer

    from support.shapes import QUICK_RUN

    settings = {**QUICK_RUN, **switches, "data": str(tokdata / "data"), "max_steps": 2, "dtype": "float32"}
    gptspeed.train(gptspeed.make_config("pico", out=str(tmp_path / "run"), **settings), echo=False)
    trained, _ = load_model(tmp_path / "run", resolve_runtime("cpu", "float32"))
    export_hf(tmp_path / "run", tmp_path / "hf")
    res = gptspeed_cli("import-hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert res.returncode == 0, res.stderr
    back, _ = load_model(tmp_path / "back", resolve_runtime("cpu", "float32"))
    fields = ("vocab_size", "valid_vocab_size", "eot_token", "tokenizer", "pos_emb", "tie_embeddings")
    assert [getattr(back.config, f) for f in fields] == [getattr(trained.config, f) for f in fields]
    assert (back.config.valid_vocab_size, back.config.vocab_size) == (300, 320)
    idx = IDX[:, :32] % 300
    torch.testing.assert_close(our_logits(back, idx), our_logits(trained, idx), atol=1e-5, rtol=0)
    kept = (tmp_path / "run" / RUN_TOKENIZER_FILE).read_text()
    assert (tmp_path / "back" / RUN_TOKENIZER_FILE).read_text() == kept
    assert run_tokenizer(tmp_path / "back").encode("ROMEO:") == run_tokenizer(tmp_path / "run").encode("ROMEO:")
    sample = gptspeed.load_run(tmp_path / "back", device="cpu").generate("ROMEO:", max_new_tokens=4, temperature=0)
    assert sample == gptspeed.load_run(tmp_path / "run", device="cpu").generate(
        "ROMEO:", max_new_tokens=4, temperature=0
    )
    cfg = gptspeed.make_config("pico", init_from=str(tmp_path / "hf"), out=str(tmp_path / "again"), **settings)
    assert [getattr(cfg.model, f) for f in fields] == [getattr(trained.config, f) for f in fields]
    assert gptspeed.train(cfg, echo=False)["step"] == 2
    assert (tmp_path / "again" / RUN_TOKENIZER_FILE).read_text() == kept


def test_an_export_whose_tokenizer_is_not_the_one_its_config_names_is_refused(tokdata, tmp_path):
    """The tokenizer.json an export ships is checked against config.json's gptspeed_tokenizer (its sha256; a
    name is a tiktoken encoding's, never a folder); import-hf of an export without it writes nothing."""
    import shutil

    import gptspeed

    from support.shapes import QUICK_RUN

    settings = {**QUICK_RUN, "data": str(tokdata / "data"), "max_steps": 1, "dtype": "float32"}
    gptspeed.train(gptspeed.make_config("pico", out=str(tmp_path / "run"), **settings), echo=False)
    export_hf(tmp_path / "run", tmp_path / "hf")
    shutil.copytree(tmp_path / "hf", tmp_path / "changed")
    spec = json.loads((tmp_path / "changed" / "tokenizer.json").read_text())
    (tmp_path / "changed" / "tokenizer.json").write_text(json.dumps(spec, indent=1))  # same tokenizer, other bytes
    with pytest.raises(
        GptspeedError, match=r"lacks the tokenizer.json its model was trained with \(.*\) \(it holds another\)"
    ):
        load_hf_model(str(tmp_path / "changed"))
    config = json.loads((tmp_path / "changed" / "config.json").read_text())
    config["gptspeed_tokenizer"] = str(tokdata / "tok")  # a folder by name: never read as a tokenizer
    (tmp_path / "changed" / "config.json").write_text(json.dumps(config))
    with pytest.raises(GptspeedError, match=r"is not a tiktoken encoding's name"):
        load_hf_model(str(tmp_path / "changed"))
    (tmp_path / "changed" / "tokenizer.json").unlink()
    config["gptspeed_tokenizer"] = "sha256:" + "0" * 64
    (tmp_path / "changed" / "config.json").write_text(json.dumps(config))
    res = gptspeed_cli("import-hf", tmp_path / "changed", "--out", tmp_path / "back")
    assert_one_line_error(res)
    assert "lacks the tokenizer.json" in res.stderr
    assert not (tmp_path / "back").exists()
