"""``gptspeed.data.sources``: documents from files and datasets, streamed one at a time (never the whole corpus in memory)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError

from support.records import DOCS, all_tokens, expected_stream, lines_of


def test_whatever_a_single_json_line_holds_is_a_bad_record(tmp_path, monkeypatch):
    """A line nested 100k deep raised RecursionError (a traceback); an integer of 5,000 digits raises
    ValueError (not JSONDecodeError) in Python >= 3.11; a line longer than any record is read whole.
    Each is now a bad record naming file and line: skipped and counted with skip_bad."""
    import gptspeed.data.sources as S

    monkeypatch.setattr(S, "MAX_RECORD_BYTES", 200_000)
    good = [json.dumps({"text": d}).encode() for d in DOCS[:4]]
    bad = {
        b"[" * 100_000: "nested too deeply",
        b'{"n": ' + b"7" * 5000 + b', "text": "x"}': "not readable as JSON",
        b'{"text": "' + b"y" * 300_000 + b'"}': "longer than 200,000 bytes",
    }
    for k, (line, what) in enumerate(bad.items()):
        path = tmp_path / f"d{k}.jsonl"
        path.write_bytes(b"\n".join([good[0], good[1], line, good[2], good[3]]) + b"\n")
        with pytest.raises(GptspeedError, match=rf"d{k}\.jsonl:3: .*{what}.*--skip-bad"):
            prepare(str(path), tmp_path / f"o{k}", progress=False)
        m = prepare(str(path), tmp_path / f"s{k}", skip_bad=True, progress=False)
        assert m["bad_records"] == 1 and m["documents"] == 4
        np.testing.assert_array_equal(all_tokens(tmp_path / f"s{k}"), expected_stream(DOCS[:4]))


# --------------------------------------------------------------------- 2. cut compressed files
def test_a_truncated_zst_or_gz_is_an_error_naming_the_file(tmp_path):
    """python-zstandard's stream_reader ends quietly inside a frame: a cut file read as a shorter
    one ("prepared 3,000 documents" of 5,000, exit 0). Now a cut inside a frame (a single-frame
    file cut anywhere, a multi-frame file cut in its second frame, a file of only the magic) is an
    error naming the file, --skip-bad or not. A cut exactly between two frames is a valid, shorter
    zstd file: it reads without error (documented as undetectable)."""
    zstd = pytest.importorskip("zstandard")
    data = lines_of(DOCS * 5)
    half = data.rindex(b"\n", 0, len(data) // 2) + 1  # frames end at a line's end, as in pzstd's output
    c = zstd.ZstdCompressor()
    whole_frame = c.compress(data)
    first, second = c.compress(data[:half]), c.compress(data[half:])
    assert first[:4] == b"\x28\xb5\x2f\xfd"
    cuts = {
        "single": whole_frame[: len(whole_frame) // 2],
        "last-byte": whole_frame[:-1],
        "second-frame": first + second[: len(second) // 3],
        "magic-only": whole_frame[:4],
    }
    gz = gzip.compress(data)
    for name, blob in [*cuts.items(), ("gz", gz[: len(gz) // 2])]:
        path = tmp_path / f"{name}.jsonl.{'gz' if name == 'gz' else 'zst'}"
        path.write_bytes(blob)
        for skip_bad in (False, True):
            with pytest.raises(GptspeedError, match=rf"{path.name} is truncated"):
                prepare(str(path), tmp_path / f"o-{name}", progress=False, skip_bad=skip_bad)
            assert not (tmp_path / f"o-{name}").exists()
    whole = tmp_path / "whole.jsonl.zst"
    whole.write_bytes(first + second)
    assert prepare(str(whole), tmp_path / "w", progress=False)["documents"] == len(DOCS) * 5
    at_boundary = tmp_path / "boundary.jsonl.zst"
    at_boundary.write_bytes(first)  # a valid zstd file: nothing says more was meant to follow
    assert prepare(str(at_boundary), tmp_path / "b", progress=False)["documents"] == data[:half].count(b"\n")
