"""``gptspeed.bench.race``: ``gptspeed bench race``: wall-clock training time to a target validation loss, arm against arm."""

from __future__ import annotations

import json
import math

import pytest

from gptspeed.bench import race
from gptspeed.config import RECIPES
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_main
from support.training import TINY_MODEL, flags

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------ the race keeps the user's files
BASE = ["--preset", "pico", "--device", "cpu", "--seeds", "1", "--eval-every", "2", "--eval-tokens", "256"]


ARM = "a=--max-steps 4 --dtype float32 --n-layer 1 --n-head 2 --n-embd 32 --seq-len 32 --batch-size 4"


#: a stand-in for ``gptspeed train`` (python -c FAKE MODE RUN_DIR): ``finish`` writes a finished run's
#: metrics; ``train`` waits for SIGTERM, then saves a checkpoint and exits 143, as train does; ``deaf``
#: ignores SIGTERM; ``crash`` crashes on it (its compile failing under the signal, in a train of before
#: issue 56), printing a traceback, its run folder removed as a new run's that finished no step
FAKE_TRAIN = """
import json, os, signal, sys, time
mode, run = sys.argv[1], sys.argv[2]
os.makedirs(run, exist_ok=True)
if mode == "finish":
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step, loss in ((0, 10.0), (2, 9.0), (4, 8.0)):
            f.write(json.dumps({"step": step, "tokens": 128 * step, "step_ms": 10.0, "val_loss": loss}) + "\\n")
    sys.exit(0)
def save(signum, frame):
    open(os.path.join(run, "ckpt_00000003.pt"), "w").write("saved")
    sys.exit(128 + signum)
def crash(signum, frame):
    import shutil
    shutil.rmtree(run)
    print("Traceback (most recent call last):\\n  File 'train.py', line 1, in <module>\\n"
          "torch._inductor.exc.InductorError: CppCompileError: C++ compile error\\n\\n"
          "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, {"deaf": signal.SIG_IGN, "crash": crash}.get(mode, save))
print("training", os.getpid(), flush=True)
time.sleep(120)
"""


def fake_train(monkeypatch, mode: str) -> None:
    import sys

    monkeypatch.setattr(
        race, "train_command", lambda flags, run_dir: [sys.executable, "-c", FAKE_TRAIN, mode, str(run_dir)]
    )


def tree(root):
    """Every path under ``root`` with its bytes (None for a folder): what must stay untouched."""
    return (
        {p: (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}
        if root.is_dir()
        else {root: root.read_bytes()}
    )


def test_the_curve_counts_training_steps_only_and_the_warm_up_at_the_next_speed():
    records = [
        {"step": 0, "val_loss": 10.9},  # the step-0 evaluation: no training yet
        {"step": 1, "step_ms": 5000.0, "includes_warmup": True, "train_loss": 10.8},  # compile: not timed
        {"step": 5, "step_ms": 100.0, "train_loss": 9.0, "val_loss": 9.5},
        {"step": 10, "step_ms": 200.0, "val_loss": 8.0},
    ]
    curve = race.training_curve(records)
    assert [p["step"] for p in curve] == [0, 5, 10]
    assert curve[0]["train_s"] == 0
    assert curve[1]["train_s"] == pytest.approx(5 * 0.1)  # steps 1-5 at 100 ms: the warm-up step at the next speed
    assert curve[2]["train_s"] == pytest.approx(0.5 + 5 * 0.2)
    hit = race.time_to_target(curve, 9.5)
    assert hit == {
        "reached": True,
        "time_to_target_s": pytest.approx(0.5),
        "tokens_to_target": 0,
        "steps_to_target": 5,
        "final_val_loss": 8.0,
    }
    assert race.time_to_target(curve, 7.0)["reached"] is False


def test_a_bpb_target_is_reached_at_the_first_evaluation_whose_val_bpb_is_at_or_below_it():
    records = [
        {"step": 0, "val_loss": 10.9},  # the step-0 evaluation gives no bits per byte
        {"step": 2, "step_ms": 100.0, "val_loss": 9.0, "val_bpb": 4.0},
        {"step": 4, "step_ms": 100.0, "val_loss": 8.5, "val_bpb": 3.0},  # the loss is never at 8.0
        {"step": 6, "step_ms": 100.0, "val_loss": 8.6, "val_bpb": 3.1},
    ]
    curve = race.training_curve(records)
    assert [p.get("val_bpb") for p in curve] == [None, 4.0, 3.0, 3.1]
    hit = race.time_to_target(curve, 3.05, "val_bpb")
    assert hit == {
        "reached": True,
        "time_to_target_s": pytest.approx(0.4),
        "tokens_to_target": 0,
        "steps_to_target": 4,
        "final_val_loss": 8.6,
        "final_val_bpb": 3.1,
    }
    assert race.time_to_target(curve, 3.05)["reached"] is False  # the same number read as a val loss
    assert race.time_to_target(curve, 2.9, "val_bpb")["reached"] is False
    a = race.Arm("a", [])
    a.runs = [{"seed": 0, "curve": curve}, {"seed": 1, "curve": curve}]
    row = race.summarize([a], 3.05, metric="val_bpb")[0]
    assert row["reached"] == 2 and row["steps_to_target_mean"] == 4 and row["final_val_bpb_mean"] == 3.1


def test_the_summary_gives_means_ratios_and_a_one_sided_welch_p_value():
    def arm(name, times):
        a = race.Arm(name, [])
        a.runs = [
            {
                "seed": i,
                "curve": [
                    {"step": 0, "tokens": 0, "train_s": 0.0, "val_loss": 11.0},
                    {"step": 10, "tokens": 100, "train_s": t, "val_loss": 3.0},
                ],
            }
            for i, t in enumerate(times)
        ]
        return a

    from scipy import stats

    base, fast = [10.0, 11.0, 12.0, 10.5], [5.0, 5.5, 4.5, 5.2]
    rows = race.summarize([arm("gpt2", base), arm("modern", fast)], target=3.5)
    assert rows[0]["time_ratio"] == 1.0 and rows[0]["p_value"] is None and rows[0]["reached"] == 4
    assert rows[1]["time_to_target_s_mean"] == pytest.approx(sum(fast) / 4)
    assert rows[1]["time_ratio"] == pytest.approx(sum(fast) / sum(base))
    assert rows[1]["p_value"] == pytest.approx(stats.ttest_ind(fast, base, equal_var=False, alternative="less").pvalue)
    assert rows[1]["p_value"] < 0.01
    slow = race.summarize([arm("gpt2", base), arm("slow", [20.0, 21.0])], target=3.5)[1]
    assert slow["p_value"] > 0.9  # one-sided: a slower arm is not "faster"
    # a target below the first arm's finals: not reached, unless the first arm defines the target
    assert race.summarize([arm("gpt2", base), arm("modern", fast)], target=2.0)[0]["reached"] == 0
    defined = race.summarize([arm("gpt2", base), arm("modern", fast)], target=2.0, first_defines_target=True)
    assert defined[0]["reached"] == 4 and defined[0]["time_to_target_s_mean"] == pytest.approx(sum(base) / 4)
    assert defined[1]["reached"] == 0 and defined[1]["time_ratio"] is None


def test_a_race_end_to_end_writes_its_files(shakespeare_data, tmp_path, monkeypatch):
    from gptspeed import cli

    def in_process(cmd, log, timeout_s, stop=None, say=print):
        import contextlib

        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return cli.main(cmd[3:])  # [python, -m, gptspeed, train, ...]

    monkeypatch.setattr(race, "spawn", in_process)
    shape = flags(dict(TINY_MODEL, batch_size=4, max_steps=6, warmup_steps=1, lr=3e-3, dtype="float32"))
    out = tmp_path / "race"
    proc = run_main(
        "bench",
        "race",
        "--arm",
        f"plain={' '.join(shape)}",
        "--arm",
        f"modern=--recipe modern {' '.join(shape)}",
        "--seeds",
        "2",
        "--preset",
        "pico",
        "--data",
        str(shakespeare_data),
        "--device",
        "cpu",
        "--eval-every",
        "2",
        "--eval-tokens",
        "256",
        "--sampling",
        "random",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "race.json").read_text())
    assert result["sampling"] == "random" and "random windows" in (out / "race.md").read_text()
    for run in (out / "runs").iterdir():  # every arm reads the data in bench's order
        assert json.loads((run / "config.json").read_text())["train"]["sampling"] == "random", run.name
    assert result["complete"] and [a["name"] for a in result["arms"]] == ["plain", "modern"]
    seeds = [(a["name"], r["seed"]) for a in result["arms"] for r in a["runs"]]
    assert sorted(seeds) == [("modern", 0), ("modern", 1), ("plain", 0), ("plain", 1)]
    plain = result["arms"][0]
    finals = [r["final_val_loss"] for r in plain["runs"]]
    assert result["target_val_loss"] == pytest.approx(sum(finals) / 2)  # the first arm's mean final val loss
    for arm in result["arms"]:
        for run in arm["runs"]:
            assert [p["step"] for p in run["curve"]] == [0, 2, 4, 6]
            assert all(b["train_s"] > a["train_s"] for a, b in zip(run["curve"], run["curve"][1:]))
            if run["reached"]:
                assert run["time_to_target_s"] > 0 and run["steps_to_target"] in (2, 4, 6)
    # the first arm defines the target: each of its runs counts its whole training
    assert plain["reached"] == 2 and "whole training" in result["target_from"]
    assert [r["time_to_target_s"] for r in plain["runs"]] == [r["curve"][-1]["train_s"] for r in plain["runs"]]
    assert [r["steps_to_target"] for r in plain["runs"]] == [6, 6]
    assert "| plain |" in (out / "race.md").read_text() and (out / "race.png").stat().st_size > 1000
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["modern-seed0.log", "modern-seed1.log", "plain-seed0.log", "plain-seed1.log"]
    order = [
        line.split(":")[1].strip()
        for line in proc.stdout.splitlines()
        if line.startswith("race:") and "final" not in line
    ]
    assert order == ["plain seed 0", "modern seed 0", "plain seed 1", "modern seed 1"]  # interleaved


def test_a_race_to_a_bpb_target_evaluates_every_run_in_bits_per_byte(shakespeare_data, tmp_path, monkeypatch):
    from gptspeed import cli

    def in_process(cmd, log, timeout_s, stop=None, say=print):
        import contextlib

        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return cli.main(cmd[3:])  # [python, -m, gptspeed, train, ...]

    monkeypatch.setattr(race, "spawn", in_process)
    out = tmp_path / "race"
    proc = run_main(
        "bench", "race", "--arm", ARM, *BASE, "--data", str(shakespeare_data), "--out", str(out), "--target-bpb", "100"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "race.json").read_text())
    assert result["metric"] == "val_bpb" and result["target_val_bpb"] == 100 and result["target_from"] == "--target-bpb"
    assert json.loads((out / "runs" / "a-seed0" / "config.json").read_text())["train"]["eval_bpb"] is True
    (run,) = result["arms"][0]["runs"]
    assert [p["step"] for p in run["curve"]] == [0, 2, 4]  # not stopped at the target: its --max-steps
    assert all(0 < p["val_bpb"] < 100 for p in run["curve"][1:])
    assert run["reached"] and run["steps_to_target"] == 2  # the first evaluation after step 0
    assert run["final_val_bpb"] == run["curve"][-1]["val_bpb"]
    assert "Target val bpb **100.0000** (--target-bpb)" in (out / "race.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "gpt2", "--target-bpb", "0"], "--target-bpb must be a positive finite number"),
        (["--arms", "gpt2", "--target-bpb", "nan"], "--target-bpb must be a positive finite number"),
        (["--arms", "gpt2", "--target-bpb", "1", "--target-val-loss", "3"], "give one target"),
        (["--arms", "gpt3"], "--arms: unknown recipe 'gpt3'"),
        (["--arm", "nameless"], 'give NAME="FLAGS"'),
        (["--arm", "a=--no-such-flag"], "arm a: '--no-such-flag' are not gptspeed train flags"),
        (["--arm", "a=--lr 1", "--arm", "a=--lr 2"], "arm names must differ"),
        ([], "bench race needs arms"),
        (["--arms", "gpt2", "--seeds", "0"], "--seeds must be at least 1"),
        (["--arm", 'a="--unclosed'], "No closing quotation"),  # an unbalanced quote: one line, no traceback
    ],
)
def test_bad_race_arguments_are_one_line(args, message, tmp_path):
    assert_user_error(
        run_main("bench", "race", *args, "--preset", "pico", "--device", "cpu", "--out", str(tmp_path / "r")), message
    )


def test_recipes_are_train_settings():
    from gptspeed.configure import build_train_config

    modern = build_train_config("pico", {}, recipe_name="modern")
    assert modern.model.pos_emb == "rope" and modern.optim.lr_schedule == "wsd" and modern.model.non_gpt2_switches()
    assert modern.optim.optimizer == "muon" and modern.model.tie_embeddings  # the race's winner keeps the tied head
    assert build_train_config("pico", {}, recipe_name="gpt2").model.non_gpt2_switches() == []
    speedrun = build_train_config("pico", {}, recipe_name="speedrun")  # modern and the speedrun's pieces
    assert {k: getattr(g, k) for g in speedrun.groups().values() for k in RECIPES["modern"] if hasattr(g, k)} == {
        k: getattr(g, k) for g in modern.groups().values() for k in RECIPES["modern"] if hasattr(g, k)
    }
    assert (speedrun.model.value_embeds, speedrun.optim.embed_lr_ratio, speedrun.optim.scalar_lr_ratio) == (1, 3, 3)
    assert speedrun.warmup_steps() == 1 and modern.warmup_steps() == 5  # 2% of pico's 50 steps; pico's
    with pytest.raises(GptspeedError, match="unknown recipe 'moden'.*did you mean 'modern'"):
        build_train_config("pico", {}, recipe_name="moden")
    flagged = build_train_config("pico", {"pos_emb": "learned"}, recipe_name="modern")  # flags override a recipe
    assert flagged.model.pos_emb == "learned" and flagged.model.qk_norm
    assert not math.isnan(modern.optim.decay_ratio)


@pytest.mark.parametrize("name", ["/abs/x", "../../x", "..", ".", "a/b", "a b", "x" * 101])
def test_an_arm_name_is_a_folder_name_never_a_path(name, tmp_path):
    """An arm's name names its runs' folders (OUT/runs/NAME-seedN): ``/abs/x`` or ``../../x`` used to
    train (and, run again, delete) outside --out."""
    assert_user_error(
        run_main("bench", "race", "--arm", f"{name}=--lr 1e-3", *BASE, "--out", str(tmp_path / "r")),
        "an arm's name names its runs' folders",
    )
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_not_a_race_of_its_own_is_refused_untouched(shakespeare_data, tmp_path, monkeypatch):
    """A file, a run folder, a data folder, the user's folder, or a race folder holding anything else:
    one line each, nothing written or deleted (the race used to reuse --out and delete its runs)."""
    from gptspeed.checkpoint import run_lock

    fake_train(monkeypatch, "finish")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("notes")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model": {}, "train": {}}')
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    users = tmp_path / "thesis"
    users.mkdir()
    (users / "chapter1.tex").write_text("years of work")
    mixed = tmp_path / "mixed"  # an earlier race whose runs/ holds a folder of the user's
    (mixed / "runs" / "mine").mkdir(parents=True)
    (mixed / "race.json").write_text('{"command": "", "steps_cap": 8, "arms": []}')
    cases = [
        (a_file, "is a file"),
        (run, "is a run folder"),
        (shakespeare_data, "is a data folder"),
        (users, "holds what a race did not write (chapter1.tex)"),
        (mixed, "runs/mine"),
    ]
    for out, fragment in cases:
        before = tree(out)
        assert_user_error(
            run_main(
                "bench", "race", "--arm", ARM, *BASE, "--data", str(shakespeare_data), "--out", str(out), "--force"
            ),
            fragment,
        )
        assert tree(out) == before, out

    earlier = tmp_path / "race"  # an earlier race: refused without --force, replaced with it
    for name in ("old-seed0", "old-seed1"):
        (earlier / "runs" / name).mkdir(parents=True)
        (earlier / "runs" / name / "config.json").write_text('{"model": {}, "train": {}, "derived": {"run_id": "r"}}')
        (earlier / "runs" / name / "metrics.jsonl").write_text('{"step": 0}\n')
        (earlier / "logs").mkdir(exist_ok=True)
        (earlier / "logs" / f"{name}.log").write_text("log")
    (earlier / "race.json").write_text('{"command": "old", "steps_cap": 8, "arms": []}')
    before = tree(earlier)
    race_args = ["bench", "race", "--arm", ARM, *BASE, "--data", str(shakespeare_data), "--out", str(earlier)]
    assert_user_error(run_main(*race_args), "holds an earlier race (2 run folder(s)", "--force")
    assert tree(earlier) == before
    lock = run_lock(earlier).acquire()  # a race still running on it: its lock
    try:
        assert_user_error(run_main(*race_args, "--force"), "is in use by pid", "another `gptspeed bench race`")
    finally:
        lock.release()
    assert {p: b for p, b in tree(earlier).items() if p.name != ".gptspeed.lock"} == before
    proc = run_main(*race_args, "--force")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (earlier / "runs").iterdir()) == ["a-seed0"]
    assert sorted(p.name for p in (earlier / "logs").iterdir()) == ["a-seed0.log"]
    assert json.loads((earlier / "race.json").read_text())["complete"]


@pytest.mark.parametrize(
    "arm, message",
    [
        ("--seed 5", "--seed is the race's to set"),
        ("--eval-every 3", "--eval-every is the race's to set"),
        ("--eval-tokens 128", "--eval-tokens is the race's to set"),
        ("--stop-at-val-loss 3", "--stop-at-val-loss is the race's to set"),
        ("--eval-bpb", "--eval-bpb is the race's to set (every arm is evaluated alike: give bench --target-bpb"),
        ("--data /elsewhere", "arm b: "),
        ("--sampling random", "--sampling is the race's to set"),
        ("--device cpu", "--device is the race's to set"),
        ("--print-config", "--print-config prints a configuration"),
        ("--max-steps 9", "--max-steps 9 is beyond the race's cap of 8"),
        ("--sdpa-backend cudnn", "arm b: --sdpa-backend cudnn cannot run this attention"),
        ("--dtype float16", "arm b: --dtype float16 is not supported on a CPU"),
        ("--loss liger", "arm b: --loss liger runs Liger-Kernel's Triton kernels"),
        ("CONFIG", "seed: in its --config"),
    ],
)
def test_every_arm_is_checked_whole_before_the_first_run(arm, message, shakespeare_data, tmp_path, monkeypatch):
    """A second arm that cannot run, or sets what the race sets itself, used to fail (or be silently
    overridden) after the first arm's whole run: now one line before anything runs or is written."""

    def no_run(*a, **k):
        raise AssertionError("a run started")

    monkeypatch.setattr(race, "spawn", no_run)
    if arm == "CONFIG":
        (tmp_path / "b.yaml").write_text("train:\n  max_steps: 4\nruntime:\n  seed: 7\n")
        arm = f"--config {tmp_path / 'b.yaml'}"
    out = tmp_path / "r"
    assert_user_error(
        run_main(
            "bench",
            "race",
            "--arm",
            ARM,
            "--arm",
            f"b={ARM[2:]} {arm}",
            *BASE,
            "--data",
            str(shakespeare_data),
            "--out",
            str(out),
        ),
        message,
    )
    assert not out.exists()


def test_a_race_on_a_stream_without_a_val_split_is_refused(tmp_path):
    out = tmp_path / "r"
    assert_user_error(
        run_main("bench", "race", "--arm", ARM, *BASE, "--data", f"jsonl:{tmp_path / 'x.jsonl'}", "--out", str(out)),
        "the race measures the val loss",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "signum, mode", [("SIGTERM", "train"), ("SIGINT", "train"), ("SIGTERM", "deaf"), ("SIGINT", "crash")]
)
def test_a_stop_signal_reaches_the_running_arm_which_saves_and_the_race_says_so(
    signum, mode, shakespeare_data, tmp_path, monkeypatch
):
    """Ctrl-C used to kill the training child 0.25 s after the signal, before its save; SIGTERM left
    it orphaned, training on. Now the running arm is sent SIGTERM (``gptspeed train`` saves its last
    finished step on it), the race waits for it -- at most STOP_WAIT_S, then kills it -- and ends
    with one line and 128 + the signal. An arm that crashes as it stops is said to have crashed, with
    its exception's line, its log kept and named (the race said "it saved and stopped")."""
    import os
    import signal
    import threading
    import time

    fake_train(monkeypatch, mode)
    monkeypatch.setattr(race, "STOP_WAIT_S", 0.5)
    out = tmp_path / "r"
    log = out / "logs" / "a-seed0.log"

    def signal_when_training():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (log.exists() and "training" in log.read_text()):
            time.sleep(0.02)
        os.kill(os.getpid(), getattr(signal, signum))

    sender = threading.Thread(target=signal_when_training)
    sender.start()
    proc = run_main("bench", "race", "--arm", ARM, *BASE, "--data", str(shakespeare_data), "--out", str(out))
    sender.join()
    sig = getattr(signal, signum)
    assert_user_error(proc, f"race stopped by {signum} while a seed 0 ran")
    assert proc.returncode == 128 + sig
    child = int(log.read_text().split()[1])
    with pytest.raises(ProcessLookupError):  # no child left running (nor a zombie: it was waited for)
        os.kill(child, 0)
    if mode == "train":
        assert "saved and stopped (exit 143), its last checkpoint is" in proc.stderr
        assert (out / "runs" / "a-seed0" / "ckpt_00000003.pt").read_text() == "saved"
    elif mode == "crash":
        assert "saved and stopped" not in proc.stderr and "Traceback" not in proc.stderr
        assert (
            "it crashed as it stopped (exit 1: torch._inductor.exc.InductorError: CppCompileError: C++ compile "
            f"error), it had saved no checkpoint (log: {log})" in proc.stderr
        )
        assert "CppCompileError" in log.read_text()  # the traceback is kept, in the log
    else:
        assert "did not stop within 0.5 s and was killed" in proc.stderr
    assert "asked the running arm" in proc.stdout
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the race's handlers are gone again


# ------------------------------------------------------------------ a race of tokenizers: each arm its own --data
TOK_ARM = "--max-steps 2 --dtype float32 --n-layer 1 --n-head 2 --n-embd 32 --seq-len 32 --batch-size 4"
TOK_BASE = ["--preset", "pico", "--device", "cpu", "--seeds", "1", "--eval-every", "2"]


@pytest.fixture(scope="module")
def tokdata(tmp_path_factory):
    """tests/support/tokdata.py's tokenizer (300 ids, ``tok``) and folders (``data``: its text prepared with
    it, ``gpt2``: with GPT-2's -- their val cuts, at 90% of the tokens moved to a document start, fall at
    different paragraphs), and the same text as 10 documents of 4,000 characters prepared with each
    (``tok10``, ``gpt10``: the cut falls at the 10th document in both, so their val text is the same)."""
    import lzma

    from gptspeed.data.corpora import EMBEDDED_DIR
    from gptspeed.data.prepare import prepare

    from support.tokdata import make_tokenizer_data

    root = make_tokenizer_data(tmp_path_factory.mktemp("tokrace"))
    text = lzma.decompress((EMBEDDED_DIR / "tinyshakespeare.txt.xz").read_bytes()).decode()[:40_000]
    src = root / "ten.jsonl"
    src.write_text("".join(json.dumps({"text": text[i : i + 4000]}) + "\n" for i in range(0, 40_000, 4000)))
    prepare(str(src), root / "tok10", shard_tokens=8192, progress=False, tokenizer=str(root / "tok"))
    prepare(str(src), root / "gpt10", shard_tokens=8192, progress=False)
    return root


def tok_race(root, out, *extra, a="gpt10", b="tok10"):
    """``bench race`` of arm a on ``root/A`` against arm b on ``root/B``, bench's --data the first."""
    return run_main(
        "bench",
        "race",
        "--arm",
        f"a={TOK_ARM} --data {root / a}",
        "--arm",
        f"b={TOK_ARM} --data {root / b}",
        *TOK_BASE,
        "--data",
        str(root / a),
        "--out",
        str(out),
        *extra,
    )


def no_run(*a, **k):
    raise AssertionError("a run started")


@pytest.mark.parametrize("target", [["--target-val-loss", "3"], []])
def test_arms_of_different_tokenizers_cannot_race_to_a_val_loss(target, tokdata, tmp_path, monkeypatch):
    monkeypatch.setattr(race, "spawn", no_run)
    out = tmp_path / "r"
    assert_user_error(
        tok_race(tokdata, out, *target), "a loss per token, which does not compare across tokenizers: give --target-bpb"
    )
    assert not out.exists()


def test_arms_whose_val_text_differs_are_refused_by_name(tokdata, tmp_path, monkeypatch):
    monkeypatch.setattr(race, "spawn", no_run)
    out = tmp_path / "r"
    proc = tok_race(tokdata, out, "--target-bpb", "3", a="gpt2", b="data")
    assert_user_error(proc, "the val text of arm(s) b (", "differs from arm a's")
    # one tokenizer: a val-loss target is allowed, and the val text is checked all the same
    proc = tok_race(tokdata, out, "--target-val-loss", "3", a="gpt10", b="gpt2")
    assert_user_error(proc, "the val text of arm(s) b (", "differs from arm a's")
    assert not out.exists()


def test_the_same_val_text_decodes_alike_from_either_tokenizer_and_other_text_does_not(tokdata):
    from gptspeed.bench.race_data import val_text_sha256

    same = val_text_sha256(str(tokdata / "gpt10"))
    assert val_text_sha256(str(tokdata / "tok10")) == same != val_text_sha256(str(tokdata / "data"))


@pytest.fixture(scope="module")
def multibyte(tmp_path_factory):
    """A folder of GPT-2 tokens whose characters take several byte-level tokens (accents, CJK, emoji)."""
    from gptspeed.data.prepare import prepare

    root = tmp_path_factory.mktemp("multibyte")
    words = ["naïve café", "日本語のテキスト", "🙂🚀 emoji", "Ελληνικά", "plain"]
    docs = [" ".join(words[(i + k) % len(words)] for k in range(3 + i % 4)) for i in range(40)]
    (root / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(str(root / "t.jsonl"), root / "mb", val_fraction=0.5, shard_tokens=256, progress=False)
    return root / "mb"


@pytest.mark.parametrize("folder", ["multibyte", "tok"])
def test_the_val_text_read_in_small_chunks_hashes_as_the_whole_split_decoded_at_once(tokdata, multibyte, folder):
    """Chunks cut only where a document starts: no character is split, whatever the chunk size."""
    import hashlib

    import numpy as np

    from gptspeed.bench.race_data import val_text_sha256
    from gptspeed.bpe import load_tokenizer_dir, resolve_tokenizer
    from gptspeed.data.shards import read_shard
    from gptspeed.data.train_data import find_train_data

    path = multibyte if folder == "multibyte" else tokdata / "data"
    data = find_train_data(str(path))
    data.close()
    ids = np.concatenate([np.asarray(read_shard(p), dtype=np.int64) for p in data.val_shards])
    tok = resolve_tokenizer("gpt2") if folder == "multibyte" else load_tokenizer_dir(tokdata / "tok")
    text = tok.decode(ids.tolist())
    assert np.count_nonzero(ids == tok.eot) > 3 and "\ufffd" not in text
    assert len(data.val_shards) > 1 or folder == "tok"  # documents carried across shards
    whole = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    for chunk in (1, 7, 64, len(ids) + 1):
        assert val_text_sha256(str(path), chunk=chunk) == whole


def test_arms_of_different_tokenizers_each_evaluate_their_whole_val_split():
    """The rule: one tokenizer, the race's --eval-tokens; different ones, 0 (the whole val split, the same text)
    for every arm, and a nonzero --eval-tokens given is refused, as it would be different text in each."""
    from gptspeed.bench import race_data

    tokenizers = {"g1": "gpt2", "g2": "gpt2", "t": "sha256:" + "0" * 64}
    real = race_data.data_tokenizer_identity
    try:
        race_data.data_tokenizer_identity = tokenizers.__getitem__
        assert race_data.arm_eval_tokens(["g1", "g2"], 256, given=True) == [256, 256]
        assert race_data.arm_eval_tokens(["g1", "t"], 32768, given=False) == [0, 0]
        assert race_data.arm_eval_tokens(["g1", "t"], 0, given=True) == [0, 0]
        with pytest.raises(GptspeedError, match="--eval-tokens 256 counts tokens"):
            race_data.arm_eval_tokens(["g1", "t"], 256, given=True)
    finally:
        race_data.data_tokenizer_identity = real


def test_a_race_of_tokenizers_trains_each_arm_on_its_data_and_records_it(tokdata, tmp_path, monkeypatch):
    from gptspeed import cli

    def in_process(cmd, log, timeout_s, stop=None, say=print):
        import contextlib

        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return cli.main(cmd[3:])  # [python, -m, gptspeed, train, ...]

    monkeypatch.setattr(race, "spawn", in_process)
    out = tmp_path / "r"
    proc = tok_race(tokdata, out, "--target-bpb", "100")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "race.json").read_text())
    recorded = {name: (d["data"], d["eval_tokens"]) for name, d in result["arm_data"].items()}
    assert recorded == {"a": (str(tokdata / "gpt10"), 0), "b": (str(tokdata / "tok10"), 0)}
    assert [(a["data"], a["eval_tokens"]) for a in result["arms"]] == [recorded["a"], recorded["b"]]
    for name, folder in (("a", "gpt10"), ("b", "tok10")):
        train = json.loads((out / "runs" / f"{name}-seed0" / "config.json").read_text())["train"]
        assert (train["data"], train["eval_tokens"], train["eval_bpb"]) == (str(tokdata / folder), 0, True)
    assert all(a["runs"][0]["reached"] for a in result["arms"])
