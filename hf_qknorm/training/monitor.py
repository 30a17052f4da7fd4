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
gradient accumulation only the first forward of each layer in a recorded step is measured. Over several processes
(DDP, FSDP2, tensor parallelism) the logged statistics are the whole step's, combined from every rank's sums
(:class:`QKMonitor`, ``sync``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from ..modeling.sharding import check_tensor_parallel, collective_device, world_size
from ..modeling.telemetry import TILE_ELEMENTS, LogitTap, logit_tiles
from .controls import ControlCallback, TrainingControl
from .heads import layer_rows
from .sites import unwrap

logger = logging.getLogger(__name__)

STATS = ("max_logit", "entropy", "q_rms", "k_rms")
DIVERGENCE_LOGIT = 1e4  # Wortsman et al. 2023: a largest attention logit above 1e4 always diverged


# --------------------------------------------------------------------------------------------------------------------
# the statistics
# --------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
    tile_elements: int = TILE_ELEMENTS,
) -> torch.Tensor:
    """``[largest pre-cap logit, mean attention entropy (nats), rms(q), rms(k), max logit of head 0, 1, ...]`` of one
    attention call: a float tensor of ``4 + heads`` values on ``q``'s device (float64 for float64 inputs, else
    float32).

    ``q`` ``(batch, heads, q_len, head_dim)`` and ``k`` ``(batch, kv_heads, kv_len, head_dim)`` as the backend sees
    them (after the norm and RoPE); the maxima are over allowed positions, the entropy is the capped distribution's,
    averaged over rows with an allowed key. Arguments: docs/training.md (Arguments of the controls)."""
    sums = attention_sums(
        q, k, attention_mask, scaling=scaling, softcap=softcap, causal=causal, tile_elements=tile_elements
    )
    return _ratios(sums)


@torch.no_grad()
def attention_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
    tile_elements: int = TILE_ELEMENTS,
) -> torch.Tensor:
    """What :func:`attention_stats` is made of, as quantities that add up across processes: ``[largest logit,
    entropy sum, rows with an allowed key, sum q^2, q elements, sum k^2, k elements, max logit of each head]``
    (``len(SUMS) + heads`` values; same arguments and dtype)."""
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
    sq_q = torch.linalg.vector_norm(q, dtype=acc).square()
    sq_k = torch.linalg.vector_norm(k, dtype=acc).square()
    counts = [torch.tensor(float(n), dtype=acc, device=q.device) for n in (q.numel(), k.numel())]
    return torch.cat(
        [torch.stack([best.max(), ent_sum, n_rows, sq_q, counts[0], sq_k, counts[1]]), best.reshape(heads)]
    )


SUMS = ("max_logit", "entropy_sum", "rows", "q_sq", "q_elements", "k_sq", "k_elements")


def _ratios(sums: torch.Tensor) -> torch.Tensor:
    """:func:`attention_sums`' layout -> :func:`attention_stats`' (works on ``(..., len(SUMS) + heads)``)."""
    top, ent, rows, sq_q, n_q, sq_k, n_k = sums[..., : len(SUMS)].unbind(-1)
    stats = torch.stack(
        [top, ent / rows.clamp_min(1), (sq_q / n_q.clamp_min(1)).sqrt(), (sq_k / n_k.clamp_min(1)).sqrt()], dim=-1
    )
    return torch.cat([stats, sums[..., len(SUMS) :]], dim=-1)


# --------------------------------------------------------------------------------------------------------------------
# the monitor: attaches to attention instances for the steps it records
# --------------------------------------------------------------------------------------------------------------------
class QKMonitor(TrainingControl):
    """Records attention statistics of ``model`` for the forward passes run inside ``with monitor.record(step) as
    stats:`` -- ``{prefix}max_logit``, ``{prefix}min_entropy`` and, per layer ``i``, ``{prefix}layer{i}/max_logit``,
    ``/entropy``, ``/q_rms``, ``/k_rms`` -- and warns (``logging`` and :attr:`alerts`, once until the condition
    clears) when a layer's largest pre-cap logit nears its cap or passes ``warn_logit``/``diverge_logit``.
    :attr:`head_max_logits` holds each query head's largest logit of the last measured step. With several processes
    the statistics are the whole step's over all ranks, so every rank records the same steps. Arguments:
    docs/training.md (Arguments of the controls)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        prefix: str = "qk/",
        tile_elements: int = TILE_ELEMENTS,
        cap_warn_fraction: float = 0.8,
        warn_logit: float = 1e3,
        diverge_logit: float = DIVERGENCE_LOGIT,
        sync: bool | None = None,
        every: int = 1,
    ):
        check_tensor_parallel(model)  # refuses tensor-parallel layouts it cannot read, saying what is supported
        self.model = model
        self.tap = LogitTap(model, lambda *args: self._measure(*args))
        self.sites = self.tap.sites
        config = unwrap(model).config
        self._q_rows = [layer_rows(site, config)[0] for site in self.sites]  # where a rank's heads sit (TP)
        self.sync = sync
        self.prefix, self.tile_elements = prefix, int(tile_elements)
        self.cap_warn_fraction, self.warn_logit, self.diverge_logit = cap_warn_fraction, warn_logit, diverge_logit
        self.every = _checked_every(every)
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

    # -- the training-control protocol (hf_qknorm.training.controls) ------------------------------------------------
    def step_begin(self, step: int) -> None:
        if step % self.every == 0:
            self.start()

    def step_end(self, step: int) -> dict | None:
        if not self.active:
            return None
        return self.stop(step) or None

    def close(self) -> None:
        if self.active:
            self.stop()

    def state_dict(self) -> dict:
        return {
            "alerts": [dict(a) for a in self.alerts],
            "firing": sorted([layer, kind] for layer, kind in self._firing),
            "head_max_logits": {str(i): v for i, v in self.head_max_logits.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.alerts = [dict(a) for a in state["alerts"]]
        self._firing = {(int(layer), kind) for layer, kind in state["firing"]}
        self.head_max_logits = {int(i): list(v) for i, v in state["head_max_logits"].items()}

    # -- measuring ---------------------------------------------------------------------------------------------------
    def _measure(self, index: int, attn: nn.Module, q, k, attention_mask, scaling, softcap) -> None:
        if index in self._results:  # gradient checkpointing recomputes; accumulation repeats: first call only
            return
        vals = attention_sums(
            q.detach(),
            k.detach(),
            attention_mask,
            scaling=float(scaling),
            softcap=softcap,
            causal=getattr(attn, "is_causal", True),
            tile_elements=self.tile_elements,
        )
        self._results[index] = (vals, softcap)

    # -- reporting ---------------------------------------------------------------------------------------------------
    def _table(self) -> torch.Tensor:
        """Per layer ``[measured, *SUMS, max logit of every head]`` (float64, ``-inf`` for heads this rank did not
        run), over all ranks when synchronised: one all-gather for all layers."""
        width = 1 + len(SUMS) + max(q.heads for q in self._q_rows)
        table = torch.zeros(len(self.sites), width, dtype=torch.float64)
        table[:, 1 + len(SUMS) :] = float("-inf")
        table[:, 1] = float("-inf")
        for i, (vals, _) in self._results.items():
            vals = vals.to(torch.float64).cpu()
            seen = vals.numel() - len(SUMS)
            first = 1 + len(SUMS) + self._q_rows[i].local_heads(seen)
            table[i, 0] = 1.0
            table[i, 1 : 1 + len(SUMS)], table[i, first : first + seen] = vals[: len(SUMS)], vals[len(SUMS) :]
        sync = self.sync if self.sync is not None else world_size() > 1
        if not sync:
            return table
        dist = torch.distributed
        local = table.to(collective_device(self.model))
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        every = torch.stack(parts).cpu()  # (ranks, layers, width)
        out = every.sum(0)  # the counts and sums add up ...
        out[:, 0] = every[:, :, 0].amax(0)
        out[:, 1] = every[:, :, 1].amax(0)  # ... the maxima do not (amax keeps a NaN: every rank sees it)
        out[:, 1 + len(SUMS) :] = every[:, :, 1 + len(SUMS) :].amax(0)
        return out

    def _collect(self) -> dict[str, float]:
        sync = self.sync if self.sync is not None else world_size() > 1
        if not self._results and not sync:
            return {}
        softcaps = {i: cap for i, (_, cap) in self._results.items()}
        table = self._table()
        self._results.clear()
        order = [i for i in range(len(self.sites)) if table[i, 0] > 0]
        if not order:
            return {}
        stats_rows = _ratios(table[order, 1:]).tolist()
        self.head_max_logits = {
            i: row[len(STATS) : len(STATS) + self._q_rows[i].heads] for i, row in zip(order, stats_rows)
        }
        p = self.prefix
        stats = {
            f"{p}max_logit": max(row[0] for row in stats_rows),
            f"{p}min_entropy": min(row[1] for row in stats_rows),
        }
        for i, row in zip(order, stats_rows):
            stats.update({f"{p}layer{i}/{name}": value for name, value in zip(STATS, row[: len(STATS)])})
        cap = next((c for c in softcaps.values() if c is not None), None)  # the scheme's one cap, if any
        self._softcaps = {i: softcaps.get(i, cap) for i in order}
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
            msg = (
                f"{where}: largest pre-cap attention logit {logit:.4g} is at {logit / softcap:.0%} of the cap "
                f"{softcap:g}; c*tanh(s/c) saturates there (lower the learning rate or raise the cap)"
            )
        elif kind == "diverge":
            msg = (
                f"{where}: largest attention logit {logit:.4g} is above {self.diverge_logit:g}, where "
                "Wortsman et al. 2023's runs diverged (attention-logit growth); consider QK-norm or a lower LR"
            )
        else:
            msg = (
                f"{where}: largest attention logit {logit:.4g} is growing toward the divergence regime "
                f"(runs diverged above {self.diverge_logit:g}, Wortsman et al. 2023)"
            )
        logger.warning(msg)
        self.alerts.append({"step": step, "layer": layer, "kind": kind, "max_logit": logit, "message": msg})


def _checked_every(every) -> int:
    if int(every) < 1:
        raise ValueError(f"every must be a positive number of steps, got {every!r}")
    return int(every)


# --------------------------------------------------------------------------------------------------------------------
# Trainer integration
# --------------------------------------------------------------------------------------------------------------------
class QKMonitorCallback(ControlCallback):
    """``transformers.Trainer`` callback measuring one optimizer step in ``every`` (the first included; the others
    pay nothing) with :class:`QKMonitor`. ``QKMonitorCallback.attach(trainer, every=10)`` sends the statistics
    through ``Trainer.log`` to every reporter; added without a trainer, only :attr:`history` and
    ``state.log_history`` get them (a warning says so once). The history and the alerts survive a checkpoint and
    resume."""

    warn_without_trainer = True

    def __init__(self, every: int = 10, *, trainer=None, **monitor_kwargs):
        self.every, self.monitor_kwargs = _checked_every(every), monitor_kwargs
        super().__init__(
            lambda model: QKMonitor(model, every=self.every, **self.monitor_kwargs),
            "the attention-logit monitor",
            trainer=trainer,
            args={"every": every, **monitor_kwargs},
        )

    @property
    def monitor(self) -> QKMonitor | None:
        return self.control

    @property
    def alerts(self) -> list[dict]:
        return [] if self.monitor is None else self.monitor.alerts
