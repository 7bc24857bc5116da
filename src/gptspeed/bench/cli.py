"""``gptspeed bench ladder | verify | profile | race | tune``: five subcommands, each with only its own
flags, made of the fields of its configuration dataclass (:mod:`gptspeed.bench.settings`,
:func:`gptspeed.configure.add_dataclass_flags`), so argparse refuses a flag of another subcommand.

The spelling of the release before (``gptspeed bench --race ...``: one parser, a mode flag) is turned
into the new one by :func:`new_spelling`, with one line on stderr naming it; it goes in the next release.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable

#: the old spelling's mode flags (``bench --race``), each the subcommand it now is
OLD_MODE_FLAGS = {
    "--ladder": "ladder",
    "--verify": "verify",
    "--profile": "profile",
    "--race": "race",
    "--tune": "tune",
}


def _modes() -> dict[str, tuple[type, str, str]]:
    """subcommand -> (its configuration dataclass, its one-line help, its description)."""
    from gptspeed.bench.ladder import PEER_NAME, BenchConfig, ProfileConfig
    from gptspeed.bench.race import RaceConfig
    from gptspeed.bench.stages import STAGE_NAMES, VERIFY_EXTRA_NAMES
    from gptspeed.bench.tune import TuneConfig
    from gptspeed.bench.verify import VerifyConfig

    return {
        "ladder": (
            BenchConfig,
            "run every stage; write ladder.md/.json/.png to --out",
            "Runs each stage of the ladder (" + " -> ".join(STAGE_NAMES) + ", cumulative) in a fresh process "
            "and compares step time, throughput, memory and step-0 loss; adds transformers' GPT-2 as a peer row "
            f"({PEER_NAME}). --stages: default every stage.",
        ),
        "verify": (
            VerifyConfig,
            "check every rung against fp32: loss, host-device syncs, graph breaks, recompiles, the SDPA kernel",
            "Trains the seeds' rungs (fp32 .. fused AdamW; --stages all: also " + ", ".join(VERIFY_EXTRA_NAMES) + ") "
            "from the same weights on the same batches and checks each against the fp32 rung; writes "
            "verify.md/.json to --out after every rung; exits 1 naming each failing rung, 3 naming each rung "
            "that ran but was not verified (a rung refused by a rule before it starts is neither).",
        ),
        "profile": (
            ProfileConfig,
            "torch.profiler trace of one stage",
            f"A torch.profiler trace of one stage ({', '.join(STAGE_NAMES)}, {PEER_NAME}) after its warm-up, "
            "and the step's time by category, written to --out.",
        ),
        "race": (
            RaceConfig,
            "wall-clock training time to a target val loss, arm against arm",
            "Wall-clock training time to a target val loss, arm against arm (--arms, --arm), each --seeds times, "
            "interleaved; writes race.json/.md/.png to --out.",
        ),
        "tune": (
            TuneConfig,
            "the fastest configuration of your run that trains the same on this device",
            "Finds the fastest configuration of your run (--preset, --config, the shape flags, --flags) that trains "
            "the same on this device: one change at a time, each candidate in a fresh process, its losses checked "
            "against your configuration's; writes tune.md/.json after every row and tuned.yaml (for gptspeed "
            "train --config) at the end.",
        ),
    }


def add_bench_arguments(s: argparse.ArgumentParser) -> None:
    """``gptspeed bench``'s five subcommands on ``s``, each with its dataclass's flags; the one chosen
    is called by :func:`cmd_bench`."""
    from gptspeed.configure import add_dataclass_flags

    s.description = "The optimization ladder and its checks, measured on this machine: choose a subcommand."
    sub = s.add_subparsers(required=True, parser_class=type(s))
    for name, (cls, help_, description) in _modes().items():
        m = sub.add_parser(name, help=help_, description=description)
        add_dataclass_flags(m, cls)
        m.set_defaults(bench_run=RUNS[name], bench_config=cls)


def cmd_bench(a: argparse.Namespace) -> int:
    """Run the subcommand parsed into ``a`` (:func:`add_bench_arguments`): its configuration made of
    its flags, then its function; the exit status."""
    from gptspeed.configure import dataclass_values

    values = dataclass_values(a.bench_config, a)
    return a.bench_run(a.bench_config, values, "gptspeed " + shlex.join(sys.argv[1:]))


def _ladder(cls: type, values: dict, command: str) -> int:
    from gptspeed.bench.ladder import run_ladder

    result = run_ladder(cls(**values), command=command)
    if not result["ok"]:
        print(f"gptspeed bench: {len(result['problems'])} problem(s): {'; '.join(result['problems'])}", file=sys.stderr)
        return 1
    return 0


def _verify(cls: type, values: dict, command: str) -> int:
    from gptspeed.bench.verify import run_verify

    out = values["out"]
    result = run_verify(cls(**values), command=command)
    if result["failing"]:
        print(
            f"gptspeed bench: verify failed for {len(result['failing'])} rung(s): {', '.join(result['failing'])} "
            f"(see {out}/verify.md)",
            file=sys.stderr,
        )
        return 1
    if result["not_verified"]:
        print(
            f"gptspeed bench: not verified: {len(result['not_verified'])} rung(s) that could run here were not "
            f"checked: {', '.join(result['not_verified'])} (see {out}/verify.md)",
            file=sys.stderr,
        )
        return 3
    return 0


def _profile(cls: type, values: dict, command: str) -> int:
    from gptspeed.bench.ladder import profile_stage

    profile_stage(cls(**values))
    return 0


def _race(cls: type, values: dict, command: str) -> int:
    from gptspeed.bench.race import RaceStopped, run_race

    try:
        run_race(cls(**values), command=command)
    except RaceStopped as e:  # one line, and the signal's status, as gptspeed train exits
        print(f"gptspeed bench: {e}", file=sys.stderr)
        return 128 + e.signum
    print(f"race written to {values['out']}/race.md")
    return 0


def _tune(cls: type, values: dict, command: str) -> int:
    """``bench tune``: your run of ``--preset``, ``--config``, the shape flags and ``--flags`` (parsed as
    ``gptspeed train`` parses them), then :func:`gptspeed.bench.tune.run_tune`."""
    from gptspeed.bench.tune import TuneStopped, run_tune, your_run

    run, data, device = your_run(values)
    try:
        result = run_tune(cls(**{**values, "data": data, "device": device}, run=run), command=command)
    except TuneStopped as e:  # one line, and the signal's status, as gptspeed train exits
        print(f"gptspeed bench: {e}", file=sys.stderr)
        return 128 + e.signum
    print(f"tuned configuration: {result['best_flags']} -> {result['tuned_yaml']}\ntrain it: {result['train_command']}")
    return 0


RUNS: dict[str, Callable[[type, dict, str], int]] = {
    "ladder": _ladder,
    "verify": _verify,
    "profile": _profile,
    "race": _race,
    "tune": _tune,
}


def new_spelling(argv: list[str]) -> list[str]:
    """``argv`` (``gptspeed``'s arguments) with the old spelling of a bench mode turned into its
    subcommand -- ``bench --race ...`` -> ``bench race ...``, ``bench --profile STAGE ...`` -> ``bench profile
    STAGE ...`` -- and one line on stderr naming the new spelling; any other ``argv`` as it is. Two mode
    flags are a usage error (one line, exit 2), as they were."""
    if len(argv) < 2 or argv[0] != "bench" or argv[1] in RUNS or argv[1] in ("-h", "--help"):
        return argv
    rest, found = list(argv[1:]), []
    for i, token in enumerate(argv[1:]):
        flag, eq, value = token.partition("=")
        if flag in OLD_MODE_FLAGS and (eq == "" or flag == "--profile"):
            found.append((i, flag, value if eq else None))
    if not found:
        if argv[1].startswith("-"):  # flags and no subcommand (`bench --out X`): argparse would misname it
            sys.stderr.write(
                "gptspeed bench: error: choose a subcommand: ladder, verify, profile, race or tune (see --help)\n"
            )
            raise SystemExit(2)
        return argv
    if len(found) > 1:
        sys.stderr.write(f"gptspeed bench: error: {found[0][1]} and {found[1][1]}: give one mode (see --help)\n")
        raise SystemExit(2)
    i, flag, value = found[0]
    mode, taken = OLD_MODE_FLAGS[flag], 1
    if flag == "--profile" and value is None and i + 1 < len(rest):
        value, taken = rest[i + 1], 2
    del rest[i : i + taken]
    new = [mode, *([value] if value is not None else []), *rest]
    old_words = "bench --profile STAGE" if mode == "profile" else f"bench {flag}"
    new_words = "gptspeed bench profile STAGE" if mode == "profile" else f"gptspeed bench {mode}"
    print(f"note: `{old_words}` is now `{new_words}`; the old spelling goes in the next release", file=sys.stderr)
    return ["bench", *new]
