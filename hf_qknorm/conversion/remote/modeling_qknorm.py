"""Models converted by hf_qknorm, loadable with plain ``transformers`` through ``trust_remote_code=True``.

This file is copied into every folder that ``hf-qknorm convert`` exports as ``qknorm_<base>``. It rebuilds the
patched model without the plugin: the base family's model, with per-head norms on queries and keys (and values for
``qkv_norm``) applied **before** RoPE, an optional logit cap ``c * tanh(s / c)`` before the mask and softmax, and,
for ``qkv_norm``, the block's pre-attention norm removed (its gain is already folded into the saved projections).
It imports nothing but ``torch`` and ``transformers``; the plugin's test suite checks that it gives the same logits
as ``hf_qknorm`` itself for every family and scheme.

Settings come from ``config.qknorm`` (scheme, norm, softcap, eps, p). Norm parameters have shape ``(head_dim,)``
and are shared by all heads (``l2``/``lp``: the query norm holds one learnable logit scale that replaces
``1/sqrt(head_dim)``; the key norm has none). With a cap and an attention implementation that cannot cap (``sdpa``,
``eager``), attention runs through :func:`capped_attention` here, which materialises the ``(q_len, kv_len)`` logits;
``pip install hf-qknorm`` gives fused kernels and a memory-lean path.
"""

from __future__ import annotations

import math
import sys
import types

import torch
from torch import nn
from torch.nn import functional as F
from transformers import (
    GPT2LMHeadModel,
    GPT2Model,
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    MistralModel,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3ForCausalLM,
    Qwen3Model,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_qknorm import (
    QKNormGPT2Config,
    QKNormLlamaConfig,
    QKNormMistralConfig,
    QKNormQwen2Config,
    QKNormQwen3Config,
)

PREFIX = "qknorm_"
CAP_BACKENDS = ("qknorm", "flash_attention_2", "flash_attention_3", "flex_attention")

# Per-family facts: decoder blocks, attention attribute, pre-attention norm, RoPE, own q/k norms, eps, context.
FAMILIES = {
    "llama": dict(layers="model.layers", attention="self_attn", prenorm="input_layernorm", rope=True, native=False,
                  eps_attr="rms_norm_eps", max_len_attr="max_position_embeddings"),
    "mistral": dict(layers="model.layers", attention="self_attn", prenorm="input_layernorm", rope=True,
                    native=False, eps_attr="rms_norm_eps", max_len_attr="max_position_embeddings"),
    "qwen2": dict(layers="model.layers", attention="self_attn", prenorm="input_layernorm", rope=True, native=False,
                  eps_attr="rms_norm_eps", max_len_attr="max_position_embeddings"),
    "qwen3": dict(layers="model.layers", attention="self_attn", prenorm="input_layernorm", rope=True, native=True,
                  eps_attr="rms_norm_eps", max_len_attr="max_position_embeddings"),
    "gpt2": dict(layers="transformer.h", attention="attn", prenorm="ln_1", rope=False, native=False,
                 eps_attr="layer_norm_epsilon", max_len_attr="n_positions"),
}


# --------------------------------------------------------------------------------------------------------------------
# per-head norms over head_dim, on (batch, seq, heads, head_dim); float32 arithmetic for half-precision inputs
# --------------------------------------------------------------------------------------------------------------------
def _acc(x):
    return torch.promote_types(x.dtype, torch.float32)


class HeadLayerNorm(nn.Module):
    def __init__(self, head_dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))
        self.eps = eps

    def forward(self, x):
        acc = _acc(x)
        y = F.layer_norm(x.to(acc), (x.shape[-1],), self.weight.to(acc), self.bias.to(acc), self.eps)
        return y.to(x.dtype)


class HeadRMSNorm(nn.Module):
    """The arithmetic of ``Qwen3RMSNorm``."""

    def __init__(self, head_dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(_acc(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class HeadLpNorm(nn.Module):
    """``x / max(||x||_p, eps)`` times a logit scale (``scale="logit"``), a per-channel scale, or nothing."""

    def __init__(self, head_dim, p, eps, scale, init=1.0):
        super().__init__()
        self.p, self.eps, self.scale = float(p), eps, scale
        if scale == "logit":
            self.weight = nn.Parameter(torch.full((1,), float(init)))
        elif scale == "channel":
            self.weight = nn.Parameter(torch.full((head_dim,), float(init)))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        acc = _acc(x)
        y = F.normalize(x.to(acc), p=self.p, dim=-1, eps=self.eps)
        if self.weight is not None:
            y = y * self.weight.to(acc)
        return y.to(x.dtype)


def _make_norm(kind, role, head_dim, eps, p, logit_scale):
    if kind == "layernorm":
        return HeadLayerNorm(head_dim, eps)
    if kind == "rmsnorm":
        return HeadRMSNorm(head_dim, eps)
    if kind in ("l2", "lp"):
        scale = {"q": "logit", "k": None, "v": "channel"}[role]
        return HeadLpNorm(head_dim, 2.0 if kind == "l2" else p, eps, scale, logit_scale if role == "q" else 1.0)
    raise ValueError(f"unknown norm {kind!r} in config.qknorm")


# --------------------------------------------------------------------------------------------------------------------
# capped attention (any attention implementation that cannot cap)
# --------------------------------------------------------------------------------------------------------------------
def _bool_mask(mask):
    if mask is None or mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(torch.all(blocked | (mask == 0))):
        raise ValueError("capped attention takes boolean masks or additive masks of 0 and -inf only")
    return ~blocked


def capped_attention(module, query, key, value, attention_mask, scaling, softcap, sliding_window=None,
                     dropout=0.0):
    """``softmax(mask(c * tanh(scaling * q k^T / c))) v``.

    ``query`` ``(batch, heads, q_len, head_dim)``; ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``.
    Causality and the window are bottom-right aligned (a query row sits at position ``row + kv_len - q_len``);
    rows with no visible key give zeros. Returns ``(batch, q_len, heads, head_dim)``.
    """
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    groups = query.shape[1] // key.shape[1]
    k = key.to(acc).repeat_interleave(groups, dim=1)
    v = value.to(acc).repeat_interleave(groups, dim=1)
    s = torch.matmul(query.to(acc), k.transpose(-1, -2)) * scaling
    s = torch.tanh(s / softcap) * softcap
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = _bool_mask(attention_mask)
    rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
    cols = torch.arange(kv_len, device=query.device)[None, :]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
    if mask is None and q_len > 1 and getattr(module, "is_causal", True):
        allowed = cols <= rows
    if sliding_window is not None:
        allowed = allowed & ((rows - cols) < sliding_window)
    allowed = allowed[None, None] if mask is None else mask[..., -q_len:, :] & allowed
    s = s.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(s, dim=-1).nan_to_num(0.0)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _attend(attn, q, k, v, attention_mask, dropout, sliding_window, kwargs):
    impl = attn.config._attn_implementation
    softcap, scaling = attn._qknorm_softcap, attn._qknorm_scaling
    if softcap is not None and impl not in CAP_BACKENDS:
        return capped_attention(attn, q, k, v, attention_mask, scaling, softcap, sliding_window, dropout)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, attn._qknorm_eager)
    if softcap is not None:
        kwargs = {**kwargs, "softcap": softcap}
    return interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **kwargs)


def _norm_heads(attn, q, k, v):
    """Per-head norms on ``(batch, seq, heads, head_dim)`` projections, before RoPE."""
    q_norm, k_norm, v_norm = (getattr(attn, n, None) for n in ("q_norm", "k_norm", "v_norm"))
    q = q if q_norm is None else q_norm(q)
    k = k if k_norm is None else k_norm(k)
    v = v if v_norm is None else v_norm(v)
    return q, k, v


def _rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                  **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    q, k, v = (t.transpose(1, 2) for t in _norm_heads(self, q, k, v))
    cos, sin = position_embeddings
    q, k = self._qknorm_rope(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    dropout = self.attention_dropout if self.training else 0.0
    out, weights = _attend(self, q, k, v, attention_mask, dropout, window, kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _gpt2_forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                  encoder_attention_mask=None, output_attentions=False, **kwargs):
    if encoder_hidden_states is not None:
        raise NotImplementedError("qknorm GPT-2 patches self-attention only; cross-attention is not supported")
    q, k, v = self.c_attn(hidden_states).split(self.split_size, dim=2)
    shape = (*q.shape[:-1], -1, self.head_dim)
    q, k, v = (t.transpose(1, 2) for t in _norm_heads(self, q.view(shape), k.view(shape), v.view(shape)))
    if past_key_values is not None:
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        k, v = cache.update(k, v, self.layer_idx)
    dropout = self.attn_dropout.p if self.training else 0.0
    out, weights = _attend(self, q, k, v, attention_mask, dropout, None, kwargs)
    out = out.reshape(*out.shape[:-2], -1).contiguous()
    return self.resid_dropout(self.c_proj(out)), weights


# --------------------------------------------------------------------------------------------------------------------
# building the patched structure in __init__ (weights are then loaded from the folder)
# --------------------------------------------------------------------------------------------------------------------
def _find_layers(model, path):
    parts = path.split(".")
    for candidate in (parts, parts[1:]):
        obj = model
        for name in candidate:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"could not find the decoder blocks at {path!r}")


def _patch(model):
    config = model.config
    settings = getattr(config, "qknorm", None)
    if not isinstance(settings, dict):
        raise ValueError("config.qknorm is missing: this folder was not written by hf_qknorm")
    family = FAMILIES[config.model_type[len(PREFIX):]]
    scheme, kind = settings["scheme"], settings.get("norm")
    eps = settings.get("eps") or float(getattr(config, family["eps_attr"], 1e-6))
    norms_qk = scheme in ("qk_norm", "qk_norm_cap", "qkv_norm")
    learned_scale = kind in ("l2", "lp")
    max_len = max(int(getattr(config, family["max_len_attr"], 2048)), 2)
    logit_scale = math.log2(max_len * max_len - max_len)  # Henry et al. 2020; replaced by the saved weight
    for block in _find_layers(model, family["layers"]):
        attn = getattr(block, family["attention"])
        if norms_qk:
            for role in ("q", "k") + (("v",) if scheme == "qkv_norm" else ()):
                setattr(attn, f"{role}_norm", _make_norm(kind, role, attn.head_dim, eps, settings.get("p"),
                                                         logit_scale))
        if scheme == "qkv_norm":
            setattr(block, family["prenorm"], nn.Identity())  # its gain is folded into the saved projections
        module = sys.modules[type(attn).__module__]
        attn._qknorm_softcap = settings.get("softcap")
        attn._qknorm_scaling = 1.0 if learned_scale else float(attn.scaling)
        attn._qknorm_rope = getattr(module, "apply_rotary_pos_emb", None)
        attn._qknorm_eager = getattr(module, "eager_attention_forward")
        attn.forward = types.MethodType(_rope_forward if family["rope"] else _gpt2_forward, attn)


class _QKNormMixin:
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        _patch(self)


class QKNormLlamaModel(_QKNormMixin, LlamaModel):
    config_class = QKNormLlamaConfig


class QKNormLlamaForCausalLM(_QKNormMixin, LlamaForCausalLM):
    config_class = QKNormLlamaConfig


class QKNormMistralModel(_QKNormMixin, MistralModel):
    config_class = QKNormMistralConfig


class QKNormMistralForCausalLM(_QKNormMixin, MistralForCausalLM):
    config_class = QKNormMistralConfig


class QKNormQwen2Model(_QKNormMixin, Qwen2Model):
    config_class = QKNormQwen2Config


class QKNormQwen2ForCausalLM(_QKNormMixin, Qwen2ForCausalLM):
    config_class = QKNormQwen2Config


class QKNormQwen3Model(_QKNormMixin, Qwen3Model):
    config_class = QKNormQwen3Config


class QKNormQwen3ForCausalLM(_QKNormMixin, Qwen3ForCausalLM):
    config_class = QKNormQwen3Config


class QKNormGPT2Model(_QKNormMixin, GPT2Model):
    config_class = QKNormGPT2Config


class QKNormGPT2LMHeadModel(_QKNormMixin, GPT2LMHeadModel):
    config_class = QKNormGPT2Config
