"""``--batch-size auto``: the largest micro-batch that fits, found by a short probe on CUDA.

:func:`largest_fitting` is a binary search over a ``fits(b) -> bool`` predicate (unit-tested on
a CPU with a fake one); :func:`cuda_fits` builds the real predicate, which runs one full training
step (forward, backward, optimizer step) at micro-batch ``b`` and reports False on
``torch.cuda.OutOfMemoryError``. The result, with a safety margin, is cached per device and
configuration in a JSON file (``$GPTSPEED_CACHE/batch_size.json``, default
``~/.cache/gptspeed/batch_size.json``), so the probe runs once per GPU model and shape.

The micro-batch actually used (:func:`pick_micro_batch`) is the largest power of two no larger
than the fit that divides the sequences per optimizer step, so gradient accumulation absorbs the
rest and the global batch in tokens stays as asked. On a CPU or MPS there is no out-of-memory
signal to probe with: ``--batch-size auto`` is refused there with a one-line error.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic

SAFETY = 0.9  # use at most 90% of the largest micro-batch that fitted (fragmentation, eval, spikes)


def largest_fitting(fits: Callable[[int], bool], limit: int = 1024) -> int:
    """The largest ``b`` in ``[1, limit]`` with ``fits(b)``, assuming fitting is monotone (if b
    fits, every smaller one does). Doubling from 1, then bisecting: O(log limit) probes.

    Returns 0 if not even ``b = 1`` fits.
    """
    if not fits(1):
        return 0
    lo = 1
    hi = None
    while hi is None:
        nxt = min(lo * 2, limit)
        if nxt == lo:
            return lo
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def agreed_largest_fitting(fits: Callable[[int], bool], agree: Callable[[int], int], limit: int = 1024) -> int:
    """:func:`largest_fitting` run by every rank in lockstep: each verdict of ``fits`` is replaced
    by ``agree(verdict)`` (the minimum over ranks: a size fits only if it fits everywhere), so all
    ranks probe the same sizes -- none is left waiting in a collective of a probe another rank
    skipped -- and return the same answer."""
    return largest_fitting(lambda b: bool(agree(int(fits(b)))), limit)


def pick_micro_batch(fit: int, sequences_per_step: int | None, safety: float = SAFETY) -> int:
    """The micro-batch to train with: the largest power of two ``<= max(1, floor(fit * safety))``
    that divides ``sequences_per_step`` (the global batch in sequences; None = any power of two).
    GptspeedError if ``fit`` is 0 (one sequence does not fit)."""
    if fit < 1:
        raise GptspeedError(
            "--batch-size auto: not even one sequence fits in GPU memory; "
            "lower --seq-len, use --activation-checkpointing full, or a smaller model"
        )
    cap = max(1, int(fit * safety))
    b = 1
    while b * 2 <= cap and (sequences_per_step is None or sequences_per_step % (b * 2) == 0):
        b *= 2
    return b


def cache_path() -> Path:
    """``$GPTSPEED_CACHE/batch_size.json`` (default ``~/.cache/gptspeed/batch_size.json``)."""
    root = os.environ.get("GPTSPEED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gptspeed")
    return Path(root) / "batch_size.json"


def cache_key(device_name: str, settings: dict[str, Any]) -> str:
    """A key for one device model and configuration: the device name plus a hash of the settings
    that change memory use (shape, dtype, loss, checkpointing, fp8, compile, optimizer, torch version)."""
    blob = json.dumps({**settings, "torch": torch.__version__}, sort_keys=True)
    return f"{device_name}|{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def cached_fit(key: str) -> int | None:
    """The cached largest fitting micro-batch for ``key``, or None (absent or unreadable cache)."""
    try:
        value = json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def store_fit(key: str, fit: int) -> None:
    """Record ``fit`` for ``key`` in the cache file (atomically; an unwritable cache is ignored)."""
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = fit
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    except OSError:
        pass


def cuda_fits(make_step: Callable[[int], Callable[[], Any]], device: torch.device) -> Callable[[int], bool]:
    """A ``fits(b)`` predicate for :func:`largest_fitting`: ``make_step(b)`` builds a training
    step at micro-batch ``b`` (fresh model and optimizer state), which is run twice (the second
    step has the optimizer state allocated); False on ``torch.cuda.OutOfMemoryError``. Memory is
    released (``gc.collect`` + ``torch.cuda.empty_cache``) after every probe."""

    def fits(b: int) -> bool:
        step = None
        try:
            step = make_step(b)
            step()
            step()
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del step
            gc.collect()
            torch.cuda.empty_cache()

    return fits


def resolve_auto_batch(
    device: torch.device,
    settings: dict[str, Any],
    sequences_per_step: int | None,
    make_step: Callable[[int], Callable[[], Any]],
    limit: int = 1024,
    say: Callable[[str], Any] = print,
    agree: Callable[[int], int] = lambda v: v,
) -> int:
    """The micro-batch for ``--batch-size auto`` on ``device``: the cached fit for (device,
    ``settings``) or a fresh probe (then cached), reduced by :func:`pick_micro_batch`. Reports the
    choice through ``say``. GptspeedError (one line) on a CPU or MPS.

    ``settings`` should name everything that changes memory per GPU (shape, dtype, compile,
    optimizer, world size, parallel mode...): they key the cache. ``agree(v)`` returns the
    minimum of ``v`` over all ranks (identity in one process): the ranks probe only if any of
    them has no cached fit, every probe's verdict is agreed (so all ranks probe the same sizes in
    lockstep and none waits in a collective another abandoned), and so is the final micro-batch."""
    if device.type != "cuda":
        raise GptspeedError(
            f"--batch-size auto probes GPU memory and needs CUDA; on {device.type} give a number (e.g. --batch-size 16)"
        )
    key = cache_key(torch.cuda.get_device_name(device), settings)
    fit = agree(cached_fit(key) or 0)
    source = "cached"
    if fit == 0:
        fit = agreed_largest_fitting(cuda_fits(make_step, device), agree, limit)
        source = "probed"
        if fit > 0:
            store_fit(key, fit)
    b = agree(pick_micro_batch(fit, sequences_per_step))
    say(f"--batch-size auto: {fit} sequences fit ({source}, {cache_path()}); using micro-batch {b}")
    return b
