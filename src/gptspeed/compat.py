"""The oldest PyTorch gptspeed runs on, checked once at start without importing torch.

gptspeed uses ``torch.optim.Muon`` (added in PyTorch 2.9), ``torch.compiler.set_stance`` (2.6) and
FSDP2's ``fully_shard`` in ``torch.distributed.fsdp`` (2.6); the newest of these sets the minimum,
which ``pyproject.toml`` states too. An older torch would fail with an AttributeError mid-run;
:func:`check_torch` turns that into one line before anything starts.
"""

from __future__ import annotations

import re
from importlib import metadata

from gptspeed.errors import GptspeedError

MIN_TORCH = (2, 9)


def torch_version_tuple(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``(0, 0)`` for a version string it cannot read."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch(version: str | None = None) -> None:
    """GptspeedError (one line) when the installed torch (``importlib.metadata``; ``version`` to
    check another) is older than :data:`MIN_TORCH` or missing. Imports no torch."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise GptspeedError(
                "PyTorch is not installed: pip install torch (CPU machines: pip install torch==2.13.0)"
            ) from None
    need = ".".join(map(str, MIN_TORCH))
    if torch_version_tuple(version) < MIN_TORCH:
        raise GptspeedError(
            f"gptspeed needs torch >= {need} (torch.optim.Muon, torch.compiler.set_stance); this is torch "
            f"{version}: pip install 'torch>={need}'"
        )
