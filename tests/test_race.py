"""bench --race (issue 32): time to a target val loss from each run's metrics, arms interleaved,
the statistics of repeated runs, and the files it writes. The runs go through ``gptspeed train``'s
own code, in this process (a subprocess per run is what a user gets; here it would cost seconds
of interpreter start-up per run)."""

import json
import math

import pytest

from conftest import TINY_MODEL, assert_user_error, flags, run_main
from gptspeed.bench import race
from gptspeed.errors import GptspeedError


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
    assert hit == {"reached": True, "time_to_target_s": pytest.approx(0.5), "tokens_to_target": 0,
                   "steps_to_target": 5, "final_val_loss": 8.0}
    assert race.time_to_target(curve, 7.0)["reached"] is False


def test_the_summary_gives_means_ratios_and_a_one_sided_welch_p_value():
    def arm(name, times):
        a = race.Arm(name, [])
        a.runs = [{"seed": i, "curve": [{"step": 0, "tokens": 0, "train_s": 0.0, "val_loss": 11.0},
                                        {"step": 10, "tokens": 100, "train_s": t, "val_loss": 3.0}]}
                  for i, t in enumerate(times)]
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

    def in_process(cmd, log, timeout_s):
        import contextlib

        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return cli.main(cmd[3:])  # [python, -m, gptspeed, train, ...]

    monkeypatch.setattr(race, "spawn", in_process)
    shape = flags(dict(TINY_MODEL, batch_size=4, max_steps=6, eval_tokens=256, warmup_steps=1, lr=3e-3, dtype="float32"))
    out = tmp_path / "race"
    proc = run_main("bench", "--race", "--arm", f"plain={' '.join(shape)}",
                    "--arm", f"modern=--recipe modern {' '.join(shape)}", "--seeds", "2", "--preset", "pico",
                    "--data", str(shakespeare_data), "--device", "cpu", "--eval-every", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "race.json").read_text())
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
    order = [line.split(":")[1].strip() for line in proc.stdout.splitlines() if line.startswith("race:") and "final" not in line]
    assert order == ["plain seed 0", "modern seed 0", "plain seed 1", "modern seed 1"]  # interleaved


@pytest.mark.parametrize("args, message", [
    (["--arms", "gpt3"], "--arms: unknown recipe 'gpt3'"),
    (["--arm", "nameless"], 'give NAME="FLAGS"'),
    (["--arm", "a=--no-such-flag"], "arm a: '--no-such-flag' are not gptspeed train flags"),
    (["--arm", "a=--lr 1", "--arm", "a=--lr 2"], "arm names must differ"),
    ([], "--race needs arms"),
    (["--arms", "gpt2", "--seeds", "0"], "--seeds must be at least 1"),
])
def test_bad_race_arguments_are_one_line(args, message, tmp_path):
    assert_user_error(run_main("bench", "--race", *args, "--preset", "pico", "--device", "cpu",
                               "--out", str(tmp_path / "r")), message)


def test_recipes_are_train_settings():
    from gptspeed.configure import build_train_config

    modern = build_train_config("pico", {}, recipe_name="modern")
    assert modern.model.pos_emb == "rope" and modern.optim.lr_schedule == "wsd" and modern.model.non_gpt2_switches()
    assert modern.optim.optimizer == "muon" and modern.model.tie_embeddings  # the race's winner keeps the tied head
    assert build_train_config("pico", {}, recipe_name="gpt2").model.non_gpt2_switches() == []
    with pytest.raises(GptspeedError, match="unknown recipe 'moden'.*did you mean 'modern'"):
        build_train_config("pico", {}, recipe_name="moden")
    flagged = build_train_config("pico", {"pos_emb": "learned"}, recipe_name="modern")  # flags override a recipe
    assert flagged.model.pos_emb == "learned" and flagged.model.qk_norm
    assert not math.isnan(modern.optim.decay_ratio)
