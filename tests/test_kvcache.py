"""KV-cache sampling (gptspeed.sample.generate_cached) against the cache-free reference."""

import io

import pytest
import torch

from gptspeed.checkpoint import save_checkpoint
from gptspeed.config import preset
from gptspeed.model import GPT, GPTConfig
from gptspeed.sample import generate, generate_cached, left_pad, sample_text

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(attention="sdpa", block_size=32, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=32, attention=attention)).eval()


def run(gen_fn, model, idx, n, seed=1, **kw):
    g = torch.Generator().manual_seed(seed)
    return torch.stack(list(gen_fn(model, idx, n, generator=g, **kw)), dim=1)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 50)])
def test_same_tokens_as_the_cache_free_path(attention, temperature, top_k):
    model = tiny(attention)
    idx = torch.randint(0, 50257, (3, 5), generator=torch.Generator().manual_seed(2))
    # 5 + 40 tokens > block_size 32: also covers the window recompute past the cache's end
    ref = run(generate, model, idx, 40, temperature=temperature, top_k=top_k)
    got = run(generate_cached, model, idx, 40, temperature=temperature, top_k=top_k)
    assert torch.equal(ref, got)


def test_prompts_of_different_lengths_in_one_batch():
    model = tiny()
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22], [31, 32, 33, 34]]
    idx, pad = left_pad(prompts)
    assert pad.tolist() == [0, 5, 3]
    batch = run(generate_cached, model, idx, 35, temperature=0, pad=pad)  # crosses block_size too
    for row, prompt in enumerate(prompts):
        alone = run(generate, model, torch.tensor([prompt]), 35, temperature=0)
        assert torch.equal(batch[row], alone[0])


def test_prompt_longer_than_block_size_is_cropped_like_the_reference():
    model = tiny(block_size=16)
    idx = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(3))
    assert torch.equal(run(generate, model, idx, 5), run(generate_cached, model, idx, 5))


def test_works_with_a_compiled_model():
    # backend "eager" checks graph capture of the decode step without the minutes inductor takes on a CPU
    model = tiny()
    idx, pad = left_pad([[1, 2, 3, 4], [5, 6]])
    ref = run(generate_cached, model, idx, 12, temperature=0, pad=pad)
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(run(generate_cached, compiled, idx, 12, temperature=0, pad=pad, compile="eager"), ref)


def test_bfloat16_autocast_runs():
    model = tiny()
    idx = torch.randint(0, 50257, (2, 4), generator=torch.Generator().manual_seed(4))
    out = run(generate_cached, model, idx, 6, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert out.shape == (2, 6) and int(out.max()) < 50257


@pytest.fixture
def run_dir(tmp_path):
    cfg = preset("pico")
    cfg.model = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    save_checkpoint(tmp_path, {"step": 3, "model": GPT(cfg.model).state_dict(), "config": cfg.to_dict()})
    return tmp_path


def test_sample_text_streams_one_row_and_prints_batches(run_dir):
    out = io.StringIO()
    texts = sample_text(run=str(run_dir), prompts=["Hello"], max_new_tokens=8, device="cpu", out=out)
    assert len(texts) == 1 and out.getvalue() == "Hello" + texts[0] + "\n"
    cache_free = sample_text(
        run=str(run_dir), prompts=["Hello"], max_new_tokens=8, device="cpu", kv_cache=False, out=io.StringIO()
    )
    assert cache_free == texts
    out = io.StringIO()
    texts = sample_text(
        run=str(run_dir), prompts=["Hello", "Once upon a time"], num_samples=2, max_new_tokens=4, device="cpu", out=out
    )
    assert len(texts) == 4 and out.getvalue().count("--- sample") == 4 and "(step 3)" in out.getvalue()
