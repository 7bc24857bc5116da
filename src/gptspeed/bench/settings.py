"""The flags ``gptspeed bench``'s subcommands share, declared once as dataclass fields (with
:func:`gptspeed.config._f`, as ``train``'s settings are), and inherited by each subcommand's
configuration: :class:`~gptspeed.bench.ladder.BenchConfig` (``ladder``),
:class:`~gptspeed.bench.verify.VerifyConfig`, :class:`~gptspeed.bench.ladder.ProfileConfig`,
:class:`~gptspeed.bench.race.RaceConfig` and :class:`~gptspeed.bench.tune.TuneConfig`.
:mod:`gptspeed.bench.cli` turns each field into its subcommand's flag
(:func:`gptspeed.configure.add_dataclass_flags`), so a subcommand has exactly its own flags.

- :class:`BenchBase`: every subcommand's (``--out``, ``--preset``, ``--device``, ``--data``);
- :class:`Workload`: the measured step's shape and compile settings (ladder, verify, profile, tune);
- :class:`Rows`: one process per row (ladder, verify, profile); :class:`Staged`: rows chosen by ``--stages``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from gptspeed.config import PRESETS, _f
from gptspeed.options import DeviceOption

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(kw_only=True)
class BenchBase(DeviceOption):
    """The flags every ``gptspeed bench`` subcommand takes (``--device``: :class:`gptspeed.options.DeviceOption`).
    ``preset`` None: :attr:`PRESET_WHEN_UNSET`."""

    #: the preset a configuration gets when ``--preset`` is not given (``tune``: None, your config file's)
    PRESET_WHEN_UNSET: ClassVar[str | None] = "gpt2"

    out: str = _f(dataclasses.MISSING, "output folder")
    preset: str | None = _f(None, "model shape and batch size (default gpt2)", choices=tuple(PRESETS))
    data: str | None = _f(
        None, "prepared data folder (gptspeed prepare's): its train shards feed every row or run", exclusive="data"
    )

    def __post_init__(self) -> None:
        if self.preset is None:
            self.preset = self.PRESET_WHEN_UNSET


@dataclass(kw_only=True)
class Workload(BenchBase):
    """The measured step's flags: the shape (None: the preset's), the warm-up, synthetic data, the compile
    backend and the peak for MFU."""

    n_layer: int | None = _f(None, "transformer blocks L (default: the preset's)")
    n_head: int | None = _f(None, "attention heads H (default: the preset's)")
    n_embd: int | None = _f(None, "embedding width C (default: the preset's)")
    seq_len: int | None = _f(None, "sequence length T (default: the preset's)")
    batch_size: int | None = _f(None, "micro-batch size B (default: the preset's)")
    warmup: int = _f(5, "untimed warm-up steps first, compilation included")
    synthetic: bool = _f(
        False,
        "random tokens instead of --data (verify and tune: learnable random phrases)",
        kind="flag",
        exclusive="data",
    )
    compile_backend: str = _f(
        "inductor",
        "torch.compile backend (eager / aot_eager check tracing, not speed)",
        choices=COMPILE_BACKENDS,
    )
    peak_tflops: float | None = _f(None, "device peak TFLOPS for MFU (default: the built-in GPU table)")


@dataclass(kw_only=True)
class Rows(Workload):
    """The flags of the subcommands that run each row in a fresh process: ladder, verify, profile."""

    seed: int = _f(1337, "initialisation and synthetic-data seed", parse="seed")
    stage_timeout: float | None = _f(None, "seconds one row may take (default: no limit)")
    grad_accum: int | None = _f(
        None,
        "micro-batches per optimizer step (default 1; with verify 2, so the accumulation path real training "
        "takes is checked)",
    )


@dataclass(kw_only=True)
class Staged(Rows):
    """The flags of the subcommands that run a chosen set of rows: ladder and verify."""

    steps: int = _f(20, "timed steps per row")
    stages: str | None = _f(
        None,
        "comma-separated stages to run, or all (default: the subcommand's own set, named in its description); "
        "the others are listed as skipped",
    )
