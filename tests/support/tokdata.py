"""A tokenizer of the tests' own (300 ids, trained on tiny Shakespeare), text prepared with it, and a run on it:
what the tests of a run that takes its tokenizer from its data share (tests/test_run_tokenizer.py,
tests/hf/test_export.py)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

TOK_VOCAB = 300  # 256 bytes + <|endoftext|> + 43 merges: padded to 320


def make_tokenizer_data(root: Path) -> Path:
    """Under ``root``: ``tok`` (the tokenizer), ``data`` (tiny Shakespeare's first 40,000 characters prepared
    with it) and ``gpt2`` (the same text prepared with GPT-2's BPE). Returns ``root``."""
    from gptspeed.bpe_train import train_tokenizer
    from gptspeed.data.corpora import EMBEDDED_DIR
    from gptspeed.data.prepare import prepare

    text = lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()[:40_000]
    src = root / "docs.jsonl"
    docs = [p for p in text.split("\n\n") if p.strip()]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    train_tokenizer([str(src)], root / "tok", vocab_size=TOK_VOCAB, progress=False)
    prepare(str(src), root / "data", shard_tokens=8192, progress=False, tokenizer=str(root / "tok"))
    prepare(str(src), root / "gpt2", shard_tokens=8192, progress=False)
    return root


def train_tokenizer_run(root: Path, **settings) -> Path:
    """Two steps of the tiny model (:data:`support.shapes.QUICK_RUN`) on ``root/data`` into ``root/run``."""
    import gptspeed

    from support.shapes import QUICK_RUN

    out = root / "run"
    cfg = gptspeed.make_config("pico", data=str(root / "data"), out=str(out), max_steps=2, **{**QUICK_RUN, **settings})
    gptspeed.train(cfg, echo=False)
    return out


TIKTOKEN_NAME = "tiny_tiktoken"
TIKTOKEN_EOT = 301  # after a gap at 300, as cl100k_base's <|endoftext|> is 100257 after its 100256 merge ranks


def tiny_tiktoken(eot: int = TIKTOKEN_EOT, name: str = TIKTOKEN_NAME):
    """A tiktoken encoding of the tests' own, loadable offline (tiktoken's named encodings are downloaded): GPT-2's
    first 300 merge ranks (every one a merge of two lower ones), GPT-4's split pattern, ``<|endoftext|>`` ``eot``
    (301; 69,999 makes a vocabulary beyond 65,536 ids) -- as a :class:`gptspeed.bpe.TiktokenTokenizer` ``name``."""
    import tiktoken

    from gptspeed.bpe import PATTERNS, TiktokenTokenizer, _tiktoken_sha256
    from gptspeed.tokenizer import get_encoding

    ranks = {t: r for t, r in get_encoding()._mergeable_ranks.items() if r < 300}
    enc = tiktoken.Encoding(
        name, pat_str=PATTERNS["gpt4"], mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eot}
    )
    return TiktokenTokenizer(name, enc, "tiktoken", _tiktoken_sha256(enc))


def offer_tiny_tiktoken(monkeypatch, eot: int = TIKTOKEN_EOT, name: str = TIKTOKEN_NAME):
    """Make :func:`tiny_tiktoken` (of ``eot``, named ``name``) resolvable by its name, as a named tiktoken encoding
    is (:func:`gptspeed.bpe.resolve_tokenizer`). Returns it."""
    import gptspeed.bpe
    import gptspeed.data.prepare_tokenizer

    tok, resolve = tiny_tiktoken(eot, name), gptspeed.bpe.resolve_tokenizer

    def resolved(spec):
        return tok if spec == name else resolve(spec)

    monkeypatch.setattr(gptspeed.bpe, "resolve_tokenizer", resolved)
    monkeypatch.setattr(gptspeed.data.prepare_tokenizer, "resolve_tokenizer", resolved)
    return tok
