"""HellaSwag (Zellers et al. 2019, "HellaSwag: Can a Machine Really Finish Your Sentence?"),
scored by completion likelihood as build-nanogpt's ``hellaswag.py`` and llm.c do.

Each example has a context and 4 endings, one of them right (``label``). Each ending is scored
as a continuation: the tokens of ``ctx`` followed by the tokens of ``" " + ending``; the
cross-entropy of the ending tokens only (the model predicting each ending token from everything
before it) gives a total and a mean loss per ending. ``acc`` picks the lowest total loss,
``acc_norm`` the lowest mean loss (length-normalised; the figure build-nanogpt and llm.c report:
29.55% for OpenAI's GPT-2 124M with this method, 48.93% for GPT-2 XL, over the 10,042 examples).

The data is the official validation file of rowanz/hellaswag, verified by sha256: taken from
``$GPTSPEED_DATA_MIRROR/hellaswag/hellaswag_val.jsonl`` when present, else from the cache
(``$GPTSPEED_CACHE`` or ``~/.cache/gptspeed``), else downloaded into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from gptspeed.errors import GptspeedError
from gptspeed.parallelize import eager, unwrap

HELLASWAG_VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# From the download_checksums that Hugging Face's `datasets` recorded for this very URL (file
# datasets/hellaswag/dataset_infos.json of huggingface/datasets, under github.com/rowanz/hellaswag/
# raw/master/data/hellaswag_val.jsonl, which redirects to the raw.githubusercontent.com address).
# The same record gives 12,246,618 bytes; the file holds 10,042 examples.
HELLASWAG_VAL_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
RELATIVE_PATH = "hellaswag/hellaswag_val.jsonl"  # under the mirror and the cache


@dataclass(frozen=True)
class HellaSwagItem:
    """One tokenized example: ``ctx`` and the 4 ``endings`` as GPT-2 token ids (each ending
    encoded with a leading space), and the index of the right ending."""

    ctx: tuple[int, ...]
    endings: tuple[tuple[int, ...], ...]
    label: int


def hellaswag_file(progress: bool = True) -> Path:
    """Local, sha256-verified path of the official HellaSwag validation jsonl: the mirror, else
    the cache, else downloaded into the cache (the only step that uses the network).

    Raises:
        GptspeedError: a mirror or cached file with the wrong sha256 (naming both hashes), or the
            download failed (offline: set ``GPTSPEED_DATA_MIRROR``).
    """
    from gptspeed.data.corpora import MIRROR_ENV, _download, _mismatch, cache_dir
    from gptspeed.fileio import sha256_file

    mirror = os.environ.get(MIRROR_ENV)
    if mirror and (Path(mirror) / RELATIVE_PATH).is_file():
        path = Path(mirror) / RELATIVE_PATH
        actual = sha256_file(path)
        if actual != HELLASWAG_VAL_SHA256:
            raise _mismatch(
                path, actual, HELLASWAG_VAL_SHA256, f"replace it with the official file or unset {MIRROR_ENV}"
            )
        return path
    path = cache_dir() / RELATIVE_PATH
    if not path.is_file() or sha256_file(path) != HELLASWAG_VAL_SHA256:
        _download((HELLASWAG_VAL_URL,), path, HELLASWAG_VAL_SHA256, RELATIVE_PATH, progress)
    return path


def read_examples(path: str | Path, max_examples: int = 0) -> list[dict[str, Any]]:
    """The examples of a HellaSwag jsonl file (one JSON object per line with ``ctx``, ``endings``
    (4 strings) and ``label`` (0-3, int or digit string)), the first ``max_examples`` (0 = all).

    Raises:
        GptspeedError: the file is missing, or a line is not such an object (naming the line).
    """
    path = Path(path)
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ex = json.loads(line)
                    ok = (
                        isinstance(ex["ctx"], str)
                        and len(ex["endings"]) == 4
                        and all(isinstance(e, str) for e in ex["endings"])
                        and int(ex["label"]) in range(4)
                    )
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    ok = False
                if not ok:
                    raise GptspeedError(f"{path}:{n} is not a HellaSwag example (ctx, 4 endings, label 0-3)")
                examples.append(ex)
                if max_examples and len(examples) == max_examples:
                    break
    except (OSError, UnicodeDecodeError) as e:
        raise GptspeedError(f"cannot read HellaSwag file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not examples:
        raise GptspeedError(f"{path} holds no HellaSwag examples")
    return examples


def render(example: dict[str, Any], tokenizer=None) -> HellaSwagItem:
    """Tokenize one example as build-nanogpt's ``render_example``: ``encode(ctx)`` and
    ``encode(" " + ending)`` for each ending (GPT-2 BPE, :func:`gptspeed.tokenizer.encode`; or
    ``tokenizer``'s, a :class:`gptspeed.bpe.Tokenizer`: the run's, :mod:`gptspeed.run_tokenizer`)."""
    from gptspeed.tokenizer import encode

    encode = encode if tokenizer is None else tokenizer.encode
    return HellaSwagItem(
        ctx=tuple(encode(example["ctx"])),
        endings=tuple(tuple(encode(" " + e)) for e in example["endings"]),
        label=int(example["label"]),
    )


def load_hellaswag(
    path: str | Path | None = None, max_examples: int = 0, progress: bool = True, tokenizer=None
) -> list[HellaSwagItem]:
    """Tokenized HellaSwag examples (:func:`render`, with ``tokenizer``: None for GPT-2's): from
    ``path`` as given (not checked against a hash: for other files in the same format), or from the
    official validation file (:func:`hellaswag_file`)."""
    examples = read_examples(path if path is not None else hellaswag_file(progress), max_examples)
    return [render(ex, tokenizer) for ex in examples]


@torch.no_grad()
def score_items(
    model: torch.nn.Module, items: list[HellaSwagItem], device: torch.device | str, autocast=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of every ending of ``items`` (N examples) in one forward pass of 4N rows.

    Rows are ``ctx + ending``, right-padded (causal attention: padding never affects earlier
    positions); longer than ``block_size``, a row loses tokens from the left and an ending token
    with nothing before it is not scored. Only hidden states that predict ending tokens go through
    the LM head. Returns ``(total, count)``, both ``(N, 4)``: summed loss (fp32, nats) and the
    number of scored tokens.
    """
    S = unwrap(model).config.block_size
    rows, starts = [], []
    for it in items:
        for end in it.endings:
            toks = list(it.ctx) + list(end)
            drop = max(0, len(toks) - S)
            rows.append(toks[drop:])
            starts.append(max(len(it.ctx) - drop, 1))
    L = max(len(r) for r in rows)
    r_idx, t_idx, seg = [], [], []
    for r, (toks, start) in enumerate(zip(rows, starts)):
        n = len(toks) - start  # ending tokens scored: positions start .. len-1
        r_idx += [r] * n
        t_idx += range(start, len(toks))
        seg += [r] * n
    # staged on the host whatever the default device is (one copy to ``device``, not one per row)
    x = torch.tensor([toks + [0] * (L - len(toks)) for toks in rows], dtype=torch.long, device="cpu")
    x = x.to(device)
    r_idx_t = torch.tensor(r_idx, device=device)
    t_idx_t = torch.tensor(t_idx, device=device)
    seg_t = torch.tensor(seg, device=device)
    with autocast if autocast is not None else contextlib.nullcontext():
        # through forward (FSDP2's hooks gather the root's parameters there); only the positions
        # before each ending token go through the LM head
        logits = model(x, logits_at=(r_idx_t, t_idx_t - 1))[0].float()  # (tokens, V)
    ce = F.cross_entropy(logits, x[r_idx_t, t_idx_t], reduction="none")  # (tokens,)
    total = torch.zeros(len(rows), device=device).index_add_(0, seg_t, ce)
    count = torch.bincount(seg_t, minlength=len(rows))
    return total.view(-1, 4), count.view(-1, 4)


def evaluate_hellaswag(
    model: torch.nn.Module,
    items: list[HellaSwagItem],
    *,
    device: torch.device | str,
    autocast=None,
    batch_examples: int = 16,
    rank: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any]:
    """HellaSwag accuracy of ``model`` (a GPT, possibly sharded by FSDP2 or with compiled blocks).
    It runs eagerly (``torch.compiler.set_stance("force_eager")``; a compiled model's module is
    used), so HellaSwag's row lengths never trigger recompiles.

    Examples are spread over ranks (``items[rank::world_size]``, default from torch.distributed
    when initialised) and the counts all-reduced; each rank batches ``batch_examples`` examples
    (4 rows each), longest first. Every rank must call this. Returns ``examples``, ``correct``,
    ``correct_norm``, ``acc`` (lowest total loss), ``acc_norm`` (lowest mean loss per token),
    ``seconds`` (wall time, device synchronised), ``examples_per_s`` and ``nan_examples``
    (examples with a NaN ending loss: a diverged model, whose accuracy means nothing; an infinite
    loss is an ending a ``--softmax data`` model cannot produce, and simply ranks last).
    """
    import torch.distributed as dist

    if batch_examples < 1:
        raise GptspeedError(f"HellaSwag batch must be at least 1 example, got {batch_examples}")
    distributed = dist.is_available() and dist.is_initialized()
    rank = rank if rank is not None else dist.get_rank() if distributed else 0
    world_size = world_size if world_size is not None else dist.get_world_size() if distributed else 1
    m = unwrap(model)  # the module under torch.compile / DDP (FSDP2 shards in place: itself)
    was_training = m.training
    m.eval()
    mine = sorted(items[rank::world_size], key=lambda it: -max(len(it.ctx) + len(e) for e in it.endings))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    stats = torch.zeros(4, dtype=torch.long, device=device)  # examples, correct, correct_norm, NaN
    for i in range(0, len(mine), batch_examples):
        batch = mine[i : i + batch_examples]
        with eager():
            total, count = score_items(m, batch, device, autocast)
        labels = torch.tensor([it.label for it in batch], device=device)
        stats[0] += len(batch)
        stats[1] += (total.argmin(dim=1) == labels).sum()
        stats[2] += ((total / count.clamp(min=1)).argmin(dim=1) == labels).sum()
        stats[3] += total.isnan().any(dim=1).sum()  # a diverged model: its accuracy means nothing
    if distributed and world_size > 1:
        dist.all_reduce(stats)
    sync()
    seconds = time.perf_counter() - t0
    m.train(was_training)
    n, correct, correct_norm, nan = stats.tolist()
    return {
        "examples": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "acc": correct / max(n, 1),
        "acc_norm": correct_norm / max(n, 1),
        "seconds": seconds,
        "examples_per_s": n / seconds if seconds else None,
        "nan_examples": nan,
    }


def hellaswag_hook(cfg, rt, tokenizer=None) -> Callable[[torch.nn.Module], dict[str, Any]] | None:
    """For the training loop: None when ``cfg.train.hellaswag_every`` is 0; else a function of the
    model returning the metrics fields ``hellaswag_acc_norm``, ``hellaswag_acc``,
    ``hellaswag_examples``. The data is loaded and tokenized here, once, so a missing file fails
    before the first step (GptspeedError, as :func:`hellaswag_file`), with ``tokenizer`` (the run's;
    None: GPT-2's)."""
    if not cfg.train.hellaswag_every:
        return None
    items = load_hellaswag(max_examples=cfg.train.hellaswag_examples, tokenizer=tokenizer)

    def run(model: torch.nn.Module) -> dict[str, Any]:
        r = evaluate_hellaswag(model, items, device=rt.device, autocast=rt.autocast())
        return {"hellaswag_acc_norm": r["acc_norm"], "hellaswag_acc": r["acc"], "hellaswag_examples": r["examples"]}

    return run
