"""Command line: ``gptspeed prepare | train | sample | eval | bench | import-hf | export-hf | consolidate | plot``.

Each subcommand parses its flags and calls one typed function; the logic lives in the modules.
The flags of ``train`` are generated from the configuration dataclasses (gptspeed.config), so a
new setting is one field. A :class:`GptspeedError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from gptspeed.compat import check_torch
from gptspeed.config import parse_seed
from gptspeed.errors import GptspeedError


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` with an option's default appended where it says something: not for a default of
    None or "" (nothing set) or for a switch (``store_true`` / ``store_false``: off or on until given), and
    not when the help already names its default (``default`` in its text) -- argparse's
    ``ArgumentDefaultsHelpFormatter`` printed ``(default: None)``, ``--no-peers ... (default: True)``
    and defaults twice."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default in (None, "", argparse.SUPPRESS)
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            or "default" in text
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """One-line errors; ``--help`` shows each option's default where it says something (:class:`_DefaultsFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add(s: argparse.ArgumentParser, flags: dict[str, dict]) -> None:
    for flag, kw in flags.items():
        s.add_argument(flag, **kw)


def _values(a: argparse.Namespace, flags: dict[str, dict]) -> dict:
    """The parsed values of ``flags``, keyed by their ``dest``: the keyword arguments of the
    function the flags were written for."""
    return {kw["dest"]: getattr(a, kw["dest"]) for kw in flags.values()}


def _device_flags(dtype: bool = True) -> dict[str, dict]:
    from gptspeed.config import DEVICES, DTYPES

    flags = {"--device": dict(dest="device", default="auto", choices=DEVICES, help="auto: cuda > mps > cpu")}
    if dtype:
        flags["--dtype"] = dict(
            dest="dtype",
            default="auto",
            choices=DTYPES,
            help="autocast precision (auto: bf16 on GPUs that have it; tf32: fp32 with TF32 matmuls)",
        )
    return flags


# each table: flag -> argparse keywords, ``dest`` named as the keyword of the function it feeds
PREPARE_FLAGS = {  # gptspeed.data.prepare.prepare
    "--val-fraction": dict(dest="val_fraction", type=float, default=0.1, help="share of tokens for the val split"),
    "--shard-tokens": dict(dest="shard_tokens", type=int, default=100_000_000, help="tokens per shard file at most"),
    "--workers": dict(
        dest="workers",
        type=int,
        default=0,
        help="tokenizing threads (the shards do not depend on it); 0 = one per usable CPU (default)",
    ),
    "--text-field": dict(
        dest="text_field", default="text", help="JSON field / parquet column / dataset feature with the text"
    ),
    "--shuffle-seed": dict(
        dest="shuffle_seed",
        type=parse_seed,
        default=None,
        help="write the documents in a global random order fixed by this seed (val is then a "
        "random share of documents); default: keep the source order",
    ),
    "--skip-bad": dict(dest="skip_bad", action="store_true", help="skip and count bad records instead of stopping"),
    "--max-tokens": dict(dest="max_tokens", type=int, default=None, help="stop after this many tokens"),
    "--hf-name": dict(dest="hf_name", default=None, help="hf: sources: the dataset configuration (e.g. sample-10BT)"),
    "--split": dict(dest="split", default="train", help="hf: sources: the dataset split"),
    "--force": dict(dest="force", action="store_true", help="overwrite an already prepared folder"),
    "--max-shards": dict(
        dest="max_shards",
        type=int,
        default=None,
        help="fineweb10B: its first N train shards, ~100M tokens each (default all 103); the val shard always",
    ),
    "--print-hashes": dict(
        dest="print_hashes", action="store_true", help="print each input file's sha256 as `sha256  path` lines"
    ),
}
SAMPLE_FLAGS = {  # gptspeed.sample.sample_text
    "--prompt": dict(
        dest="prompts",
        action="append",
        default=None,
        metavar="TEXT",
        help="text to continue; repeat for several prompts, generated together (default a newline)",
    ),
    "--max-new-tokens": dict(dest="max_new_tokens", type=int, default=200, help="tokens to generate per sample"),
    "--temperature": dict(dest="temperature", type=float, default=0.8, help="0 = greedy"),
    "--top-k": dict(dest="top_k", type=int, default=200, help="sample from the k most likely tokens (0 = all)"),
    "--num-samples": dict(dest="num_samples", type=int, default=1, help="samples per prompt"),
    "--seed": dict(
        dest="seed", type=parse_seed, default=1337, help="sampling seed (the same seed draws the same tokens)"
    ),
    "--no-kv-cache": dict(
        dest="kv_cache",
        action="store_false",  # %(default).0s: prints nothing, and keeps
        # argparse from adding "(default: True)", the value of kv_cache, not of this flag
        help="recompute every position each step (the reference path)%(default).0s",
    ),
    "--compile": dict(dest="compile", action="store_true", help="torch.compile the one-token decode step"),
}
EVAL_FLAGS = {  # gptspeed.eval.evaluate_run
    "--data": dict(dest="data_dir", default=None, help="prepared data folder: val loss on its val split"),
    "--hellaswag": dict(dest="hellaswag", action="store_true", help="HellaSwag validation accuracy (acc, acc_norm)"),
    "--hellaswag-file": dict(
        dest="hellaswag_file",
        default=None,
        help="a jsonl in HellaSwag's format instead of the official validation file (not hash-checked)",
    ),
    "--max-examples": dict(
        dest="max_examples", type=int, default=0, help="HellaSwag: the first N examples only (0 = all)"
    ),
    "--batch-size": dict(
        dest="batch_size", type=int, default=8, help="sequences (val loss) or examples (HellaSwag) per batch"
    ),
    "--max-tokens": dict(dest="max_tokens", type=int, default=0, help="evaluate at most this many tokens (0 = all)"),
}


def _add_prepare_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "source",
        help="named corpus (tinyshakespeare, shakespeare-gutenberg; online: tinystories, "
        "fineweb-edu-10B; tokenized upstream: fineweb10B), a .txt / .jsonl[.gz|.zst] / .parquet file, a folder, "
        "a glob, or hf:DATASET",
    )
    s.add_argument("--out", required=True, help="output data folder")
    _add(s, PREPARE_FLAGS)
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_sample_args(s: argparse.ArgumentParser) -> None:
    _add_model_source(s)
    _add(s, {**SAMPLE_FLAGS, **_device_flags()})


def _add_eval_args(s: argparse.ArgumentParser) -> None:
    _add_model_source(s)
    _add(s, {**EVAL_FLAGS, **_device_flags()})


def _add_import_hf_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "source",
        help="folder with config.json + model.safetensors / pytorch_model.bin, "
        "or gpt2 | gpt2-medium | gpt2-large | gpt2-xl (downloaded)",
    )
    s.add_argument("--out", required=True, help="run folder to create")


def _add_export_hf_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--run", required=True, help="run folder")
    s.add_argument("--out", required=True, help="folder to write (config.json, model.safetensors, tokenizer files)")
    s.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the exported weights: float32 (as trained) or bfloat16 (half the bytes)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="replace --out if it is an earlier export (never a run or data folder, nor other files)",
    )


def _add_consolidate_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--run", required=True, help="run folder (its newest valid .dcp checkpoint) or a ckpt_*.dcp folder")
    s.add_argument("--out", required=True, help="FILE.pt, or a run folder to receive ckpt_<step>.pt")
    s.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out FILE.pt (never a run's checkpoint, "
        "a file inside the run consolidated, or another run's files)",
    )


def _add_plot_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl), overlaid; the legend names them")
    s.add_argument("--out", default="loss.png", help="PNG file to write")
    s.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out file (never a run's or a data "
        "folder's own file: metrics.jsonl, a checkpoint, manifest.json, ...)",
    )
    s.add_argument("--title", default=None, help="figure title (default: none)")
    s.add_argument(
        "--panels",
        default="loss",
        help="comma-separated panels: loss (against tokens and against wall "
        "time), tps (training tokens/s against tokens), lr (learning rate against tokens)",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``gptspeed`` parser. With ``command``, ``train`` and ``bench`` get their flags only if
    they are that command (the others always do): their flags come from modules that import torch,
    which ``gptspeed prepare`` or ``plot`` should not wait for."""
    from gptspeed import __version__

    p = _Parser(prog="gptspeed", description="Pretrain GPT-2 from scratch, fast, and measure every speed-up.")
    p.add_argument("--version", action="version", version=f"gptspeed {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_, add) in SUBCOMMANDS.items():
        s = sub.add_parser(name, help=help_)
        if name not in ("train", "bench") or command in (None, name):
            add(s)
    return p


def _add_train_args(s: argparse.ArgumentParser) -> None:
    from gptspeed.configure import add_train_arguments

    add_train_arguments(s)


def _add_bench_args(s: argparse.ArgumentParser) -> None:
    from gptspeed.bench.ladder import COMPILE_BACKENDS, PEER_NAME
    from gptspeed.bench.stages import STAGE_NAMES, VERIFY_EXTRA_NAMES
    from gptspeed.config import PRESETS

    s.description = (
        "Runs each stage of the ladder (" + " -> ".join(STAGE_NAMES) + ", cumulative) "
        "in a fresh process and compares step time, throughput, memory and step-0 loss; "
        "adds transformers' GPT-2 as a peer row. --verify checks every rung instead: loss "
        "against fp32, host-device syncs, graph breaks, recompiles, the SDPA kernel."
    )
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--ladder", action="store_true", help="run every stage; write ladder.md/.json/.png to --out")
    what.add_argument(
        "--profile", metavar="STAGE", help=f"torch.profiler trace of one stage ({', '.join(STAGE_NAMES)}, {PEER_NAME})"
    )
    what.add_argument(
        "--verify",
        action="store_true",
        help="train the seeds' rungs (fp32 .. fused AdamW; --stages all: also "
        + ", ".join(VERIFY_EXTRA_NAMES)
        + ") from the same weights on the same batches and check each against the fp32 rung; write "
        "verify.md/.json to --out after every rung; exit 1 naming each failing rung, 3 naming each "
        "rung that ran but was not verified (a rung refused by a rule before it starts is neither)",
    )
    what.add_argument(
        "--race",
        action="store_true",
        help="wall-clock training time to a target val loss, arm against arm (--arms, --arm), each "
        "--seeds times, interleaved; write race.json/.md/.png to --out",
    )
    what.add_argument(
        "--tune",
        action="store_true",
        help="find the fastest configuration of your run (--preset, --config, --flags) that trains the "
        "same on this device: one change at a time, each candidate in a fresh process, its losses "
        "checked against your configuration's; write tune.md/.json after every row and tuned.yaml "
        "(for gptspeed train --config) at the end",
    )
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--preset", choices=list(PRESETS), default=None, help="model shape and batch size (default gpt2)")
    _add_tune_args(s)
    _add_race_args(s)
    s.add_argument("--n-layer", type=int, help="transformer blocks L (default: the preset's)")
    s.add_argument("--n-head", type=int, help="attention heads H (default: the preset's)")
    s.add_argument("--n-embd", type=int, help="embedding width C (default: the preset's)")
    s.add_argument("--seq-len", type=int, help="sequence length T (default: the preset's)")
    s.add_argument("--batch-size", type=int, help="micro-batch size B (default: the preset's)")
    s.add_argument(
        "--steps", type=int, help="timed steps per stage (default 20; with --profile, traced steps, default 3)"
    )
    s.add_argument(
        "--warmup", type=int, default=5, help="untimed warm-up steps first, compilation included (default 5)"
    )
    _add(s, _device_flags(dtype=False))
    data = s.add_mutually_exclusive_group()
    data.add_argument("--data", help="prepared data folder (its train shards feed every stage)")
    data.add_argument(
        "--synthetic",
        action="store_true",
        help="random tokens instead of --data (with --verify: learnable random phrases)",
    )
    s.add_argument(
        "--stages",
        help="comma-separated stages to run, or all (default: every ladder stage; with "
        "--verify the seeds' rungs, all adding the rungs named above); the others are "
        "listed as skipped",
    )
    s.add_argument("--no-peers", dest="peers", action="store_false", help="leave out the transformers GPT-2 row")
    s.add_argument("--seed", type=parse_seed, default=1337, help="initialisation and synthetic-data seed")
    s.add_argument(
        "--compile-backend",
        default="inductor",
        choices=COMPILE_BACKENDS,
        help="torch.compile backend (default inductor; eager/aot_eager check tracing, not speed)",
    )
    s.add_argument("--peak-tflops", type=float, help="device peak TFLOPS for MFU (default: the built-in GPU table)")
    s.add_argument("--stage-timeout", type=float, help="seconds one stage may take (default: no limit)")
    s.add_argument(
        "--grad-accum",
        type=int,
        help="micro-batches per optimizer step (default 1; with --verify 2, so "
        "the accumulation path real training takes is checked)",
    )


def _add_race_args(s: argparse.ArgumentParser) -> None:
    race = s.add_argument_group("race (with --race)")
    race.add_argument(
        "--arms", help="comma-separated recipes, each an arm: gpt2, modern, speedrun (the first is the baseline)"
    )
    race.add_argument(
        "--arm",
        action="append",
        metavar='NAME="FLAGS"',
        help="an arm of any gptspeed train flags (repeatable), after --arms' ones",
    )
    race.add_argument("--seeds", type=int, default=3, help="runs per arm (default 3)")
    race.add_argument(
        "--sampling",
        choices=("sequential", "random"),
        default="sequential",
        help="every arm's order of the training windows (gptspeed train --sampling; default sequential); random "
        "gives each step windows from the whole corpus, as FineWeb's shuffled documents do",
    )
    race.add_argument(
        "--target-val-loss", type=float, help="the val loss to reach (default: the first arm's mean final val loss)"
    )
    race.add_argument("--eval-every", type=int, help="steps between evaluations (default: the first arm's steps / 15)")
    race.add_argument("--eval-tokens", type=int, help="val tokens per evaluation (default: the preset's)")
    race.add_argument("--run-timeout", type=float, help="seconds one run may take (default: no limit)")
    race.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier race in --out (its runs, logs and race.*; never a folder holding anything else)",
    )


def _add_tune_args(s: argparse.ArgumentParser) -> None:
    tune = s.add_argument_group("tune (with --tune)")
    tune.add_argument("--config", dest="config_file", help="your run's gptspeed train --config file (YAML or JSON)")
    tune.add_argument(
        "--flags",
        default="",
        metavar='"FLAGS"',
        help='your run\'s other gptspeed train flags, quoted: --flags "--dtype bfloat16 --loss fused" '
        "(one flag alone: --flags=--no-compile)",
    )
    tune.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="seconds the whole search may take; the candidates left are listed as not tried (default 300)",
    )


def _add_model_source(s: argparse.ArgumentParser) -> None:
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--run", help="run folder (its newest checkpoint is used)")
    g.add_argument("--init-from", help="Hugging Face GPT-2: a folder, or gpt2 | gpt2-medium | gpt2-large | gpt2-xl")


def cmd_prepare(a: argparse.Namespace) -> int:
    from gptspeed.data.prepare import prepare

    m = prepare(a.source, a.out, progress=not a.no_progress, **_values(a, PREPARE_FLAGS))
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(
        f"{'already prepared (same input and settings)' if m.get('reused') else 'prepared'} {a.out}: {m['documents']:,} documents; train {tr['tokens']:,} tokens in {len(tr['shards'])} shard(s), "
        f"val {va['tokens']:,} tokens in {len(va['shards'])} shard(s)"
        + (f"; {m['bad_records']:,} bad record(s) skipped" if m.get("bad_records") else "")
    )
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from gptspeed.config import config_to_yaml
    from gptspeed.configure import config_from_arguments

    cfg = config_from_arguments(a)
    if a.print_config:
        sys.stdout.write(config_to_yaml(cfg))
        return 0
    from gptspeed.api import train

    summary = train(cfg)
    return 128 + summary["interrupted"] if summary["interrupted"] else 0


def cmd_sample(a: argparse.Namespace) -> int:
    from gptspeed.sample import sample_text

    sample_text(run=a.run, init_from=a.init_from, device=a.device, dtype=a.dtype, **_values(a, SAMPLE_FLAGS))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from gptspeed.eval import evaluate_run

    result = evaluate_run(a.run, init_from=a.init_from, device=a.device, dtype=a.dtype, **_values(a, EVAL_FLAGS))
    print(json.dumps(result, indent=2, allow_nan=False))  # strict JSON: a non-finite figure is null (evaluate_run)
    if result.get("note"):
        print(f"gptspeed eval: note: {result['note']}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    import shlex

    from gptspeed.bench import BenchConfig, profile_stage, run_ladder, run_verify

    _refuse_flags_of_another_mode(a)
    if a.tune:
        return _tune(a)
    if a.config_file or a.flags:
        raise GptspeedError(
            "--config and --flags describe your run for --tune; the ladder, --verify, --profile and "
            "--race take their own flags"
        )
    steps = a.steps if a.steps is not None else (3 if a.profile else 20)
    a.preset = a.preset or "gpt2"
    cfg = BenchConfig(
        out=a.out,
        preset=a.preset,
        n_layer=a.n_layer,
        n_head=a.n_head,
        n_embd=a.n_embd,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        steps=steps,
        warmup=a.warmup,
        device=a.device,
        data=a.data,
        synthetic=a.synthetic,
        stages=a.stages,
        peers=a.peers,
        seed=a.seed,
        compile_backend=a.compile_backend,
        peak_tflops=a.peak_tflops,
        stage_timeout=a.stage_timeout,
        grad_accum=a.grad_accum,
    )
    command = "gptspeed " + shlex.join(sys.argv[1:])
    if a.race:
        from gptspeed.bench.race import RaceConfig, RaceStopped, parse_arms, run_race

        if a.seeds < 1:
            raise GptspeedError(f"--seeds must be at least 1, got {a.seeds}")
        try:
            run_race(
                RaceConfig(
                    arms=parse_arms(a.arms, a.arm),
                    seeds=a.seeds,
                    preset=a.preset,
                    data=a.data,
                    sampling=a.sampling,
                    device=a.device,
                    out=a.out,
                    target_val_loss=a.target_val_loss,
                    eval_every=a.eval_every,
                    eval_tokens=a.eval_tokens,
                    timeout_s=a.run_timeout,
                    force=a.force,
                ),
                command=command,
            )
        except RaceStopped as e:  # one line, and the signal's status, as gptspeed train exits
            print(f"gptspeed bench: {e}", file=sys.stderr)
            return 128 + e.signum
        print(f"race written to {a.out}/race.md")
        return 0
    if a.profile:
        if a.stages:
            raise GptspeedError("--stages selects ladder rows; with --profile name the one stage to trace")
        profile_stage(cfg, a.profile)
        return 0
    if a.verify:
        result = run_verify(cfg, command=command)
        if result["failing"]:
            print(
                f"gptspeed bench: verify failed for {len(result['failing'])} rung(s): {', '.join(result['failing'])} "
                f"(see {a.out}/verify.md)",
                file=sys.stderr,
            )
            return 1
        if result["not_verified"]:
            print(
                f"gptspeed bench: not verified: {len(result['not_verified'])} rung(s) that could run here were not "
                f"checked: {', '.join(result['not_verified'])} (see {a.out}/verify.md)",
                file=sys.stderr,
            )
            return 3
        return 0
    result = run_ladder(cfg, command=command)
    if not result["ok"]:
        print(f"gptspeed bench: {len(result['problems'])} problem(s): {'; '.join(result['problems'])}", file=sys.stderr)
        return 1
    return 0


#: bench flags by mode, each with its default: a flag given to a mode that does not read it is refused
#: (it used to be ignored: `--race --n-layer 4` raced the preset's shape)
_RACE_ONLY = {
    "arms": ("--arms", None),
    "arm": ("--arm", None),
    "seeds": ("--seeds", 3),
    "target_val_loss": ("--target-val-loss", None),
    "eval_every": ("--eval-every", None),
    "eval_tokens": ("--eval-tokens", None),
    "run_timeout": ("--run-timeout", None),
    "force": ("--force", False),
}
_NOT_FOR_RACE = {
    "n_layer": ("--n-layer", None),
    "n_head": ("--n-head", None),
    "n_embd": ("--n-embd", None),
    "seq_len": ("--seq-len", None),
    "batch_size": ("--batch-size", None),
    "steps": ("--steps", None),
    "warmup": ("--warmup", 5),
    "synthetic": ("--synthetic", False),
    "stages": ("--stages", None),
    "peers": ("--no-peers", True),
    "seed": ("--seed", 1337),
    "compile_backend": ("--compile-backend", "inductor"),
    "peak_tflops": ("--peak-tflops", None),
    "stage_timeout": ("--stage-timeout", None),
    "grad_accum": ("--grad-accum", None),
}


_NOT_FOR_TUNE = {
    "stages": ("--stages", None),
    "grad_accum": ("--grad-accum", None),
    "peers": ("--no-peers", True),
    "seed": ("--seed", 1337),
    "stage_timeout": ("--stage-timeout", None),
}


def _refuse_flags_of_another_mode(a: argparse.Namespace) -> None:
    """GptspeedError naming a bench flag given to a mode that would ignore it: the race's flags
    (``--arms``, ``--seeds``, ``--force``, ...) without ``--race``; the ladder's shape, steps and
    data flags with ``--race`` (its arms carry ``gptspeed train`` flags)."""
    table, why = (
        (
            _NOT_FOR_RACE,
            "not read by --race: its model and steps come from --preset and each arm's flags "
            '(--arm NAME="FLAGS"), its seeds from --seeds, its data from --data; drop it',
        )
        if a.race
        else (_RACE_ONLY, "only --race reads it; drop it")
    )
    given = [flag for dest, (flag, default) in table.items() if getattr(a, dest) != default]
    if given:
        raise GptspeedError(f"{', '.join(given)}: {why}")
    tune = [flag for dest, (flag, default) in _NOT_FOR_TUNE.items() if a.tune and getattr(a, dest) != default]
    if tune:
        raise GptspeedError(
            f"{', '.join(tune)}: not read by --tune: it chooses its own candidates, micro-steps and "
            "time limits (--budget-s); your run's --seed goes in --flags; drop it"
        )


def _tune(a: argparse.Namespace) -> int:
    """``bench --tune``: your run from ``--preset``, ``--config``, the bench's shape flags and ``--flags`` (parsed
    as ``gptspeed train`` parses them), then :func:`gptspeed.bench.tune.run_tune`."""
    import shlex

    from gptspeed.bench.tune import TuneConfig, run_tune
    from gptspeed.configure import config_from_flags

    shape = {
        "--n-layer": a.n_layer,
        "--n-head": a.n_head,
        "--n-embd": a.n_embd,
        "--seq-len": a.seq_len,
        "--batch-size": a.batch_size,
        "--preset": a.preset,
        "--config": a.config_file,
    }
    base = [x for flag, v in shape.items() if v is not None for x in (flag, str(v))]
    run = config_from_flags([*base, *shlex.split(a.flags)], "--tune", shown=shlex.split(a.flags))
    data = a.data if a.data is not None else (run.train.data or None)
    if a.synthetic or data is None:
        if not a.synthetic:
            raise GptspeedError(
                "--tune needs --data DIR (a folder from `gptspeed prepare`, or your run's) or --synthetic"
            )
        data = None
    result = run_tune(
        TuneConfig(
            out=a.out,
            run=run,
            device=a.device,
            data=data,
            budget_s=a.budget_s,
            steps=a.steps if a.steps is not None else 8,
            warmup=a.warmup,
            compile_backend=a.compile_backend,
            peak_tflops=a.peak_tflops,
        ),
        command="gptspeed " + shlex.join(sys.argv[1:]),
    )
    print(f"tuned configuration: {result['best_flags']} -> {result['tuned_yaml']}\ntrain it: {result['train_command']}")
    return 0


def cmd_import_hf(a: argparse.Namespace) -> int:
    from gptspeed.hf.load import import_hf

    path = import_hf(a.source, a.out)
    print(f"imported {a.source} into {path}")
    return 0


def cmd_export_hf(a: argparse.Namespace) -> int:
    from gptspeed.hf.export import export_hf

    print(f"exported {a.run} to {export_hf(a.run, a.out, force=a.force, dtype=a.dtype)}")
    return 0


def cmd_consolidate(a: argparse.Namespace) -> int:
    from gptspeed.checkpoint import consolidate

    print(f"consolidated {a.run} into {consolidate(a.run, a.out, force=a.force)}")
    return 0


def cmd_plot(a: argparse.Namespace) -> int:
    from gptspeed.plot import plot_runs

    print(f"wrote {plot_runs(a.runs, a.out, title=a.title, panels=a.panels, force=a.force)}")
    return 0


SUBCOMMANDS = {  # name -> (help, adds its flags)
    "prepare": ("tokenize a corpus into train/val shards", _add_prepare_args),
    "train": ("pretrain a GPT-2 on prepared data", _add_train_args),
    "sample": ("generate text from a trained run or a Hugging Face GPT-2", _add_sample_args),
    "eval": ("val loss / perplexity and HellaSwag accuracy, as JSON", _add_eval_args),
    "bench": ("the optimization ladder (or a profile of one stage) on this machine", _add_bench_args),
    "import-hf": ("turn a Hugging Face GPT-2 into a run folder (step-0 checkpoint)", _add_import_hf_args),
    "export-hf": (
        "write a run's newest checkpoint as a Hugging Face folder (GPT-2, or its own modeling code for a run with "
        "switches)",
        _add_export_hf_args,
    ),
    "consolidate": (
        "merge a sharded (FSDP) checkpoint into one file for sample / eval / one-process training",
        _add_consolidate_args,
    ),
    "plot": ("train/val loss against tokens and wall time (and tokens/s, learning rate), as a PNG", _add_plot_args),
}
COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "sample": cmd_sample,
    "eval": cmd_eval,
    "bench": cmd_bench,
    "import-hf": cmd_import_hf,
    "export-hf": cmd_export_hf,
    "consolidate": cmd_consolidate,
    "plot": cmd_plot,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if sys.platform == "win32":
        import gptspeed

        print(f"gptspeed: error: {gptspeed.WINDOWS_LINE}", file=sys.stderr)
        return 2
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        if args.command not in ("prepare", "plot"):  # these two need no torch
            check_torch()
        return COMMANDS[args.command](args)
    except GptspeedError as e:
        print(f"gptspeed {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gptspeed {args.command}: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The ``gptspeed`` command (its console script, ``python -m gptspeed``, ``torchrun -m gptspeed``):
    :func:`main`, then its exit status through :func:`gptspeed.distributed.finish_process` when the
    command joined a process group (imported only then: ``prepare`` and ``plot`` import no torch)."""
    code = main()
    distributed = sys.modules.get("gptspeed.distributed")
    if distributed is not None:
        distributed.finish_process(code)
    raise SystemExit(code)
