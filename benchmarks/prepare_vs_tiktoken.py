"""How fast does `gptspeed prepare` tokenize, against a one-process tiktoken loop? ``python benchmarks/prepare_vs_tiktoken.py``

Over the same input (default ``../shared/data/shakespeare-gutenberg``, 77 e-texts; or a
``.jsonl`` file with a ``text`` field, one document per line), times (1) a plain one-process loop
of ``tiktoken`` ``encode_ordinary`` over the documents as read from disk (the reference),
(2) ``gptspeed prepare --workers 1`` and (3) ``--workers N`` (default 2), each the whole prepare:
reading, tokenizing, writing shards. Both exclude building the tokenizer (done once before).
tokens/s = corpus tokens / wall seconds. One warm-up round, then ``--repeats`` of the harness's
interleaved rounds (:func:`harness.time_rounds`); reports the best and the median time of each, and
the median over rounds of each round's ratio to the loop in the same round (the figure least moved
by slow spells of a shared host).
Prints a markdown table and the loop's per-core rate; ``--json`` keeps every timing.
``--paragraph-docs 1500`` first rewrites the e-texts as a .jsonl of ~1.5 KB documents (runs of
whole paragraphs), to measure web-page-sized documents like FineWeb's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from importlib.metadata import version
from pathlib import Path

import harness

from gptspeed.data.prepare import prepare
from gptspeed.tokenizer import get_encoding

ROOT = harness.ROOT


def paragraph_jsonl(folder: Path, min_chars: int, dest: Path) -> Path:
    """The .txt files of ``folder`` as JSON lines ``{"text": ...}``, each document a run of whole
    paragraphs (split at blank lines) of at least ``min_chars`` characters."""
    with dest.open("w", encoding="utf-8") as f:
        for path in sorted(folder.glob("*.txt")):
            doc = ""
            for para in path.read_text(encoding="utf-8").removeprefix("\ufeff").split("\n\n"):
                doc += para + "\n\n"
                if len(doc) >= min_chars:
                    f.write(json.dumps({"text": doc}) + "\n")
                    doc = ""
            if doc:
                f.write(json.dumps({"text": doc}) + "\n")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(ROOT.parent / "shared" / "data" / "shakespeare-gutenberg"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the timings, counts and environment here")
    ap.add_argument(
        "--paragraph-docs",
        type=int,
        metavar="CHARS",
        help="first rewrite the .txt files as one .jsonl whose documents are runs of whole "
        "paragraphs of at least CHARS characters (web-page-sized documents)",
    )
    a = ap.parse_args()
    keep = tempfile.TemporaryDirectory()
    if a.paragraph_docs:
        a.source = str(paragraph_jsonl(Path(a.source), a.paragraph_docs, Path(keep.name) / "paragraphs.jsonl"))
    src = Path(a.source)
    jsonl = src.is_file() and src.suffix == ".jsonl"
    files = [src] if jsonl else sorted(src.glob("*.txt"))
    enc = get_encoding()
    if jsonl:
        texts = [json.loads(line)["text"] for line in src.open(encoding="utf-8")]
    else:
        texts = [f.read_text(encoding="utf-8") for f in files]
    enc.encode_ordinary("warm up")

    def loop() -> int:
        n = 0
        if jsonl:  # one document per line, like prepare reads it
            with src.open(encoding="utf-8") as f:
                for line in f:
                    n += len(enc.encode_ordinary(json.loads(line)["text"]))
            return n
        for f in files:  # read + encode, like prepare does
            n += len(enc.encode_ordinary(f.read_text(encoding="utf-8").removeprefix("\ufeff")))
        return n

    runs = {"tiktoken encode_ordinary loop, 1 process": loop}
    tmp = tempfile.TemporaryDirectory()
    for w in (1, a.workers):

        def run(w=w) -> int:
            m = prepare(a.source, Path(tmp.name) / f"w{w}", workers=w, force=True, progress=False)
            return m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]

        runs[f"gptspeed prepare --workers {w}"] = run
    counts: dict[str, int] = {}

    def counted(name: str):
        def run() -> None:
            counts[name] = runs[name]()

        return run

    # one warm-up call each (page cache, tokenizer threads and their encodings), then interleaved rounds,
    # so that a slow spell of a shared machine hits every variant alike
    ms = harness.time_rounds({name: counted(name) for name in runs}, a.repeats, warmup=1)["wall"]
    times: dict[str, list[float]] = {k: [r[0] / 1000 for r in v] for k, v in ms.items()}
    tmp.cleanup()
    loop_name = next(iter(runs))
    t_loop, n_loop = min(times[loop_name]), counts[loop_name]
    rows = [(name, min(ts), statistics.median(ts), counts[name]) for name, ts in times.items()]
    print(
        f"{len(files)} files, {len(texts):,} documents, {sum(len(t) for t in texts):,} characters; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, python {platform.python_version()}"
    )
    print(f"best and median of {a.repeats} interleaved rounds")
    print(
        "| what | best s | median s | tokens/s (best) | vs loop (best) | vs loop (median) "
        "| vs loop (median of rounds) |\n|---|---|---|---|---|---|---|"
    )
    t_loop_med = statistics.median(times[loop_name])
    for name, t, med, n in rows:
        # each round's ratio to the loop in the same round: robust to slow spells of a shared host
        per_round = harness.ratios(ms[loop_name], ms[name])["median"]
        print(
            f"| {name} | {t:.3f} | {med:.3f} | {n / t:,.0f} | {t_loop / t * n / n_loop:.2f}x "
            f"| {t_loop_med / med * n / n_loop:.2f}x | {per_round * n / n_loop:.2f}x |"
        )
    print(f"loop per core: {n_loop / t_loop:,.0f} tokens/s")
    if a.json:
        env = {**harness.environment("cpu"), "tiktoken": version("tiktoken")}
        harness.write_outputs(
            None,
            {
                "source": a.source,
                "paragraph_docs": a.paragraph_docs,
                "files": len(files),
                "documents": len(texts),
                "characters": sum(len(t) for t in texts),
                "seconds": times,
                "tokens": counts,
                "environment": env,
            },
            None,
            a.json,
        )


if __name__ == "__main__":
    main()
