"""Attention-logit monitor: per layer, the largest pre-cap logit, the attention entropy and the RMS of q and k.

Why: attention logits that grow without bound are the failure QK-norm and capping exist to prevent. Wortsman et al.
2023 (arXiv:2309.14322) found that runs whose largest attention logit passed about 1e4 always diverged; a capped
model whose pre-cap logits sit at the cap has a saturated ``tanh``. The monitor measures both on real training steps.

How: only on the steps it records, the monitor attaches a :class:`~hf_qknorm.modeling.telemetry.LogitTap` to each
attention module *instance* and detaches afterwards, so other steps pay nothing and two models in one process stay
independent. The tap hands over q and k as the attention backend sees them -- from the ``"qknorm"`` backend itself,
or rebuilt from projection hooks and the family's RoPE on any other backend (see
:mod:`hf_qknorm.modeling.telemetry`).

Statistics are computed without grad, in float32 (float64 stays float64), in query chunks of at most
``tile_elements`` logits -- never a whole ``(batch, heads, seq, seq)`` tensor. Under gradient checkpointing or
gradient accumulation only the first forward of each layer in a recorded step is measured.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import torch
from torch import nn
from transformers import TrainerCallback

from ..modeling.telemetry import TILE_ELEMENTS, LogitTap, logit_tiles


logger = logging.getLogger(__name__)

STATS = ("max_logit", "entropy", "q_rms", "k_rms")
DIVERGENCE_LOGIT = 1e4  # Wortsman et al. 2023: a largest attention logit above 1e4 always diverged


# --------------------------------------------------------------------------------------------------------------------
# the statistics
# --------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def attention_stats(q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    scaling: float, softcap: float | None = None, causal: bool = True,
                    tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """``[largest pre-cap logit, mean attention entropy (nats), rms(q), rms(k), max logit of head 0, 1, ...]`` of one
    attention call.

    Args:
        q: ``(batch, heads, q_len, head_dim)``; k: ``(batch, kv_heads, kv_len, head_dim)`` -- as the attention
            backend sees them (after any norm and RoPE). GQA: query head ``h`` reads key head ``h // (heads //
            kv_heads)``, Transformers' ``repeat_kv`` layout.
        attention_mask: boolean (True = attend) or additive ``(batch|1, 1|heads, q_len, kv_len)``, or ``None``
            for the causal pattern a missing mask stands for (:mod:`hf_qknorm.attention.masks`: top-left aligned)
            when ``causal``, else no mask.
        scaling: the logit scale; the logit is ``scaling * q.k`` (the value the cap, if any, is applied to).
        softcap: the cap ``c``: the entropy is that of ``softmax(c * tanh(logit / c))``, the distribution used.
    Returns:
        a float tensor of ``4 + heads`` values (float64 for float64 inputs, else float32), on ``q``'s device. The
        maxima are over allowed positions; the entropy is averaged over query rows with at least one allowed key.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    heads, kv_heads = q.shape[1], k.shape[1]
    best = torch.full((kv_heads, heads // kv_heads), float("-inf"), dtype=acc, device=q.device)
    ent_sum = torch.zeros((), dtype=acc, device=q.device)
    n_rows = torch.zeros((), dtype=acc, device=q.device)
    for s, ok in logit_tiles(q, k, attention_mask, scaling=scaling, causal=causal, tile_elements=tile_elements):
        best = torch.maximum(best, s.amax(dim=(0, 3, 4)))
        if softcap is not None:
            s.div_(softcap).tanh_().mul_(softcap)
            if ok is not None:
                s.masked_fill_(~ok, float("-inf"))
        # entropy of softmax(s) per row, one exp: with t = s - max and e = exp(t), H = log(sum e) - sum(e t) / sum e
        m = s.amax(-1, keepdim=True)
        t = s.sub_(torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        e = t.exp()
        z = e.sum(-1)
        et = torch.nansum(e.mul_(t), -1)  # masked keys: 0 * -inf = nan, dropped by nansum
        valid = z > 0  # rows with at least one allowed key
        ent_sum += torch.where(valid, torch.log(z) - et / z.clamp_min(torch.finfo(acc).tiny), 0.0).sum()
        n_rows += valid.sum()
    rms_q = torch.linalg.vector_norm(q, dtype=acc) / math.sqrt(max(1, q.numel()))
    rms_k = torch.linalg.vector_norm(k, dtype=acc) / math.sqrt(max(1, k.numel()))
    return torch.cat([torch.stack([best.max(), ent_sum / n_rows.clamp_min(1), rms_q, rms_k]), best.reshape(heads)])


# --------------------------------------------------------------------------------------------------------------------
# the monitor: attaches to attention instances for the steps it records
# --------------------------------------------------------------------------------------------------------------------
class QKMonitor:
    """Records attention statistics of ``model`` for the forward passes run while it is active.

    Plain loop::

        monitor = QKMonitor(model)
        with monitor.record(step) as stats:      # only this step is measured
            loss = model(**batch).loss
        print(stats["qk/max_logit"])

    ``stats`` maps ``{prefix}max_logit`` (over layers), ``{prefix}min_entropy`` and, per layer ``i``,
    ``{prefix}layer{i}/max_logit``, ``/entropy``, ``/q_rms``, ``/k_rms`` to floats; :attr:`head_max_logits` holds
    the largest logit of each query head of each layer measured last (kept out of the logged dict, which would grow
    by layers x heads entries). Warnings (``logging`` and
    :attr:`alerts`) fire when a layer's largest pre-cap logit reaches ``cap_warn_fraction`` of its cap, or passes
    ``warn_logit`` (default 1e3, a tenth of the 1e4 at which Wortsman et al. 2023's runs diverged) or
    ``diverge_logit`` (1e4); each fires once until the condition clears.
    """

    def __init__(self, model: nn.Module, *, prefix: str = "qk/", tile_elements: int = TILE_ELEMENTS,
                 cap_warn_fraction: float = 0.8, warn_logit: float = 1e3, diverge_logit: float = DIVERGENCE_LOGIT):
        self.tap = LogitTap(model, lambda *args: self._measure(*args))
        self.sites = self.tap.sites
        self.prefix, self.tile_elements = prefix, int(tile_elements)
        self.cap_warn_fraction, self.warn_logit, self.diverge_logit = cap_warn_fraction, warn_logit, diverge_logit
        self.alerts: list[dict] = []
        self.head_max_logits: dict[int, list[float]] = {}  # per layer, the largest logit of each query head
        self._firing: set[tuple[int, str]] = set()
        self._results: dict[int, tuple[torch.Tensor, float | None]] = {}

    @property
    def active(self) -> bool:
        return self.tap.attached

    # -- attach / detach ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Attach to every attention module; the next forward of each layer is measured."""
        if self.active:
            return
        self._results.clear()
        self.tap.attach()

    def stop(self, step: int | None = None) -> dict[str, float]:
        """Detach, and return the statistics of the layers measured since :meth:`start` (empty if none)."""
        self.tap.detach()
        stats = self._collect()
        if stats:
            self._check(stats, step)
        return stats

    @contextmanager
    def record(self, step: int | None = None):
        """Measure the forwards run inside the block; the yielded dict is filled with the statistics on exit."""
        out: dict[str, float] = {}
        self.start()
        try:
            yield out
        finally:
            out.update(self.stop(step))

    # -- measuring ---------------------------------------------------------------------------------------------------
    def _measure(self, index: int, attn: nn.Module, q, k, attention_mask, scaling, softcap) -> None:
        if index in self._results:  # gradient checkpointing recomputes; accumulation repeats: first call only
            return
        vals = attention_stats(q.detach(), k.detach(), attention_mask, scaling=float(scaling), softcap=softcap,
                               causal=getattr(attn, "is_causal", True), tile_elements=self.tile_elements)
        self._results[index] = (vals, softcap)

    # -- reporting ---------------------------------------------------------------------------------------------------
    def _collect(self) -> dict[str, float]:
        if not self._results:
            return {}
        order = sorted(self._results)
        table = torch.stack([self._results[i][0].to(torch.float64).cpu() for i in order]).tolist()  # one sync
        self.head_max_logits = {i: row[len(STATS):] for i, row in zip(order, table)}
        p = self.prefix
        stats = {f"{p}max_logit": max(row[0] for row in table), f"{p}min_entropy": min(row[1] for row in table)}
        for i, row in zip(order, table):
            stats.update({f"{p}layer{i}/{name}": value for name, value in zip(STATS, row[:len(STATS)])})
        self._softcaps = {i: self._results[i][1] for i in order}
        self._results.clear()
        return stats

    def _check(self, stats: dict[str, float], step: int | None) -> None:
        for i, softcap in self._softcaps.items():
            logit = stats[f"{self.prefix}layer{i}/max_logit"]
            conditions = {
                "cap": softcap is not None and logit >= self.cap_warn_fraction * softcap,
                "diverge": logit >= self.diverge_logit,
                "growth": self.warn_logit <= logit < self.diverge_logit,
            }
            for kind, on in conditions.items():
                if not on:
                    self._firing.discard((i, kind))
                elif (i, kind) not in self._firing:
                    self._firing.add((i, kind))
                    self._alert(step, i, kind, logit, softcap)

    def _alert(self, step, layer, kind, logit, softcap) -> None:
        where = f"step {step}, layer {layer}" if step is not None else f"layer {layer}"
        if kind == "cap":
            msg = (f"{where}: largest pre-cap attention logit {logit:.4g} is at {logit / softcap:.0%} of the cap "
                   f"{softcap:g}; c*tanh(s/c) saturates there (lower the learning rate or raise the cap)")
        elif kind == "diverge":
            msg = (f"{where}: largest attention logit {logit:.4g} is above {self.diverge_logit:g}, where "
                   "Wortsman et al. 2023's runs diverged (attention-logit growth); consider QK-norm or a lower LR")
        else:
            msg = (f"{where}: largest attention logit {logit:.4g} is growing toward the divergence regime "
                   f"(runs diverged above {self.diverge_logit:g}, Wortsman et al. 2023)")
        logger.warning(msg)
        self.alerts.append({"step": step, "layer": layer, "kind": kind, "max_logit": logit, "message": msg})


# --------------------------------------------------------------------------------------------------------------------
# Trainer integration
# --------------------------------------------------------------------------------------------------------------------
class QKMonitorCallback(TrainerCallback):
    """``transformers.Trainer`` callback: every ``every`` optimizer steps, measure one step and log its statistics.

    Use :meth:`attach`, so that the statistics go through ``Trainer.log`` to every reporter (TensorBoard, W&B, ...)
    and into ``trainer.state.log_history``::

        monitor = QKMonitorCallback.attach(trainer, every=10)
        trainer.train()
        monitor.history        # [{"step": 1, "qk/max_logit": ..., ...}, ...]

    Added without a trainer (``Trainer(callbacks=[QKMonitorCallback()])``), it still records into
    :attr:`history` and ``state.log_history``, but reporters do not see the values (a callback cannot reach
    ``Trainer.log``); a warning says so once. Steps ``0, every, 2*every, ...`` are measured (the first included);
    other steps pay nothing. Keyword arguments go to :class:`QKMonitor`.
    """

    def __init__(self, every: int = 10, *, trainer=None, **monitor_kwargs):
        if int(every) < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.every, self.trainer, self.monitor_kwargs = int(every), trainer, monitor_kwargs
        self.monitor: QKMonitor | None = None
        self.history: list[dict] = []
        self._warned = False

    @classmethod
    def attach(cls, trainer, every: int = 10, **monitor_kwargs) -> "QKMonitorCallback":
        callback = cls(every, trainer=trainer, **monitor_kwargs)
        trainer.add_callback(callback)
        return callback

    @property
    def alerts(self) -> list[dict]:
        return [] if self.monitor is None else self.monitor.alerts

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.monitor is None:
            self.monitor = QKMonitor(model, **self.monitor_kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None and state.global_step % self.every == 0:
            self.monitor.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is None or not self.monitor.active:
            return
        stats = self.monitor.stop(step=state.global_step)
        if not stats:
            return
        self.history.append({"step": state.global_step, **stats})
        if self.trainer is not None:
            should_log = control.should_log  # Trainer.log clears it: keep this step's own (loss) log due
            self.trainer.log(dict(stats))
            control.should_log = should_log
            return
        if not self._warned:
            self._warned = True
            logger.warning("QKMonitorCallback was added without a trainer: statistics go to state.log_history and "
                           "callback.history only; use QKMonitorCallback.attach(trainer) to reach the reporters")
        state.log_history.append({**stats, "step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None and self.monitor.active:
            self.monitor.stop()
