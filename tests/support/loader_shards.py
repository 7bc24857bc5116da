"""A val shard of known tokens for the loader's tests."""

from __future__ import annotations

import numpy as np

from gptspeed.data.shards import write_shard

B, T = 2, 8  # one rank's micro-batch: 16 tokens (+1)


def _val_shard(path, toks):
    write_shard(path, np.asarray(toks))
    return path
