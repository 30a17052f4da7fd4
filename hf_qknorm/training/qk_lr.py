"""Q/K learning-rate control: Anson & Aitchison 2025 (arXiv:2511.21377, "QuacK") and a plain constant factor.

The rule, per layer ``l`` and head ``h``, recomputed before every step (Frobenius norms, ``||.||_0`` at the start):

    lr(W_Q^{l,h}) = tau * eta * ||W_K^{l,h}||_0 / ||W_K^{l,h}||
    lr(W_K^{l,h}) = tau * eta * ||W_Q^{l,h}||_0 / ||W_Q^{l,h}||

where ``eta`` is the optimizer's own (scheduled) learning rate. Their Lemma 1: a step of bounded size on ``W_Q``
changes a logit ``x^T W_Q^T W_K y`` by at most ``||dW_Q|| ||W_K||``, so shrinking ``W_Q``'s step as ``W_K`` grows
(and vice versa) bounds the logit change per step.

How it is applied exactly: all heads of a layer share one ``nn.Linear`` weight (GPT-2: one fused ``Conv1D``), so
per-head rates cannot be parameter groups. Instead the controller snapshots the Q and K rows before
``optimizer.step()`` and afterwards rescales each head's rows of the update: ``W <- W_old + f_h * (W_new - W_old)``.
For every optimizer whose whole update is proportional to its learning rate -- SGD (with momentum), Adam with L2
decay, AdamW with its decoupled decay, Lion, Muon -- this is exactly a per-head learning rate ``f_h * eta``: the
optimizer's state (moments) does not depend on the learning rate. It is not exact for optimizers whose state does
(Adafactor's relative step, schedule-free methods). Q/K biases (Qwen2) take their head's factor; the norms are of
the weights only. Memory: one copy of the Q and K weights, held during the step.

GQA: key head ``g`` is read by query heads ``h`` with ``h // (heads // kv_heads) == g`` (Transformers' ``repeat_kv``
layout). A query head uses its key head's norm ratio; a key head uses the ratio of the largest norm among its query
heads (``max_h ||W_Q^h||_0 / max_h ||W_Q^h||``), the worst case Lemma 1 bounds. With ``kv_heads == heads`` this is the
paper's rule. ``per_head=False`` uses whole-layer norms instead.

Sharded weights (FSDP2, tensor parallelism): each rank computes its shard's share of every head's squared norm, one
SUM all-reduce per step completes them (all layers packed together), and the snapshot and the rescale act on the
rank's own shard -- rows of a head split between ranks included (:mod:`hf_qknorm.training.heads`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..modeling.sharding import check_tensor_parallel, fsdp_owned, refuse_engines
from .controls import ControlCallback, TrainingControl
from .heads import HeadRows, head_norms, layer_rows
from .sites import attention_sites, unwrap

logger = logging.getLogger(__name__)

RULES = ("norm_ratio", "constant")


class _Snapshot:
    """W_Q or W_K rows of a layer (:class:`HeadRows`) with the snapshot taken before ``optimizer.step()``."""

    def __init__(self, rows: HeadRows):
        if not rows.weight.requires_grad:
            raise ValueError(
                f"{rows.where} is frozen (a LoRA base weight?): Q/K learning-rate control needs trainable W_Q and W_K"
            )
        self.rows, self.heads = rows, rows.heads
        self.snapshot: list[torch.Tensor] | None = None

    def save(self) -> None:
        self.snapshot = self.rows.snapshot()

    def rescale(self, factor: torch.Tensor) -> None:
        """``W <- W_old + factor_h * (W - W_old)`` per head, for the weight and the bias."""
        old, self.snapshot = self.snapshot, None
        self.rows.rescale_update(old, factor)


def _layer_rows(site, config) -> tuple[_Snapshot, _Snapshot]:
    q, k = layer_rows(site, config)
    if k is None:
        raise NotImplementedError(
            f"layer {site.index} reuses an earlier layer's keys (no W_K of its own): per-head Q/K learning rates "
            "need both projections in every layer"
        )
    return _Snapshot(q), _Snapshot(k)


class QKLearningRate(TrainingControl):
    """Per-head (or per-layer) learning-rate factors for ``W_Q`` and ``W_K`` (Anson & Aitchison 2025), applied around
    ``optimizer.step()``: ``qk.step(optimizer)`` is ``qk.pre_step(); optimizer.step(); qk.post_step()``, and
    ``qk.attach(optimizer)`` hooks both onto ``optimizer.step()``. ``W_Q`` and ``W_K`` must be trainable. Arguments:
    docs/training.md (Arguments of the controls)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        tau: float = 1.0,
        rule: str = "norm_ratio",
        per_head: bool = True,
        initial_norms: dict | None = None,
    ):
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")
        if not tau > 0:
            raise ValueError(f"tau must be positive, got {tau!r}")
        self.tau, self.rule, self.per_head = float(tau), rule, bool(per_head)
        config = unwrap(model).config
        refuse_engines(model, "Q/K learning-rate control")
        check_tensor_parallel(model)
        self.model, self.sites = model, attention_sites(model)
        self.layers = [_layer_rows(site, config) for site in self.sites]
        self.initial_norms = initial_norms if initial_norms is not None else self._current_norms()
        if len(self.initial_norms["q"]) != len(self.layers):
            raise ValueError(
                f"initial_norms cover {len(self.initial_norms['q'])} layers, the model has {len(self.layers)}"
            )
        self.last_factors: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _current_norms(self) -> dict:
        norms = self._norms()
        return {"q": [q.tolist() for q, _ in norms], "k": [k.tolist() for _, k in norms]}

    def _norms(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the current per-head norms ``(||W_Q^h||, ||W_K^h||)``: one collective for all layers when the
        weights are sharded."""
        flat = head_norms([s.rows for pair in self.layers for s in pair])
        return list(zip(flat[0::2], flat[1::2]))

    # -- the rule ----------------------------------------------------------------------------------------------------
    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``(f_Q (heads,), f_K (kv_heads,))``: the multipliers of ``eta`` for this step (float64)."""
        out = []
        norms = self._norms() if self.rule != "constant" else [None] * len(self.layers)
        for i, ((q, k), current) in enumerate(zip(self.layers, norms)):
            if self.rule == "constant":
                out.append(
                    (
                        torch.full((q.heads,), self.tau, dtype=torch.float64),
                        torch.full((k.heads,), self.tau, dtype=torch.float64),
                    )
                )
                continue
            nq, nk = current
            nq0 = torch.tensor(self.initial_norms["q"][i], dtype=torch.float64)
            nk0 = torch.tensor(self.initial_norms["k"][i], dtype=torch.float64)
            if not self.per_head:
                fq = torch.full((q.heads,), float(nk0.norm() / nk.norm()), dtype=torch.float64)
                fk = torch.full((k.heads,), float(nq0.norm() / nq.norm()), dtype=torch.float64)
            else:
                groups = q.heads // k.heads
                fq = (nk0 / nk).repeat_interleave(groups)  # query head h reads key head h // groups
                fk = nq0.view(k.heads, groups).amax(1) / nq.view(k.heads, groups).amax(1)
            out.append((self.tau * fq, self.tau * fk))
        return out

    # -- around the optimizer step -----------------------------------------------------------------------------------
    def pre_step(self) -> None:
        """Compute this step's factors from the current weights and snapshot W_Q, W_K (call before the step)."""
        self._check_at_rest()
        self.last_factors = self.factors()
        for q, k in self.layers:
            q.save()
            k.save()

    def _check_at_rest(self) -> None:
        for owned, (q, k) in zip(fsdp_owned(self.model, [s.module for s in self.sites]), self.layers):
            q.rows.check_at_rest(owned)
            k.rows.check_at_rest(owned)

    def post_step(self) -> None:
        """Rescale each head's update by its factor (call right after ``optimizer.step()``)."""
        if not self.last_factors or self.layers[0][0].snapshot is None:
            raise RuntimeError("post_step() without pre_step(): call pre_step() before optimizer.step()")
        for (q, k), (fq, fk) in zip(self.layers, self.last_factors):
            q.rescale(fq)
            k.rescale(fk)

    def pre_optimizer_step(self) -> None:
        self.pre_step()

    def post_optimizer_step(self) -> None:
        self.post_step()

    def step(self, optimizer: torch.optim.Optimizer, closure=None):
        """``pre_step(); optimizer.step(closure); post_step()``; returns what the optimizer returns."""
        self.pre_step()
        result = optimizer.step(closure) if closure is not None else optimizer.step()
        self.post_step()
        return result

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"tau": self.tau, "rule": self.rule, "per_head": self.per_head, "initial_norms": self.initial_norms}

    def load_state_dict(self, state: dict) -> None:
        self.tau, self.rule, self.per_head = float(state["tau"]), state["rule"], bool(state["per_head"])
        self.initial_norms = state["initial_norms"]


class QKLearningRateCallback(ControlCallback):
    """``transformers.Trainer`` callback applying :class:`QKLearningRate` around every optimizer step
    (:class:`ControlCallback` over :class:`QKLearningRate`).

    ``Trainer(..., callbacks=[QKLearningRateCallback(tau=1.0)])``. The initial norms ``||.||_0`` are saved with
    every checkpoint (``trainer_state.json``, as an ``ExportableState``) and taken back on
    ``trainer.train(resume_from_checkpoint=...)``, so a resumed run continues identically. DDP, FSDP2 and tensor
    parallelism give every rank the same factors (sharded weights: per-head norms summed over the shards);
    DeepSpeed and FSDP version 1 are refused. :attr:`controller` is the :class:`QKLearningRate`.
    """

    def __init__(
        self,
        tau: float = 1.0,
        rule: str = "norm_ratio",
        per_head: bool = True,
        initial_norms: dict | None = None,
        *,
        trainer=None,
    ):
        self.tau, self.rule, self.per_head, self.initial_norms = tau, rule, per_head, initial_norms
        super().__init__(
            lambda model: QKLearningRate(
                model, tau=self.tau, rule=self.rule, per_head=self.per_head, initial_norms=self.initial_norms
            ),
            "Q/K learning-rate control",
            trainer=trainer,
            args={"tau": tau, "rule": rule, "per_head": per_head, "initial_norms": initial_norms},
        )

    @property
    def controller(self) -> QKLearningRate | None:
        return self.control


def qk_param_groups(model: nn.Module, lr: float, *, weight_decay: float = 0.0, qk_lr_factor: float = 1.0) -> list[dict]:
    """Optimizer parameter groups: matrices with ``weight_decay``; vectors (norms, biases, the lp logit scale)
    without; and ``W_Q``/``W_K`` of every layer in their own group at ``lr * qk_lr_factor`` (with decay).

    A constant Q/K factor through parameter groups costs nothing per step and works with any optimizer and
    scheduler (schedulers scale each group's own ``lr``). GPT-2's fused ``c_attn`` cannot be split into groups:
    use ``QKLearningRate(model, tau=factor, rule="constant")`` there. Use with ``Trainer(optimizers=(
    torch.optim.AdamW(qk_param_groups(model, lr), lr=lr), None))``.
    """
    sites = attention_sites(model)
    if sites and sites[0].family.fused_qkv:
        raise ValueError(
            f"{sites[0].family.model_type} fuses Q, K and V in one weight ({sites[0].family.qkv_proj}); "
            "use QKLearningRate(model, tau=factor, rule='constant') for a Q/K factor"
        )
    qk_ids = set()
    for site in sites:
        for name in (site.family.q_proj, site.family.k_proj):
            proj = getattr(site.module, name, None)
            if proj is None:  # a layer that reuses an earlier layer's keys has no W_K
                continue
            qk_ids.add(id(getattr(proj, "base_layer", proj).weight))
    decay, no_decay, qk = [], [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (qk if id(param) in qk_ids else decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": qk, "weight_decay": weight_decay, "lr": lr * qk_lr_factor},
    ]
    return [g for g in groups if g["params"]]
