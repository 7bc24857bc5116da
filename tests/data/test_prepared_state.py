"""``gptspeed.data.prepared_state``: the prepared folder's state between two runs: a progress file that
cannot be read is started over (or refused when something else stands under its name)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gptspeed.data import write_shard
from gptspeed.data.prepare import prepare
from gptspeed.data.prepared_state import PROGRESS_NAME

from support.cli import assert_user_error, run_main
from support.records import DOCS as DOCS_RECORDS
from support.records import lines_of

pytestmark = pytest.mark.usefixtures("no_network", "no_requests")


def shard_bytes_records(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def test_prepare_progress_files_that_cannot_be_read_are_started_over_or_refused(tmp_path):
    """The progress file was read with a bare json.loads: not UTF-8 (UnicodeDecodeError), a list,
    or chunk names reaching outside the folder (renamed into train shards, or deleted)."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS_RECORDS))
    ref = prepare(str(src), tmp_path / "ref", shard_tokens=1000, progress=False)
    victim = tmp_path / "victim.bin"
    write_shard(victim, np.arange(5))
    out = tmp_path / "out"
    out.mkdir()
    for junk in (
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        b'{"chunks": 3}',
        json.dumps(
            {
                "key": "k",
                "chunks": [{"name": "../victim.bin", "tokens": 5}],
                "next_doc": 0,
                "doc_offset": 0,
                "documents": 0,
                "tokens": 5,
            }
        ).encode(),
    ):
        (out / PROGRESS_NAME).write_bytes(junk)
        m = prepare(str(src), out, shard_tokens=1000, progress=False)
        assert m["splits"] == ref["splits"] and shard_bytes_records(out) == shard_bytes_records(tmp_path / "ref")
        assert victim.is_file() and not (out / PROGRESS_NAME).exists()
        (out / "manifest.json").unlink()
    (out / PROGRESS_NAME).mkdir()
    assert_user_error(
        run_main("prepare", str(src), "--out", str(out), "--shard-tokens", "1000"),
        ".prepare-progress.json is not a file",
    )
