"""``gptspeed.data.train_data``: what the trainer trains on: one loader protocol for token shards and document streams."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gptspeed.checkpoint import list_checkpoints, load_checkpoint
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.errors import GptspeedError
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_cli
from support.shapes import TEXT_RUN, TEXT_RUN_FLAGS

pytestmark = pytest.mark.usefixtures("one_thread")

#: a real-text run read from a stream: no --eval-tokens (a stream has no val split: refused there)
STREAM_RUN = {k: v for k, v in TEXT_RUN.items() if k != "eval_tokens"}


def test_token_ids_beyond_the_vocabulary_are_reported(shakespeare_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    toks = np.array(read_shard(data / "train_000000.bin"))
    toks[100] = 60000
    write_shard(data / "train_000000.bin", toks)
    proc = run_cli("train", *TEXT_RUN_FLAGS, "--data", str(data), "--out", str(tmp_path / "r"), "--max-steps", "2")
    assert_user_error(proc, "train_000000.bin", "token id 60000 at token 100")


def test_train_from_a_hugging_face_dataset_file_with_its_field_and_split(tmp_path):
    """`--data hf:FILE` goes through the datasets library; --text-field / --split reach it."""
    docs = [{"body": "To be, or not to be, that is the question. " * 8}] * 40
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    run = tmp_path / "run"
    summary = fit(
        build_train_config(
            "pico",
            dict(
                STREAM_RUN,
                data=f"hf:{path}",
                text_field="body",
                split="train",
                out=str(run),
                max_steps=2,
                eval_every=0,
            ),
        ),
        echo=False,
    )
    assert summary["step"] == 2 and summary["last_train_loss"] is not None
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck["loader"]["documents"] > 0 and ck["data"] == {
        "stream": f"hf:{path}",
        "text_field": "body",
        "hf_name": None,
        "split": "train",
    }

    with pytest.raises(GptspeedError, match="body2"):  # the field the user named, not silently "text"
        fit(
            build_train_config(
                "pico",
                dict(
                    STREAM_RUN,
                    data=f"hf:{path}",
                    text_field="body2",
                    out=str(tmp_path / "x"),
                    max_steps=1,
                    eval_every=0,
                ),
            ),
            echo=False,
        )


def test_softmax_data_counts_the_token_ids_of_uint32_shards_beyond_65536(tmp_path):
    """--softmax data's ids of a vocabulary above 65,536 (llm.c's uint32 shards): every id, the large ones too."""
    from gptspeed.data.train_data import TrainData

    write_shard(tmp_path / "train_000000.bin", np.array([5, 70_000, 65_536, 5], dtype=np.uint32))
    write_shard(tmp_path / "val_000000.bin", np.array([99_999, 1], dtype=np.uint32))
    data = TrainData(str(tmp_path), [tmp_path / "train_000000.bin"], [tmp_path / "val_000000.bin"])
    assert data.token_ids().tolist() == [1, 5, 65_536, 70_000, 99_999]
    gpt2 = TrainData(str(tmp_path), [tmp_path / "g.bin"])
    write_shard(tmp_path / "g.bin", np.array([3, 50256], dtype=np.uint16))
    assert gpt2.token_ids().tolist() == [3, 50256]


def test_a_streams_tokenizer_is_in_its_identity_and_its_tokenizer_json_is_found_sha256_checked(tmp_path):
    """A stream has no manifest: its TrainData carries its --tokenizer's (the TOK_DIR, where the run finds the
    tokenizer.json, and its sha256). The identity a resume compares names it; a GPT-2 stream's is what it was (its
    checkpoints resume). The TOK_DIR changed after the data was found is refused in one line."""
    from gptspeed.bpe import load_tokenizer_dir
    from gptspeed.bpe_train import train_tokenizer
    from gptspeed.data.train_data import find_train_data
    from gptspeed.run_tokenizer import GPT2_DATA, data_tokenizer_json

    from support.records import DOCS, lines_of

    path = tmp_path / "d.jsonl"
    path.write_bytes(lines_of(DOCS))
    train_tokenizer([str(path)], tmp_path / "tok", vocab_size=300, progress=False)
    tok = load_tokenizer_dir(tmp_path / "tok")
    data = find_train_data(f"jsonl:{path}", tokenizer=str(tmp_path / "tok"))
    said = data.tokenizer
    assert (said.identity, said.n_vocab, said.eot, data.eot) == ("sha256:" + tok.sha256, 300, tok.eot, tok.eot)
    assert data.identity["tokenizer"] == "sha256:" + tok.sha256 and data.stream_tokenizer.sha256 == tok.sha256
    folder = data.tokenizer_folder
    assert data_tokenizer_json(folder.spec, folder.manifest) == (tmp_path / "tok" / "tokenizer.json").read_text()
    gpt2 = find_train_data(f"jsonl:{path}")
    assert gpt2.tokenizer is GPT2_DATA and "tokenizer" not in gpt2.identity and gpt2.stream_tokenizer is None
    (tmp_path / "tok" / "tokenizer.json").write_text(tok.json_text + "\n")
    with pytest.raises(
        GptspeedError, match=r"^the stream jsonl:.* is tokenized with .*tok \(sha256 .* gone or changed"
    ):
        data_tokenizer_json(folder.spec, folder.manifest)


def test_a_tokenizer_that_is_not_a_prepared_folders_own_is_refused_and_the_folder_released(
    shakespeare_data, monkeypatch
):
    """--tokenizer with a prepared folder can only name the folder's own (it keeps its tokenizer): another is
    refused naming both, and the shared lock taken is given back (a prepare may write the folder)."""
    from gptspeed.data.folder import prepare_lock
    from gptspeed.data.train_data import find_train_data

    from support.tokdata import offer_tiny_tiktoken

    offer_tiny_tiktoken(monkeypatch)
    with pytest.raises(GptspeedError, match=r"^--tokenizer tiny_tiktoken is tiktoken tiny_tiktoken, but --data ") as e:
        find_train_data(str(shakespeare_data), tokenizer="tiny_tiktoken")
    assert "was prepared with GPT-2's BPE (gpt2)" in str(e.value)
    prepare_lock(shakespeare_data).acquire().release()  # refused while a train holds the folder
    assert find_train_data(str(shakespeare_data), tokenizer="gpt2").train_shards
