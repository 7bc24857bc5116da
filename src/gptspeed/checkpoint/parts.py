"""The stateful parts of a run besides the loader and the trainer's counters: RNG states, the
model, the optimizer (each with ``state_dict()`` / ``load_state_dict()``, the torchtitan /
``torch.distributed.checkpoint.stateful.Stateful`` protocol), and :func:`load_part`, which turns a
part that does not fit its checkpoint into one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from gptspeed.errors import GptspeedError


class Stateful(Protocol):
    """A piece of run state: ``state_dict()`` returns plain data and tensors; ``load_state_dict``
    restores it exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """The CPU RNG and, on CUDA, the device's RNG, as a stateful part."""

    def __init__(self, device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        import torch

        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"torch": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and state.get("cuda") is not None:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class ModelState:
    """The model's weights as a stateful part. ``sharded`` (FSDP2): DTensor shards through
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict``;
    otherwise the plain module's ``state_dict`` (full tensors, the usual parameter names)."""

    def __init__(self, model, sharded: bool = False):
        self.model, self.sharded = model, sharded

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model)
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state)
        else:
            self.model.load_state_dict(state)


def optimizers_of(optimizer) -> list:
    """The ``torch.optim.Optimizer`` objects behind ``optimizer`` (Muon + AdamW: both)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


class OptimizerState:
    """The optimizer's state as a stateful part. ``sharded`` (FSDP2): every underlying
    ``torch.optim.Optimizer`` (both of :class:`gptspeed.optim.MuonWithAdamW`) through
    ``get_optimizer_state_dict(model, optimizers)``: one dict keyed by parameter name, param
    groups in optimizer order; otherwise the optimizer's own ``state_dict``."""

    def __init__(self, model, optimizer, sharded: bool = False):
        self.model, self.optimizer, self.sharded = model, optimizer, sharded

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, optimizers_of(self.optimizer))
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.model, optimizers_of(self.optimizer), state)
        else:
            self.optimizer.load_state_dict(state)

    def layout(self) -> list[list]:
        """``[[name, param groups], ...]`` per underlying optimizer, to split a consolidated
        name-keyed state back into the optimizer's own form."""
        names = list(getattr(self.optimizer, "names", ["optimizer"]))
        return [[n, len(o.param_groups)] for n, o in zip(names, optimizers_of(self.optimizer))]


def load_part(path: Path, name: str, part: Stateful, state: Any) -> None:
    """``part.load_state_dict(state)``, with a checkpoint whose ``name`` does not fit the part
    (other tensor shapes or names: a checkpoint whose seal does not describe its content, or
    ``--force-resume`` with another model shape) as one GptspeedError line naming both."""
    try:
        part.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()
        detail = next(
            (
                line.strip()
                for line in first
                if "size mismatch" in line or "Missing key" in line or "Unexpected key" in line
            ),
            first[0] if first else type(e).__name__,
        )
        raise GptspeedError(
            f"checkpoint {Path(path).name}: its {name} state does not fit this run ({detail[:200]}): "
            "resume with the settings it was written with, or start a new --out"
        ) from None
