"""gptspeed.model where the mutation check (tools/mutation/README.md) found it unguarded: the
``--softmax data`` ids' checks and a target beyond the largest id, and explicit devices honoured
when the default device is another one. Tiny models, no subprocess."""

import math

import pytest
import torch

from gptspeed.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=32, block_size=16), **kw})


@pytest.mark.parametrize("bad", [[1, 5, 3], [0, 5, 50257], [2, 2, 9]])
def test_softmax_ids_out_of_order_or_range_anywhere_are_refused(bad):
    """Checked over every neighbouring pair and at the last id, not just against the first."""
    model = GPT(small(softmax="data"))
    with pytest.raises(ValueError, match=r"^softmax ids must be sorted, unique and in \[0, 50257\)$"):
        model.set_softmax_ids(bad)


def test_softmax_ids_of_any_integer_like_input_are_int64_where_the_model_is():
    model = GPT(small(softmax="data"))
    ids = torch.tensor([[0.0, 5.0], [7.0, 9.0]])
    with torch.device("meta"):  # the default device elsewhere: the ids still go where the buffer is
        model.set_softmax_ids(ids)
    assert model.softmax_ids.dtype == torch.int64 and model.softmax_ids.tolist() == [0, 5, 7, 9]
    with torch.device("meta"):
        model.set_softmax_ids([1, 2])
    assert model.softmax_ids.dtype == torch.int64 and model.softmax_ids.device.type == "cpu"
    assert model.softmax_ids.tolist() == [1, 2]


@pytest.mark.parametrize("loss", ["plain", "fused"])
def test_a_target_beyond_the_largest_id_has_infinite_loss(loss):
    """A target above every id (searchsorted's K) is outside like any other: loss +inf, no error."""
    torch.manual_seed(0)
    model = GPT(small(softmax="data", loss=loss))
    model.set_softmax_ids([3, 11, 25])
    x = torch.tensor([[3, 11, 25, 3]])
    assert math.isfinite(model(x, x)[1].item())
    y = x.clone()
    y[0, 2] = 4000
    assert math.isinf(model(x, y)[1].item())
