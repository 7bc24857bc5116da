"""The ``--on-nan`` policy: what a run does after a step whose loss or gradient was not finite.

The step itself never lets such a step update the weights or the optimizer state
(:meth:`gptspeed.step.TrainStep.optimizer_step`); this policy counts those steps on the device --
no host-device sync per step -- and reads the count only at log steps: ``stop`` ends the run in one
line naming the first bad step and the last good checkpoint; ``skip`` goes on past isolated bad
steps, until at least :data:`MAX_SKIPPED_SHARE` of the run's steps (and 3 or more) were skipped:
then the run is not training any more, and it stops as ``stop`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gptspeed.errors import GptspeedError

MAX_SKIPPED_SHARE = 0.5  # --on-nan skip: a run with at least this share of its steps skipped has diverged


class DivergencePolicy:
    """Non-finite steps since the last read (``bad_count``) and the first of them (``first_bad``),
    kept on ``device``."""

    def __init__(self, on_nan: str, device: torch.device):
        self.on_nan = on_nan
        self.bad_count = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    def note(self, bad: torch.Tensor, step: int) -> None:
        """Count step ``step`` if ``bad`` (a device bool), on the device: no sync."""
        self.bad_count += bad
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def check(self, skipped: int, steps_done: int, last_good: Callable[[], str], say: Callable[..., None]) -> int:
        """At a log step (one read of the device counters), for a run that skipped ``skipped`` steps
        before and has done ``steps_done``: GptspeedError when it diverged by the policy
        (``last_good()`` names the last good checkpoint for the line); else the steps skipped since
        the last read are said and returned, and the counters start again."""
        n_bad = int(self.bad_count.item())
        if not n_bad:
            return 0
        where = int(self.first_bad.item())
        total = skipped + n_bad
        if self.on_nan == "stop" or (total >= 3 and total >= MAX_SKIPPED_SHARE * steps_done):
            what = (
                f"non-finite loss or gradient at step {where} (that step did not update the weights)"
                if self.on_nan == "stop"
                else f"{total} of the {steps_done} steps so far had a non-finite loss or gradient and were skipped "
                f"(--on-nan skip goes on past isolated ones only)"
            )
            raise GptspeedError(
                f"training diverged: {what}; last good checkpoint: {last_good()}. "
                f"Try a lower --lr, more --warmup-steps, --dtype float32{', or --on-nan skip' if self.on_nan == 'stop' else ''}"
            )
        say(f"skipped {n_bad} step(s) with a non-finite loss or gradient (first at step {where})")
        self.bad_count.zero_()
        self.first_bad.fill_(-1)
        return n_bad
