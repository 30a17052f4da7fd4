"""What the reference needs to know about each attention layer, read from a model: effective float64 weights, norms,
scaling, cap, window and pre-norm -- and the probe plan that names the modules to watch.

Everything here comes from the weights and the config, never from what the attention code computes: the scheme
from ``config.qknorm``, the logit scale from the formulas (``head_dim ** -0.5``; ``1`` for ``l2``/``lp``, whose
query norm carries the learnable scale; GPT-2's layer-index scaling from its config), the window from the config.
Weights are those a forward would use: ``transformers.Conv1D`` transposed to ``(out, in)``, GPT-2's fused ``c_attn``
split in thirds, and ``peft`` LoRA layers as ``base + sum of active unmerged deltas`` (``get_delta_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..modeling.patch import qknorm_config
from ..portable.families import SPELLED_OUT_TYPES, Family, UnsupportedModelError, family_of_model
from ..portable.layout import find_layers, unwrap
from ..portable.schemes import QKNormConfig
from .probe import probe_tokens


@dataclass
class LayerSpec:
    """One attention layer for :func:`hf_qknorm.reference.attention_layer_reference`, all tensors float64 on CPU.

    ``wq`` ``(heads * head_dim, hidden)``, ``wk``/``wv`` ``(kv_heads * head_dim, hidden)``, ``wo``
    ``(hidden, heads * head_dim)``; biases ``(out,)`` or ``None``. ``q_norm``/``k_norm``/``v_norm``: dicts with
    ``weight``/``bias`` (``(head_dim,)``, ``(1,)`` for the lp logit scale, or ``None``), or ``None`` for no norm.
    ``prenorm``: the block's pre-attention norm (``kind``, ``weight``, ``bias``, ``eps``), or ``None`` when the
    scheme removes it (``qkv_norm``)."""

    index: int
    weights: dict
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    softcap: float | None
    norm: str | None
    eps: float
    p: float
    q_norm: dict | None
    k_norm: dict | None
    v_norm: dict | None
    window: int | None
    prenorm: dict | None = field(default=None)

    @property
    def has_norms(self) -> bool:
        return any(n is not None for n in (self.q_norm, self.k_norm, self.v_norm))


class ReferenceModel:
    """The reference side of a model: its scheme, its layers' specs (built on demand: a large model's float64
    weights are never all held at once) and the probe plan, with module names as seen from ``model``."""

    def __init__(self, model: nn.Module):
        self.outer = model
        self.inner = unwrap(model)
        self.config = self.inner.config
        self.family: Family = family_of_model(self.inner)
        if self.family.model_type not in SPELLED_OUT_TYPES:
            raise UnsupportedModelError(
                f"verify recomputes attention in float64 for model types {', '.join(SPELLED_OUT_TYPES)}; model type "
                f"{self.family.model_type!r} was checked when it was patched (the patch-time self-check)"
            )
        self.scheme: QKNormConfig | None = qknorm_config(self.inner)
        self.blocks = find_layers(self.inner, self.family)
        self.attns = [getattr(b, self.family.attention) for b in self.blocks]
        self._names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def __len__(self) -> int:
        return len(self.attns)

    # ---------------------------------------------------------------------------------------------------------------
    def head_counts(self, attn) -> tuple[int, int, int]:
        heads = int(self.config.num_attention_heads)
        kv = int(getattr(self.config, "num_key_value_heads", None) or heads)
        return heads, kv, int(attn.head_dim)

    def scaling(self, index: int, head_dim: int) -> float:
        if self.scheme is not None and self.scheme.learned_logit_scale:
            return 1.0  # the query norm's learnable scale replaces 1/sqrt(head_dim)
        if self.family.model_type == "gpt2":
            s = head_dim**-0.5 if getattr(self.config, "scale_attn_weights", True) else 1.0
            if getattr(self.config, "scale_attn_by_inverse_layer_idx", False):
                s /= float(index + 1)
            return s
        return head_dim**-0.5

    def window(self, index: int) -> int | None:
        types = getattr(self.config, "layer_types", None)
        if types:
            return self.config.sliding_window if types[index] == "sliding_attention" else None
        return getattr(self.config, "sliding_window", None)

    def norm_settings(self) -> tuple[str | None, bool, float, float]:
        """``(kind, on values, eps, p)`` of the q/k(/v) norms of the scheme, or of Qwen3's own q/k RMSNorm."""
        s = self.scheme
        if s is not None and s.norms_qk:
            return s.norm, s.norms_v, float(s.eps), float(s.p or 2.0)
        if self.family.native_qk_norm:
            return "rmsnorm", False, float(self.family.norm_eps(self.config)), 2.0
        return None, False, 1e-6, 2.0

    # ---------------------------------------------------------------------------------------------------------------
    def spec(self, index: int) -> LayerSpec:
        attn, block = self.attns[index], self.blocks[index]
        heads, kv, head_dim = self.head_counts(attn)
        kind, on_v, eps, p = self.norm_settings()
        norms = {}
        for role in ("q", "k", "v"):
            wanted = kind is not None and (role != "v" or on_v)
            module = getattr(attn, f"{role}_norm", None) if wanted else None
            if wanted and module is None:
                raise ValueError(
                    f"layer {index}: the scheme has a {role} norm but the attention module has no {role}_norm"
                )
            norms[role] = _norm_params(module) if wanted else None
        return LayerSpec(
            index=index,
            weights=self._weights(attn),
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            scaling=self.scaling(index, head_dim),
            softcap=self.scheme.softcap if self.scheme else None,
            norm=kind,
            eps=eps,
            p=p,
            q_norm=norms["q"],
            k_norm=norms["k"],
            v_norm=norms["v"],
            window=self.window(index),
            prenorm=self._prenorm(block),
        )

    def _weights(self, attn) -> dict:
        f = self.family
        if f.fused_qkv:
            w, b = _effective(getattr(attn, f.qkv_proj), f.conv1d)
            e = w.shape[0] // 3
            out = {"wq": w[:e], "wk": w[e : 2 * e], "wv": w[2 * e :]}
            out.update(
                {"bq": None, "bk": None, "bv": None}
                if b is None
                else {"bq": b[:e], "bk": b[e : 2 * e], "bv": b[2 * e :]}
            )
        else:
            out = {}
            for role, name in f.projections.items():
                out[f"w{role}"], out[f"b{role}"] = _effective(getattr(attn, name), f.conv1d)
        out["wo"], out["bo"] = _effective(getattr(attn, f.out_proj), f.conv1d)
        return out

    def _prenorm(self, block) -> dict | None:
        if self.scheme is not None and self.scheme.removes_prenorm:
            return None  # qkv_norm: the attention reads the residual stream itself
        module = getattr(block, self.family.prenorm)
        kind = "layernorm" if isinstance(module, nn.LayerNorm) else "rmsnorm"
        return {"kind": kind, "eps": float(self.family.norm_eps(self.config)), **_norm_params(module)}

    # ---------------------------------------------------------------------------------------------------------------
    def name(self, module: nn.Module) -> str:
        try:
            return self._names[id(module)]
        except KeyError:
            raise ValueError(f"{type(module).__name__} is not a submodule of the model") from None

    def plan(self, *, generate: bool = True, seed: int = 0) -> dict:
        """The probe plan (JSON-able): per layer the attention and block names, the modules producing the final
        pre-RoPE query and key (for the stress gain), head_dim, scaling and cap; and the probe tokens."""
        layers = []
        for i, (attn, block) in enumerate(zip(self.attns, self.blocks)):
            _, _, head_dim = self.head_counts(attn)
            layers.append(
                {
                    "attn": self.name(attn),
                    "block": self.name(block),
                    "q": self._producer(attn, "q"),
                    "k": self._producer(attn, "k"),
                    "head_dim": head_dim,
                    "scaling": self.scaling(i, head_dim),
                    "cap": self.scheme.softcap if self.scheme else None,
                }
            )
        gen = getattr(self.inner, "generation_config", None)
        can_generate = generate and callable(getattr(self.inner, "can_generate", None)) and self.inner.can_generate()
        return {
            "layers": layers,
            **probe_tokens(self.config.vocab_size, seed),
            "generate": bool(can_generate),
            "pad_token_id": getattr(gen, "pad_token_id", None),
        }

    def _producer(self, attn, role: str) -> list:
        """``[module name, part, parts]`` of the module whose output is the final pre-RoPE ``role`` vector: the
        norm when the layer has one, else the projection (a third of GPT-2's fused ``c_attn``)."""
        norm = getattr(attn, f"{role}_norm", None)
        if isinstance(norm, nn.Module):
            return [self.name(norm), 0, 1]
        f = self.family
        if f.fused_qkv:
            return [self.name(getattr(attn, f.qkv_proj)), "qkv".index(role), 3]
        return [self.name(getattr(attn, f.projections[role])), 0, 1]


# -------------------------------------------------------------------------------------------------------------------
# weights as a forward uses them
# -------------------------------------------------------------------------------------------------------------------
def _f64(t):
    return None if t is None else t.detach().to(device="cpu", dtype=torch.float64)


def _active_module(module: nn.Module) -> nn.Module:
    """The module a ``peft`` ``ModulesToSaveWrapper`` runs (its active trained copy), or the module itself."""
    copies = getattr(module, "modules_to_save", None)
    if not isinstance(copies, nn.ModuleDict):
        return module
    active = [a for a in getattr(module, "active_adapters", []) if a in copies]
    if getattr(module, "disable_adapters", False) or not active:
        return module.original_module
    return copies[active[0]]


def _norm_params(module: nn.Module) -> dict:
    module = _active_module(module)
    return {"weight": _f64(getattr(module, "weight", None)), "bias": _f64(getattr(module, "bias", None))}


def _effective(module: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W (out, in), b)`` in float64 of a projection: plain, ``Conv1D`` or a ``peft`` LoRA layer."""
    base = getattr(module, "base_layer", module)
    weight = _f64(base.weight)
    bias = _f64(getattr(base, "bias", None))
    if hasattr(module, "lora_A") and hasattr(module, "get_delta_weight") and not module.disable_adapters:
        merged = set(getattr(module, "merged_adapters", []))
        for name in module.active_adapters:
            if name not in module.lora_A or name in merged:
                continue  # a merged adapter is in the base weight already
            if getattr(module, "use_dora", {}).get(name):
                raise ValueError(
                    f"adapter {name!r} uses DoRA, which the verifier's reference does not model; "
                    "merge it (merge_and_unload) and verify the merged model"
                )
            weight = weight + _f64(module.get_delta_weight(name))  # in the base layer's layout
            if getattr(module, "lora_bias", {}).get(name):
                lb = module.lora_B[name].bias
                bias = (bias if bias is not None else 0) + _f64(lb) * module.scaling[name]
    if conv1d:
        weight = weight.T
    return weight, bias
