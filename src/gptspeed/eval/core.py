"""The CORE score (Li et al. 2024, "DataComp-LM: In search of the next generation of training sets
for language models", arXiv:2406.11794) of a base model, computed as nanochat's reference
implementation does (``nanochat/core_eval.py`` and ``scripts/base_eval.py``, read and re-written
here): the mean over the bundle's in-context-learning tasks (22 in DCLM's ``core.yaml``) of each
task's accuracy centred against its random baseline ``b`` (percent)::

    centered = (accuracy - 0.01 b) / (1 - 0.01 b)

Per task (its data and config: :mod:`gptspeed.eval.core_bundle`), the examples are shuffled with
``random.Random(1337)`` and cut to the first ``max_examples``; example ``i`` gets ``shots`` few-shot
examples drawn by ``random.Random(1234 + i).sample`` from the others (of the cut list). Its prompts:

- ``multiple_choice``: per choice, each shot's ``query + delimiter + choices[gold]`` and a blank
  line, then ``query + delimiter + choice``; the continuation is what follows the choices' common
  token prefix. Right: the choice of lowest mean loss over its continuation tokens.
- ``schema``: per context option, each shot's ``context_options[gold] + delimiter + continuation``
  and a blank line, then ``option + delimiter + continuation``; the continuation is the options'
  common token suffix. Right: the option of lowest mean loss over it.
- ``language_modeling``: the shots' ``context.strip() + delimiter + continuation`` and a blank line,
  then ``context.strip() + delimiter``, stripped; and that unstripped plus ``continuation``. Right:
  the greedy (argmax) prediction of every continuation token is that token.

Every prompt is tokenized as ``[bos] + encode(prompt)``; a sequence longer than the model's
``block_size`` keeps its last ``block_size`` tokens (the continuation's span shifted with it).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from gptspeed.errors import GptspeedError
from gptspeed.eval.core_bundle import CoreTask, official_bundle, read_examples, read_tasks
from gptspeed.parallelize import eager, unwrap

SHUFFLE_SEED = 1337  # nanochat's base_eval.py: the order the examples are cut in
FEWSHOT_SEED = 1234  # nanochat's core_eval.py: example i's shots come from random.Random(1234 + i)

Row = tuple[list[int], int, int]  # tokens, first continuation position, end (exclusive)


def centered(accuracy: float, baseline: float) -> float:
    """``accuracy`` (a fraction) centred against the random ``baseline`` (percent): 0 at chance, 1 at
    every example right (DCLM's centred accuracy)."""
    return (accuracy - 0.01 * baseline) / (1.0 - 0.01 * baseline)


def fewshot(data: Sequence[dict], idx: int, shots: int) -> list[dict]:
    """The ``shots`` few-shot examples of example ``idx``: ``random.Random(1234 + idx).sample`` of
    the other examples' indices, in the order drawn (nanochat's draw, so the prompts are its). The
    draw is made over ``range(len(data) - 1)``, position ``p`` standing for the ``p``-th other index
    (``sample`` reads only the length and the positions it picks: the same draw, without a list of
    ``len(data)`` indices per example)."""
    if shots == 0:
        return []
    picks = random.Random(FEWSHOT_SEED + idx).sample(range(len(data) - 1), shots)
    return [data[p + (p >= idx)] for p in picks]


def render(kind: str, item: dict, shots: Sequence[dict], delimiter: str) -> list[str]:
    """The prompts of ``item``: one per choice (``multiple_choice``) or per context option
    (``schema``); for ``language_modeling`` two, without and with the continuation (see the module)."""
    if kind == "multiple_choice":
        head = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    head = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    without = f"{head}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def common_length(seqs: Sequence[Sequence[int]], from_end: bool = False) -> int:
    """How many leading (or, ``from_end``, trailing) tokens all of ``seqs`` share."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        at = -1 - i if from_end else i
        if any(s[at] != seqs[0][at] for s in seqs):
            return i
    return n


def token_rows(kind: str, prompts: list[str], encode: Callable[[str], list[int]], bos: int) -> list[Row]:
    """``(tokens, start, end)`` per scored sequence: ``tokens = [bos] + encode(prompt)``, the
    continuation at ``tokens[start:end]`` (for ``language_modeling`` one row: the prompt with it).

    Raises:
        GptspeedError: a ``language_modeling`` prompt whose tokens without the continuation are not a
            prefix of those with it, or equal them (the tokenizer merges across the boundary, or the
            continuation is empty): nanochat asserts both.
    """
    rows = [[bos, *encode(p)] for p in prompts]
    if kind == "multiple_choice":
        start = common_length(rows)
        return [(r, start, len(r)) for r in rows]
    if kind == "schema":
        suffix = common_length(rows, from_end=True)
        return [(r, len(r) - suffix, len(r)) for r in rows]
    without, with_ = rows
    if len(without) >= len(with_) or with_[: len(without)] != without:
        raise GptspeedError(
            f"the tokens of the prompt {prompts[0][-60:]!r} are not a prefix of those with its continuation "
            "(the tokenizer merges across the boundary, or the continuation is empty): this example cannot be scored"
        )
    return [(with_, len(without), len(with_))]


def crop(rows: list[Row], block_size: int) -> list[Row]:
    """``rows`` with each sequence longer than ``block_size`` cut to its last ``block_size`` tokens
    and its span shifted with it; a span start below 1 becomes 1 (the first token has nothing
    before it to be predicted from)."""
    out = []
    for tokens, start, end in rows:
        cut = max(0, len(tokens) - block_size)
        out.append((tokens[cut:], max(start - cut, 1), end - cut))
    return out


@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: list[Row], device, pad: int, autocast=None) -> tuple[list, list]:
    """One forward pass over ``rows`` (right-padded with ``pad``; causal attention keeps padding from
    every earlier position): per row, the mean cross-entropy (nats) of its span's tokens, each
    predicted from all before it, and whether the argmax prediction of every one is right. Only the
    hidden states that predict span tokens go through the LM head. A row with an empty span has a
    NaN mean (nanochat's mean over nothing) and counts as all right.

    Returns:
        ``(means, greedy)``: two lists of ``len(rows)`` Python floats and bools.
    """
    L = max(len(t) for t, _, _ in rows)
    x = torch.tensor([t + [pad] * (L - len(t)) for t, _, _ in rows], dtype=torch.long, device="cpu").to(device)
    r_idx = [r for r, (_, s, e) in enumerate(rows) for _ in range(s, e)]
    t_idx = [t for _, s, e in rows for t in range(s, e)]  # (N,) positions of the span tokens
    r_t = torch.tensor(r_idx, dtype=torch.long, device=device)
    t_t = torch.tensor(t_idx, dtype=torch.long, device=device)
    with autocast if autocast is not None else contextlib.nullcontext():
        logits = model(x, logits_at=(r_t, t_t - 1))[0].float()  # (N, V): each predicts the token at t
    target = x[r_t, t_t]
    ce = F.cross_entropy(logits, target, reduction="none")  # (N,)
    miss = (logits.argmax(dim=-1) != target).float()
    total = torch.zeros(len(rows), device=device).index_add_(0, r_t, ce)
    misses = torch.zeros(len(rows), device=device).index_add_(0, r_t, miss)
    count = torch.bincount(r_t, minlength=len(rows)).float()
    return (total / count).tolist(), (misses == 0).tolist()


def example_rows(task: CoreTask, data: Sequence[dict], idx: int, encode, bos: int, block_size: int) -> list[Row]:
    """The cropped ``(tokens, start, end)`` rows of example ``idx`` of ``data`` (the task's examples as
    shuffled and cut), with its few-shot examples."""
    prompts = render(task.kind, data[idx], fewshot(data, idx, task.shots), task.delimiter)
    try:
        rows = token_rows(task.kind, prompts, encode, bos)
    except GptspeedError as e:
        raise GptspeedError(f"CORE task {task.label}: {e}") from None
    return crop(rows, block_size)


def evaluate_task(
    model: torch.nn.Module,
    task: CoreTask,
    data: Sequence[dict],
    *,
    encode: Callable[[str], list[int]],
    bos: int,
    device,
    autocast=None,
    batch_examples: int = 8,
) -> int:
    """How many examples of ``data`` (``task``'s, shuffled and cut) ``model`` gets right, scoring
    ``batch_examples`` examples (all their rows) per forward pass. The model must be in eval mode."""
    block_size = unwrap(model).config.block_size
    right = 0
    for lo in range(0, len(data), batch_examples):
        idxs = range(lo, min(lo + batch_examples, len(data)))
        per = [example_rows(task, data, i, encode, bos, block_size) for i in idxs]
        with eager():
            means, greedy = score_rows(model, [r for rows in per for r in rows], device, bos, autocast)
        at = 0
        for i, rows in zip(idxs, per):
            if task.kind == "language_modeling":
                right += bool(greedy[at])
            else:
                m = means[at : at + len(rows)]
                right += m.index(min(m)) == data[i]["gold"]  # Python's min, as nanochat: a NaN first stays
            at += len(rows)
    return right


def load_core(bundle: str | None, names: str | None, max_examples: int = 0) -> list[tuple[CoreTask, list[dict]]]:
    """The tasks to score and their examples, shuffled with ``random.Random(1337)`` and cut to the
    first ``max_examples`` (0 = all): of the bundle folder ``bundle``, or of the official bundle
    (:func:`gptspeed.eval.core_bundle.official_bundle`) when None; every task of ``core.yaml``, or
    those named in ``names`` (comma-separated labels), in ``core.yaml``'s order.

    Raises:
        GptspeedError: an unknown task name, a task without a random baseline, too few examples for
            a task's shots, and every error of reading the bundle.
    """
    if max_examples < 0:
        raise GptspeedError(f"--max-examples must be 0 (all) or more, got {max_examples}")
    tasks = read_tasks(bundle if bundle is not None else official_bundle())
    if names is not None:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        known = {t.label for t in tasks}
        unknown = [n for n in wanted if n not in known]
        if not wanted or unknown:
            raise GptspeedError(
                f"--core-tasks: no task {', '.join(unknown) or 'named'}; the bundle's: {', '.join(t.label for t in tasks)}"
            )
        tasks = [t for t in tasks if t.label in wanted]
    out = []
    for task in tasks:
        if task.baseline is None:
            raise GptspeedError(
                f"CORE task {task.label} has no random baseline in the bundle's eval_meta_data.csv (a row whose "
                "'Random baseline' is a percentage below 100)"
            )
        data = read_examples(task)
        random.Random(SHUFFLE_SEED).shuffle(data)
        data = data[:max_examples] if max_examples else data
        if len(data) <= task.shots:
            raise GptspeedError(
                f"CORE task {task.label} takes {task.shots} few-shot examples from the others and has "
                f"{len(data)} example(s){' (--max-examples)' if max_examples else ''}: it needs {task.shots + 1}"
            )
        out.append((task, data))
    return out


def evaluate_core(
    model: torch.nn.Module,
    tasks: list[tuple[CoreTask, list[dict]]],
    *,
    encode: Callable[[str], list[int]],
    bos: int,
    device,
    autocast=None,
    batch_examples: int = 8,
) -> dict[str, Any]:
    """The CORE score of ``model`` on ``tasks`` (:func:`load_core`), prompts tokenized with
    ``encode`` (text -> token ids) after the document separator ``bos`` (50256 for GPT-2's BPE).

    Returns:
        ``centered`` (the CORE score: the mean of the tasks' centred accuracies), ``tasks`` (per
        label: ``accuracy``, ``centered``, ``examples``, ``shots``, ``type``, ``baseline`` in
        percent) and ``seconds`` (wall time).
    """
    if batch_examples < 1:
        raise GptspeedError(f"CORE batch must be at least 1 example, got {batch_examples}")
    m = unwrap(model)
    was_training = m.training
    m.eval()
    t0 = time.perf_counter()
    per: dict[str, dict[str, Any]] = {}
    try:
        for task, data in tasks:
            right = evaluate_task(
                m, task, data, encode=encode, bos=bos, device=device, autocast=autocast, batch_examples=batch_examples
            )
            acc = right / len(data)
            per[task.label] = {
                "accuracy": acc,
                "centered": centered(acc, task.baseline or 0.0),
                "examples": len(data),
                "shots": task.shots,
                "type": task.kind,
                "baseline": task.baseline,
            }
    finally:
        m.train(was_training)
    score = sum(t["centered"] for t in per.values()) / len(per) if per else float("nan")
    return {"centered": score, "tasks": per, "seconds": time.perf_counter() - t0}
