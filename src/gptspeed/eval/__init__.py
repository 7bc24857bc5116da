"""Evaluation: the val loss (:mod:`.val_loss`), bits per byte (:mod:`.bpb`), HellaSwag (:mod:`.hellaswag`) and
CORE (:mod:`.core`), and the ``gptspeed eval`` command that runs them on a checkpoint or a Hugging Face GPT-2."""

from __future__ import annotations

import math
from pathlib import Path

from gptspeed.errors import GptspeedError
from gptspeed.options import DeviceOptions, EvalOptions


def evaluate_run(
    run_dir: str | Path | None = None,
    data_dir: str | Path | None = EvalOptions.data_dir,
    *,
    init_from: str | None = None,
    hellaswag: bool = EvalOptions.hellaswag,
    hellaswag_file: str | None = EvalOptions.hellaswag_file,
    max_examples: int = EvalOptions.max_examples,
    batch_size: int = EvalOptions.batch_size,
    max_tokens: int = EvalOptions.max_tokens,
    core: bool = EvalOptions.core,
    core_tasks: str | None = EvalOptions.core_tasks,
    core_bundle: str | None = EvalOptions.core_bundle,
    lm_eval: str | None = EvalOptions.lm_eval,
    lm_eval_include: str | None = EvalOptions.lm_eval_include,
    device: str = DeviceOptions.device,
    dtype: str = DeviceOptions.dtype,
) -> dict:
    """``gptspeed eval``: for the newest checkpoint of ``run_dir`` (or the HF model ``init_from``),
    the val loss on the val split of ``data_dir`` (``step``, ``val_loss``, ``perplexity``,
    ``val_bpb`` -- bits per byte over the same tokens, in the same pass, :mod:`gptspeed.eval.bpb` --, ``tokens``,
    ``run``, ``data``) and/or, with ``hellaswag``, HellaSwag accuracy under
    ``"hellaswag"`` (see :func:`gptspeed.eval.hellaswag.evaluate_hellaswag`; ``max_examples`` 0 = all;
    ``hellaswag_file`` a jsonl in the same format instead of the official file, implies ``hellaswag``);
    with ``core``, the CORE score under ``"core"`` (:func:`gptspeed.eval.core.evaluate_core`: ``centered``
    and each task's ``accuracy``, ``centered``, ``examples``; ``core_tasks`` comma-separated task labels,
    ``core_bundle`` a local bundle folder instead of the official bundle, each implying ``core``;
    ``max_examples`` per task), its prompts tokenized by the run's tokenizer after its ``<|endoftext|>``;
    and/or, with ``lm_eval`` (tasks, comma-separated), lm-evaluation-harness's metrics of the run's
    export under ``"lm_eval"`` (:mod:`gptspeed.eval.harness`; ``lm_eval_include`` a folder of task YAMLs).

    Raises:
        GptspeedError: nothing to evaluate, bad sizes, missing data or model.
    """
    from gptspeed.data import find_shards

    hellaswag = hellaswag or hellaswag_file is not None
    core = core or core_tasks is not None or core_bundle is not None
    if data_dir is None and not hellaswag and not core and lm_eval is None:
        raise GptspeedError(
            "nothing to evaluate: give --data DIR (val loss), --hellaswag, --core and/or --lm-eval TASKS"
        )
    if batch_size < 1:
        raise GptspeedError(f"--batch-size must be at least 1, got {batch_size}")
    if max_examples < 0:
        raise GptspeedError(f"--max-examples must be 0 (all) or more, got {max_examples}")
    if max_tokens < 0:
        raise GptspeedError(f"--max-tokens must be 0 (all) or more, got {max_tokens}")
    shards = find_shards(data_dir, "val") if data_dir is not None else None  # before importing torch
    from gptspeed.eval.harness import plan_lm_eval, run_lm_eval

    harness = plan_lm_eval(lm_eval, lm_eval_include, run_dir, init_from)  # None without --lm-eval; before any model
    from gptspeed.eval.bpb import bytes_table
    from gptspeed.eval.hellaswag import evaluate_hellaswag, load_hellaswag
    from gptspeed.eval.val_loss import evaluate_val
    from gptspeed.run_tokenizer import eval_tokenizer
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_any_model

    rt = resolve_runtime(device, dtype, compile=False)
    tok = eval_tokenizer(run_dir, data_dir, init_from)  # the run's (None: GPT-2's); refused unless the data's
    items = None
    if hellaswag:
        items = load_hellaswag(hellaswag_file, max_examples=max_examples, tokenizer=tok)
    core_data = _load_core(core_bundle, core_tasks, max_examples) if core else None
    model, info = (
        load_any_model(rt, run_dir, init_from)
        if shards is not None or items is not None or core_data is not None
        else (None, {"run": str(run_dir)})
    )
    result: dict = {**info}
    if shards is not None:
        nbytes = bytes_table(model, rt.device, tok)  # one pass gives both the loss and bits per byte
        loss, n, bpb = evaluate_val(model, rt, shards, batch_size, model.config.block_size, max_tokens, nbytes=nbytes)
        perplexity = math.exp(loss) if loss < _MAX_EXP else math.inf  # NaN stays NaN
        result.update(val_loss=loss, perplexity=perplexity, val_bpb=bpb, tokens=n, data=str(data_dir))
    if items is not None:
        result["hellaswag"] = evaluate_hellaswag(
            model, items, device=rt.device, autocast=rt.autocast(), batch_examples=batch_size
        )
    if core_data is not None:
        result["core"] = _score_core(model, rt, core_data, batch_size, tok)
    if harness is not None:  # the harness loads the run's export itself
        lm = run_lm_eval(harness, run_dir, device=rt.device.type, dtype=rt.dtype, batch_size=batch_size)
        result.update(step=lm.pop("step"), lm_eval=lm)
    return json_safe(result)


def _load_core(bundle: str | None, tasks: str | None, max_examples: int):
    """CORE's tasks and examples, read before the model is loaded (a bad bundle fails first)."""
    from gptspeed.eval.core import load_core

    return load_core(bundle, tasks, max_examples)


def _score_core(model, rt, core_data, batch_size: int, tok) -> dict:
    """The CORE result of ``model``, its prompts tokenized by the run's tokenizer ``tok`` (None:
    GPT-2's BPE) after its ``<|endoftext|>``."""
    from gptspeed.eval.core import evaluate_core
    from gptspeed.tokenizer import EOT_TOKEN, encode

    return evaluate_core(
        model,
        core_data,
        encode=encode if tok is None else tok.encode,
        bos=EOT_TOKEN if tok is None else tok.eot,
        device=rt.device,
        autocast=rt.autocast(),
        batch_examples=batch_size,
    )


_MAX_EXP = math.log(1.7976931348623157e308)  # math.exp raises OverflowError above this


def json_safe(result: dict) -> dict:
    """``result`` as strict JSON can hold it (``json.dumps(..., allow_nan=False)``, which the
    command uses): every float that is not finite -- the NaN or infinite val loss of a model whose
    weights diverged, a perplexity that overflows -- becomes None, and ``note`` names each and why."""
    bad: list[str] = []

    def clean(value, path: str):
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{path} ({value})")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(result, "")
    loss = result.get("val_loss")
    nan = (result.get("hellaswag") or {}).get("nan_examples")
    if nan:
        bad.append(f"hellaswag ({nan} example(s) scored with NaN losses)")
    if bad:
        if nan or (isinstance(loss, float) and math.isnan(loss)):
            why = "the model's weights have diverged or are corrupt"
        elif isinstance(loss, float) and math.isinf(loss):
            why = (
                "the model gives a val token probability 0 (a --softmax data model evaluated on data with other "
                "tokens?) or its weights have diverged"
            )
        else:
            why = "too large for a float (the perplexity is exp(val_loss))"
        out["note"] = f"not finite, shown as null: {', '.join(bad)}: {why}"
    return out
