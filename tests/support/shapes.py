"""The shapes of the tests' models and runs, each defined once and named for what it is for; each derives from
:data:`support.training.TINY_MODEL`, the one tiny model (1 block, 2 heads, 32 wide, 32 tokens), and says what it
changes. Model shapes are :class:`gptspeed.model.GPTConfig` fields; run settings are ``gptspeed.make_config`` /
``build_train_config`` names; flags are ``gptspeed train`` / ``bench`` arguments."""

from __future__ import annotations

from support.training import TINY_MODEL, flags

# ------------------------------------------------------------------------------------------------ models
#: The tiny model with the plain (unfused) cross-entropy: the loss a test computes again by hand.
PLAIN_LOSS_MODEL = dict(TINY_MODEL, loss="plain")

#: Two blocks and GPT-2's padded vocabulary (50304 rows, 50257 real): what padding and Muon's matrices see
#: (tests/support/padded_model.py's model).
PADDED_VOCAB_MODEL = dict(TINY_MODEL, n_layer=2, vocab_size=50304)

#: The ladder rungs' model on the CPU (tests/support/host_reads.py): two blocks of 16 tokens, the step whose host
#: reads are counted.
HOST_READS_MODEL = dict(TINY_MODEL, n_layer=2, block_size=16)

#: Two blocks 64 wide: the residual stream's dtype and bf16's losses against fp32's (tests/test_model.py).
RESIDUAL_DTYPE_MODEL = dict(TINY_MODEL, n_layer=2, n_embd=64)

#: An FP8 LM head's model: two blocks 64 wide in 4 heads, the padded vocabulary (FP8 matmuls need each dimension a
#: multiple of 16).
FP8_MODEL = dict(TINY_MODEL, n_layer=2, n_head=4, n_embd=64, vocab_size=50304)

#: :data:`FP8_MODEL` with the plain loss: the head's logits through the FP8 matmul.
FP8_HEAD_MODEL = dict(FP8_MODEL, loss="plain")

# ----------------------------------------------------------------------------------------------- runs
#: A quick one-block run: 4 x 32 tokens a step, 2 warm-up steps, no periodic evaluation (512 val tokens at the end).
QUICK_RUN = dict(TINY_MODEL, batch_size=4, warmup_steps=2, eval_tokens=512, eval_every=0, log_every=1, device="cpu")

#: ``gptspeed train`` flags of the tiny model's run: ``--preset pico``, 4 x 32 tokens a step, float32 and eager on
#: every host, no periodic evaluation (128 val tokens at the end).
FP32_EAGER_FLAGS = [
    "--preset",
    "pico",
    *flags(dict(TINY_MODEL, batch_size=4)),
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-tokens",
    "128",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--no-compile",
]

#: The 2-rank runs' settings (tests/support/torchrun.py, tests/support/dist_scenarios.py): two blocks, a global
#: batch of 4 x 32 x 2 = 256 tokens: 2 ranks x 1 micro-step, or 1 rank x 2 micro-steps.
DIST_RUN = dict(QUICK_RUN, n_layer=2, total_batch_tokens=256, lr=3e-3, dtype="float32")

#: The ``dist_runs`` fixture's runs: :data:`DIST_RUN` for 4 steps, a checkpoint every 2.
DIST_RUNS_FIXTURE = dict(DIST_RUN, max_steps=4, save_every=2, keep_checkpoints=5)

#: The real-text runs' model and micro-batch: two blocks, 8 x 64 tokens.
TEXT_MODEL = dict(TINY_MODEL, n_layer=2, block_size=64, batch_size=8)

#: A tiny run on real text that learns (a val loss falls): :data:`TEXT_MODEL`, lr 3e-3 after 2 warm-up steps,
#: 1024 val tokens, the preset's evaluation interval.
TEXT_RUN = dict(TEXT_MODEL, warmup_steps=2, lr=3e-3, eval_tokens=1024, log_every=1, device="cpu")

#: ``gptspeed train`` flags of a run on real text: ``--preset pico`` at :data:`TEXT_MODEL`, no periodic evaluation,
#: eager (a 500-step run on a CPU with native bf16 would otherwise compile with inductor before its first step:
#: minutes on a busy machine, in tests of signals and locks that compiling proves nothing about).
TEXT_RUN_FLAGS = [
    "--preset",
    "pico",
    *flags(dict(TEXT_MODEL, log_every=1, eval_every=0, eval_tokens=1024, device="cpu")),
    "--no-compile",
]

#: A run streaming a jsonl file (``--data jsonl:FILE``: no val split, so no evaluation): one block 16 wide,
#: 4 x 32 tokens a step; each test adds its data, steps and checkpoints.
STREAM_SETTINGS = dict(
    TINY_MODEL, n_embd=16, batch_size=4, warmup_steps=1, lr=3e-3, log_every=1, device="cpu", eval_every=0
)

# ----------------------------------------------------------------------------------------------- bench
#: The bench's ladder and verify flags (``gptspeed bench ladder|verify|profile``): the tiny model, 2 x 32 tokens,
#: 2 steps after 1 warm-up, synthetic data, compiled rows with the "eager" backend.
LADDER_FLAGS = [
    *flags(dict(TINY_MODEL, batch_size=2)),
    "--steps",
    "2",
    "--warmup",
    "1",
    "--synthetic",
    "--device",
    "cpu",
    "--compile-backend",
    "eager",
]

#: The tiny model as bench flags on synthetic data: what every bench subcommand but ``race`` accepts.
BENCH_MODEL_FLAGS = [*flags(TINY_MODEL), "--synthetic"]

#: The smallest ladder row on the CPU (:class:`gptspeed.bench.worker.StageSpec` fields): one step of 1 x 8 tokens of a
#: 1-block model 16 wide; each test adds its name and settings (and what it changes).
SMALLEST_ROW = dict(n_layer=1, n_head=2, n_embd=16, seq_len=8, batch_size=1, steps=1, warmup=1, device="cpu")
