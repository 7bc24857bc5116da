"""Hostile input, fuzzed (hypothesis): shard files, configurations from JSON, config files. Each
is refused with one line or read correctly, never a traceback. hypothesis is a test extra: without
it this module is skipped, with the reason (the rest of the suite, the GPU tests included, still
collects and runs)."""

import json

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gptspeed.config import RunConfig, preset  # noqa: E402
from gptspeed.data.shards import ShardError, read_header, read_shard  # noqa: E402
from gptspeed.errors import GptspeedError  # noqa: E402


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=1200),
    header=st.none()
    | st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
)
def test_fuzz_shard_reader(tmp_path_factory, data, header):
    path = tmp_path_factory.mktemp("fuzz") / "train_000000.bin"
    raw = bytearray(data)
    if header is not None:  # a plausible header, then random bytes
        head = np.zeros(256, dtype="<i4")
        head[:3] = header
        raw = bytearray(head.tobytes()) + raw
    path.write_bytes(bytes(raw))
    try:
        version, count = read_header(path)
        toks = read_shard(path)
    except ShardError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    assert len(toks) == count == (len(raw) - 1024) // 2 and version == 1 and toks.dtype == np.dtype("<u2")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
FIELDS = [
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "lr",
    "batch_size",
    "dtype",
    "compile",
    "resume",
    "on_nan",
    "vocab_size",
    "attention",
    "total_batch_tokens",
    "nonsense",
]


@settings(max_examples=200, deadline=None)
@given(
    d=st.dictionaries(
        st.sampled_from(["model", "optim", "train", "runtime", "preset"]),
        st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4) | json_values,
        max_size=5,
    )
)
def test_fuzz_config_from_dict(d):
    try:
        cfg = RunConfig.from_dict(d, "fuzz")
        cfg.validate()
    except GptspeedError as e:
        assert "\n" not in str(e)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4).map(json.dumps))
def test_fuzz_config_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_text(text)
    try:
        preset("pico").apply_file(str(path)).validate()
    except GptspeedError as e:
        assert "\n" not in str(e).strip()


metrics_lines = st.one_of(
    st.builds(lambda step, loss: json.dumps({"step": step, "train_loss": loss}), st.integers(-5, 50), st.floats()),
    json_values.map(json.dumps),  # any JSON: lists, strings, objects whose step is not an integer
    st.text(max_size=30).filter(lambda t: "\n" not in t),  # not JSON, or a torn line (U+2028, \r... included)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(metrics_lines, max_size=12), step=st.integers(-1, 40), end=st.sampled_from(["\n", ""]))
def test_fuzz_metrics_truncate_after(tmp_path_factory, lines, step, end):
    """Whatever metrics.jsonl holds, --resume's truncate_after never raises: it keeps exactly the
    records (objects with an integer step) up to ``step``, in order, each a whole line."""
    from gptspeed.metrics import RunLog

    path = tmp_path_factory.mktemp("log") / "metrics.jsonl"
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    expected = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and type(r.get("step")) is int and r["step"] <= step:
            expected.append(line)
    RunLog(path, echo=False).truncate_after(step)
    assert path.read_text(encoding="utf-8") == "".join(e + "\n" for e in expected)
    assert all(isinstance(json.loads(x)["step"], int) for x in expected)
