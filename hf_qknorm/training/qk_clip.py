"""QK-Clip (Kimi K2, arXiv:2507.20534, "MuonClip"): bound every head's largest attention logit by rescaling its
query and key weights after the optimizer step -- the architecture stays as it is.

Rule. During the forward passes of a step, record ``S_h``, the largest pre-cap logit ``scaling * q.k`` of head ``h``
(over the batch, the allowed pairs, gradient-accumulation micro-batches and checkpoint recomputations; all-reduced
with MAX across data-parallel ranks). After ``optimizer.step()``, for every head with ``S_h > tau``,
``gamma_h = tau / S_h``; the head's query rows are scaled by ``gamma_h ** alpha`` and its key rows by
``gamma_h ** (1 - alpha)``, so its logits scale by ``gamma_h`` and the largest one becomes ``tau``. Heads below
``tau`` are left alone.

Where the rows are and what else scales with them:

- separate projections (Llama, Mistral, Qwen2/3): rows ``[h*d, (h+1)*d)`` of ``q_proj``/``k_proj``; GPT-2's fused
  ``c_attn`` (``Conv1D``, ``(in, 3E)``): only the Q and K columns of that head;
- biases (Qwen2's q/k biases) scale with their rows: ``q = W x + b`` then scales exactly by the factor;
- RoPE rotates each head's ``(head_dim,)`` vector: a scalar factor per head commutes with it;
- GQA: a key head is read by several query heads. Query head ``h`` takes ``gamma_h ** alpha``; key head ``g`` takes
  ``(min over its query heads of gamma_h) ** (1 - alpha)``. Every query head's logits then scale by at most
  ``gamma_h``, so every head ends at or below ``tau`` (heads sharing a clipped key head may shrink a little more
  than they need); with one query head per key head this is the paper's rule;
- only trained parameters change: a frozen weight is never edited (it is not in what training saves, and a model
  with its adapters disabled -- the reference model of DPO, KTO, GRPO -- must stay the base). A trained projection
  with a ``peft`` LoRA adapter scales its rows, bias and the adapter's ``B`` rows, so the adapted output scales
  exactly. Under LoRA the base projections are frozen: QK-Clip then acts only through trained q/k norm gains (the
  ``modules_to_save`` copies :func:`hf_qknorm.prepare_lora` makes; the frozen ``original_module`` copies stay as
  they are), and refuses a model whose logits only frozen weights set (an unpatched model under LoRA, or norms left
  frozen), saying so when it is created;
- a model whose q and k are normalised (Qwen3's own q/k RMSNorm, or a model patched with QK-norm): scaling the
  projections changes nothing, since the norm divides it out; the logits are bounded by the norm's gains instead.
  Those gains are shared by all heads, so the clip scales them by the worst head's factor: ``q_norm``'s weight (and
  bias) by ``(min_h gamma_h) ** alpha``, ``k_norm``'s by ``(min_h gamma_h) ** (1 - alpha)``; ``l2``/``lp`` norms
  carry one logit scale on ``q_norm``, which takes the whole ``min_h gamma_h``. A gain of Gemma's form ``1 + w`` is
  scaled as a whole (``w`` becomes ``f * w + f - 1``; the form is read off the module once). Every head ends at or
  below ``tau``; heads that were below it shrink too;
- several processes: the per-head maxima of all layers travel in one MAX all-reduce per step (the way torchtitan
  does it); every rank then computes the same factors. DDP: every rank rescales its whole replica. FSDP2
  (``fully_shard``, ``DTensor`` shards): every rank rescales its own shard of each head's rows -- a head whose rows
  are split between ranks is scaled on both -- and the norm gains' shards, with no further communication. Tensor
  parallelism (heads split across ranks, :func:`hf_qknorm.parallelize_attention`): each rank records its own heads
  and rescales its own rows. Call :meth:`QKClip.step` after ``optimizer.step()``, when FSDP2 has resharded (refused
  otherwise: an edit of gathered weights would be lost). An optimizer that keeps its own master copy of the weights
  (a ZeRO-style distributed optimizer) would need that copy scaled too: not supported (DeepSpeed is refused).
- a maximum that is not finite (overflow, NaN) gives no factor: that head is skipped and a warning logged; a
  maximum at or below zero is below ``tau`` and untouched (never a negative base under a fractional power).

Recording: on the ``"qknorm"`` backend the per-head maxima come out of the attention's own pass (the Triton kernels'
and the PyTorch path's row maxima); on other backends they cost one chunked ``q k^T`` per layer and forward (no
``T x T`` tensor per head). ``benchmarks/bench_qk_clip.py`` measures the overhead.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from ..modeling.sharding import (
    check_tensor_parallel,
    collective_device,
    fsdp_owned,
    is_dtensor,
    local_part,
    refuse_engines,
    world_size,
)
from ..modeling.telemetry import LogitTap
from ..portable.families import own_roles
from ..portable.fold import affine_form
from ..portable.layout import norm_module
from ..portable.norms import HeadLayerNorm, HeadLpNorm, HeadRMSNorm
from .controls import ControlCallback, TrainingControl
from .heads import layer_rows
from .sites import attention_sites, unwrap

logger = logging.getLogger(__name__)


class QKClip(TrainingControl):
    """Per-head logit bound by weight rescaling (Kimi K2's QK-Clip). Create it once, before training: it records
    every forward in training mode from then on, and :meth:`step` -- after each ``optimizer.step()``, or hooked by
    ``clip.attach(optimizer)`` -- rescales each head whose largest logit passed ``tau`` down to it (its q/k rows, or
    the shared q/k norm gains; module docstring), and clears. :attr:`last_clipped` lists ``(layer, head, S_h,
    gamma_h)`` of the last step that clipped anything. Arguments: docs/training.md (Arguments of the controls)."""

    def __init__(self, model: nn.Module, *, tau: float = 100.0, alpha: float = 0.5):
        self.tau, self.alpha = _checked(tau, alpha)
        self.model = model
        config = unwrap(model).config
        refuse_engines(model, "QK-Clip")
        check_tensor_parallel(model)  # refuses the layouts it cannot act on, saying what is supported
        self.sites = attention_sites(model)
        self.rows = [layer_rows(site, config) for site in self.sites]
        self.norms = [_normed_gains(site) for site in self.sites]
        for site, rows, norms in zip(self.sites, self.rows, self.norms):
            if rows[1] is None and norms is None:
                raise NotImplementedError(
                    f"QK-Clip: layer {site.index} reuses an earlier layer's keys and does not normalise its queries: "
                    "its logits could be bounded only through the other layer's keys"
                )
            _check_trained(site, rows, norms)
        self.heads = [q.heads for q, _ in self.rows]
        self.maxima: list[torch.Tensor | None] = [None] * len(self.sites)  # this rank's, its own heads only
        self.last_maxima: list[list[float] | None] = []  # the last step's gathered per-head maxima, per layer
        self.last_clipped: list[tuple[int, int, float, float]] = []
        self.last_skipped: list[tuple[int, int, float]] = []
        self.steps = self.clipped_steps = 0
        self._record_of_step: dict | None = None
        self._tap = LogitTap(model, self._record, max_logits=True, training_only=True)
        self._tap.attach()

    # -- recording ---------------------------------------------------------------------------------------------------
    def _record(self, index, attn, q, k, mask, scaling, softcap, top):
        seen = self.maxima[index]
        top = top.detach()
        self.maxima[index] = top if seen is None else torch.maximum(seen, top)

    def close(self) -> None:
        """Stop recording (detach from the model)."""
        self._tap.detach()

    # -- the training-control protocol (hf_qknorm.training.controls) ------------------------------------------------
    def post_optimizer_step(self) -> None:
        clipped = self.step()
        if clipped or self.last_skipped:
            self._record_of_step = {
                "clipped": [list(c) for c in clipped],
                "skipped": [list(c) for c in self.last_skipped],
                "qk_clip/clipped_heads": len(clipped),
            }

    def step_end(self, step: int) -> dict | None:
        record, self._record_of_step = self._record_of_step, None
        return record

    # -- the clip ----------------------------------------------------------------------------------------------------
    def gathered_maxima(self) -> list[torch.Tensor | None]:
        """Per layer, every query head's recorded maximum (float64 ``(heads,)`` on the CPU), over all ranks: one MAX
        all-reduce for all layers when ``torch.distributed`` is initialised. Each rank contributes the heads its
        forwards ran -- all of them under DDP and FSDP2, its own share under tensor parallelism -- and ``-inf``
        elsewhere. A NaN maximum travels as ``+inf`` (MAX with NaN is not well defined), so every rank agrees that
        the head is not finite. Layers no forward reached stay ``None`` (on every rank)."""
        distributed = world_size() > 1
        seen = next((m for m in self.maxima if m is not None), None)
        device = collective_device(self.model) if distributed else (seen.device if seen is not None else "cpu")
        # packed on the device (one transfer to the CPU at the end), float64: exact for any input dtype
        flat = torch.full((sum(self.heads),), float("-inf"), dtype=torch.float64, device=device)
        starts = [sum(self.heads[:i]) for i in range(len(self.heads))]
        for (q_rows, _), top, start in zip(self.rows, self.maxima, starts):
            if top is None:
                continue
            first = start + q_rows.local_heads(top.numel())
            flat[first : first + top.numel()] = _nan_as_inf(top.to(device=device, dtype=torch.float64))
        if distributed:
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX)
        flat = flat.cpu()
        out = []
        for start, h in zip(starts, self.heads):
            part = flat[start : start + h]
            out.append(part if bool((part > float("-inf")).any()) else None)
        return out

    @torch.no_grad()
    def step(self) -> list[tuple[int, int, float, float]]:
        """Rescale every head whose recorded maximum exceeds ``tau``, then clear the record. Returns (and keeps in
        :attr:`last_clipped`) ``(layer, head, S_h, gamma_h)`` for each clipped head.

        A head whose maximum is not finite (an overflowed or NaN forward) has no meaningful factor: it is left
        alone, listed in :attr:`last_skipped` and logged as a warning -- scaling it by ``tau / inf = 0`` would erase
        it. A maximum at or below zero never exceeds ``tau > 0``, so it is never clipped (no negative base under a
        fractional power: no NaN)."""
        self._check_at_rest()
        maxima = self.gathered_maxima()
        self.maxima = [None] * len(self.sites)
        self.steps += 1
        self.last_maxima = [None if m is None else m.tolist() for m in maxima]
        clipped, skipped = [], []
        for index, (top, (q_rows, k_rows), norms) in enumerate(zip(maxima, self.rows, self.norms)):
            if top is None:
                continue
            top = top.to(torch.float64)
            bad = torch.isnan(top) | (top == float("inf"))  # -inf is a head no allowed pair reached: fine
            skipped += [(index, h, float(top[h])) for h in range(len(top)) if bad[h]]
            over = ~bad & (top > self.tau)
            gamma = torch.where(over, self.tau / torch.where(over, top, torch.ones_like(top)), torch.ones_like(top))
            if not bool(over.any()):
                continue
            clipped += [(index, h, float(top[h]), float(gamma[h])) for h in range(len(top)) if over[h]]
            if norms is not None:
                _scale_norm_gains(norms, float(gamma.min()), self.alpha)
                continue
            groups = q_rows.heads // k_rows.heads
            q_rows.scale(gamma.pow(self.alpha))
            k_rows.scale(gamma.view(k_rows.heads, groups).amin(1).pow(1.0 - self.alpha))
        self.last_skipped = skipped
        if skipped:
            logger.warning(
                "QK-Clip: non-finite attention logits, heads left unclipped: %s",
                ", ".join(f"layer {i} head {h}: {s}" for i, h, s in skipped),
            )
        if clipped:
            self.clipped_steps += 1
            self.last_clipped = clipped
            logger.info(
                "QK-Clip (tau %g): %s",
                self.tau,
                ", ".join(f"layer {i} head {h}: {s:.4g} -> x{g:.4f}" for i, h, s, g in clipped),
            )
        return clipped

    def _check_at_rest(self) -> None:
        for owned, (q_rows, k_rows) in zip(fsdp_owned(self.model, [s.module for s in self.sites]), self.rows):
            for rows in (q_rows, k_rows) if k_rows is not None else (q_rows,):
                rows.check_at_rest(owned)

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self.alpha,
            "steps": self.steps,
            "clipped_steps": self.clipped_steps,
            "last_clipped": [list(c) for c in self.last_clipped],
            "last_skipped": [list(c) for c in self.last_skipped],
            "last_maxima": self.last_maxima,
        }

    def load_state_dict(self, state: dict) -> None:
        self.tau, self.alpha = _checked(state["tau"], state["alpha"])
        self.steps, self.clipped_steps = int(state["steps"]), int(state["clipped_steps"])
        self.last_clipped = [tuple(c) for c in state.get("last_clipped", [])]
        self.last_skipped = [tuple(c) for c in state.get("last_skipped", [])]
        self.last_maxima = state.get("last_maxima", [])


def _nan_as_inf(t: torch.Tensor) -> torch.Tensor:
    """NaN -> +inf, everything else (infinities included) as it is (``nan_to_num`` would turn +inf into the largest
    finite number: a factor of ~1e-308 that erases the head)."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("inf")), t)


def _checked(tau, alpha) -> tuple[float, float]:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < float("inf"):
        raise ValueError(f"tau must be a positive finite number, got {tau!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return float(tau), float(alpha)


_GAINED_NORMS = (HeadLayerNorm, HeadRMSNorm, HeadLpNorm)


def _normed_gains(site):
    """``(q_norm, k_norm)`` when the module normalises q and k (then the projections' scale does not reach the
    logits and the norms' gains are what to clip), else ``None``."""
    attn = site.module
    q_norm, k_norm = (norm_module(attn, site.family, role) for role in ("q", "k"))
    reused = "k" not in own_roles(attn, site.family)  # the keys of an earlier layer: their gain is that layer's
    if q_norm is None or (k_norm is None and not reused):
        return None
    inner = getattr(q_norm, "original_module", q_norm)  # peft modules_to_save
    if not (isinstance(inner, _GAINED_NORMS) or type(inner).__name__.endswith("RMSNorm")):
        raise NotImplementedError(
            f"layer {site.index}: q/k norm {type(inner).__name__} is not one QK-Clip knows how to scale"
        )
    return attn, q_norm, k_norm, tuple(_gain_offset(site, norm) for norm in (q_norm, k_norm) if norm is not None)


def _gain_offset(site, norm: nn.Module) -> float:
    """What a norm adds to its ``weight`` to make its gain: 0 for ``weight * n(x)``, 1 for Gemma's ``(1 + weight) *
    n(x)`` (scaling such a weight by ``f`` would not scale the output by ``f``). Read off the module by the probe
    :func:`hf_qknorm.portable.fold.affine_form` makes; the norms hf_qknorm makes carry their gain as it is."""
    inner = _whole(getattr(norm, "original_module", norm))
    weight = getattr(inner, "weight", None)
    if isinstance(inner, _GAINED_NORMS) or not isinstance(weight, torch.Tensor) or weight.is_meta:
        return 0.0
    try:
        gain, _ = affine_form(inner)
    except ValueError:
        gain = None
    if gain is weight:
        return 0.0
    if gain is not None and torch.equal(gain.detach().float(), 1 + weight.detach().float()):
        return 1.0
    raise NotImplementedError(
        f"layer {site.index}: q/k norm {type(inner).__name__}'s gain is neither its weight nor 1 + its weight; "
        "QK-Clip does not know how to scale it"
    )


def _whole(norm: nn.Module) -> nn.Module:
    """``norm``, or where its own parameters are ``DTensor`` shards (FSDP2) a shallow copy holding them whole (one
    all-gather each, made by every rank alike), which its form can be read off."""
    own = norm._parameters
    if not any(p is not None and is_dtensor(p) for p in own.values()):
        return norm
    whole = copy.copy(norm)
    whole._parameters = {
        k: None if p is None else nn.Parameter(p.full_tensor().detach() if is_dtensor(p) else p.detach(), False)
        for k, p in own.items()
    }
    return whole


def _check_trained(site, rows, norms) -> None:
    """Refuse, in one line naming why and the fix, a layer whose logits QK-Clip could bound only by editing frozen
    weights."""
    if norms is not None:
        attn, q_norm, k_norm, _ = norms
        lp = isinstance(getattr(k_norm, "original_module", k_norm), HeadLpNorm)  # lp: one scale, on q
        slots = attn.__dict__.get("_qknorm_norms", {})
        for role, norm in (("q", q_norm),) if lp or k_norm is None else (("q", q_norm), ("k", k_norm)):
            name = slots.get(role, f"{role}_norm")
            if not _trained_copies(norm):
                raise ValueError(
                    f"QK-Clip changes only trained parameters, and layer {site.index}'s {name} is frozen (under "
                    "LoRA: not in modules_to_save), so clipping would edit weights the saved adapter does not hold; "
                    "train the q/k norms: hf_qknorm.prepare_lora(model) or LoraConfig(modules_to_save=['q_norm', "
                    "'k_norm'])"
                )
        return
    for r in rows:
        if not r.weight.requires_grad:
            raise ValueError(
                f"QK-Clip changes only trained parameters, and {r.where} is frozen (a LoRA base weight?), so "
                "clipping would edit weights the saved adapter does not hold; patch the model with a QK-norm scheme "
                "before LoRA and train its norms (hf_qknorm.prepare_lora), or train the full weights"
            )


def _scale_norm_gains(norms, gamma: float, alpha: float) -> None:
    """Scale the shared q/k norm gains so that every head's logits scale by at most ``gamma``."""
    attn, q_norm, k_norm, offsets = norms
    if k_norm is None or isinstance(getattr(k_norm, "original_module", k_norm), HeadLpNorm):
        # one logit scale, on q_norm; or a layer reusing an earlier layer's keys, whose gain the q norm alone has
        return _scale_gain(q_norm, gamma, offsets[0])
    _scale_gain(q_norm, gamma**alpha, offsets[0])
    _scale_gain(k_norm, gamma ** (1.0 - alpha), offsets[1])


def _scale_gain(norm: nn.Module, factor: float, offset: float) -> None:
    """Scale a norm's output by ``factor``: its gain (``offset``: 1 for a ``1 + w`` gain) and bias."""
    for module in _trained_copies(norm) if factor != 1.0 else ():
        for name in ("weight", "bias"):
            param = getattr(module, name, None)
            if param is not None:  # this rank's block (FSDP2 shards even a (head_dim,) gain): no collective
                local = local_part(param, f"{name} of {type(module).__name__}").tensor
                local.mul_(factor)
                if name == "weight" and offset:  # (1 + w) -> factor * (1 + w): w -> factor * w + factor - 1
                    local.add_((factor - 1.0) * offset)


def _trained_copies(norm: nn.Module) -> list[nn.Module]:
    """The copies of a q/k norm that training changes and saves: the norm itself, or under ``peft``
    (``ModulesToSaveWrapper``) its trained ``modules_to_save`` copies -- never the frozen ``original_module``, which
    the base model and a disabled adapter compute with. A copy without a trainable parameter is left out."""
    copies = list(norm.modules_to_save.values()) if hasattr(norm, "original_module") else [norm]
    return [m for m in copies if any(p.requires_grad for p in m.parameters())]


class QKClipCallback(ControlCallback):
    """``transformers.Trainer`` callback: QK-Clip after every optimizer step (:class:`ControlCallback` over
    :class:`QKClip`).

    ``Trainer(..., callbacks=[QKClipCallback(tau=100.0)])``. The clip is created when training begins and records
    every training forward from then on. :attr:`clip` is the :class:`QKClip`; ``clip.clipped_steps`` counts the steps
    that clipped something. :attr:`history` has one entry per step that clipped (or skipped a non-finite head):
    ``{"step", "clipped": [[layer, head, S_h, gamma_h], ...], "skipped": [...], "qk_clip/clipped_heads": n}``; the
    count is logged. The clip's counters and the history are saved with every checkpoint and restored on resume."""

    def __init__(self, tau: float = 100.0, alpha: float = 0.5, *, trainer=None):
        self.tau, self.alpha = _checked(tau, alpha)
        super().__init__(
            lambda model: QKClip(model, tau=self.tau, alpha=self.alpha),
            "QK-Clip",
            trainer=trainer,
            args={"tau": self.tau, "alpha": self.alpha},
        )

    @property
    def clip(self) -> QKClip | None:
        return self.control
