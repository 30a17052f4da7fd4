"""Attention-logit monitor: per layer, the largest pre-cap logit, the attention entropy and the RMS of q and k.

Why: attention logits that grow without bound are the failure QK-norm and capping exist to prevent. Wortsman et al.
2023 (arXiv:2309.14322) found that runs whose largest attention logit passed about 1e4 always diverged; a capped
model whose pre-cap logits sit at the cap has a saturated ``tanh``. The monitor measures both on real training steps.

How: only on the steps it records, the monitor attaches itself to each attention module *instance* and detaches
afterwards, so other steps pay nothing and two models in one process stay independent.

- Models on the ``"qknorm"`` attention backend: the backend calls ``attn._qknorm_probe(attn, q, k,
  attention_mask=, scaling=, softcap=)`` before attending, with ``q`` ``(batch, heads, seq, head_dim)`` and ``k``
  ``(batch, kv_heads, seq, head_dim)`` after the norm and after RoPE. The monitor sets that attribute.
- Models on any other backend (the unpatched baseline of a learning-rate sweep, an uncapped patched model on
  ``sdpa``): forward hooks on the projections named by the family table (``q_proj``/``k_proj``, Qwen3's own
  ``q_norm``/``k_norm``, GPT-2's fused ``c_attn``) capture q and k -- after a patched model's norms, whose hooks run
  first -- and a pre-hook on the attention module captures the mask and RoPE's ``(cos, sin)``; q and k are rotated
  with the family's own ``apply_rotary_pos_emb``, as its forward does.

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

from ..attention.chunked import chunk_allowed
from ..attention.masks import bool_mask
from ..modeling.layout import rotary_function
from .sites import attention_sites

try:  # a plain-loop user needs no transformers Trainer machinery
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a dependency
    TrainerCallback = object

logger = logging.getLogger(__name__)

TILE_ELEMENTS = 1 << 21  # logits per chunk: 8 MiB in float32
STATS = ("max_logit", "entropy", "q_rms", "k_rms")
DIVERGENCE_LOGIT = 1e4  # Wortsman et al. 2023: a largest attention logit above 1e4 always diverged
PROBING_BACKEND = "qknorm"  # the attention implementation that calls ``module._qknorm_probe``


# --------------------------------------------------------------------------------------------------------------------
# the statistics
# --------------------------------------------------------------------------------------------------------------------
def _allowed_mask(mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """Boolean (True = attend) view of an attention mask (the backend's rule, :func:`bool_mask`)."""
    if mask is not None and mask.shape[-1] > kv_len:  # a mask over cached + new keys, with only the new keys seen
        mask = mask[..., -kv_len:]
    return bool_mask(mask)


def _per_group(ok: torch.Tensor | None, kv_heads: int, groups: int) -> torch.Tensor | None:
    """A ``(.., rows, kv_len)`` allowed-tile reshaped to broadcast against ``(B, kv_heads, groups, rows, kv_len)``."""
    if ok is None:
        return None
    if ok.dim() == 2:
        return ok[None, None, None]
    if ok.shape[1] == 1:
        return ok[:, :, None]
    return ok.reshape(ok.shape[0], kv_heads, groups, *ok.shape[-2:])


@torch.no_grad()
def attention_stats(q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    scaling: float, softcap: float | None = None, causal: bool = True,
                    tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """``[largest pre-cap logit, mean attention entropy (nats), rms(q), rms(k)]`` of one attention call.

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
        a float tensor of 4 values (float64 for float64 inputs, else float32), on ``q``'s device. The maximum is
        over allowed positions; the entropy is averaged over query rows with at least one allowed key.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    mask = _allowed_mask(attention_mask, kv_len)
    causal = bool(causal) and mask is None and q_len > 1
    if causal and kv_len > q_len:  # top-left causal: keys past the last query row are never seen
        k, kv_len = k[:, :, :q_len], q_len
    qg = q.reshape(batch, kv_heads, groups, q_len, head_dim)
    kt = k.to(acc).transpose(-1, -2).unsqueeze(2)  # (B, Hkv, 1, D, Tk)
    rows = int(max(1, min(q_len, tile_elements // max(1, batch * heads * kv_len))))
    if causal:
        rows = min(rows, 64)  # small row chunks skip the keys above the diagonal (about half the work)
    best = torch.full((), float("-inf"), dtype=acc, device=q.device)
    ent_sum = torch.zeros((), dtype=acc, device=q.device)
    n_rows = torch.zeros((), dtype=acc, device=q.device)
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        hi = min(kv_len, end + kv_len - q_len) if causal else kv_len  # causal rows never see keys past `hi`
        if hi <= 0:
            continue
        s = torch.matmul(qg[:, :, :, start:end].to(acc), kt[..., :hi]).mul_(scaling)  # (B, Hkv, G, rows, hi)
        ok = _per_group(chunk_allowed(mask, start, end, q_len, kv_len, causal, None, q.device, 0, hi), kv_heads,
                        groups)
        if ok is not None:
            s.masked_fill_(~ok, float("-inf"))
        best = torch.maximum(best, s.amax())
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
    return torch.stack([best, ent_sum / n_rows.clamp_min(1), rms_q, rms_k])


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
    ``{prefix}layer{i}/max_logit``, ``/entropy``, ``/q_rms``, ``/k_rms`` to floats. Warnings (``logging`` and
    :attr:`alerts`) fire when a layer's largest pre-cap logit reaches ``cap_warn_fraction`` of its cap, or passes
    ``warn_logit`` (default 1e3, a tenth of the 1e4 at which Wortsman et al. 2023's runs diverged) or
    ``diverge_logit`` (1e4); each fires once until the condition clears.
    """

    def __init__(self, model: nn.Module, *, prefix: str = "qk/", tile_elements: int = TILE_ELEMENTS,
                 cap_warn_fraction: float = 0.8, warn_logit: float = 1e3, diverge_logit: float = DIVERGENCE_LOGIT):
        self.sites = attention_sites(model)
        self.prefix, self.tile_elements = prefix, int(tile_elements)
        self.cap_warn_fraction, self.warn_logit, self.diverge_logit = cap_warn_fraction, warn_logit, diverge_logit
        self.alerts: list[dict] = []
        self._firing: set[tuple[int, str]] = set()
        self._handles: list = []
        self._results: dict[int, tuple[torch.Tensor, float | None]] = {}
        self._pending: dict[int, dict] = {}
        # one probe per layer, made once: a compiled model then has one graph with the probe and one without
        self._probes = {site.index: _bound_probe(self, site.index) for site in self.sites}
        self._probed: list = []
        self.active = False

    # -- attach / detach ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Attach to every attention module; the next forward of each layer is measured."""
        if self.active:
            return
        self._results.clear()
        self._pending.clear()
        for site in self.sites:
            if site.backend == PROBING_BACKEND:
                site.module._qknorm_probe = self._probes[site.index]
                self._probed.append(site.module)
            else:
                self._hook(site)
        self.active = True

    def stop(self, step: int | None = None) -> dict[str, float]:
        """Detach, and return the statistics of the layers measured since :meth:`start` (empty if none)."""
        for module in self._probed:
            module.__dict__.pop("_qknorm_probe", None)
        self._probed.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self.active = False
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

    def _hook(self, site) -> None:
        """Hooks that rebuild the q and k an unpatched attention module hands its backend (see module doc)."""
        attn, fam, index = site.module, site.family, site.index
        ctx = self._pending.setdefault(index, {})

        def pre(module, args, kwargs):
            if index not in self._results:
                ctx.clear()
                ctx["mask"] = kwargs.get("attention_mask")
                ctx["rope"] = kwargs.get("position_embeddings")

        def capture(name):
            def hook(module, args, output):
                if index not in self._results:
                    ctx[name] = output.detach()  # nothing here may join the autograd graph (checkpointing)
            return hook

        def post(module, args, kwargs, output):
            captured = "qkv" in ctx or ("q" in ctx and "k" in ctx)
            if index in self._results or not captured:
                return
            with torch.no_grad():
                q, k = _rebuild_qk(attn, fam, ctx)
            self._measure(index, attn, q, k, ctx.get("mask"), attn.scaling, attn.__dict__.get("_qknorm_softcap"))
            ctx.clear()

        self._handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        if fam.fused_qkv:
            self._handles.append(getattr(attn, fam.qkv_proj).register_forward_hook(capture("qkv")))
        else:
            native = fam.native_qk_norm and isinstance(getattr(attn, "q_norm", None), nn.Module)
            q_src = attn.q_norm if native else getattr(attn, fam.q_proj)
            k_src = attn.k_norm if native else getattr(attn, fam.k_proj)
            self._handles.append(q_src.register_forward_hook(capture("q")))
            self._handles.append(k_src.register_forward_hook(capture("k")))
        self._handles.append(attn.register_forward_hook(post, with_kwargs=True))

    # -- reporting ---------------------------------------------------------------------------------------------------
    def _collect(self) -> dict[str, float]:
        if not self._results:
            return {}
        order = sorted(self._results)
        table = torch.stack([self._results[i][0].to(torch.float64).cpu() for i in order]).tolist()  # one sync
        p = self.prefix
        stats = {f"{p}max_logit": max(row[0] for row in table), f"{p}min_entropy": min(row[1] for row in table)}
        for i, row in zip(order, table):
            stats.update({f"{p}layer{i}/{name}": value for name, value in zip(STATS, row)})
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


def _rebuild_qk(attn: nn.Module, fam, ctx: dict):
    """``(B, H, T, D)`` queries and ``(B, Hkv, T, D)`` keys from captured projection outputs, RoPE applied."""
    d = attn.head_dim
    if fam.fused_qkv:
        q, k, _ = ctx["qkv"].split(attn.split_size, dim=-1)
    else:
        q, k = ctx["q"], ctx["k"]
    q = q.reshape(*q.shape[:2], -1, d).transpose(1, 2)
    k = k.reshape(*k.shape[:2], -1, d).transpose(1, 2)
    if fam.rope and ctx.get("rope") is not None:
        rope = rotary_function(attn)
        q, k = rope(q, k, *ctx["rope"])
    return q, k


def _bound_probe(monitor: QKMonitor, index: int):
    """The ``_qknorm_probe`` callable for layer ``index``. Traceable by torch.compile (``fullgraph=True`` too): a
    compiled model gets a second graph that includes the statistics, used on the recorded steps only."""

    def probe(attn, q, k, attention_mask=None, scaling=1.0, softcap=None):
        monitor._measure(index, attn, q, k, attention_mask, scaling, softcap)

    return probe


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
