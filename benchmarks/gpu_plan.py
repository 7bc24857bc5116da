"""The plan of a lent GPU's 15-minute window: its device commands, what each part should take on one H100
and what that rests on, and the window's total (``python3 benchmarks/gpu_session.py --plan`` prints it).

Every figure here is a measurement from the first GPU session (2026-11-27, one H100) or an estimate that
says what it rests on; none is a measurement of the parts it plans until a window has run them.
"""

from __future__ import annotations

WINDOW = ("window1", "window2")
# The documented device commands of one 15-minute window, in order: each one `gpu_session.py PHASE` command,
# typed as COMMAND_LINE says, with the run tool's carry [".carry"] and timeout_s RUN_TIMEOUT_S
COMMANDS = (("window1",), ("window2",))
COMMAND_LINE = "source .carry/setup.sh && python3 benchmarks/gpu_session.py {}"
# The window: WINDOW_S of device time for the session, the machine's start included (MACHINE_START s, 1-2 minutes),
# the second command issued within GAP s of the first returning (the machine goes back after 30 s idle), and one
# command's rerun to spare: MACHINE_START[1] + 3 x RUN_TIMEOUT_S + 2 x GAP + GIVE_BACK <= WINDOW_S
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
MS = {"bf16": 37}


def _steps(n: int, micro: int, kind: str = "bf16") -> float:
    return n * micro * MS[kind] / 1000


def tune_budget(left_s: float) -> float:
    """window2's ``bench tune --budget-s`` with ``left_s`` seconds left of the command's budget: at most
    :data:`TUNE_BUDGET_S`, leaving 15 s for the packing and :data:`TUNE_MARGIN_S` for its start and end."""
    return min(TUNE_BUDGET_S, left_s - 15 - TUNE_MARGIN_S)


def window_parts(phase: str, cold: float, build: float) -> list[tuple[str, float, str]]:
    """The parts of a window phase in run order: ``(part, seconds on one H100, what they rest on)`` with a
    cold compile of ``cold`` s and llm.c's build of ``build`` s (run beside the profile: 0 s of its own)."""
    prepare = ("prepare", PREPARE, "shakespeare-gutenberg tokenized (0 when carried in .carry/prepared)")
    if phase == "window2":
        budget = tune_budget(BUDGET_S - PREPARE)
        why = (
            f"bench tune's own --budget-s {budget:.0f} (at most {TUNE_BUDGET_S:.0f}, cut to what the command "
            f"has left; each row a fresh process, ~{START + cold + 1:.0f} s with a cold compile), its start and tuned.yaml"
        )
        return [prepare, ("tune", budget + 10, why)]
    b, accum, warm, steps = LLMC_RECORD
    profile = START + cold + _steps(11, 1) + TRACE
    llmc = LLMC_START + _steps(warm + steps, b * accum // 16)
    row = START + cold + _steps(sum(ROUND_STEPS), 32)
    row_warm = START + WARM + _steps(sum(ROUND_STEPS), 32)
    wait = max(0.0, build - profile - row)
    return [
        prepare,
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


def estimate(phase: str) -> tuple[float, float, str] | None:
    """``(seconds planned, seconds at the upper end, what they rest on)`` for a window ``phase`` on one H100
    (the upper end: a cold compile of ``COLD[1]`` s, llm.c's build ``LLMC_BUILD[1]`` s), each at most the
    budget (its last part is cut there: :func:`cut_at_budget`); None for the older phases."""
    if phase not in WINDOW:
        return None
    mid, high = (window_parts(phase, c, b) for c, b in zip(COLD, LLMC_BUILD))
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
    """The whole window's device time, ``(planned, at most)``: the machine's start, the two commands and the
    gaps between them (planned: their estimates, give-back included; at most: the start's upper end, each
    command its full ``timeout_s``, and a rerun of one of them)."""
    planned = MACHINE_START[0] + sum(command_estimate(c)[0] for c in COMMANDS) + GAP + GIVE_BACK
    return planned, MACHINE_START[1] + 3 * RUN_TIMEOUT_S + 2 * GAP + GIVE_BACK


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
        f"machine's start {MACHINE_START[1]} s, each command its timeout_s {RUN_TIMEOUT_S} s, {GAP} s between calls, "
        f"give_back, and one command's rerun to spare"
    )
    out.append(
        f"estimates for one H100 (an H200 should be no slower), not measurements: cold compile {COLD[0]}-{COLD[1]} s "
        f"(measured 19-35), {MS['bf16']} ms per 16k-token micro-batch (measured 36.2), a process's start ~{START} s, "
        f"llm.c's build {LLMC_BUILD[0]}-{LLMC_BUILD[1]} s (cudnn_att.cpp measured at 96 CPU-s on the CPU machine); "
        f"the budget stops each command {BUDGET_S:.0f} s after setup.sh, packing what finished"
    )
    return out
