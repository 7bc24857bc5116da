"""Optimizer construction: the registry of optimizers (:data:`OPTIMIZERS`), AdamW and Muon+AdamW.

AdamW (Loshchilov & Hutter 2019) with weight decay on tensors of 2 or more dimensions only
(matmul weights and embeddings; not biases or LayerNorm gains), as in GPT-3 / nanoGPT. Each param
group carries an ``lr_mult``; the learning rate of each step and its warm-ups are
:mod:`gptspeed.schedules`'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gptspeed.config import OPTIMIZERS as CONFIG_OPTIMIZERS
from gptspeed.config import OptimConfig
from gptspeed.errors import GptspeedError


def param_groups(
    model: torch.nn.Module, weight_decay: float, cfg: OptimConfig | None = None, params=None
) -> list[dict]:
    """AdamW's param groups over ``params`` (default: every trainable parameter of ``model``; tied
    weights count once). By default two: tensors with ``dim >= 2`` decayed, the rest not, each with
    ``lr_mult`` 1. With ``cfg.embed_lr``, ``head_lr`` or ``scalar_lr`` set, or their ``*_lr_ratio``
    (:meth:`OptimConfig.group_lr`; the modded-nanogpt speedrun's per-group Adam rates), four: the
    matrices, the ``nn.Embedding`` weights, the untied LM head, the gains and biases, each with ``lr_mult`` = its peak rate / ``cfg.lr`` (the schedule
    scales every group); empty groups are left out."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]  # parameters() de-duplicates ties
    rates = ({"matrix": None} | {g: cfg.group_lr(g) for g in ("embed", "head", "scalar")}) if cfg is not None else {}
    if not any(rates.values()):
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return [dict(g, lr_mult=1.0) for g in groups]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_ids = {id(head.weight)} - embeddings if isinstance(head, torch.nn.Linear) else set()

    def kind(p: torch.nn.Parameter) -> str:
        if id(p) in embeddings:
            return "embed"
        if id(p) in head_ids:
            return "head"
        return "matrix" if p.dim() >= 2 else "scalar"

    groups = []
    for name, lr in rates.items():
        members = [p for p in params if kind(p) == name]
        if members:
            decay = weight_decay if name != "scalar" else 0.0
            groups.append({"params": members, "weight_decay": decay, "lr_mult": (lr or cfg.lr) / cfg.lr})
    return groups


def fused_adamw_available(device_type: str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` has a kernel for this device type (PyTorch docs:
    CUDA, and CPU / MPS from PyTorch 2.4 / 2.5)."""
    return device_type in ("cuda", "cpu", "mps")


@dataclass(frozen=True)
class OptimizerSpec:
    """What gptspeed needs to know of an optimizer, in one place (its entry in :data:`OPTIMIZERS`).

    ``build(model, cfg, device_type) -> (optimizer, skips_on_device)``: the optimizer over the
    model's parameters (each param group carrying ``lr_mult``: the trainer sets ``group["lr"] = lr
    * lr_mult`` every step), and whether it skips a non-finite step on the device by itself
    (AdamW's ``found_inf`` argument, which :meth:`gptspeed.step.TrainStep.optimizer_step` sets:
    no host-device sync; otherwise the step reads the flag, one sync a step). ``grad_scaler``:
    whether it works under float16's GradScaler (``scaler.step`` unscales and skips). ``verify_rtol``:
    the least relative loss tolerance of its ``bench verify`` rungs (None: the dtype's)."""

    name: str
    build: Callable[[torch.nn.Module, OptimConfig, str], tuple[Any, bool]]
    grad_scaler: bool = True
    verify_rtol: float | None = None
    doc: str = ""


#: the optimizers ``--optimizer`` names, by name (:func:`register_optimizer` adds one)
OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Make ``spec`` an ``--optimizer`` choice: adding an optimizer is this one call (and its
    builder). Its name joins the setting's declared choices (:data:`gptspeed.config.OPTIMIZERS`)."""
    OPTIMIZERS[spec.name] = spec
    if spec.name not in CONFIG_OPTIMIZERS:
        CONFIG_OPTIMIZERS.append(spec.name)
    return spec


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered optimizer ``name``; GptspeedError naming the choices for another."""
    if name not in OPTIMIZERS:
        raise GptspeedError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device_type: str):
    """The optimizer ``cfg.optimizer`` names (:data:`OPTIMIZERS`); returns ``(optimizer,
    skips_on_device)`` (see :class:`OptimizerSpec`)."""
    return optimizer_spec(cfg.optimizer).build(model, cfg, device_type)


def build_adamw(model: torch.nn.Module, cfg: OptimConfig, device_type: str):
    """AdamW over :func:`param_groups`. ``cfg.fused_adamw``: None picks the fused kernel where
    available (then a non-finite step is skipped on the device); True demands it (ValueError from
    torch if the device has none); False uses PyTorch's default implementation."""
    fused = fused_adamw_available(device_type) if cfg.fused_adamw is None else cfg.fused_adamw
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )
    return opt, fused


def build_muon(model: torch.nn.Module, cfg: OptimConfig, device_type: str):
    """A :class:`MuonWithAdamW` (Muon for the blocks' 2-D weights, AdamW -- fused where available --
    for the rest). Muon has no ``found_inf`` argument: the step reads the non-finite flag."""
    fused = fused_adamw_available(device_type) if cfg.fused_adamw is None else cfg.fused_adamw
    return MuonWithAdamW(model, cfg, fused), False


def muon_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(hidden, rest)``: the 2-D weights inside the transformer blocks (``transformer.h.*``:
    attention and MLP matrices) for Muon, and everything else (token and position embeddings, the
    LM head tied to ``wte``, LayerNorm gains, biases) for AdamW. Tied weights count once."""
    hidden, rest, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (hidden if p.dim() == 2 and name.startswith("transformer.h.") else rest).append(p)
    return hidden, rest


class MuonWithAdamW:
    """Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; ``torch.optim.Muon``)
    for the hidden 2-D weights and AdamW for the rest, stepped together, as modded-nanogpt does.

    Muon: SGD momentum ``cfg.muon_momentum`` (Nesterov) whose update is orthogonalised by 5
    Newton-Schulz iterations in bf16, learning rate ``cfg.muon_lr``, decoupled weight decay
    ``cfg.weight_decay``. Learning-rate adjustment: ``adjust_lr_fn="original"`` (torch's default,
    Keller Jordan's: ``lr * sqrt(max(1, rows / cols))``), so ``--muon-lr`` is on the scale of
    modded-nanogpt's (0.02-0.05) and independent of AdamW's; ``"match_rms_adamw"`` (Moonshot's
    ``0.2 * sqrt(max(rows, cols))``, which would let Muon share AdamW's lr) is not used.
    AdamW: ``cfg.lr``, betas, eps, weight decay on the embeddings only (2-D), as :func:`param_groups`.

    Quacks like one ``torch.optim.Optimizer`` for the trainer: ``param_groups`` (both
    optimizers' groups; each has ``lr_mult`` = its peak lr / ``cfg.lr`` so the schedule scales
    both), ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict`` (``{"adamw": ..., "muon": ...}``).
    GradScaler (float16) is not supported with it: use bf16 or fp32.
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, fused: bool):
        hidden, rest = muon_params(model)
        self.muon = torch.optim.Muon(
            hidden,
            lr=cfg.muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=True,
            adjust_lr_fn="original",
        )
        self.adamw = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay, cfg, params=rest),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused or None,
        )
        for g in self.muon.param_groups:
            g["lr_mult"] = cfg.muon_lr / cfg.lr

    names = ("adamw", "muon")  # the keys of state_dict(), in the order of :attr:`optimizers`

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The two ``torch.optim.Optimizer`` objects (what ``torch.distributed.checkpoint`` saves)."""
        return [self.adamw, self.muon]

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    @property
    def state(self):
        return {**self.adamw.state, **self.muon.state}

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output; GptspeedError for a plain AdamW checkpoint."""
        if not isinstance(state, dict) or set(state) != {"adamw", "muon"}:
            raise GptspeedError("the checkpoint's optimizer state is not Muon+AdamW: resume with its --optimizer")
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


register_optimizer(
    OptimizerSpec("adamw", build_adamw, doc="AdamW (Loshchilov & Hutter 2019), decay on matrices and embeddings only")
)
register_optimizer(
    OptimizerSpec(
        "muon",
        build_muon,
        grad_scaler=False,
        verify_rtol=1e-2,  # its Newton-Schulz runs in bf16: bf16's tolerance
        doc="Muon for the blocks' 2-D weights, AdamW for the rest (Jordan et al. 2024)",
    )
)
