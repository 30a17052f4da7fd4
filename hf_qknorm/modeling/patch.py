"""``patch_model``: add QK-norm / softmax capping / QKV-norm to a loaded Transformers model, in place.

Instance-level and table-driven: every supported family is a row of :mod:`hf_qknorm.modeling.families`; this module walks the
model's decoder blocks, adds ``q_norm``/``k_norm``/(``v_norm``) to each attention module, binds a patched
``forward`` to that module instance only, and records the scheme on ``model.config.qknorm``. A patched and an
unpatched model can live in the same process.
"""

from __future__ import annotations

import logging
import sys
import types

import torch
from torch import nn

from ..attention.interface import ATTN_IMPLEMENTATION, CAP_BACKENDS, REPLACEABLE_BACKENDS, fused_norm_rope
from .families import Family, get_family
from .norms import henry_logit_scale, make_norm
from .schemes import QKNormConfig

logger = logging.getLogger(__name__)


class _Spec:
    """What a patched attention module needs at run time (kept on the module as ``_qknorm``)."""

    def __init__(self, cfg: QKNormConfig, family: Family, scaling: float, rope_fn, eager_fn):
        self.cfg, self.family, self.scaling = cfg, family, scaling
        self.rope_fn, self.eager_fn = rope_fn, eager_fn


# --------------------------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------------------------
def patch_model(model: nn.Module, scheme: str = "qk_norm_cap", *, norm: str | None = None,
                softcap: float | None = None, eps: float | None = None, p: float | None = None) -> nn.Module:
    """Patch every attention layer of ``model`` with ``scheme``; returns the same (patched) model.

    Args:
        model: a loaded Llama, Mistral, Qwen2, Qwen3 or GPT-2 model (``*ForCausalLM`` or the base model), in any
            dtype, optionally wrapped by ``peft``.
        scheme: ``"qk_norm"``, ``"soft_cap"``, ``"qk_norm_cap"`` or ``"qkv_norm"``.
        norm: ``"layernorm"`` (default), ``"rmsnorm"``, ``"l2"`` or ``"lp"`` (with ``p``); not for ``soft_cap``.
        softcap: the cap ``c``; ``None`` means 50.0 for the capped schemes.
        eps: the norm epsilon; ``None`` takes the model's own norm epsilon.
        p: the exponent of the ``lp`` norm.

    New norm weights start as identity (weight 1, bias 0); ``l2``/``lp`` start their logit scale at Henry et al.'s
    ``log2(L^2 - L)`` for the model's context length ``L``. ``qkv_norm`` removes the pre-attention norm and folds
    its gain (and bias) into the projections that read it. A capped scheme moves a model on ``eager``/``sdpa``
    (which cannot cap) to the ``"qknorm"`` attention implementation.
    """
    cfg = QKNormConfig(scheme=scheme, norm=norm, softcap=softcap, eps=eps, p=p)
    target = _unwrap(model)
    config = target.config
    if getattr(config, "qknorm", None) is not None or str(getattr(config, "model_type", "")).startswith("qknorm_"):
        raise ValueError(f"model is already patched with {getattr(config, 'qknorm', None)!r}; "
                         "patching twice is not supported: patch the original model once")
    family = get_family(getattr(config, "model_type", None))
    if cfg.eps is None:
        cfg = QKNormConfig(**{**cfg.to_dict(), "eps": float(getattr(config, family.eps_attr, 1e-6))})
    _apply(target, cfg, family)
    _mark_patched(target, cfg, family)
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    """The Transformers model inside a ``peft`` wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise TypeError(f"patch_model expects a Transformers model, got {type(model).__name__}")
    return inner


def _find_layers(model: nn.Module, family: Family) -> nn.ModuleList:
    """The decoder blocks, for a ``*ForCausalLM`` (``model.layers``) or a bare base model (``layers``)."""
    path = family.layers.split(".")
    for candidate in (path, path[1:]):
        obj = model
        for name in candidate:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"could not find the decoder blocks of this {family.model_type} model at "
                     f"{family.layers!r} (model class {type(model).__name__})")


# --------------------------------------------------------------------------------------------------------------------
# the structural change
# --------------------------------------------------------------------------------------------------------------------
def _apply(model: nn.Module, cfg: QKNormConfig, family: Family) -> None:
    config = model.config
    layers = _find_layers(model, family)
    logit_scale = henry_logit_scale(getattr(config, family.max_len_attr, 2048))
    for block in layers:
        attn = getattr(block, family.attention, None)
        if attn is None or type(attn).__name__ != family.attention_class:
            found = type(attn).__name__ if attn is not None else "nothing"
            raise ValueError(f"expected {family.attention_class} at .{family.attention} of each "
                             f"{family.model_type} block, found {found}")
        ref = _proj_weight(attn, family)
        factory = dict(device=ref.device, dtype=ref.dtype if ref.dtype.is_floating_point else torch.float32)
        if cfg.norms_qk:
            _install_norm(attn, "q_norm", cfg, family, logit_scale, factory)
            _install_norm(attn, "k_norm", cfg, family, logit_scale, factory)
        if cfg.norms_v:
            _install_norm(attn, "v_norm", cfg, family, logit_scale, factory)
        if cfg.removes_prenorm:
            _remove_prenorm(block, attn, family)
        module = sys.modules[type(attn).__module__]
        scaling = 1.0 if cfg.learned_logit_scale else float(attn.scaling)
        attn._qknorm = _Spec(cfg, family, scaling, getattr(module, "apply_rotary_pos_emb", None),
                             getattr(module, "eager_attention_forward"))
        attn.forward = types.MethodType(_rope_forward if family.rope else _gpt2_forward, attn)
    if cfg.caps:
        _ensure_cap_backend(model)


def _proj_weight(attn: nn.Module, family: Family) -> torch.Tensor:
    proj = getattr(attn, family.qkv_proj or family.q_proj)
    proj = getattr(proj, "base_layer", proj)  # peft LoRA wrapper
    return proj.weight


def _install_norm(attn, name, cfg, family, logit_scale, factory) -> None:
    role = name[0]
    head_dim = attn.head_dim
    # Qwen3's own q/k RMSNorm: its pretrained gain is carried over to the new norm. For ``rmsnorm`` the new module
    # is the same arithmetic with the same weight (and float64 stays float64), i.e. the norm is kept.
    existing = getattr(attn, name, None) if family.native_qk_norm else None
    new = make_norm(cfg.norm, role, head_dim, cfg.eps, cfg.p, logit_scale).to(**factory)
    if existing is not None and getattr(new, "weight", None) is not None and new.weight.shape == existing.weight.shape:
        with torch.no_grad():
            new.weight.copy_(existing.weight)
    setattr(attn, name, new)


def _remove_prenorm(block: nn.Module, attn: nn.Module, family: Family) -> None:
    """Drop the pre-attention norm ``y = g * n(x) + b`` and fold ``g`` (and ``b``) into the projections reading it.

    ``W (g * n + b) + c  ==  (W diag(g)) n + (W b + c)``: the projections keep their pretrained behaviour on the
    normalised direction, and the per-head q/k/v norms of ``qkv_norm`` take over the normalisation."""
    prenorm = getattr(block, family.prenorm)
    gain = getattr(prenorm, "weight", None)
    bias = getattr(prenorm, "bias", None)
    names = [family.qkv_proj] if family.fused_qkv else [family.q_proj, family.k_proj, family.v_proj]
    with torch.no_grad():
        for name in names:
            _fold_input_affine(getattr(attn, name), gain, bias, family.conv1d)
    setattr(block, family.prenorm, nn.Identity())


def _fold_input_affine(proj: nn.Module, gain, bias, conv1d: bool) -> None:
    if bias is not None:  # the constant the pre-norm bias contributes, computed through the module itself
        zero = torch.zeros_like(bias).unsqueeze(0)
        shift = (proj(bias.unsqueeze(0)) - proj(zero)).squeeze(0)
    base = getattr(proj, "base_layer", proj)
    if gain is not None:
        g = gain.to(base.weight.dtype)
        if conv1d:
            base.weight.mul_(g[:, None])  # Conv1D weight is (in, out)
        else:
            base.weight.mul_(g[None, :])
        for lora_a in getattr(proj, "lora_A", {}).values():  # peft: LoRA A reads the same input
            lora_a.weight.mul_(g.to(lora_a.weight.dtype)[None, :])
    if bias is not None:
        if base.bias is None:
            base.bias = nn.Parameter(torch.zeros(shift.shape, dtype=base.weight.dtype, device=base.weight.device))
        base.bias.add_(shift.to(base.bias.dtype))


def _ensure_cap_backend(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl in CAP_BACKENDS:
        return
    if impl in REPLACEABLE_BACKENDS:
        logger.info("attention implementation %r cannot cap logits; switching to %r", impl, ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return
    raise ValueError(f"attention implementation {impl!r} would drop the softcap; use one of {CAP_BACKENDS}")


def check_cap_backend(config, softcap) -> None:
    """Refuse to run a capped attention through a backend that ignores ``softcap``."""
    impl = config._attn_implementation
    if softcap is not None and impl not in CAP_BACKENDS:
        raise ValueError(f"attention implementation {impl!r} cannot apply the softcap of this patched model "
                         f"(it would be dropped silently); use one of {CAP_BACKENDS}, e.g. "
                         f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")


# --------------------------------------------------------------------------------------------------------------------
# patched forwards (bound to each attention instance)
# --------------------------------------------------------------------------------------------------------------------
def _norm_heads(attn, q, k, v):
    """Per-head norms on ``(batch, seq, heads, head_dim)`` projections, before RoPE."""
    q_norm, k_norm, v_norm = (getattr(attn, n, None) for n in ("q_norm", "k_norm", "v_norm"))
    if q_norm is not None:
        q = q_norm(q)
    if k_norm is not None:
        k = k_norm(k)
    if v_norm is not None:
        v = v_norm(v)
    return q, k, v


def _attend(attn, spec, q, k, v, attention_mask, dropout, sliding_window, kwargs):
    config = attn.config
    softcap = spec.cfg.softcap
    check_cap_backend(config, softcap)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, spec.eager_fn)
    probe = getattr(attn, "_qknorm_probe", None)  # set by monitors (hf_qknorm.training) for the steps they record
    if probe is not None:
        probe(attn, q, k, attention_mask=attention_mask, scaling=spec.scaling, softcap=softcap)
    if softcap is not None:
        kwargs = {**kwargs, "softcap": softcap}
    return interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=spec.scaling,
                     sliding_window=sliding_window, **kwargs)


def _rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                  **kwargs):
    """Llama-style attention (Llama, Mistral, Qwen2, Qwen3) with per-head norms before RoPE and an optional cap.
    On CUDA the norm and RoPE of q and k run as one fused Triton kernel each."""
    spec = self._qknorm
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    cos, sin = position_embeddings
    fused_q = fused_norm_rope(self.q_norm, q, cos, sin) if getattr(self, "q_norm", None) is not None else None
    fused_k = fused_norm_rope(self.k_norm, k, cos, sin) if fused_q is not None else None
    if fused_k is not None:
        v = self.v_norm(v) if getattr(self, "v_norm", None) is not None else v
        q, k, v = fused_q.transpose(1, 2), fused_k.transpose(1, 2), v.transpose(1, 2)
    else:
        q, k, v = (t.transpose(1, 2) for t in _norm_heads(self, q, k, v))
        q, k = spec.rope_fn(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    dropout = self.attention_dropout if self.training else 0.0
    out, weights = _attend(self, spec, q, k, v, attention_mask, dropout, window, kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _gpt2_forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                  encoder_attention_mask=None, output_attentions=False, **kwargs):
    """GPT-2 self-attention (fused Conv1D ``c_attn``, no RoPE) with per-head norms and an optional cap."""
    if encoder_hidden_states is not None:
        raise NotImplementedError("hf_qknorm patches GPT-2 self-attention only; cross-attention is not supported")
    spec = self._qknorm
    q, k, v = self.c_attn(hidden_states).split(self.split_size, dim=2)
    shape = (*q.shape[:-1], -1, self.head_dim)
    q, k, v = (t.transpose(1, 2) for t in _norm_heads(self, q.view(shape), k.view(shape), v.view(shape)))
    if past_key_values is not None:
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        k, v = cache.update(k, v, self.layer_idx)
    dropout = self.attn_dropout.p if self.training else 0.0
    out, weights = _attend(self, spec, q, k, v, attention_mask, dropout, None, kwargs)
    out = out.reshape(*out.shape[:-2], -1).contiguous()
    return self.resid_dropout(self.c_proj(out)), weights


# --------------------------------------------------------------------------------------------------------------------
# bookkeeping: the config and class that save/load as ``qknorm_<base>``
# --------------------------------------------------------------------------------------------------------------------
def _mark_patched(model: nn.Module, cfg: QKNormConfig, family: Family) -> None:
    from .classes import patched_classes

    config_cls, model_cls = patched_classes(family.model_type, type(model))
    model.config.__class__ = config_cls
    model.config.qknorm = cfg.to_dict()
    if model_cls is not None:
        model.__class__ = model_cls
    if getattr(model.config, "architectures", None) is not None or model_cls is not None:
        model.config.architectures = [type(model).__name__]


def is_patched(model: nn.Module) -> bool:
    return getattr(_unwrap(model).config, "qknorm", None) is not None


def qknorm_config(model: nn.Module) -> QKNormConfig | None:
    """The :class:`QKNormConfig` a model was patched with, or ``None``."""
    d = getattr(_unwrap(model).config, "qknorm", None)
    return None if d is None else QKNormConfig.from_dict(d)
