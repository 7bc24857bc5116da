"""``gptspeed bench race``'s ``--out``: what a race writes there (:data:`RACE_NAMES`), refused when it holds
anything else (:func:`race_entries`), locked for the whole race and emptied of an earlier race only with
``--force`` (:func:`open_race_folder`). See :mod:`gptspeed.bench.race`."""

from __future__ import annotations

import re
from pathlib import Path

from gptspeed.errors import GptspeedError

#: what a race writes into its ``--out`` (and the run lock it holds there)
RACE_NAMES = ("race.json", "race.md", "race.png", "runs", "logs")
_RACE_TEMP = re.compile(r"^\.race\.(json|md)\.[0-9a-f]{8}\.tmp$|^\.race\.png\.tmp\.png$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}-seed\d+$")


def race_entries(out: Path) -> list[str]:
    """The race's own entries in ``out`` (:data:`RACE_NAMES`), sorted; [] for a new or empty folder.
    GptspeedError (one line, naming them) when ``out`` holds anything a race does not write: a
    race's ``runs/`` holds only run folders named ``ARM-seedN`` that hold only gptspeed's files
    (:func:`gptspeed.checkpoint.foreign_entries`), its ``logs/`` only ``ARM-seedN.log`` files, its
    ``race.json`` is a race record."""
    if not out.is_dir():
        return []
    try:
        return _race_entries(out)
    except OSError as e:
        raise GptspeedError(f"cannot read --out {out}: {e.strerror or e}") from None


def _race_entries(out: Path) -> list[str]:
    import os

    from gptspeed.checkpoint import LOCK_NAME, foreign_entries
    from gptspeed.fileio import read_user_json

    fix = "a race writes only into a new or empty folder, or an earlier race's; choose another --out"
    names = [n for n in sorted(os.listdir(out)) if n != LOCK_NAME and not _RACE_TEMP.match(n)]
    foreign = [n for n in names if n not in RACE_NAMES]
    for sub, ok in (
        ("runs", lambda p: _RUN_NAME.match(p.name) and p.is_dir() and not p.is_symlink() and not foreign_entries(p)),
        (
            "logs",
            lambda p: p.name.endswith(".log") and _RUN_NAME.match(p.name[:-4]) and p.is_file() and not p.is_symlink(),
        ),
    ):
        folder = out / sub
        if sub in names:
            if folder.is_symlink() or not folder.is_dir():
                foreign.append(sub)
            else:
                foreign += [f"{sub}/{p.name}" for p in sorted(folder.iterdir()) if not ok(p)]
    record = out / "race.json"
    if "race.json" in names and "race.json" not in foreign:
        try:
            doc = read_user_json(record, "race record", max_bytes=1 << 26)
        except GptspeedError:
            doc = {}
        if not {"steps_cap", "arms", "command"} <= set(doc):
            foreign.append("race.json")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise GptspeedError(f"--out {out} holds what a race did not write ({shown}): {fix}")
    return names


def _refuse_earlier_race(out: Path, names: list[str], force: bool) -> None:
    if names and not force:
        runs = len(list((out / "runs").iterdir())) if "runs" in names else 0
        raise GptspeedError(
            f"--out {out} holds an earlier race ({runs} run folder(s), {', '.join(names)}): pass "
            "--force to replace it, or choose another --out"
        )


def open_race_folder(out: Path, force: bool):
    """Create ``out`` and lock it for one race (:func:`gptspeed.checkpoint.run_lock`, the run
    folder's lock: released by the kernel when the process dies), then make it empty of an earlier
    race: refused without ``force`` (one line), removed with it -- each earlier run's folder only
    after taking its own run lock, so never under a live ``gptspeed train``. Returns the lock
    (``release()`` it). GptspeedError for another race holding ``out``, or anything in it that a
    race did not write (:func:`race_entries`)."""
    import shutil

    from gptspeed.checkpoint import LOCK_NAME, run_lock

    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = run_lock(out).acquire()
    except GptspeedError:
        try:
            holder = (out / LOCK_NAME).read_text(errors="replace")[:200].strip() or "another process"
        except OSError:
            holder = "another process"
        raise GptspeedError(
            f"--out {out} is in use by {holder} (another `gptspeed bench race`): wait for it to "
            "end or stop it, or choose another --out"
        ) from None
    except OSError as e:
        raise GptspeedError(f"cannot create or lock --out {out}: {e.strerror or e}") from None
    try:
        names = race_entries(out)  # again, under the lock
        _refuse_earlier_race(out, names, force)
        try:
            for name in ("race.json", "race.md", "race.png"):  # the record first: a cut clearing leaves a race's
                (out / name).unlink(missing_ok=True)
            for run in sorted((out / "runs").iterdir()) if "runs" in names else []:
                held = run_lock(run).acquire()  # refused, naming it, while a gptspeed train writes it
                try:
                    shutil.rmtree(run)
                finally:
                    held.release()
            for log in sorted((out / "logs").iterdir()) if "logs" in names else []:
                log.unlink()
        except OSError as e:
            raise GptspeedError(
                f"cannot remove the earlier race in --out {out}: {e.strerror or e} "
                f"({getattr(e, 'filename', None) or out})"
            ) from None
    except BaseException:
        lock.release()
        raise
    return lock
