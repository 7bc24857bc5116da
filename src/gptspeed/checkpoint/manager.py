"""The :class:`Checkpointer`: a run's stateful parts, registered by name, saved when due and
restored on resume -- in the run's format (:mod:`gptspeed.checkpoint.formats`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptspeed.checkpoint.formats import DcpFormat, PtFormat
from gptspeed.checkpoint.parts import OptimizerState, Stateful, load_part


class Checkpointer:
    """Saves and restores a run's registered stateful parts (the torchtitan checkpoint manager's
    shape: adding a piece of state is one :meth:`register` call). Which checkpoint a run resumes,
    and whether it may, is decided before the checkpointer exists (:mod:`gptspeed.resume`).

    Args:
        run_dir: the run folder.
        sharded: FSDP2 (:class:`~gptspeed.checkpoint.formats.DcpFormat`: the parts registered with
            ``sharded=True`` are saved by every rank); else one ``.pt`` file by rank 0
            (:class:`~gptspeed.checkpoint.formats.PtFormat`).
        is_main: this process is rank 0 (the one that writes files and seals).
        barrier: waits for every rank (a no-op in one process).
        keep: newest checkpoints of this run to keep.
        meta: what identifies the run (``config``, ``data``, ``world_size``, ``run_id``): saved in
            every checkpoint and its seal, as given (the configuration is final by then).
        every, last_step: when to save: every ``every`` steps (0: never) and at ``last_step``.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        sharded: bool = False,
        is_main: bool = True,
        barrier: Callable[[], None] = lambda: None,
        keep: int = 2,
        meta: dict[str, Any] | None = None,
        every: int = 0,
        last_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        fmt = DcpFormat if sharded else PtFormat
        self.format = fmt(self.run_dir, is_main, barrier, keep)
        self.sharded = sharded
        self.every, self.last_step = every, last_step
        self.meta = dict(meta or {})
        self.parts: dict[str, Stateful] = {}
        self._dcp_parts: set[str] = set()

    def register(self, name: str, part: Stateful, *, sharded: bool = False) -> None:
        """Add a stateful part under ``name``; ``sharded`` parts go through
        ``torch.distributed.checkpoint`` when the checkpointer is sharded."""
        self.parts[name] = part
        if sharded:
            self._dcp_parts.add(name)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a step to save at: every ``every`` steps, and the last step."""
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    def save_if_due(self, step: int, *, stopping: bool = False) -> Path | None:
        """Save ``step`` when it is :meth:`due`, or when the run is ``stopping`` (a signal); the
        checkpointer decides, as torchtitan's does. Returns the checkpoint written, or None."""
        return self.save(step) if stopping or self.due(step) else None

    def save(self, step: int) -> Path:
        """Write and seal the checkpoint of ``step`` (every rank calls this), then prune to
        ``keep``. GptspeedError if it cannot be written; the earlier checkpoints are untouched then."""
        part = self.parts.get("optimizer")
        layout = part.layout() if isinstance(part, OptimizerState) else None
        if self.sharded:
            return self.format.save(step, self.parts, self.meta, {"optimizer_layout": layout}, self._dcp_parts)
        return self.format.save(step, self.parts, self.meta, {"optimizer_layout": layout} if layout else {})

    def load(self, path: Path) -> dict[str, Any]:
        """Restore every registered part present in checkpoint ``path`` (verified already, see
        :func:`gptspeed.resume.find_resume_point`); returns the checkpoint's other entries
        (``step``, ``config`` ...). A weights-only checkpoint restores the model only. A part that
        does not fit is one line (:func:`~gptspeed.checkpoint.parts.load_part`)."""
        sharded = self._dcp_parts if self.sharded else set()
        state = self.format.load(Path(path), self.parts, sharded)
        for name, part in self.parts.items():
            if name in state and name not in sharded:
                load_part(path, name, part, state[name])
        return {k: v for k, v in state.items() if k not in self.parts}
