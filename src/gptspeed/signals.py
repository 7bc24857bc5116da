"""Signals that stop a run cleanly, in bounded time: Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any


class StopFlag:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) set ``signum``; the loop
    stops -- in one process at the unfinished step's next micro-batch, leaving that step; under
    torchrun at the next log step, where the ranks agree -- saves the last finished step and
    exits 128+signum (``ranks``: under torchrun, for the notice). The notice is printed once: later signals (a
    scheduler repeating SIGTERM while the checkpoint is written) only wait for the save -- printing
    from a handler that interrupted another print would raise "reentrant call" and kill the
    process before its resume line; SIGTERM and SIGHUP are then ignored (``SIG_IGN``, which also
    outlives the interpreter's shutdown) and the handlers are left so when the run ends. A second SIGINT raises KeyboardInterrupt at once (checkpoints
    are written atomically, so nothing is corrupted). Calling the flag says whether a signal arrived."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self, say=print, *, ranks: bool = False, doing: str | None = None):
        self.signum: int | None = None
        self.say = say
        self.doing = doing or (  # what the notice says is done now (another command than train: its own words)
            "finishing this step; the ranks stop together at the next log step and save"
            if ranks
            else "leaving this step at its next micro-batch and saving the last finished one"
        )
        # asked between micro-batches (gptspeed.step.TrainStep): one process only -- a rank that left
        # a step alone would leave the others waiting in its gradient all-reduce
        self.mid_step = None if ranks else self
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # already stopping: the save goes on
        self.signum = signum
        for repeat in self.SIGNALS:  # repeats of SIGTERM / SIGHUP are ignored by the OS from here to the exit
            if repeat != signal.SIGINT:
                signal.signal(repeat, signal.SIG_IGN)
        with contextlib.suppress(RuntimeError):  # "reentrant call": the signal interrupted a print
            self.say(f"\n{signal.Signals(signum).name} received: {self.doing} (Ctrl-C again to quit now)", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def agree_on_stop(stop: StopFlag, rt) -> int | None:
    """The signal that stops the run, agreed by all ranks of ``rt`` (one all-reduce; the trainer
    asks at log steps only); ``stop.signum`` in one process."""
    if not rt.distributed:
        return stop.signum
    import torch
    import torch.distributed as dist

    sig = torch.tensor([stop.signum or 0], device=rt.device)
    dist.all_reduce(sig, op=dist.ReduceOp.MAX)
    return int(sig.item()) or None
