"""How long does the README's first command train on this machine, and how much of the text it then
writes is made of real words?

Runs ``gptspeed train --preset nano --out RUN`` (the embedded tiny Shakespeare; extra flags after
``--``), times it (wall clock of the whole command, preparing the corpus included when the cache is
cold), then ``gptspeed sample --run RUN --prompt "ROMEO:"`` with its defaults (200 new tokens, seed
1337), and counts the sample's letters-only words (maximal runs of ``[A-Za-z]``, the prompt left out)
that occur as words of the corpus. One run, not rounds: the figure is the command's wall time as a
user sees it. Writes one JSON record (the command, the time, the share, the sample, and the
harness's environment record: the CPU, its flags, torch, the commit) to ``--json``.

    python benchmarks/quickstart_time_and_words.py --json benchmarks/runs/quickstart-$(date +%Y%m%d).json
    python benchmarks/quickstart_time_and_words.py --sample-only --run runs/nano   # re-score an existing run
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

WORD = re.compile(r"[A-Za-z]+")


def real_word_share(sample: str, corpus: str) -> tuple[float, list[str]]:
    """Share of the letters-only words of ``sample`` that are words of ``corpus`` (case-sensitive,
    as written), and the words that are not."""
    vocab = set(WORD.findall(corpus))
    words = WORD.findall(sample)
    missing = [w for w in words if w not in vocab]
    return (1 - len(missing) / len(words) if words else 0.0), missing


def run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return seconds, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="run folder (default: a fresh temporary one)")
    ap.add_argument("--sample-only", action="store_true", help="score the sample of an existing --run, do not train")
    ap.add_argument("--json", help="write the record here")
    ap.add_argument("extra", nargs="*", help="extra flags for gptspeed train (after --)")
    a = ap.parse_args()
    from gptspeed.data.corpora import corpus_files

    corpus = corpus_files("tinyshakespeare", progress=False)[0].read_text(encoding="utf-8")
    tmp = None
    if a.run is None:
        tmp = tempfile.mkdtemp(prefix="gptspeed-quickstart-")
        a.run = str(Path(tmp) / "nano")
    train_cmd = ["gptspeed", "train", "--preset", "nano", "--out", a.run, *a.extra]
    record: dict[str, object] = {"command": " ".join(train_cmd)}
    if not a.sample_only:
        seconds, log = run(train_cmd)
        lines = log.strip().splitlines()
        record.update(train_s=round(seconds, 1), log_head=lines[:8], log_tail=lines[-6:])
    sample_cmd = ["gptspeed", "sample", "--run", a.run, "--prompt", "ROMEO:"]
    _, text = run(sample_cmd)
    generated = text[len("ROMEO:") :] if text.startswith("ROMEO:") else text
    share, missing = real_word_share(generated, corpus)
    record.update(
        sample_command=" ".join(sample_cmd),
        sample=text,
        words=len(WORD.findall(generated)),
        real_word_share=round(share, 4),
        not_in_corpus=missing,
        environment=harness.environment("cpu"),
    )
    print(json.dumps(record, indent=2))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        harness.write_outputs(None, record, None, a.json)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
