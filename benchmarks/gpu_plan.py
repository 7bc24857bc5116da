"""The plan of a lent GPU's 15-minute window: its device commands, what each part should take on one H100
and what that rests on, and the window's total (``python3 benchmarks/gpu_session.py --plan`` prints it).

Every figure here is a measurement from the first GPU session (2026-11-27, one H100) or an estimate that
says what it rests on; none is a measurement of the parts it plans until a window has run them.
"""

from __future__ import annotations

WINDOW = ("window1", "window2", "window3")
# The documented device commands of one 15-minute window, in order: each one `gpu_session.py PHASE` command,
# typed as COMMAND_LINE says, with the run tool's carry [".carry"] and timeout_s RUN_TIMEOUT_S
COMMANDS = (("window1",), ("window2",), ("window3",))
COMMAND_LINE = "source .carry/setup.sh && python3 benchmarks/gpu_session.py {}"
# The window: WINDOW_S of device time for the session, the machine's start included (MACHINE_START s, 1-2 minutes),
# each command issued within GAP s of the one before returning (the machine goes back after 30 s idle):
# MACHINE_START[1] + 3 x RUN_TIMEOUT_S + 2 x GAP + GIVE_BACK = 895 s <= WINDOW_S. Three slots of RUN_TIMEOUT_S, no
# fourth: window3 takes the slot a rerun of window1 or window2 would (RERUN), run only when neither needed one
WINDOW_S = 900
MACHINE_START = (60, 120)
GAP = 10
GIVE_BACK = 5
RUN_TIMEOUT_S = 250  # the run tool's timeout_s for each command (its limit: 600)
SETUP = 15  # source .carry/setup.sh: pip installs the carried wheels into /tmp/site, prints the GPU (estimate)
BUDGET_S = float(RUN_TIMEOUT_S - SETUP - 5)  # the phases' budget (its clock starts after setup.sh): 230 s
# llm.c's rows run with its own flags: no GELU recompute, as its record (llm.c's GPT-2 124M run: -b 64 -t 1024
# -d 524288 -r 0, 140 ms a step on 8xH100, ~468k tokens/s per GPU); the record alone: B, micro-steps
# (-d = 64 x 1024 x 8 = 524,288), warm-up and timed steps
LLMC_FLAGS = "-r 0"
LLMC_RECORD = (64, 8, 2, 5)
# window1's interleaved rounds, at the record's 524,288 tokens a step: gptspeed's default (B=16 x 32), its B=64 form
# (x 8) and llm.c (-b 64 -r 0); 2 warm-up + 5 timed steps a process, as many of 2 rounds as the budget leaves
ROUND_ROWS = "gptspeed,llmc,B64"
ROUND_STEPS = (2, 5)
TUNE_BUDGET_S = 300.0  # window2: bench tune's --budget-s, cut to what the command has left ...
TUNE_MARGIN_S = 20.0  # ... less this, for its start and tuned.yaml before the part's timeout
RERUN = "window3"  # the command whose slot a rerun of an earlier one takes (then it waits for the next window)
# window3 (issue 52, item 4): what has never run on CUDA, in one short run of GPT-2 124M at T=1024 trained three
# times -- uninterrupted (in the background), stopped by SIGTERM once step STOP_AFTER is logged, then --resume'd
# to its end, its losses compared step by step -- then pytest -m cuda with what the budget leaves
RESUME_STEPS = 40
RESUME_RUN = (
    *("--recipe", "speedrun"),  # Muon, RoPE, QK-norm, ReLU^2, RMSNorm, value embeddings, WSD
    *("--align-to-docs", "--doc-mask"),  # rows start at <|endoftext|>; attention stops there (FlexAttention's mask)
    *("--attn-window", "512"),  # a sliding window, 128 tokens at step 0 growing to 512 at the last step
    *("--batch-size", "16", "--total-batch-tokens", "65536"),  # 1 to 4 micro-batches of 16k tokens a step:
    *("--batch-start-tokens", "16384", "--batch-warmup-steps", "10"),  # the batch-size warm-up over 10 steps
    "--eval-bpb",  # val bits per byte beside the val loss
    *("--ema-tail-ratio", "0.5", "--ema-horizon", "5", "--ema-blend", "0.5"),  # the tail average from step 20
    *(
        "--max-steps",
        str(RESUME_STEPS),
        "--eval-every",
        "20",
        "--save-every",
        "20",
        "--eval-tokens",
        "65536",
        "--log-every",
        "1",
    ),
)
STOP_AFTER = 22  # SIGTERM once this step is logged: after the evaluation and save at 20, inside the tail average
RESUME_MICRO_BATCHES = (67, 139)  # micro-batches of 16k tokens in steps 1-22 and in all 40: the warm-up's 10 steps
#                                   take 1, 1, 1, 1, 2, 2, 2, 3, 3, 3 (schedules.grad_accum_at), then 4 a step

# ------------------------------------------------------------------ the estimates the plan rests on
# For one H100 at GPT-2 124M, T=1024, B=16. "measured" figures come from the first GPU session
# (2026-11-27, H100 80GB HBM3, torch 2.11.0+cu130: benchmarks/runs/2026-11-27-h100/, its summary.json
# and verify.json); the others are still estimates, and say what they rest on.
START = 10  # a fresh Python process: import torch, initialise CUDA, build the model (estimate)
COLD = (30, 45)  # a cold torch.compile of train's graph: measured 19-28 s as verify's first step (compile 27.5,
#                  flash 19.2, vocab-pad 21.6) and ~35 s in the peers' first round; 45 at the upper end
WARM = 5  # the same graph from the FX-graph cache: measured 3.4 s (verify's fused-adamw first step)
PREPARE = 5  # gptspeed prepare shakespeare-gutenberg: 1.1-2.6 s on a 2-core CPU (measured); 0 when carried prepared
LLMC_BUILD = (130, 170)  # make train_gpt2cu USE_CUDNN=1 for sm_90: cudnn_att.cpp alone took 96 CPU-s (nvcc 13.0,
#   frontend 1.32.0, on this project's 2-core CPU machine: benchmarks/llmc_cudnn_att.nm-u.txt), then train_gpt2.cu
#   (~30-50 s, llm.c PRs #322 and #386: not compiled here, no cuBLAS headers); it runs beside the profile
LLMC_BUILD_TIMEOUT = 170  # each make's timeout: the cuDNN build, then (~40 s) one without cuDNN if it fails
LLMC_START = 10  # train_gpt2cu's start to its first step: 124M random weights on the host, allocations (estimate)
TRACE = 30  # bench profile: exporting the Chrome trace of 3 steps, the breakdown, gzip (estimate)
# ms per micro-batch of 16,384 tokens, measured (verify's median steps / 2): bf16 compiled with SDPA, vocab 50304 and
# fused AdamW 36.2 (llm.c's record: 35 ms per 16k tokens per GPU on 8xH100)
MS = {"bf16": 37, "speedrun": 45}  # speedrun: an estimate (the default's rate, plus Muon and value embeddings)
# a train process's seconds beyond its steps with its graph from the compile cache: measured 22 s (the run stopped
# by SIGINT and its resume: start, the step-0 evaluation, load, a save) to 33 s (the uninterrupted run: 3 evaluations,
# 2 saves) in the first session's first/summary.json (2026-11-27); window3's checkpoints are larger (value
# embeddings, Muon's and the tail average's state): the upper end taken
PROCESS = (22, 33)
FLEX_COLD = (20, 40)  # FlexAttention's kernels for the doc mask and window and the evaluation's no-grad graph,
#                       compiled cold, beyond COLD (estimate); two runs compiling side by side on 16 cores
SIDE_BY_SIDE = 10  # ... each taken as this much slower than alone (estimate)
PYTEST_NCCL = 12.5  # pytest of the one-GPU NCCL DDP step: measured 12.5 s (cudatests, 2026-11-27)
PYTEST_CUDA = 80  # window3's pytest -m cuda (15 tests): 9 of them took 41.7 s (cudatests, 2026-11-27), the 6 added
#                   since taken at the same rate (estimate)


def _steps(n: int, micro: int, kind: str = "bf16") -> float:
    return n * micro * MS[kind] / 1000


def tune_budget(left_s: float) -> float:
    """window2's ``bench tune --budget-s`` with ``left_s`` seconds left of the command's budget: at most
    :data:`TUNE_BUDGET_S`, leaving 15 s for the packing and :data:`TUNE_MARGIN_S` for its start and end."""
    return min(TUNE_BUDGET_S, left_s - 15 - TUNE_MARGIN_S)


def window_parts(phase: str, end: int) -> list[tuple[str, float, str]]:
    """The parts of a window phase in run order: ``(part, seconds on one H100, what they rest on)``, planned
    (``end`` 0) or at the upper end (``end`` 1) of each estimate's range (:data:`COLD`, :data:`LLMC_BUILD`, ...)."""
    prepare = ("prepare", PREPARE, "shakespeare-gutenberg tokenized (0 when carried in .carry/prepared)")
    parts = {"window1": _window1_parts, "window2": _window2_parts, "window3": _window3_parts}[phase]
    return [prepare, *parts(end)]


def _window2_parts(end: int) -> list[tuple[str, float, str]]:
    budget = tune_budget(BUDGET_S - PREPARE)
    why = (
        f"bench tune's own --budget-s {budget:.0f} (at most {TUNE_BUDGET_S:.0f}, cut to what the command "
        f"has left; each row a fresh process, ~{START + COLD[end] + 1:.0f} s with a cold compile), its start and tuned.yaml"
    )
    return [("tune", budget + 10, why)]


def _window1_parts(end: int) -> list[tuple[str, float, str]]:
    """llm.c's build (``LLMC_BUILD[end]`` s, beside the profile and the default: 0 s of its own), the
    profile, the default, llm.c's record and the rounds."""
    cold, build = COLD[end], LLMC_BUILD[end]
    b, accum, warm, steps = LLMC_RECORD
    profile = START + cold + _steps(11, 1) + TRACE
    llmc = LLMC_START + _steps(warm + steps, b * accum // 16)
    row = START + cold + _steps(sum(ROUND_STEPS), 32)
    row_warm = START + WARM + _steps(sum(ROUND_STEPS), 32)
    wait = max(0.0, build - profile - row)
    return [
        (
            "llmc-build",
            0,
            f"llm.c's make with cuDNN, ~{build:.0f} s beside the next parts (its timeout {LLMC_BUILD_TIMEOUT})",
        ),
        (
            "profile",
            profile,
            "bench profile fused-adamw: a fresh process, a cold compile, 8 + 3 steps at B=16, the trace",
        ),
        (
            "default",
            row,
            f"gptspeed train's default at 524,288 tokens a step, {ROUND_STEPS[0]} + {ROUND_STEPS[1]} steps, cold",
        ),
        (
            "llmc-record",
            wait + llmc,
            f"waits {wait:.0f} s for the build; train_gpt2cu -b {b} -d {b * 1024 * accum} -r 0, "
            f"{warm} + {steps} steps at gptspeed's measured 36.2 ms per 16k tokens",
        ),
        (
            "rounds",
            row_warm + llmc + row + 2 * row_warm + llmc,
            f"{ROUND_ROWS} at 524,288 tokens a step, {ROUND_STEPS[0]} + {ROUND_STEPS[1]} steps a process: round 1 "
            f"~{row_warm + llmc + row:.0f} s (the default from the compile cache, B=64 cold), round 2 "
            f"~{2 * row_warm + llmc:.0f} s",
        ),
    ]


def _window3_parts(end: int) -> list[tuple[str, float, str]]:
    """The uninterrupted run (in the background, beside the stopped run and its resume), the run stopped by
    SIGTERM, its resume, then the NCCL test and the rest of ``pytest -m cuda`` (what the budget leaves)."""
    first, whole = (m * MS["speedrun"] / 1000 for m in RESUME_MICRO_BATCHES)
    cold = COLD[end] - WARM + FLEX_COLD[end] + SIDE_BY_SIDE
    ref, stopped, resumed = PROCESS[end] + cold + whole, PROCESS[end] + cold + first, PROCESS[end] + whole - first
    steps = f"{MS['speedrun']} ms per 16k-token micro-batch"
    return [
        (
            "train-ref",
            0,
            f"the {RESUME_STEPS}-step run uninterrupted, ~{ref:.0f} s beside the next two (a cold compile with "
            f"FlexAttention's kernels, {RESUME_MICRO_BATCHES[1]} micro-batches at {steps}, 3 evaluations, 2 saves)",
        ),
        ("train-stopped", stopped, f"the same run, cold beside it, stopped by SIGTERM after step {STOP_AFTER}"),
        ("train-resume", resumed, "its --resume to the end: the graphs from the compile cache"),
        (
            "train-ref-wait",
            max(0.0, ref - stopped - resumed),
            "the uninterrupted run waited for, then the losses compared step by step",
        ),
        ("pytest-nccl", PYTEST_NCCL, "the one-GPU NCCL DDP step (measured 12.5 s on the H100)"),
        ("pytest-cuda", PYTEST_CUDA, "pytest -m cuda but the verify, tune and NCCL tests, stopped at the budget"),
    ]


def estimate(phase: str) -> tuple[float, float, str] | None:
    """``(seconds planned, seconds at the upper end, what they rest on)`` for a window ``phase`` on one H100
    (the upper end: each estimate at the top of its range, :func:`window_parts`), each at most the
    budget (its last part is cut there: :func:`cut_at_budget`); None for the older phases."""
    if phase not in WINDOW:
        return None
    mid, high = (window_parts(phase, end) for end in (0, 1))
    why = "; ".join(f"{p} ~{s:.0f} s: {w}" for p, s, w in mid) + cut_at_budget(mid)
    return round(min(BUDGET_S, sum(s for _, s, _ in mid))), round(min(BUDGET_S, sum(s for _, s, _ in high))), why


def cut_at_budget(parts: list[tuple[str, float, str]]) -> str:
    """What the budget leaves the last part, said when it is less than the part's estimate ('' else)."""
    before, (name, sec, _) = sum(s for _, s, _ in parts[:-1]), parts[-1]
    left = BUDGET_S - 15 - before
    return "" if left >= sec else f" -- the budget leaves {name} ~{max(0.0, left):.0f} s of its ~{sec:.0f}: what fits"


def command_estimate(cmd: tuple[str, ...]) -> tuple[float, float]:
    """A documented command's ``(seconds planned, upper end)``: setup.sh, then its phases."""
    return SETUP + sum(estimate(p)[0] for p in cmd), SETUP + sum(estimate(p)[1] for p in cmd)


def window_total() -> tuple[float, float]:
    """The whole window's device time, ``(planned, at most)``: the machine's start, the commands and the gaps
    between them, and the give-back (planned: the start's lower end and the commands' estimates; at most: the
    start's upper end and each command its full ``timeout_s``, the last slot -- :data:`RERUN`'s -- taken
    instead by a rerun of an earlier command when one needs it: the same total)."""
    gaps = (len(COMMANDS) - 1) * GAP + GIVE_BACK
    planned = MACHINE_START[0] + sum(command_estimate(c)[0] for c in COMMANDS) + gaps
    return planned, MACHINE_START[1] + len(COMMANDS) * RUN_TIMEOUT_S + gaps


def plan_lines() -> list[str]:
    """The window's commands as typed on the device, with their estimates and what they rest on, and the
    window's total (``--plan``)."""
    out = []
    for cmd in COMMANDS:
        mid, high = command_estimate(cmd)
        out.append(
            f"{COMMAND_LINE.format(' '.join(cmd))}\n    ~{mid / 60:.1f} min (up to {high / 60:.1f}; run tool: "
            f'carry [".carry"], timeout_s {RUN_TIMEOUT_S}) -- setup.sh ~{SETUP} s; '
            + "; ".join(estimate(p)[2] for p in cmd)
        )
    planned, most = window_total()
    out.append(
        f"window total: ~{planned / 60:.1f} min planned; at most {most / 60:.1f} min of {WINDOW_S / 60:.0f} -- the "
        f"machine's start {MACHINE_START[1]} s, each of the {len(COMMANDS)} commands its timeout_s {RUN_TIMEOUT_S} s, "
        f"{GAP} s between calls, give_back; no room for a fourth: {RERUN} runs in the slot of a rerun, so when "
        f"{' or '.join(c[0] for c in COMMANDS if c[0] != RERUN)} must be rerun (a transfer failed, the machine was "
        f"taken back), rerun it instead and leave {RERUN} to the next window"
    )
    out.append(
        f"estimates for one H100 (an H200 should be no slower), not measurements: cold compile {COLD[0]}-{COLD[1]} s "
        f"(measured 19-35), {MS['bf16']} ms per 16k-token micro-batch (measured 36.2; the speedrun recipe's "
        f"{MS['speedrun']} estimated), a process's start ~{START} s, "
        f"llm.c's build {LLMC_BUILD[0]}-{LLMC_BUILD[1]} s (cudnn_att.cpp measured at 96 CPU-s on the CPU machine); "
        f"the budget stops each command {BUDGET_S:.0f} s after setup.sh, packing what finished"
    )
    return out
