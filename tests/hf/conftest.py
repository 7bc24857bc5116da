"""The Hugging Face tests' fixtures: a tiny random GPT-2 saved by transformers."""

from __future__ import annotations

import pytest
import torch

from support.hf_models import TINY_HF_GPT2


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random GPT-2 in transformers (:data:`TINY_HF_GPT2`), saved with save_pretrained
    (config.json + model.safetensors): ``(model, folder)``."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_HF_GPT2)).eval()
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def hf_folder(hf_model):
    """The folder of :func:`hf_model`."""
    return hf_model[1]
