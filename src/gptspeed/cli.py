"""Command line: ``gptspeed prepare | tokenizer | train | sample | eval | bench | import-hf | export-hf | consolidate | plot``.

Each subcommand parses its flags and calls one typed function; the logic lives in the modules.
The flags of ``train`` are generated from the configuration dataclasses (gptspeed.config), so a
new setting is one field. A :class:`GptspeedError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from gptspeed.compat import check_torch
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


def _add_options(s: argparse.ArgumentParser, *names: str) -> None:
    """The flags of the option dataclasses ``names`` of :mod:`gptspeed.options` on ``s``: each field's
    flag, with its declared default (the function's too) and help."""
    from gptspeed import options
    from gptspeed.configure import add_dataclass_flags

    for name in names:
        add_dataclass_flags(s, getattr(options, name))


def _options(a: argparse.Namespace, *names: str) -> dict:
    """The parsed values of :func:`_add_options`' flags, by field name: the function's keyword arguments."""
    from gptspeed import options
    from gptspeed.configure import dataclass_values

    return {k: v for name in names for k, v in dataclass_values(getattr(options, name), a).items()}


def _add_prepare_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "source",
        help="named corpus (tinyshakespeare, shakespeare-gutenberg; online: tinystories, "
        "fineweb-edu-10B; tokenized upstream: fineweb10B), a .txt / .jsonl[.gz|.zst] / .parquet file, a folder, "
        "a glob, or hf:DATASET",
    )
    s.add_argument("--out", required=True, help="output data folder")
    _add_options(s, "PrepareOptions")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_tokenizer_args(s: argparse.ArgumentParser) -> None:
    sub = s.add_subparsers(dest="tokenizer_command", required=True, parser_class=_Parser, metavar="{train,compare}")
    t = sub.add_parser("train", help="train a byte-level BPE (Hugging Face tokenizers) on the sources prepare reads")
    t.add_argument("sources", nargs="+", metavar="SOURCE", help="named corpus, file, folder or glob (as prepare's)")
    t.add_argument("--out", required=True, help="tokenizer folder to write (tokenizer.json and its manifest)")
    _add_options(t, "TokenizerTrainOptions")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("compare", help="bytes per token of each tokenizer and GPT-2's on each text file")
    c.add_argument("tokenizers", nargs="*", metavar="TOK_DIR", help="tokenizer folders or tiktoken encoding names")
    _add_options(c, "TokenizerCompareOptions")


def _add_sample_args(s: argparse.ArgumentParser) -> None:
    _add_model_source(s)
    _add_options(s, "SampleOptions", "DeviceOptions")


def _add_eval_args(s: argparse.ArgumentParser) -> None:
    _add_model_source(s)
    _add_options(s, "EvalOptions", "DeviceOptions")


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
    """The ``gptspeed`` parser. With ``command``, only that subcommand gets its flags: the flags of
    ``train``, ``bench``, ``sample`` and ``eval`` come from modules that import torch, which
    ``gptspeed prepare`` or ``plot`` should not wait for."""
    from gptspeed import __version__

    p = _Parser(prog="gptspeed", description="Pretrain GPT-2 from scratch, fast, and measure every speed-up.")
    p.add_argument("--version", action="version", version=f"gptspeed {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_, add) in SUBCOMMANDS.items():
        s = sub.add_parser(name, help=help_)
        if command in (None, name):
            add(s)
    return p


def _add_train_args(s: argparse.ArgumentParser) -> None:
    from gptspeed.configure import add_train_arguments

    add_train_arguments(s)


def _add_bench_args(s: argparse.ArgumentParser) -> None:
    from gptspeed.bench.cli import add_bench_arguments

    add_bench_arguments(s)


def _add_model_source(s: argparse.ArgumentParser) -> None:
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--run", help="run folder (its newest checkpoint is used)")
    g.add_argument("--init-from", help="Hugging Face GPT-2: a folder, or gpt2 | gpt2-medium | gpt2-large | gpt2-xl")


def cmd_prepare(a: argparse.Namespace) -> int:
    from gptspeed.data.prepare import prepare

    m = prepare(a.source, a.out, progress=not a.no_progress, **_options(a, "PrepareOptions"))
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(
        f"{'already prepared (same input and settings)' if m.get('reused') else 'prepared'} {a.out}: {m['documents']:,} documents; train {tr['tokens']:,} tokens in {len(tr['shards'])} shard(s), "
        f"val {va['tokens']:,} tokens in {len(va['shards'])} shard(s)"
        + (f"; {m['bad_records']:,} bad record(s) skipped" if m.get("bad_records") else "")
    )
    return 0


def cmd_tokenizer(a: argparse.Namespace) -> int:
    from gptspeed import bpe_train

    if a.tokenizer_command == "compare":
        rows = bpe_train.compare_tokenizers(a.tokenizers, **_options(a, "TokenizerCompareOptions"))
        print(bpe_train.format_comparison(rows))
        return 0
    m = bpe_train.train_tokenizer(a.sources, a.out, progress=not a.no_progress, **_options(a, "TokenizerTrainOptions"))
    print(
        f"trained {a.out}: {m['vocab_size']:,} ids ({m['pattern']['name']} pattern) from {m['chars']:,} "
        f"characters of {m['documents']:,} documents"
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

    sample_text(run=a.run, init_from=a.init_from, **_options(a, "SampleOptions", "DeviceOptions"))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from gptspeed.eval import evaluate_run

    result = evaluate_run(a.run, init_from=a.init_from, **_options(a, "EvalOptions", "DeviceOptions"))
    print(json.dumps(result, indent=2, allow_nan=False))  # strict JSON: a non-finite figure is null (evaluate_run)
    if result.get("note"):
        print(f"gptspeed eval: note: {result['note']}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from gptspeed.bench.cli import cmd_bench

    return cmd_bench(a)


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
    "tokenizer": (
        "train a tokenizer on your text (train), or compare tokenizers' bytes per token (compare)",
        _add_tokenizer_args,
    ),
    "train": ("pretrain a GPT-2 on prepared data", _add_train_args),
    "sample": ("generate text from a trained run or a Hugging Face GPT-2", _add_sample_args),
    "eval": ("val loss / perplexity and HellaSwag accuracy, as JSON", _add_eval_args),
    "bench": ("the optimization ladder, its checks (verify, profile), race and tune, on this machine", _add_bench_args),
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
    "tokenizer": cmd_tokenizer,
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
    if argv[:1] == ["bench"]:
        from gptspeed.bench.cli import new_spelling

        argv = new_spelling(argv)  # `bench --race` -> `bench race`, for one more release
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        if args.command not in ("prepare", "plot", "tokenizer"):  # these need no torch
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
