"""Muon for a Transformers model: ``torch.optim.Muon`` on the hidden weight matrices, AdamW on everything else.

``torch.optim.Muon`` (Jordan et al. 2024; Kimi K2 trains with it) orthogonalises 2-D updates and takes 2-D
parameters only; the usual recipe gives it the hidden matrices (attention and MLP projections) and leaves the
embeddings, the output head, norms and biases to AdamW. :class:`MuonAdamW` is that recipe as one optimizer, so it
drops into ``Trainer(optimizers=(opt, None))``, a learning-rate scheduler (each group keeps its own ``lr``),
:class:`~hf_qknorm.QKLearningRate` (``qk.step(opt)``) and :meth:`~hf_qknorm.QKClip.attach` (MuonClip).

Muon's whole update, weight decay included, is proportional to its learning rate, so the Q/K learning-rate rule's
per-head rescaling of the update is exactly a per-head learning rate with Muon too (``tests/training/test_muon.py``
checks it
against a hand-written Muon step).
"""

from __future__ import annotations

import torch
from torch import nn

from ..portable.layout import unwrap


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(hidden matrices, the rest)`` of the trainable parameters: Muon takes 2-D weights other than the input
    embeddings and the output head (``get_input_embeddings`` / ``get_output_embeddings``)."""
    inner = unwrap(model)
    outside = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(inner, get, lambda: None)()
        if module is not None:
            outside.update(id(p) for p in module.parameters())
    matrices, rest = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (matrices if param.dim() == 2 and id(param) not in outside else rest).append(param)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on :func:`muon_split`'s matrices and ``torch.optim.AdamW`` on the rest, stepped together.

    Args:
        model: the model to optimise.
        lr: Muon's learning rate (``torch.optim.Muon`` scales it per matrix shape, ``adjust_lr_fn``).
        adamw_lr: AdamW's learning rate (default ``lr``).
        weight_decay: decoupled decay for both (AdamW applies it to its 2-D parameters only, embeddings and head).
        muon_kwargs, adamw_kwargs: passed on (``momentum``, ``adjust_lr_fn``; ``betas``, ``eps``).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        *,
        adamw_lr: float | None = None,
        weight_decay: float = 0.0,
        muon_kwargs: dict | None = None,
        adamw_kwargs: dict | None = None,
    ):
        matrices, rest = muon_split(model)
        if not matrices:
            raise ValueError("the model has no trainable hidden weight matrices for Muon")
        adamw_lr = lr if adamw_lr is None else adamw_lr
        decay, no_decay = [p for p in rest if p.dim() >= 2], [p for p in rest if p.dim() < 2]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, **(muon_kwargs or {}))
        groups = [
            g
            for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ]
        self.adamw = torch.optim.AdamW(groups, lr=adamw_lr, **(adamw_kwargs or {}))
        # the base class sees the union of both optimizers' groups (the same dicts: a scheduler's change reaches them)
        super().__init__([{"params": []}], {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
