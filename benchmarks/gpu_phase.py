"""One phase of a GPU session (``benchmarks/gpu_session.py``): its parts run one after another (or one in
the background) under one budget, each part's output in its log, and everything the phase wrote packed
into ``$OUT/<phase>.tgz`` after every part, with ``summary.json`` listing the parts."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from harness import read_lines  # beside this file: reads a pipe line by line up to a deadline

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry"


class Session:
    """One phase: its results folder, its budget, the log of what ran, and the packing."""

    in_archive_max = 4 << 20  # a file over this stays out of <phase>.tgz (packed after every part): a trace ...
    return_max = 15 << 20  # ... and comes back beside it, gzipped, when that is at most this (the device: 16 MiB)
    out_files_max = 8  # the device returns at most 8 files from $OUT
    min_part_s = 10  # a part with less time than this left is recorded as not run

    def __init__(self, phase: str, out: Path, budget_s: float, smoke: bool):
        self.phase, self.smoke = phase, smoke
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.out = out  # <phase>.tgz (and a file too big for it, gzipped): what is under $OUT comes back (8 files,
        #                 16 MiB each)
        self.work = Path(os.environ.get("GPTSPEED_SESSION_WORK", "/tmp/gptspeed-session"))
        self.dir = self.work / f"{phase}-results"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        out.mkdir(parents=True, exist_ok=True)
        self.summary: list[dict] = []
        self.large: dict[str, dict] = {}  # files over in_archive_max: how each came back, or why not

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
        if (CARRY / "data").exists():
            env.setdefault("GPTSPEED_DATA_MIRROR", str(CARRY / "data"))
        if (CARRY / "peers").exists():
            env.setdefault("GPTSPEED_PEERS_DIR", str(CARRY / "peers"))
        return env

    def run(self, name: str, cmd: list[str], cap_s: float, on_line=None, expect: int = 0) -> int | None:
        """Run ``cmd`` with its output in ``<name>.log``, for at most ``cap_s`` seconds or what is
        left of the budget (less 15 s for packing). ``on_line(line, proc)`` sees every output line;
        ``expect`` is the exit status that means it went as planned. Returns the exit status, or
        None when it timed out or there was no time left to start it."""
        timeout = min(cap_s, self.left() - 15)
        entry = {"part": name, "command": shlex.join(cmd)}
        if timeout < self.min_part_s:
            entry.update(status="not run: out of time")
            self.summary.append(entry)
            print(f"== {name}: not run, {self.left():.0f} s left", flush=True)
            self.pack()
            return None
        print(f"== {name} (at most {timeout:.0f} s): {shlex.join(cmd)}", flush=True)
        t = time.monotonic()
        log = (self.dir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )

        def seen(line: str) -> bool:
            log.write(line + "\n")
            log.flush()
            if on_line is not None:
                on_line(line, proc)
            return False

        deadline = time.perf_counter() + timeout
        timed_out = False
        try:
            read_lines(proc.stdout.fileno(), seen, deadline)
            try:  # the output ended: the process is exiting, or it closed its output and runs on
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            log.close()
        code = proc.returncode
        entry.update(
            status="timed out" if timed_out else "ok" if code == expect else f"exit {code}",
            exit=code,
            seconds=round(time.monotonic() - t, 1),
        )
        self.summary.append(entry)
        tail = (self.dir / f"{name}.log").read_text().splitlines()[-3:]
        print(f"== {name}: {entry['status']} in {entry['seconds']} s | " + " | ".join(tail)[-600:], flush=True)
        self.pack()
        return None if timed_out else code

    def start(self, name: str, cmd: list[str], cap_s: float) -> subprocess.Popen:
        """Start ``cmd`` in the background (its own process group) with its output in ``<name>.log``:
        :meth:`wait` records it. Its time limit, ``cap_s`` or the budget less 15 s, is kept with it."""
        print(
            f"== {name} (in the background, at most {min(cap_s, self.left() - 15):.0f} s): {shlex.join(cmd)}",
            flush=True,
        )
        with (self.dir / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc.gptspeed = (name, shlex.join(cmd), time.monotonic(), min(cap_s, self.left() - 15))
        return proc

    def wait(self, proc: subprocess.Popen) -> int | None:
        """Wait for a part :meth:`start` began, up to its limit (then it is killed), and record it as
        :meth:`run` records a part. Returns its exit status, or None when it was killed at its limit."""
        name, line, t, cap = proc.gptspeed
        try:
            code = proc.wait(timeout=max(0.0, t + cap - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        status = "timed out" if code is None else "ok" if code == 0 else f"exit {code}"
        self.summary.append(
            {
                "part": name,
                "command": line,
                "status": status,
                "exit": proc.returncode,
                "seconds": round(time.monotonic() - t, 1),
            }
        )
        print(f"== {name}: {status} in {self.summary[-1]['seconds']} s", flush=True)
        self.pack()
        return code

    def note(self, **fields) -> None:
        self.summary.append(fields)
        print("== note: " + json.dumps(fields), flush=True)
        self.pack()

    def pack(self) -> None:
        """``$OUT/<phase>.tgz``: the results folder, less any file over :attr:`in_archive_max` (a
        profiler trace), written to a temporary name first; each such file comes back beside it,
        gzipped (:meth:`return_large`). ``summary.json`` says which came back and how."""
        big = sorted(p for p in self.dir.rglob("*") if p.is_file() and p.stat().st_size > self.in_archive_max)
        for path in big:
            self.return_large(path)
        (self.dir / "summary.json").write_text(
            json.dumps({"phase": self.phase, "parts": self.summary, "large_files": self.large}, indent=1) + "\n"
        )
        tmp = self.out / f".{self.phase}.tgz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(
                self.dir,
                arcname=self.dir.name,
                filter=lambda info: None if info.isfile() and info.size > self.in_archive_max else info,
            )
        tmp.replace(self.out / f"{self.phase}.tgz")

    def return_large(self, path: Path) -> None:
        """``$OUT/<phase>-<path, / as ->.gz``: ``path`` gzipped, kept when at most :attr:`return_max`
        bytes and when $OUT then holds at most :attr:`out_files_max` files (its archive counted);
        else left out, and said so in :attr:`large`. Compressing stops at the limit: a trace of
        hundreds of MB costs seconds, not minutes. Once per file and size."""
        rel, size = path.relative_to(self.dir).as_posix(), path.stat().st_size
        if self.large.get(rel, {}).get("bytes") == size:
            return
        name = f"{self.phase}-{rel.replace('/', '-')}.gz"
        rec = self.large[rel] = {"bytes": size}
        files = {p.name for p in self.out.iterdir() if p.is_file() and not p.name.startswith(".")} | {
            f"{self.phase}.tgz",
            name,
        }
        if len(files) > self.out_files_max:
            rec["left_out"] = f"$OUT would hold more than {self.out_files_max} files"
            return
        tmp, read = self.out / f".{name}.tmp", 0
        with path.open("rb") as src, tmp.open("wb") as raw:
            with gzip.GzipFile(filename=path.name, mode="wb", fileobj=raw, compresslevel=6, mtime=0) as gz:
                while chunk := src.read(1 << 20):
                    gz.write(chunk)
                    read += len(chunk)
                    if raw.tell() > self.return_max:
                        break
        if tmp.stat().st_size > self.return_max:
            tmp.unlink()
            (self.out / name).unlink(missing_ok=True)
            rec["left_out"] = (
                f"over {self.return_max / 2**20:.1f} MiB gzipped (after {read / 2**20:.1f} of {size / 2**20:.1f} MiB)"
            )
            return
        tmp.replace(self.out / name)
        rec["returned_as"] = name
        rec["gzipped_bytes"] = (self.out / name).stat().st_size
