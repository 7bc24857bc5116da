"""Several processes: joining the process group torchrun set up (a store per restart round),
telling a lost peer from a bug, leaving the group, and gradient-sync control for accumulation."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from typing import NoReturn

import torch

from gptspeed.errors import GptspeedError
from gptspeed.parallelize import is_ddp, unwrap
from gptspeed.runtime import Runtime


def init_distributed(rt: Runtime, timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (``env://``: MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), NCCL on CUDA and gloo otherwise, unless one exists or ``rt`` needs none.

    ``timeout_s`` bounds the rendezvous and every later collective (``init_process_group``'s
    ``timeout``). A rank that cannot reach the rendezvous raises GptspeedError naming the address
    instead of hanging or printing a stack trace. A gloo group joined is remembered for
    :func:`finish_process`. See
    https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group
    """
    import datetime

    import torch.distributed as dist

    global _joined_gloo
    if rt.world_size == 1 and rt.parallel != "fsdp":
        return
    if dist.is_available() and dist.is_initialized():
        return
    if not dist.is_available():
        raise GptspeedError("this PyTorch build has no torch.distributed")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one process with --parallel fsdp, no torchrun
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rt.rank))
    os.environ.setdefault("WORLD_SIZE", str(rt.world_size))
    if rt.device_type == "cuda":
        torch.cuda.set_device(rt.device)
    backend = "nccl" if rt.device_type == "cuda" else "gloo"
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = datetime.timedelta(seconds=timeout_s)
    start = time.monotonic()
    try:
        store = restart_store(timeout)
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=rt.device if rt.device_type == "cuda" else None,
            **({"store": store, "rank": rt.rank, "world_size": rt.world_size} if store else {}),
        )
        _joined_gloo = _joined_gloo or backend == "gloo"
    except (RuntimeError, ValueError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        msg = (str(e).splitlines()[0] if str(e) else type(e).__name__).rstrip(".")
        raise GptspeedError(
            f"rank {rt.rank} of {rt.world_size}: could not join the process group at {where} ({backend}) after "
            f"{time.monotonic() - start:.1f} s (timeout {timeout_s:g} s): {msg}. Check MASTER_ADDR / --rdzv-endpoint, "
            "the firewall, and that every node was launched"
        ) from e


def restart_store(timeout):
    """Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set), the rendezvous store torchrun gives
    (``torch.distributed.rendezvous("env://")``) inside a ``PrefixStore`` of this restart round;
    otherwise None (``init_process_group`` makes its own).

    Why: torchrun's agent keeps one store across restarts, and a process group writes the same keys
    every round (each rank's listening address, among them). After a rank died and torchrun
    restarted the group, a new rank could read its peer's address *from the dead round* before the
    peer wrote the new one, and fail at once in gloo's ``connectFullMesh`` ("Connection refused"):
    3 of 4 runs of a 15-line plain-PyTorch script failed so on a 2-core CPU, 0 of 6 with the prefix
    (pytorch/pytorch#167288 reports the like for NCCL). See https://pytorch.org/docs/stable/distributed.html#torch.distributed.PrefixStore
    """
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"gptspeed/restart_{restart}/", store)


PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
    "remote process exited",
)


def peer_lost(e: BaseException) -> bool:
    """Whether ``e``, raised by a collective, means another rank of the job is gone (killed, crashed,
    its node lost): a ``torch.distributed.DistError`` (``DistBackendError`` for NCCL), or gloo's
    plain RuntimeError naming a closed connection."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_LOST)


def lost_peer_error(rt, step: int, e: BaseException) -> GptspeedError:
    """The one line for a rank that lost contact with another (:func:`peer_lost`) after ``step``."""
    return GptspeedError(
        f"rank {rt.rank} of {rt.world_size}: lost contact with another rank after step {step} "
        f"({str(e).splitlines()[0][:160]}): a process of the job died or was killed. The newest sealed "
        "checkpoint is intact; torchrun --max-restarts restarts the group, which resumes from it"
    )


#: whether this process joined a gloo process group (CPU ranks): :func:`finish_process` then skips
#: the interpreter's teardown
_joined_gloo = False


def finish_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` (what ``gptspeed`` and ``python -m gptspeed`` do
    after the command returned). After a gloo process group, the interpreter's teardown is skipped:
    the ``atexit`` handlers run and stdout/stderr are flushed, then ``os._exit(code)``. Otherwise
    ``SystemExit(code)``: the ordinary exit.

    Why: a gloo process group outlives ``destroy_process_group`` once DDP or FSDP2 used it (its
    worker threads stay alive until the process ends), and a worker thread releases a finished
    collective's tensors a moment after the rank has seen it complete. When that moment falls in
    the interpreter's teardown, the release needs the GIL of a finalizing interpreter, the thread is
    ended by force inside a C++ destructor, and the rank dies with SIGABRT ("terminate called
    without an active exception") after its run was done and saved: torchrun then reports the job
    failed. Measured on a 2-core CPU: 1 FSDP resume in 40 under load; tests/support/gloo_exit.py (DDP built,
    one all_reduce, exit) 3 launches in 16 with 2 ranks, 3 in 6 with 4, and 0 in 16 through this
    function. pytorch/pytorch#179291 describes the same teardown race (its fix was
    withdrawn). Nothing of the run is lost by the skip: the trainer has closed its files, logs and
    trackers before returning."""
    if not _joined_gloo:
        raise SystemExit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def shutdown_distributed() -> None:
    """Leave the process group if this process is in one (end of training)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def grad_sync_control(train_model: torch.nn.Module, keep_weights: bool = False):
    """For gradient accumulation: ``sync(last: bool)`` returning a context manager to run one
    micro-step's forward and backward in, which reduces gradients across ranks only when ``last``
    is True -- DDP's ``no_sync()`` and FSDP2's ``set_requires_gradient_sync`` -- or None when the
    model is not data-parallel (the single-process path then pays nothing). ``keep_weights``
    (FSDP2, ``--cast-weights-once``): the unsharded weights are also kept after every backward but
    the last (``set_reshard_after_backward``), so the next micro-step's forward neither casts nor
    all-gathers them again; the last backward reshards, and the optimizer's update reaches the next
    step's copy."""
    inner = unwrap(train_model, keep_ddp=True)
    if is_ddp(inner):
        return lambda last: contextlib.nullcontext() if last else inner.no_sync()
    from torch.distributed.fsdp import FSDPModule

    if isinstance(inner, FSDPModule):

        def sync(last: bool):
            inner.set_requires_gradient_sync(last)
            if keep_weights:
                inner.set_reshard_after_backward(last)
            return contextlib.nullcontext()

        return sync
    return None
