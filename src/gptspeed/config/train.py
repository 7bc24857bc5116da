"""The ``train`` group of settings: :class:`TrainConfig`, what to train on, how long, in which batches,
and how to log and save; the conditions on ``--data`` and ``--log-to`` its settings act with."""

from __future__ import annotations

from dataclasses import dataclass

from gptspeed.config.checks import parse_log_to
from gptspeed.config.declare import MAX_LOADER_WORKERS, Where, _f

# --data's kinds (data.sources.STREAM_PREFIXES: jsonl:PATH / hf:NAME stream; anything else is a prepared folder;
# config imports no data module, a test checks the prefixes agree)
STREAM_PREFIXES = ("jsonl:", "hf:")
PREPARED = Where(
    "a prepared folder, not a jsonl:/hf: stream (read in order, without a val split)",
    lambda d: not d.startswith(STREAM_PREFIXES),
    "prepare it (gptspeed prepare) and give that folder",
)
STREAM = Where("a jsonl:/hf: stream", lambda d: d.startswith(STREAM_PREFIXES))
HF_STREAM = Where("an hf: stream", lambda d: d.startswith("hf:"))
TOKENIZED_STREAM = Where(
    "a jsonl:/hf: stream",
    lambda d: d.startswith(STREAM_PREFIXES),
    "a prepared folder keeps the tokenizer it was prepared with (gptspeed prepare --tokenizer)",
)
WANDB = Where("naming wandb", lambda v: "wandb" in parse_log_to(v), "add wandb to --log-to")


@dataclass
class TrainConfig:
    """What to train on, how long, in which batches, and how to log and save."""

    data: str = _f(
        "",
        "prepared data folder (from `gptspeed prepare`), or jsonl:PATH / hf:NAME to train straight "
        "from a document stream (tokenized while training; no val split), or a weighted mixture of "
        "prepared folders of one tokenizer, DIR=WEIGHT,DIR=WEIGHT or a mixture file (mix.yaml: "
        "docs/data.md), with a val loss per folder; default: tiny Shakespeare, "
        "shipped with gptspeed and prepared into the cache on first use",
        path=True,
    )
    text_field: str = _f(
        "text",
        "jsonl:/hf: streams: the JSON field / column / dataset feature holding the text",
        only_with={"data": STREAM},
        run_defining=True,
    )
    hf_name: str | None = _f(
        None,
        "hf: streams: the dataset configuration (e.g. sample-10BT)",
        only_with={"data": HF_STREAM},
        run_defining=True,
    )
    split: str = _f("train", "hf: streams: the dataset split", only_with={"data": HF_STREAM}, run_defining=True)
    data_tokenizer: str = _f(
        "gpt2",
        "jsonl:/hf: streams: the tokenizer the documents are encoded with, each after its <|endoftext|>: gpt2 "
        "(GPT-2's BPE), a tiktoken encoding (cl100k_base, o200k_base, ...) or a folder written by `gptspeed "
        "tokenizer train`; the model takes its vocabulary and <|endoftext|>, the run folder keeps its "
        "tokenizer.json, a --resume must stream with the same one",
        flag="--tokenizer",
        metavar="TOK_DIR|gpt2|ENCODING",
        only_with={"data": TOKENIZED_STREAM},
    )
    out: str = _f("", "run folder: checkpoints, metrics.jsonl, config.json", path=True)
    batch_size: int = _f(
        16,
        "micro-batch size B (sequences per forward/backward), or auto: the largest power of two "
        "that fits in GPU memory with a 10% margin and divides the global batch (CUDA only; probed once per GPU "
        "model and configuration, cached in $GPTSPEED_CACHE/batch_size.json)",
        parse="batch_size",
        min=1,
        run_defining=True,
    )
    total_batch_tokens: int | None = _f(
        None,
        "tokens per optimizer step; gradient accumulation = this / (B * T * world size) (default B*T)",
        min=1,
        text="positive",
        run_defining=True,
    )
    batch_warmup_steps: int = _f(
        0,
        "batch-size warm-up: the tokens per optimizer step rise linearly from --batch-start-tokens to "
        "--total-batch-tokens over the first N steps, in whole micro-batches (GPT-3, Brown et al. 2020, "
        "appendix B; the modded-nanogpt speedrun's batch-size schedule); 0 = off",
        min=0,
        off=0,
        below=("max_steps", "the run would end inside the warm-up, never training at --total-batch-tokens"),
        starts="batch_start_tokens",
        run_defining=True,
    )
    batch_start_tokens: int | None = _f(
        None,
        "--batch-warmup-steps: the tokens of step 0 (rounded down to whole micro-batches, at least one; taken as "
        "--total-batch-tokens where larger; default: one micro-batch per process)",
        min=1,
        text="positive",
        needs="batch_warmup_steps",
        below=("total_batch_tokens", "the batch warm-up would change nothing"),
        run_defining=True,
    )
    seq_len_warmup_steps: int = _f(
        0,
        "sequence-length warm-up: each micro-batch's B x T tokens are trained as shorter sequences, their "
        "length rising linearly from --seq-len-start to --seq-len over the first N steps, in halvings of "
        "--seq-len (each length compiles once) (Li, Zhang & He 2022, sequence length warm-up); 0 = off",
        min=0,
        off=0,
        below=("max_steps", "the run would end inside the warm-up, never training at --seq-len"),
        starts="seq_len_start",
        run_defining=True,
    )
    seq_len_start: int = _f(
        64,
        "--seq-len-warmup-steps: the sequence length of step 0 (taken as --seq-len where larger; rounded up "
        "to a halving of --seq-len)",
        min=1,
        needs="seq_len_warmup_steps",
        below=("block_size", "the sequence-length warm-up would change nothing"),
        run_defining=True,
    )
    max_steps: int = _f(19073, "optimizer steps to train for", min=1)
    log_every: int = _f(10, "log a record every N steps", min=1)
    eval_every: int = _f(
        250, "evaluate val loss every N steps (0 = only at start and end)", min=0, off=0, only_with={"data": PREPARED}
    )
    eval_tokens: int = _f(
        1 << 20, "val tokens per evaluation (0 = the whole val split)", min=0, only_with={"data": PREPARED}
    )
    save_every: int = _f(1000, "write a checkpoint every N steps (0 = only at the end and on interrupt)", min=0)
    keep_checkpoints: int = _f(2, "keep the newest K checkpoints", min=1)
    resume: bool = _f(False, "continue from the newest valid checkpoint in --out", kind="flag")
    force_resume: bool = _f(
        False,
        "resume even if the configuration or data changed (the run is then no longer exact)",
        kind="flag",
        needs="resume",
    )
    on_nan: str = _f(
        "stop",
        "a step with a non-finite loss or gradient never updates the weights; then "
        "stop (keep the last good checkpoint) or skip (count it and go on; a run that skips half its steps "
        "stops)",
        choices=("stop", "skip"),
    )
    init_from: str = _f(
        "",
        "start from a Hugging Face GPT-2's weights (a folder, or gpt2 | gpt2-medium | gpt2-large "
        "| gpt2-xl, downloaded): its shape replaces the preset's; training starts at step 0",
        path=True,
    )
    hellaswag_every: int = _f(0, "HellaSwag accuracy every N steps and at the end (0 = never)", min=0)
    hellaswag_examples: int = _f(
        0,
        "HellaSwag validation examples per evaluation during training (0 = all 10,042)",
        min=0,
        needs="hellaswag_every",
    )
    eval_bpb: bool = _f(
        False,
        "each evaluation also gives the val bits per byte (val_bpb in metrics.jsonl: nats over ln 2 times the "
        "UTF-8 bytes of the same val tokens, as nanochat reports it; from the val loss's own forwards)",
        kind="bool",
    )
    stop_at_val_loss: float | None = _f(
        None,
        "end the run at the first evaluation (every --eval-every steps) whose "
        "val loss is at or below this (nats/token): time to a target, as the "
        "modded-nanogpt speedrun measures it; a --resume of a run that reached it trains no further",
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number",
        needs="eval_every",
        only_with={"data": PREPARED},
    )
    ema_tail_ratio: float = _f(
        0.0,
        "tail weight averaging: over the last share of --max-steps keep an exponential moving average of the "
        "weights (fp32, on the device) and evaluate, save for eval / sample / export-hf the blend "
        "(1 - --ema-blend) x weights + --ema-blend x average; the raw weights still train and resume "
        "(modded-nanogpt's tail EMA readout, track 3 record #45); 0 = off",
        min=0,
        max=1,
        off=0,
        text="in [0, 1]",
        run_defining=True,
    )
    ema_horizon: float | None = _f(
        None,
        "--ema-tail-ratio: the average's time constant in steps (each step moves it 1/N of the way to the "
        "weights; default: a fifth of the tail, so the weights it starts from weigh under 1% at the end)",
        min=1,
        min_open=True,
        finite=True,
        text="a finite number above 1",
        needs="ema_tail_ratio",
        run_defining=True,
    )
    ema_blend: float = _f(
        0.6,
        "--ema-tail-ratio: the average's share of the weights evaluated and exported (1 = the average alone; "
        "modded-nanogpt: 0.6)",
        min=0,
        min_open=True,
        max=1,
        text="in (0, 1]",
        needs="ema_tail_ratio",
        run_defining=True,
    )
    sampling: str = _f(
        "sequential",
        "order of the training windows: sequential (shard order) or random "
        "(a permutation per epoch, seeded by --seed; resumable)",
        choices=("sequential", "random"),
        off="sequential",
        only_with={"data": PREPARED},
        run_defining=True,
    )
    align_to_docs: bool = _f(
        False,
        "batches aligned to document starts: each row of --seq-len tokens starts at an <|endoftext|> (the "
        "rest of a document begun inside the previous row is skipped when shorter than a row; a longer "
        "one goes on in whole rows), as the modded-nanogpt speedrun aligns its batches to BOS; a prepared "
        "folder only",
        kind="bool",
        run_defining=True,
    )
    loader_workers: int = _f(
        -1,
        "background threads preparing batches ahead into pinned memory (0 = in the "
        "training loop; -1 = auto: 1 on CUDA, 0 elsewhere; at most 64); the batches do not depend on it",
        min=-1,
        text="-1 (auto), 0 or more",
        max=MAX_LOADER_WORKERS,
        max_note="each keeps 4 batches ready; one keeps up with a GPU",
    )
    log_to: str = _f(
        "jsonl",
        "where metrics records go, comma-separated: jsonl (RUN_DIR/metrics.jsonl, always on), "
        "tensorboard (RUN_DIR/tensorboard; pip install 'gptspeed[tensorboard]'), wandb (Weights & Biases; "
        "pip install 'gptspeed[wandb]'; WANDB_MODE=offline needs no account)",
    )
    wandb_project: str = _f("gptspeed", "W&B project (with --log-to wandb)", only_with={"log_to": WANDB})
    wandb_run_name: str = _f(
        "",
        "W&B run name (default: the run folder's name); the W&B run id is kept in "
        "RUN_DIR/wandb_run_id, so --resume continues the same W&B run",
        only_with={"log_to": WANDB},
    )
