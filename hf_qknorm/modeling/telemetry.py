"""What the attention backend sees, delivered to whoever asks: the q and k of every attention call, and the largest
pre-cap logit of every head.

:class:`LogitTap` attaches to the attention modules of a model (any supported family, patched or not, wrapped or not)
and hands each call's ``q`` ``(batch, heads, q_len, head_dim)`` and ``k`` ``(batch, kv_heads, kv_len, head_dim)`` --
after the norms and after RoPE -- with the mask, the scaling, the cap and (``max_logits=True``) the per-head largest
pre-cap logit to a consumer:

- on the ``"qknorm"`` backend the backend itself calls the tap (``module._qknorm_probes``) with the tensors it
  attended over, and the per-head maxima come out of the attention's own pass (the Triton kernels' row maxima, the
  PyTorch path's tile maxima; :mod:`hf_qknorm.attention.interface`): nothing is recomputed, and it works under
  ``torch.compile`` (the probe is traced in);
- on any other backend (the unpatched baseline on ``sdpa``, an uncapped patched model on ``sdpa``/``eager``) forward
  hooks capture the projection outputs -- after a patched model's norm hooks, which run first -- and the attention
  module's ``position_embeddings``, and q and k are rotated with the family's own ``apply_rotary_pos_emb`` as its
  forward does (:func:`hf_qknorm.portable.layout.rotary_function`). Here the keys are the current call's only
  (no cached keys), and the per-head maxima are computed on the side by :func:`head_max_logits`: the per-head
  maximum of ``scaling * q.k`` over the pairs the mask allows, in query chunks that skip the keys past a causal
  row's diagonal (never a ``(q_len, kv_len)`` tensor per head for the whole sequence).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ..attention.chunked import max_logits
from ..attention.tiles import TILE_ELEMENTS
from ..portable.families import SPELLED_OUT_TYPES
from ..portable.layout import attention_sites, rotary_function
from ..portable.masks import resolve_mask
from ..portable.names import ATTN_IMPLEMENTATION

_TAP_IDS = itertools.count()


def _resolve(mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool):
    """:func:`~hf_qknorm.portable.masks.resolve_mask` for the keys a probe sees: on a backend other than
    ``"qknorm"`` the hooks see the current call's keys only, while the mask covers cached + new keys."""
    if mask is not None and mask.shape[-1] > kv_len:
        mask = mask[..., -kv_len:]
    return resolve_mask(mask, q_len, kv_len, causal)


def per_group(ok: torch.Tensor | None, kv_heads: int, groups: int) -> torch.Tensor | None:
    """A ``(.., rows, kv_len)`` allowed-tile reshaped to broadcast against ``(B, kv_heads, groups, rows, kv_len)``."""
    if ok is None:
        return None
    if ok.dim() == 2:
        return ok[None, None, None]
    if ok.shape[1] == 1:
        return ok[:, :, None]
    return ok.reshape(ok.shape[0], kv_heads, groups, *ok.shape[-2:])


def logit_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    causal: bool,
    tile_elements: int = TILE_ELEMENTS,
):
    """The pre-cap logits ``scaling * q.k`` of one attention call in query-row chunks, for statistics.

    Yields ``(s, ok)``: ``s`` ``(batch, kv_heads, groups, rows, keys)`` in float32 (float64 for float64 inputs) with
    disallowed pairs set to ``-inf``, and ``ok`` the allowed pattern broadcastable to it (``None``: all allowed).
    Causal rows skip the keys past their diagonal (a missing mask is top-left causal, as in the backend). Only a few
    ``tile_elements``-sized tiles are ever live."""
    acc = torch.promote_types(q.dtype, torch.float32)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    mask, causal, kv_len = _resolve(attention_mask, q_len, kv_len, causal)
    qg = q.reshape(batch, kv_heads, groups, q_len, head_dim)
    kt = k[:, :, :kv_len].to(acc).transpose(-1, -2).unsqueeze(2)  # (B, Hkv, 1, D, Tk)
    rows = int(max(1, min(q_len, tile_elements // max(1, batch * heads * kv_len))))
    if causal:
        rows = min(rows, 64)  # small row chunks skip the keys above the diagonal (about half the work)
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        hi = min(kv_len, end) if causal else kv_len
        s = torch.matmul(qg[:, :, :, start:end].to(acc), kt[..., :hi]).mul_(scaling)  # (B, Hkv, G, rows, hi)
        if causal:
            ok = torch.arange(hi, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        elif mask is not None:
            ok = per_group(mask[..., start:end, :hi], kv_heads, groups)
        else:
            ok = None
        if ok is not None:
            s.masked_fill_(~ok, float("-inf"))
        yield s, ok


@torch.no_grad()
def head_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scaling: float,
    causal: bool = True,
    tile_elements: int | None = None,
) -> torch.Tensor:
    """The largest pre-cap logit ``scaling * q.k`` of each query head, over the batch and the allowed pairs.

    ``q`` ``(batch, heads, q_len, head_dim)``, ``k`` ``(batch, kv_heads, kv_len, head_dim)`` (GQA: query head ``h``
    reads key head ``h // (heads // kv_heads)``); ``attention_mask`` boolean or additive, or ``None`` (causal when
    ``causal``, top-left as in the backend). Returns ``(heads,)`` in float32 (float64 for float64 inputs); ``-inf``
    for a head with no allowed pair. Computed over cache-sized tiles
    (:func:`hf_qknorm.attention.chunked.max_logits`)."""
    mask, causal, kv_len = _resolve(attention_mask, q.shape[2], k.shape[2], causal)
    return max_logits(q, k[:, :, :kv_len], scaling=scaling, mask=mask, causal=causal, tile_elements=tile_elements)


class LogitTap:
    """Calls ``consumer(index, module, q, k, attention_mask, scaling, softcap)`` for every attention call of
    ``model`` while attached (see the module docstring for how q and k are obtained on each backend).

    ``max_logits=True`` adds an eighth argument: the call's per-head largest pre-cap logit ``(heads,)`` (float32,
    float64 for float64 inputs; ``-inf`` for a head with no allowed pair). ``training_only=True``: calls of
    modules in eval mode are skipped (and cost nothing). Several taps may be attached to one model at once (a monitor
    and QK-Clip); each is independent. ``attach`` and ``detach`` are cheap: the monitor attaches only on the steps it
    records."""

    def __init__(self, model: nn.Module, consumer, *, max_logits: bool = False, training_only: bool = False):
        self.sites = attention_sites(model)
        self.consumer = consumer
        self.max_logits, self.training_only = bool(max_logits), bool(training_only)
        self.key = next(_TAP_IDS)
        self._probes = {site.index: self._probe_for(site.index) for site in self.sites}  # made once: compile-stable
        self._handles: list = []
        self._probed: list[nn.Module] = []
        self.attached = False

    def _probe_for(self, index: int):
        def probe(attn, q, k, attention_mask=None, scaling=1.0, softcap=None, max_logits=None):
            if self.training_only and not attn.training:
                return
            if self.max_logits and max_logits is None:  # a backend that does not produce them: on the side
                max_logits = head_max_logits(
                    q.detach(),
                    k.detach(),
                    attention_mask,
                    scaling=float(scaling),
                    causal=getattr(attn, "is_causal", True),
                )
            self._deliver(index, attn, q, k, attention_mask, scaling, softcap, max_logits)

        # read by the backend before it attends: whether to produce the per-head maxima in its own pass
        probe.wants_max_logits = (
            (lambda attn: attn.training) if self.max_logits and self.training_only else self.max_logits
        )
        return probe

    def _deliver(self, index, attn, q, k, mask, scaling, softcap, max_logits) -> None:
        if self.max_logits:
            self.consumer(index, attn, q, k, mask, scaling, softcap, max_logits)
        else:
            self.consumer(index, attn, q, k, mask, scaling, softcap)

    def attach(self) -> None:
        if self.attached:
            return
        rebuilt = [s for s in self.sites if s.backend != ATTN_IMPLEMENTATION]
        if rebuilt and rebuilt[0].family.model_type not in SPELLED_OUT_TYPES:
            raise NotImplementedError(
                f"the q/k telemetry on attention implementation {rebuilt[0].backend!r} rebuilds q and k the way "
                f"{', '.join(SPELLED_OUT_TYPES)} compute them; for model type {rebuilt[0].family.model_type!r} run the "
                f"model on {ATTN_IMPLEMENTATION!r} (model.set_attn_implementation({ATTN_IMPLEMENTATION!r})), whose "
                "backend reports what it attends over"
            )
        for site in self.sites:
            if site.backend == ATTN_IMPLEMENTATION:
                site.module.__dict__.setdefault("_qknorm_probes", {})[self.key] = self._probes[site.index]
                self._probed.append(site.module)
            else:
                self._hook(site)
        self.attached = True

    def detach(self) -> None:
        for module in self._probed:
            probes = module.__dict__.get("_qknorm_probes", {})
            probes.pop(self.key, None)
            if not probes:
                module.__dict__.pop("_qknorm_probes", None)
        self._probed.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.attached = False

    def _hook(self, site) -> None:
        """Hooks that rebuild the q and k a module on another backend hands it (see the module docstring)."""
        attn, fam, index = site.module, site.family, site.index
        ctx: dict = {}

        def pre(module, args, kwargs):
            ctx.clear()
            ctx["mask"] = kwargs.get("attention_mask")
            ctx["rope"] = kwargs.get("position_embeddings")

        def capture(name):
            def hook(module, args, output):
                ctx[name] = output.detach()  # nothing here may join the autograd graph (checkpointing)

            return hook

        def post(module, args, kwargs, output):
            if not ("qkv" in ctx or ("q" in ctx and "k" in ctx)) or (self.training_only and not attn.training):
                ctx.clear()
                return
            with torch.no_grad():
                q, k = _rebuild_qk(attn, fam, ctx)
                top = (
                    head_max_logits(
                        q, k, ctx.get("mask"), scaling=float(attn.scaling), causal=getattr(attn, "is_causal", True)
                    )
                    if self.max_logits
                    else None
                )
            self._deliver(index, attn, q, k, ctx.get("mask"), attn.scaling, attn.__dict__.get("_qknorm_softcap"), top)
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


def _rebuild_qk(attn: nn.Module, fam, ctx: dict):
    """``(B, H, T, D)`` queries and ``(B, Hkv, T, D)`` keys from captured projection outputs, RoPE applied."""
    d = attn.head_dim
    if fam.fused_qkv:
        q, k, _ = ctx["qkv"].split(attn.split_size, dim=-1)
    else:
        q, k = ctx["q"], ctx["k"]
    # contiguous (batch, heads, seq, head_dim): RoPE's elementwise ops on the transposed views are several times
    # slower (benchmarks/results/tuning.md)
    q = q.reshape(*q.shape[:2], -1, d).transpose(1, 2).contiguous()
    k = k.reshape(*k.shape[:2], -1, d).transpose(1, 2).contiguous()
    if fam.rope and ctx.get("rope") is not None:
        q, k = rotary_function(attn)(q, k, *ctx["rope"])
    return q, k
