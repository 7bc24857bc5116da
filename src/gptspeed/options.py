"""The options of ``gptspeed prepare``, ``sample`` and ``eval``, declared once each: a field's default is
the default of the function's keyword argument (:func:`gptspeed.data.prepare.prepare`,
:func:`gptspeed.sample.sample_text`, :func:`gptspeed.eval.evaluate_run`, which take it from here) and
of the flag (:func:`gptspeed.configure.add_dataclass_flags` makes the flags of these fields, with their
help). Imports no torch: ``gptspeed sample --help`` does not wait for it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from gptspeed.config import DEVICES, DTYPES, _f


@dataclass
class DeviceOption:
    """The device a command runs on: ``sample``'s, ``eval``'s and every ``bench`` subcommand's."""

    device: str = _f("auto", "auto: cuda > mps > cpu", choices=DEVICES)


@dataclass
class DeviceOptions(DeviceOption):
    """Where a loaded model runs: ``sample``'s and ``eval``'s (their functions' ``device`` and ``dtype``)."""

    dtype: str = _f(
        "auto",
        "autocast precision (auto: bf16 on GPUs that have it; tf32: fp32 with TF32 matmuls)",
        choices=DTYPES,
    )


@dataclass
class PrepareOptions:
    """``gptspeed prepare``'s options (:func:`gptspeed.data.prepare.prepare`'s keyword arguments)."""

    val_fraction: float = _f(0.1, "share of tokens for the val split")
    shard_tokens: int = _f(100_000_000, "tokens per shard file at most")
    workers: int = _f(0, "tokenizing threads (the shards do not depend on it); 0 = one per usable CPU (default)")
    text_field: str = _f("text", "JSON field / parquet column / dataset feature with the text")
    shuffle_seed: int | None = _f(
        None,
        "write the documents in a global random order fixed by this seed (val is then a random share of "
        "documents); default: keep the source order",
        parse="seed",
    )
    skip_bad: bool = _f(False, "skip and count bad records instead of stopping", kind="flag")
    max_tokens: int | None = _f(None, "stop after this many tokens")
    hf_name: str | None = _f(None, "hf: sources: the dataset configuration (e.g. sample-10BT)")
    split: str = _f("train", "hf: sources: the dataset split")
    force: bool = _f(False, "overwrite an already prepared folder", kind="flag")
    max_shards: int | None = _f(
        None, "fineweb10B: its first N train shards, ~100M tokens each (default all 103); the val shard always"
    )
    print_hashes: bool = _f(False, "print each input file's sha256 as `sha256  path` lines", kind="flag")
    tokenizer: str = _f(
        "gpt2",
        "gpt2 (GPT-2's BPE, shipped), a tiktoken encoding (cl100k_base, o200k_base, ...) or a folder written by "
        "`gptspeed tokenizer train`; a vocabulary above 65,536 ids writes llm.c's uint32 shards",
        metavar="TOK_DIR|gpt2|ENCODING",
    )


@dataclass
class TokenizerTrainOptions:
    """``gptspeed tokenizer train``'s options (:func:`gptspeed.bpe_train.train_tokenizer`'s keyword arguments)."""

    vocab_size: int = _f(16_384, "ids in the vocabulary: the 256 bytes, the merges and <|endoftext|>")
    pattern: str = _f("gpt4", "the split pattern, GPT-2's or GPT-4's", choices=("gpt2", "gpt4"))
    max_chars: int = _f(1_000_000_000, "read at most this many characters of the sources")
    text_field: str = _f("text", "JSON field / parquet column with the text")
    skip_bad: bool = _f(False, "skip and count bad records instead of stopping", kind="flag")
    force: bool = _f(False, "replace --out if it is a tokenizer folder", kind="flag")


@dataclass
class TokenizerCompareOptions:
    """``gptspeed tokenizer compare``'s options (:func:`gptspeed.bpe_train.compare_tokenizers`)."""

    text: list[str] = _f(MISSING, "UTF-8 text files to encode", kind="list", metavar="FILE")


@dataclass
class SampleOptions:
    """``gptspeed sample``'s options (:func:`gptspeed.sample.sample_text`'s keyword arguments)."""

    prompts: list[str] | None = _f(
        None,
        "text to continue; repeat for several prompts, generated together (default a newline)",
        flag="--prompt",
        kind="append",
        metavar="TEXT",
    )
    max_new_tokens: int = _f(200, "tokens to generate per sample")
    temperature: float = _f(0.8, "0 = greedy")
    top_k: int = _f(200, "sample from the k most likely tokens (0 = all)")
    num_samples: int = _f(1, "samples per prompt")
    seed: int = _f(1337, "sampling seed (the same seed draws the same tokens)", parse="seed")
    kv_cache: bool = _f(
        True, "recompute every position each step (the reference path)", flag="--no-kv-cache", kind="off"
    )
    compile: bool = _f(False, "torch.compile the one-token decode step", kind="flag")


@dataclass
class EvalOptions:
    """``gptspeed eval``'s options (:func:`gptspeed.eval.evaluate_run`'s arguments)."""

    data_dir: str | None = _f(None, "prepared data folder: val loss on its val split", flag="--data")
    hellaswag: bool = _f(False, "HellaSwag validation accuracy (acc, acc_norm)", kind="flag")
    hellaswag_file: str | None = _f(
        None, "a jsonl in HellaSwag's format instead of the official validation file (not hash-checked)"
    )
    max_examples: int = _f(0, "HellaSwag: the first N examples only (0 = all)")
    batch_size: int = _f(8, "sequences (val loss) or examples (HellaSwag) per batch")
    max_tokens: int = _f(0, "evaluate at most this many tokens (0 = all)")
    core: bool = _f(
        False,
        "the CORE score (DCLM's in-context tasks, centred against chance, as nanochat computes it): the official "
        "bundle, fetched once; --max-examples N: N per task, --batch-size: examples per forward pass",
        kind="flag",
    )
    core_tasks: str | None = _f(
        None, "CORE: only these tasks (labels of the bundle's core.yaml; implies --core)", metavar="NAME,NAME"
    )
    core_bundle: str | None = _f(
        None,
        "CORE: a local bundle folder (core.yaml, eval_meta_data.csv, eval_data/) instead of the official one "
        "(not hash-checked; implies --core)",
        metavar="DIR",
    )
    lm_eval: str | None = _f(
        None,
        "lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,arc_easy): the run exported to a temporary "
        "folder and scored by the harness's own API (pip install -e '.[eval]')",
        metavar="TASKS",
    )
    lm_eval_include: str | None = _f(
        None, "--lm-eval: a folder of your own task YAMLs, found beside the harness's", metavar="DIR"
    )
