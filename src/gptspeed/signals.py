"""Signals that stop a run cleanly: Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any


class StopFlag:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) set ``signum``; the loop
    finishes its step, saves and exits 128+signum. The notice is printed once: later signals (a
    scheduler repeating SIGTERM while the checkpoint is written) only wait for the save -- printing
    from a handler that interrupted another print would raise "reentrant call" and kill the
    process before its resume line; SIGTERM and SIGHUP are then ignored (``SIG_IGN``, which also
    outlives the interpreter's shutdown) and the handlers are left so when the run ends. A second SIGINT raises KeyboardInterrupt at once (checkpoints
    are written atomically, so nothing is corrupted). Calling the flag says whether a signal arrived."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self, say=print):
        self.signum: int | None = None
        self.say = say
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
            self.say(f"\n{signal.Signals(signum).name} received: finishing this step and saving a checkpoint "
                     "(Ctrl-C again to quit now)", flush=True)

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
