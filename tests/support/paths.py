"""Where the tests find the checkout, the package's source and the real text."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
# the corpora: ../shared/data beside the checkout, or where GPTSPEED_DATA_MIRROR already points (a GPU
# machine has no ../shared: its .carry/setup.sh points the mirror at .carry/data)
SHARED_DATA = Path(os.environ.get("GPTSPEED_DATA_MIRROR") or ROOT.parent / "shared" / "data")
#: tinyshakespeare's text, and its length in GPT-2 tokens (one document: no end-of-text token).
SHAKESPEARE_TEXT = SHARED_DATA / "tinyshakespeare" / "input.txt"
SHAKESPEARE_TOKENS = 338_025
