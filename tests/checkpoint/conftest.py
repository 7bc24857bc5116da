"""The checkpoint tests' fixtures."""

import json

import pytest

from support.checkpoints import CONFIG, RUN_ID, _save


@pytest.fixture
def run(tmp_path):
    """A run folder with config.json, metrics.jsonl and the sharded checkpoint of step 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**CONFIG, "derived": {"run_id": RUN_ID}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    _save(run, 2)
    return run
