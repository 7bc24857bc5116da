"""A run takes its tokenizer from its data (gptspeed.run_tokenizer): the vocabulary (padded to a multiple
of 64), the <|endoftext|> id, a copy of the tokenizer in the run folder; sample and eval encode and decode
with it; a resume, an --init-from or a training on data of another tokenizer is one line naming both."""

from __future__ import annotations

import io
import json

import pytest

import gptspeed
from gptspeed.bpe import load_tokenizer_dir
from gptspeed.errors import GptspeedError
from gptspeed.run_tokenizer import RUN_TOKENIZER_FILE, padded_vocab, run_tokenizer

from support.cli import assert_user_error, run_main
from support.shapes import QUICK_RUN
from support.tokdata import TOK_VOCAB as VOCAB
from support.tokdata import make_tokenizer_data, train_tokenizer_run


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tokenizer of 300 ids trained on tiny Shakespeare, that text prepared with it and with GPT-2's."""
    return make_tokenizer_data(tmp_path_factory.mktemp("tokdata"))


@pytest.fixture(scope="module")
def run(folders):
    """Two steps of the tiny model on the tokenizer's data."""
    return train_tokenizer_run(folders)


def test_a_new_run_takes_the_vocabulary_and_eot_of_its_data(folders):
    tok = load_tokenizer_dir(folders / "tok")
    cfg = gptspeed.make_config("pico", data=str(folders / "data"), out=str(folders / "unused"), **QUICK_RUN)
    m = cfg.model
    assert (m.valid_vocab_size, m.vocab_size, m.eot_token) == (VOCAB, 320, tok.eot)
    assert m.tokenizer == "sha256:" + tok.sha256
    assert padded_vocab(50257) == 50304 and padded_vocab(4096) == 4096
    given = gptspeed.make_config("pico", data=str(folders / "data"), vocab_size=384, **QUICK_RUN).model
    assert (given.vocab_size, given.valid_vocab_size) == (384, VOCAB)


def test_a_gpt2_run_is_configured_as_before(folders):
    cfg = gptspeed.make_config("pico", data=str(folders / "gpt2"), **QUICK_RUN)
    plain = gptspeed.make_config("pico", **QUICK_RUN)
    assert cfg.model == plain.model
    assert (cfg.model.vocab_size, cfg.model.valid_vocab_size, cfg.model.eot_token) == (50304, 50257, 50256)
    assert cfg.model.tokenizer == "gpt2"


def test_a_vocab_size_below_the_datas_tokenizer_is_refused(folders):
    with pytest.raises(GptspeedError, match=r"--vocab-size 256 is smaller than the 300 ids"):
        gptspeed.make_config("pico", data=str(folders / "data"), vocab_size=256, **QUICK_RUN)


@pytest.mark.parametrize(
    "setting, value",
    [("tokenizer", "cl100k_base"), ("eot_token", 0), ("valid_vocab_size", 290), ("tokenizer", "gpt2")],
)
def test_a_derived_setting_other_than_the_datas_is_refused_not_replaced(folders, setting, value):
    """tokenizer, eot_token and valid_vocab_size are the data's: set otherwise (a config file's key, a
    make_config keyword) they would be replaced silently -- a stream would train on GPT-2's BPE with
    ``tokenizer: TOK`` in its YAML. The data's own value (a --print-config file) is accepted."""
    data = str(folders / "data")
    with pytest.raises(
        GptspeedError, match=rf"^{setting} .* is not the data's: a new run takes {setting} from its data"
    ):
        gptspeed.make_config("pico", data=data, **{setting: value}, **QUICK_RUN)
    same = gptspeed.make_config("pico", data=data, **QUICK_RUN).model
    assert gptspeed.make_config("pico", data=data, **{setting: getattr(same, setting)}, **QUICK_RUN).model == same


def test_a_config_files_tokenizer_key_is_one_line_naming_the_streams_setting(folders, tmp_path):
    (tmp_path / "c.yaml").write_text("tokenizer: cl100k_base\n")
    out = tmp_path / "run"
    proc = run_main(
        "train", "--config", str(tmp_path / "c.yaml"), "--preset", "pico", "--out", str(out), "--device", "cpu"
    )
    assert_user_error(proc, "tokenizer 'cl100k_base' is not the data's", "data_tokenizer (--tokenizer)")
    assert not out.exists()


def test_the_run_folder_keeps_the_tokenizer_and_decodes_with_it(folders, run):
    tok = load_tokenizer_dir(folders / "tok")
    assert (run / RUN_TOKENIZER_FILE).read_text() == (folders / "tok" / "tokenizer.json").read_text()
    kept = run_tokenizer(run)
    assert (kept.sha256, kept.eot, kept.n_vocab) == (tok.sha256, tok.eot, VOCAB)
    text = "ROMEO: Wherefore art thou?\nJULIET: Ça va, 東京 — done."
    assert kept.decode(kept.encode(text)) == text
    ids = kept.encode("ROMEO:")
    assert ids != gptspeed.tokenizer.encode("ROMEO:")  # not GPT-2's
    assert (folders / "data" / RUN_TOKENIZER_FILE).read_text() == kept.json_text  # the prepared folder carries it


def test_sample_encodes_the_prompt_and_decodes_the_samples_with_the_runs_tokenizer(run):
    import torch

    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import generate, load_model

    tok = run_tokenizer(run)
    sample = gptspeed.load_run(run, device="cpu").generate("ROMEO:", max_new_tokens=8, temperature=0)
    model, _ = load_model(run, resolve_runtime("cpu", "float32", compile=False))
    with torch.no_grad():
        new = [int(t[0]) for t in generate(model, torch.tensor([tok.encode("ROMEO:")]), 8, temperature=0)]
    assert sample == tok.decode(new) and new != gptspeed.tokenizer.encode(sample)


def test_eval_measures_the_run_on_its_data_with_its_tokenizer(folders, run):
    from gptspeed.eval import evaluate_run

    result = evaluate_run(run, folders / "data", max_tokens=256, batch_size=2, device="cpu")
    assert result["val_loss"] < 6.5  # ln(300) = 5.7: the model's, not a 50,257-way guess
    assert 0 < result["val_bpb"] < 20
    with pytest.raises(GptspeedError, match=r"tokenized with GPT-2's BPE"):
        evaluate_run(run, folders / "gpt2", max_tokens=256, device="cpu")


def test_hellaswag_scores_the_run_with_its_tokenizer(run, tmp_path):
    """HellaSwag's contexts and endings are the run's ids (GPT-2's would index past its 320 embedding rows)."""
    import json

    from gptspeed.eval import evaluate_run
    from gptspeed.eval.hellaswag import render

    example = {"ctx": "ROMEO: Wherefore art thou", "endings": ["Romeo?", "the moon", "a pie", "12"], "label": 0}
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(example) + "\n")
    tok = run_tokenizer(run)
    item = render(example, tok)
    assert item.ctx == tuple(tok.encode(example["ctx"])) and item.endings[1] == tuple(tok.encode(" the moon"))
    result = evaluate_run(run, None, hellaswag_file=str(path), device="cpu")["hellaswag"]
    assert result["examples"] == 1


def test_a_resume_on_data_of_another_tokenizer_is_refused(folders, run):
    with pytest.raises(GptspeedError, match=r"--resume: the run .* takes the tokenizer.json of sha256 .* GPT-2's BPE"):
        gptspeed.make_config("pico", data=str(folders / "gpt2"), out=str(run), resume=True, max_steps=4)
    proc = run_main("train", "--data", str(folders / "gpt2"), "--out", str(run), "--resume", "--max-steps", "4")
    assert_user_error(proc, "--resume: the run", "the tokenizer.json of sha256", "GPT-2's BPE (gpt2)")
    proc = run_main("sample", "--run", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "2")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:"), proc.stderr


def test_training_a_run_on_data_of_another_tokenizer_is_refused(folders, tmp_path):
    cfg = gptspeed.make_config("pico", data=str(folders / "data"), out=str(tmp_path / "r"), max_steps=1, **QUICK_RUN)
    cfg.train.data = str(folders / "gpt2")
    with pytest.raises(GptspeedError, match=r"the run's model takes the tokenizer.json .* GPT-2's BPE"):
        gptspeed.train(cfg, echo=False)
    assert not (tmp_path / "r").exists()


def test_a_run_without_its_tokenizer_file_is_refused(folders, run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / RUN_TOKENIZER_FILE).unlink()
    with pytest.raises(GptspeedError, match=r"lacks the tokenizer.json its model was trained with"):
        run_tokenizer(copy)


def test_a_vocabulary_beyond_65536_trains_from_uint32_shards(folders, tmp_path):
    """A folder of llm.c's uint32 shards whose manifest names a 70,000-id vocabulary (GPT-2's ids moved up by
    19,743, its <|endoftext|> made 69,999) trains: 70,016 embedding rows, every id below 70,000 accepted."""
    import shutil

    import numpy as np

    from gptspeed.data.shards import read_header, read_shard, write_shard

    data = tmp_path / "wide"
    shutil.copytree(folders / "gpt2", data)
    for shard in sorted(data.glob("*.bin")):
        ids = np.asarray(read_shard(shard)).astype(np.uint32)
        moved = np.where(ids == 50256, 69_999, ids + 19_743).astype(np.uint32)
        write_shard(shard, moved)
        assert read_header(shard)[0] == 7 and int(read_shard(shard).max()) == 69_999
    manifest = json.loads((data / "manifest.json").read_text())
    manifest.update(tokenizer="cl100k_base", tokenizer_kind="tiktoken", tokenizer_sha256="0" * 64)
    manifest.update(n_vocab=70_000, eot_token=69_999)
    (data / "manifest.json").write_text(json.dumps(manifest))
    cfg = gptspeed.make_config("pico", data=str(data), out=str(tmp_path / "run"), max_steps=2, **QUICK_RUN)
    assert (cfg.model.vocab_size, cfg.model.valid_vocab_size, cfg.model.eot_token) == (70_016, 70_000, 69_999)
    summary = gptspeed.train(cfg, echo=False)
    assert summary["step"] == 2 and summary["last_val_loss"] < 12


def test_a_mixture_of_folders_of_one_tokenizer_trains_with_it(folders, tmp_path):
    import shutil

    tok = load_tokenizer_dir(folders / "tok")
    shutil.copytree(folders / "data", tmp_path / "more")
    mixture = f"{folders / 'data'}=0.5,{tmp_path / 'more'}=0.5"
    out = tmp_path / "run"
    cfg = gptspeed.make_config("pico", data=mixture, out=str(out), max_steps=2, eval_bpb=True, **QUICK_RUN)
    assert (cfg.model.valid_vocab_size, cfg.model.vocab_size, cfg.model.eot_token) == (VOCAB, 320, tok.eot)
    gptspeed.train(cfg, echo=False)
    assert run_tokenizer(out).sha256 == tok.sha256
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_bpb/more" in r for r in records)


def test_core_scores_the_run_with_its_tokenizer(run, monkeypatch):
    import gptspeed.eval.core as core
    from gptspeed.eval import evaluate_run

    seen = {}

    def scored(model, data, *, encode, bos, **kw):
        seen.update(ids=encode("ROMEO: so"), bos=bos)
        return {"centered": 0.0, "tasks": {}}

    monkeypatch.setattr(core, "load_core", lambda *args: ["a task"])
    monkeypatch.setattr(core, "evaluate_core", scored)
    evaluate_run(run, core=True, device="cpu")
    tok = run_tokenizer(run)
    assert seen == {"ids": tok.encode("ROMEO: so"), "bos": tok.eot} and tok.eot != 50256


def test_sample_and_eval_init_from_an_export_encode_with_the_tokenizer_it_ships(folders, run, tmp_path):
    """sample and eval --init-from an export of a run on its own tokenizer encoded with GPT-2's BPE (ids past its
    320 rows). They now encode and decode with the export's tokenizer.json: the run's samples and val loss."""
    from gptspeed.eval import evaluate_run
    from gptspeed.hf.export import export_hf
    from gptspeed.run_tokenizer import eval_tokenizer
    from gptspeed.sample import sample_text

    pytest.importorskip("safetensors")
    out = export_hf(run, tmp_path / "hf")
    assert eval_tokenizer(None, folders / "data", init_from=str(out)).sha256 == run_tokenizer(run).sha256
    greedy = dict(prompts=["ROMEO:"], max_new_tokens=6, temperature=0.0, device="cpu", dtype="float32")
    ours = sample_text(run=str(run), out=io.StringIO(), **greedy)
    assert sample_text(init_from=str(out), out=io.StringIO(), **greedy) == ours
    kw = dict(max_tokens=256, batch_size=2, device="cpu", dtype="float32")
    via_export = evaluate_run(None, folders / "data", init_from=str(out), **kw)
    assert via_export["val_loss"] == pytest.approx(evaluate_run(run, folders / "data", **kw)["val_loss"], abs=1e-5)
    with pytest.raises(GptspeedError, match=r"the model of .* takes the tokenizer.json .* GPT-2's BPE"):
        evaluate_run(None, folders / "gpt2", init_from=str(out), **kw)
    proc = run_main(
        "sample", "--init-from", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--temperature", "0"
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:" + ours[0]), proc.stderr


# ------------------------------------------------------------- a stream tokenized with the user's tokenizer
#: the quick run without a val split's settings: a stream has none (they are refused there)
STREAM_QUICK = {k: v for k, v in QUICK_RUN.items() if k not in ("eval_tokens", "eval_every")}


def _stream(folders) -> str:
    return f"jsonl:{folders / 'docs.jsonl'}"


def test_a_stream_run_takes_the_vocabulary_eot_and_batches_of_its_tokenizer_and_keeps_it(folders, tmp_path):
    """`train --data jsonl:docs.jsonl --tokenizer TOK_DIR`: the model's vocabulary, <|endoftext|> and identity are
    the tokenizer's (as from a manifest), the batches its encoding of each document after its <|endoftext|>, the
    run folder keeps its tokenizer.json, and `sample --run` encodes and decodes with it."""
    import numpy as np
    import torch

    from gptspeed.data.train_data import train_data_for
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import generate, load_model

    tok = load_tokenizer_dir(folders / "tok")
    out = tmp_path / "run"
    cfg = gptspeed.make_config(
        "pico", data=_stream(folders), data_tokenizer=str(folders / "tok"), out=str(out), max_steps=2, **STREAM_QUICK
    )
    m = cfg.model
    assert (m.valid_vocab_size, m.vocab_size, m.eot_token, m.tokenizer) == (VOCAB, 320, tok.eot, "sha256:" + tok.sha256)
    docs = [json.loads(line)["text"] for line in (folders / "docs.jsonl").read_text().splitlines()]
    expected = np.concatenate([[tok.eot, *tok.encode(d)] for d in docs])
    loader = train_data_for(cfg.train).loader(4, 32)
    x, y = loader.next_batch()
    loader.close()
    np.testing.assert_array_equal(x.flatten().numpy(), expected[:128])
    np.testing.assert_array_equal(y.flatten().numpy(), expected[1:129])
    gptspeed.train(cfg, echo=False)
    assert (out / RUN_TOKENIZER_FILE).read_text() == (folders / "tok" / "tokenizer.json").read_text()
    model, _ = load_model(out, resolve_runtime("cpu", "float32", compile=False))
    with torch.no_grad():
        new = [int(t[0]) for t in generate(model, torch.tensor([tok.encode("ROMEO:")]), 6, temperature=0)]
    proc = run_main("sample", "--run", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:" + tok.decode(new)), proc.stderr


def test_a_stream_run_on_a_tiktoken_encoding_by_name(folders, tmp_path, monkeypatch):
    """`--tokenizer ENCODING` (here the tests' own, offline; cl100k_base is the same path, downloaded once): the
    model's vocabulary and eot are the encoding's, its name the run's tokenizer (no file to keep)."""
    from support.tokdata import TIKTOKEN_EOT, TIKTOKEN_NAME, offer_tiny_tiktoken

    tok = offer_tiny_tiktoken(monkeypatch)
    out = tmp_path / "run"
    cfg = gptspeed.make_config(
        "pico", data=_stream(folders), data_tokenizer=TIKTOKEN_NAME, out=str(out), max_steps=1, **STREAM_QUICK
    )
    m = cfg.model
    assert (m.valid_vocab_size, m.vocab_size, m.eot_token, m.tokenizer) == (302, 320, TIKTOKEN_EOT, TIKTOKEN_NAME)
    assert gptspeed.train(cfg, echo=False)["step"] == 1
    assert not (out / RUN_TOKENIZER_FILE).exists() and run_tokenizer(out) is tok


def test_a_stream_run_on_a_vocabulary_beyond_65536_trains(folders, tmp_path, monkeypatch):
    """70,000 ids (<|endoftext|> 69,999): 70,016 embedding rows, the ids reach the model whole."""
    from support.tokdata import offer_tiny_tiktoken

    offer_tiny_tiktoken(monkeypatch, eot=69_999, name="wide_tiktoken")
    cfg = gptspeed.make_config(
        "pico",
        data=_stream(folders),
        data_tokenizer="wide_tiktoken",
        out=str(tmp_path / "r"),
        max_steps=2,
        **STREAM_QUICK,
    )
    assert (cfg.model.vocab_size, cfg.model.valid_vocab_size, cfg.model.eot_token) == (70_016, 70_000, 69_999)
    summary = gptspeed.train(cfg, echo=False)
    assert summary["step"] == 2 and summary["last_train_loss"] < 12  # ln(70,000) = 11.2


def test_a_tokenizer_that_cannot_apply_is_one_line_before_training(folders, tmp_path):
    """With a prepared folder --tokenizer is the folder's (another is refused naming both; the same one does nothing,
    refused as such); a TOK_DIR without a valid tokenizer.json or a name of nothing known: one line, no run folder."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    train = ("train", "--preset", "pico", "--device", "cpu", "--max-steps", "1", "--out", str(tmp_path / "r"))
    tok, stream = str(folders / "tok"), _stream(folders)
    cases = [
        (str(folders / "gpt2"), tok, ["--tokenizer", "is the tokenizer.json of sha256", "prepared with GPT-2's BPE"]),
        (str(folders / "data"), "gpt2", ["--tokenizer gpt2 is GPT-2's BPE (gpt2), but --data", f"{tok} (sha256"]),
        (str(folders / "data"), tok, ["acts only with --data a jsonl:/hf: stream", "keeps the tokenizer it was"]),
        (stream, str(tmp_path / "empty"), ["is not a tokenizer folder (no tokenizer.json)"]),
        (stream, str(tmp_path / "bad"), [str(tmp_path / "bad" / "tokenizer.json")]),
        (stream, "cl200k_base", ["--tokenizer 'cl200k_base' names nothing known"]),
    ]
    for data, given, fragments in cases:
        assert_user_error(run_main(*train, "--data", data, "--tokenizer", given), *fragments)
    assert not (tmp_path / "r").exists()


def test_a_stream_run_on_its_tokenizer_resumes_exactly_and_refuses_another(folders, tmp_path):
    """A run stopped after its step-2 checkpoint and resumed (its --tokenizer from its configuration) gives steps 3
    and 4 the losses of the run never stopped, to the bit; a --resume streaming with another tokenizer is one line
    naming both."""
    import shutil

    from support.training import train_losses

    ref, run = tmp_path / "ref", tmp_path / "run"
    cfg = gptspeed.make_config(
        "pico", data=_stream(folders), data_tokenizer=str(folders / "tok"), out=str(ref), max_steps=4, **STREAM_QUICK
    )
    cfg.train.save_every = 2
    gptspeed.train(cfg, echo=False)
    run.mkdir()
    for name in ("ckpt_00000002.pt", "ckpt_00000002.json"):
        shutil.copy(ref / name, run / name)
    proc = run_main("train", "--out", str(run), "--resume")
    assert proc.returncode == 0 and "resumed from step 2" in proc.stdout, proc.stderr
    assert [train_losses(run)[s] for s in (3, 4)] == [train_losses(ref)[s] for s in (3, 4)]
    proc = run_main("train", "--out", str(run), "--resume", "--max-steps", "6", "--tokenizer", "gpt2")
    assert_user_error(
        proc, "--resume: the run", "takes the tokenizer.json of sha256", "tokenized with GPT-2's BPE (gpt2)"
    )
