"""Exact resume, end to end: a run stopped and resumed logs the losses of the run that was never stopped, to the bit.

One case per way of stopping a run (right after a checkpoint, Ctrl-C, SIGTERM in the middle of a step, SIGKILL at
random moments, a crash before the first checkpoint, a rank SIGKILLed under torchrun --max-restarts), checkpoint
format (a .pt file, FSDP2's sharded folder), optimizer (AdamW, Muon, a registered one), architecture (the modern
switches), schedule (the batch-size and sequence-length warm-ups), data order (rows aligned to documents), data (a prepared folder, a jsonl stream), host branch (dtype, softmax, loss path, compile) and world size
(one process, 2 ranks under torchrun) that the tests cover. The runs never stopped are shared: the ``reference_run``
fixture trains each once per session (tests/support/references.py), the FSDP2 one is the ``dist_runs`` fixture's."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gptspeed.checkpoint import check_checkpoint, list_checkpoints, load_checkpoint
from gptspeed.data.loader import TokenLoader
from gptspeed.step import TrainStep

from support import torchrun
from support.cli import assert_user_error, finish, run_main, start_cli, wait_for_line
from support.dist_scenarios import MODERN
from support.references import SETUPS, SHAKESPEARE, THREADS, train_flags
from support.settings import BRANCH_IDS, BRANCHES, STREAM_RUN, branch_run
from support.shapes import DIST_RUNS_FIXTURE, TEXT_MODEL
from support.training import records

#: The cases' runs on tinyshakespeare (``gptspeed.make_config`` names; the data by name, the threads pinned).
CASE_RUN = dict(
    TEXT_MODEL,
    log_every=1,
    eval_every=0,
    eval_tokens=1024,
    device="cpu",
    threads=THREADS,
    data=SHAKESPEARE,
)
#: 10 steps, evaluated every 4, checkpointed every 3: long enough to stop 3 times and still run.
LONG = dict(CASE_RUN, max_steps=10, eval_every=4, save_every=3, keep_checkpoints=5)
#: 3 steps of 4 micro-batches, float32 and eager on every host, checkpointed only at the end.
STEPPED = dict(
    CASE_RUN, eval_tokens=512, dtype="float32", compile=False, total_batch_tokens=4 * 8 * 64, max_steps=3, save_every=0
)
#: STEPPED under both warm-ups (steps of 1, 2, 3, 4, 4 micro-batches at lengths 16, 32, 32, 64, 64) and with rows
#: aligned to documents, a checkpoint every 2.
WARMED = dict(
    STEPPED,
    align_to_docs=True,
    batch_warmup_steps=3,
    seq_len_warmup_steps=3,
    seq_len_start=16,
    max_steps=5,
    save_every=2,
    keep_checkpoints=5,
)
#: 16 steps of a global batch of 2 ranks x 1 micro-step (the ``dist_runs`` fixture's), a checkpoint every step.
RANKS = dict(DIST_RUNS_FIXTURE, data=SHAKESPEARE, max_steps=16, save_every=1)  # one thread per rank (torchrun_cmd)
#: What each case compares, step by step, unless it says otherwise.
LOGGED = ("train_loss", "val_loss", "tokens", "documents")


@dataclass(frozen=True)
class Case:
    #: ``stop(case, flags, ref, run, monkeypatch)``: stops the run in ``run`` (``flags``: its ``gptspeed train``
    #: flags), resumes it to its end, and returns the step after which its records begin (-1: all of them).
    stop: Callable[..., int]
    #: the settings of the run never stopped, or the name of a ``dist_runs`` run
    settings: dict | str
    setup: str | None = None  # tests/support/references.py's SETUPS: a registered optimizer, the eager backend
    changes: dict = field(default_factory=dict)  # the stopped run's checkpoint cadence, where it differs
    compared: tuple[str, ...] = LOGGED
    tolerance: float = 0.0  # 0: to the bit
    ranks: int = 1


def at_checkpoint(step: int, keep: str = "checkpoint", refused: tuple[list[str], str] | None = None):
    """A run stopped right after its checkpoint of ``step``, resumed: a folder holding only that checkpoint and its
    seal (``keep="config"``: and the run's config.json; ``"folder"``: the run's folder, the later checkpoints
    deleted). ``refused``: flags a further resume must refuse in one line naming the fragment."""

    def stop(case, flags, ref, run, monkeypatch) -> int:
        if keep == "folder":
            shutil.copytree(ref, run)
            for p in run.glob("ckpt_*"):
                if int(p.name[5:13]) > step:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        else:
            run.mkdir()
            names = [f"ckpt_{step:08d}.pt", f"ckpt_{step:08d}.json"] + (["config.json"] if keep == "config" else [])
            for name in names:
                shutil.copy(ref / name, run / name)
        if case.ranks == 2:
            res = torchrun.torchrun("train", "--out", str(run), "--resume", "--parallel", "fsdp")
        else:
            res = run_main("train", "--out", str(run), "--resume")
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"resumed from step {step}" in res.stdout
        if refused:  # e.g. the other optimizer would not continue the run
            assert_user_error(run_main("train", "--out", str(run), "--resume", *refused[0]), refused[1])
        return -1 if keep == "folder" else step  # the folder kept the records of the steps before

    return stop


def sigkill_at_random_moments(case, flags, ref, run, monkeypatch) -> int:
    """3 SIGKILLs, each after a random number (1-3) of new records and a random part of a step (so that stepping,
    logging, evaluating and saving are all hit), then a resume to the end; every checkpoint left is valid."""
    rng = random.Random(4)  # its draws: 1, 3 and 1 records, so at most step 8 is reached: the run never ends first
    for _attempt in range(3):
        proc = start_cli("train", *flags, "--out", str(run), "--resume")
        lines = [wait_for_line(proc, "| loss ") for _ in range(rng.randint(1, 3))]
        step_s = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]).get("step_ms", 100) / 1000
        time.sleep(rng.uniform(0.0, step_s))
        assert proc.poll() is None, lines
        proc.kill()  # SIGKILL: no handler runs
        finish(proc)
    final = run_main("train", *flags, "--out", str(run), "--resume")
    assert final.returncode == 0, final.stderr
    for ck in list_checkpoints(run):
        assert check_checkpoint(ck) is None
    return -1


def ctrl_c(case, flags, ref, run, monkeypatch) -> int:
    """Ctrl-C (SIGINT) after step 3 of a run checkpointed only when stopped: it saves, says how to resume, exits 130."""
    n = case.settings["max_steps"]
    proc = start_cli("train", *flags, "--out", str(run))
    wait_for_line(proc, f"step {3:>{len(str(n))}}/{n}")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert "--resume" in out
    assert 3 <= load_checkpoint(list_checkpoints(run)[-1])["step"] < n
    res = run_main("train", "--out", str(run), "--resume")
    assert res.returncode == 0, res.stderr
    return -1


def sigterm_mid_step(case, flags, ref, run, monkeypatch) -> int:
    """SIGTERM during the 2nd of step 2's 4 micro-batches: no further micro-batch is read, step 1 is saved, and the
    resume redoes step 2 from the same batches."""
    reads = []
    real = TokenLoader.next_batch

    def next_batch(self):
        reads.append(self.batches)
        if len(reads) == 6:  # step 2's 2nd micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(TokenLoader, "next_batch", next_batch)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        res = run_main("train", *flags, "--out", str(run))
    finally:
        for s, h in handlers.items():  # a stopped run leaves SIGTERM / SIGHUP ignored until its process exits
            signal.signal(s, h)
    assert res.returncode == 143, res.stderr
    assert len(reads) == 6, reads  # nothing read after the micro-batch the signal arrived in
    assert "step 2 was left after 2 of its 4 micro-batches: a resume redoes it" in res.stdout
    assert "stopped at step 1; checkpoint saved" in res.stdout
    (ck,) = list_checkpoints(run)
    assert check_checkpoint(ck) is None and load_checkpoint(ck)["step"] == 1
    monkeypatch.setattr(TokenLoader, "next_batch", real)
    res = run_main("train", "--out", str(run), "--resume")
    assert res.returncode == 0, res.stderr
    return -1


def crash_before_first_checkpoint(case, flags, ref, run, monkeypatch) -> int:
    """The README's "run the first command again" after a crash at step 2, before any checkpoint: `--resume`
    restarted a GPT-2 124M run on the default corpus and wrote its config.json over the run's. Now it restarts the
    run's own configuration (flags given apply on top), and a flag that would make it another run is refused in one
    line, config.json untouched."""

    def settings() -> dict:
        doc = json.loads((run / "config.json").read_text())
        return {g: doc[g] for g in ("model", "optim", "train", "runtime")}

    real = TrainStep.__call__
    calls = []

    def crash_at_step_2(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")  # as a SIGKILL: no checkpoint, config.json stays
        return real(self, *a, **k)

    monkeypatch.setattr(TrainStep, "__call__", crash_at_step_2)
    with pytest.raises(RuntimeError, match="went away"):
        run_main("train", *flags, "--out", str(run))
    monkeypatch.setattr(TrainStep, "__call__", real)
    assert not list_checkpoints(run) and (run / "config.json").is_file()
    started = settings()

    changed = run_main("train", "--out", str(run), "--resume", "--n-layer", "3")
    assert_user_error(changed, f"--resume: {run} has no checkpoint yet", "model.n_layer", "--force-resume")
    assert settings() == started

    res = run_main("train", "--preset", "pico", "--out", str(run), "--resume")  # the first command, again
    assert res.returncode == 0, res.stderr
    assert "restarting the run of its config.json from step 0" in res.stdout
    now = settings()
    now["train"]["resume"] = started["train"]["resume"]
    assert now == started
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck["step"] == case.settings["max_steps"] and ck["config"]["model"] == started["model"]
    return -1


def sigkill_a_rank(case, flags, ref, run, monkeypatch) -> int:
    """SIGKILL rank 1 after step 3; torchrun (--max-restarts 2) restarts the group, which resumes from the newest
    checkpoint. The restarted ranks used to fail 4 times in 5 in gloo's connectFullMesh ("Connection refused"),
    reading their peer's address from the dead round (distributed.restart_store)."""
    cmd, env = torchrun.torchrun_cmd(["train", *flags, "--out", str(run), "--resume"], 2)
    cmd[cmd.index("--standalone") + 1 : cmd.index("--standalone") + 1] = ["--max-restarts", "2"]
    proc = torchrun.launch(cmd, env)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or '"step": 3,' not in (run / "metrics.jsonl").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                torchrun.kill_group(proc)
                pytest.fail(f"step 3 never logged (exit code {proc.poll()}): {torchrun.collect(proc, 30)[1][-3000:]}")
            time.sleep(0.05)
        pid = torchrun.worker_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, 9)
        _, err = torchrun.collect(proc, 240)
    finally:
        torchrun.kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    # the kill was seen (torchrun reports rank 1's SIGKILL, or first the survivor's one line), and
    # torchrun restarted the group (exit status 0, every step's loss compared)
    assert "exitcode: -9" in err or "lost contact with another rank after step" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # the survivor, if a collective saw its peer go: one line
    return -1


CASES = [
    pytest.param(Case(at_checkpoint(6), LONG), id="checkpoint-pt-adamw-1"),
    pytest.param(
        Case(sigkill_at_random_moments, LONG, changes=dict(save_every=1, keep_checkpoints=2)), id="sigkill-pt-adamw-1"
    ),
    # the val loss of the step Ctrl-C lands in may be left (a stop does not wait for an evaluation)
    pytest.param(
        Case(ctrl_c, LONG, changes=dict(save_every=0), compared=("train_loss", "tokens", "documents")),
        id="ctrl-c-pt-adamw-1",
    ),
    pytest.param(Case(sigterm_mid_step, STEPPED), id="sigterm-mid-step-pt-adamw-1"),
    pytest.param(Case(crash_before_first_checkpoint, STEPPED), id="crash-before-first-checkpoint-pt-adamw-1"),
    pytest.param(
        Case(
            at_checkpoint(2, refused=(["--max-steps", "6", "--optimizer", "adamw"], "optimizer")),
            dict(CASE_RUN, optimizer="muon", muon_lr=0.02, max_steps=5, save_every=2, keep_checkpoints=5),
        ),
        id="checkpoint-pt-muon-1",
    ),
    pytest.param(
        Case(
            at_checkpoint(2, "config"),
            dict(CASE_RUN, **MODERN, dtype="float32", max_steps=4, save_every=2, keep_checkpoints=5, warmup_steps=1),
        ),
        id="checkpoint-pt-adamw-modern-1",
    ),
    pytest.param(  # SGD's momentum buffers come back with the checkpoint
        Case(
            at_checkpoint(2, "config"),
            dict(
                CASE_RUN, optimizer="toy-sgd", lr=0.05, dtype="float32", max_steps=4, save_every=2, keep_checkpoints=5
            ),
            setup="toy-sgd",
        ),
        id="checkpoint-pt-registered-1",
    ),
    pytest.param(Case(at_checkpoint(2, "config"), WARMED), id="checkpoint-pt-adamw-warm-ups-aligned-1"),
    pytest.param(Case(at_checkpoint(3), STREAM_RUN), id="checkpoint-pt-adamw-stream-1"),
    *[
        pytest.param(Case(at_checkpoint(2, "config"), *branch_run(*b)), id=f"checkpoint-pt-adamw-{name}-1")
        for b, name in zip(BRANCHES, BRANCH_IDS)
    ],
    pytest.param(Case(at_checkpoint(2, "folder"), "fsdp", ranks=2), id="checkpoint-dcp-adamw-2"),
    # compared with one process (2 micro-steps): 2 ranks sum their gradients in another order
    pytest.param(
        Case(sigkill_a_rank, RANKS, compared=("train_loss", "val_loss"), tolerance=1e-5, ranks=2),
        id="sigkill-a-rank-pt-adamw-2",
        marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds torchrun's workers through /proc"),
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_a_stopped_run_resumes_to_the_losses_of_the_run_never_stopped(
    case, reference_run, request, tmp_path, monkeypatch
):
    if isinstance(case.settings, str):
        ref, flags = request.getfixturevalue("dist_runs")[case.settings], []
    else:
        ref = reference_run(case.settings, case.setup)
        flags = train_flags(reference_run.resolved(dict(case.settings, **case.changes)))
    run = tmp_path / "run"
    with SETUPS[case.setup]():
        after = case.stop(case, flags, ref, run, monkeypatch)
    want, got = by_step(ref), by_step(run)
    assert [r["step"] for r in records(run)] == [s for s in sorted(want) if s > after]  # each step once, in order
    for s in got:
        for name in case.compared:
            a, b = got[s].get(name), want[s].get(name)
            if case.tolerance and a is not None and b is not None:
                assert abs(a - b) < case.tolerance, (s, name, a, b)
            else:
                assert a == b, (s, name, a, b)  # bit for bit


def by_step(run: Path) -> dict[int, dict]:
    """A run's records by step."""
    return {r["step"]: r for r in records(run)}
