"""QK-norm on a multimodal model's vision encoder, on request (``patch_model(vlm, ..., vision=True)``).

ViT-22B (Dehghani et al. 2023) introduced QK-norm in a vision transformer: each head's query and key are normalised
before the bidirectional softmax attention of its encoder. Here the vision encoder's attention modules get
``q_norm``/``k_norm`` applied at their projections through :mod:`.hooks` (its forward keeps running unmodified), and a
cap only when the vision settings name one. Patched: encoders whose attention module has separate ``q_proj``,
``k_proj``, ``v_proj``, takes the hidden states alone (no rotary embedding, no packed-image boundaries) and calls the
attention interface once, bidirectionally (CLIP, SigLIP, Idefics3 / SmolVLM). Refused with the reason: fused
projections and per-image attention calls (Qwen2-VL's vision blocks), vision RoPE (Pixtral), q/k norms of the
model's own (InternVL), ``qkv_norm`` (which removes the pre-norm) and the ``l2``/``lp`` logit scale.

The settings are kept on the multimodal config as ``config.qknorm_vision`` (a :class:`QKNormConfig` dict), so a saved
folder rebuilds them (:func:`hf_qknorm.portable.structure.patch_on_init`). This module imports nothing but ``torch``
and its siblings: it is also copied into exported folders.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .families import UnsupportedModelError
from .hooks import install, uninstall
from .layout import upstream_class
from .norms import make_norm
from .schemes import QKNormConfig

CONFIG_KEY = "qknorm_vision"  # the multimodal config's attribute holding the vision settings
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
NORMS = {"q": "q_norm", "k": "k_norm"}
# What a vision attention module's forward may take besides the hidden states: anything more (rotary embeddings,
# packed-image boundaries) is a computation between the projections and the backend that the plugin does not reach.
ACCEPTED = {"self", "hidden_states", "attention_mask", "causal_attention_mask", "output_attentions", "kwargs"}
DEFAULT_EPS = 1e-6


@dataclass
class VisionPlan:
    cfg: QKNormConfig  # eps resolved
    path: str  # dotted path to the vision encoder
    attentions: list[nn.Module]


def vision_settings(cfg: QKNormConfig, vision) -> QKNormConfig | None:
    """The vision encoder's settings for ``patch_model``'s ``vision`` argument: ``False``/``None`` none; ``True`` the
    scheme's norm kind (and ``eps``) as ``qk_norm``, no cap; a :class:`QKNormConfig` itself (a cap only there)."""
    if vision is None or vision is False:
        return None
    if isinstance(vision, QKNormConfig):
        return vision
    if vision is not True:
        raise TypeError(f"vision must be True, False or a QKNormConfig, got {vision!r}")
    if not cfg.norms_qk:
        raise ValueError(
            f"vision=True gives the vision encoder the scheme's q/k norms, and scheme {cfg.scheme!r} has none; "
            "pass vision=QKNormConfig('qk_norm', norm=...) instead"
        )
    return QKNormConfig(scheme="qk_norm", norm=cfg.norm, eps=cfg.eps, p=cfg.p)


def vision_tower_path(model: nn.Module) -> str:
    """The dotted path to a multimodal model's vision encoder: the outermost submodule that is a model of its own and
    holds the config's ``vision_config``. Raises :class:`UnsupportedModelError` where there is none."""
    config = model.config
    vision = getattr(config, "vision_config", None)
    models = [(name, m) for name, m in model.named_modules() if name and hasattr(m, "base_model_prefix")]
    found = [name for name, m in models if vision is not None and m.__dict__.get("config") is vision]
    if not found and vision is not None:  # a config copied on the way in: the same model type
        kind = getattr(vision, "model_type", None)
        found = [name for name, m in models if getattr(getattr(m, "config", None), "model_type", 0) == kind]
    outer = sorted({n for n in found if not any(n.startswith(o + ".") for o in found)}, key=len)
    if len(outer) != 1:
        what = (
            "it has no vision_config"
            if vision is None
            else f"several of its submodules hold its vision_config ({', '.join(outer)})"
            if outer
            else "none of its submodules holds its vision_config"
        )
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r}: vision= patches a multimodal model's vision "
            f"encoder, and {what}"
        )
    return outer[0]


def plan_vision(model: nn.Module, cfg: QKNormConfig, *, loading: bool = False) -> VisionPlan:
    """Check that ``cfg`` can be applied to the vision encoder of ``model`` (nothing is changed); raises
    :class:`UnsupportedModelError` naming the model type, the attention class and what is missing."""
    path = vision_tower_path(model)
    tower = model.get_submodule(path)
    where = f"model type {getattr(model.config, 'model_type', '?')!r}, vision encoder .{path}"
    if cfg.removes_prenorm or cfg.learned_logit_scale:
        what = "qkv_norm (which removes the pre-norm)" if cfg.removes_prenorm else f"norm {cfg.norm!r}"
        raise ValueError(f"{where}: {what} is not supported on a vision encoder; use qk_norm with layernorm or rmsnorm")
    attentions = [m for m in tower.modules() if all(isinstance(getattr(m, p, None), nn.Module) for p in PROJECTIONS)]
    if not attentions:
        kinds = sorted({type(m).__name__ for n, m in tower.named_modules() if n.endswith(("attn", "attention"))})
        raise UnsupportedModelError(
            f"{where}: its attention ({', '.join(kinds) or 'none found'}) has no separate q_proj/k_proj/v_proj "
            "(a fused projection, with per-image attention calls in Qwen2-VL's vision blocks, is not supported)"
        )
    attn = attentions[0]
    name = upstream_class(attn).__name__
    extra = sorted(set(_parameters(upstream_class(attn).forward)) - ACCEPTED)
    if extra:
        raise UnsupportedModelError(
            f"{where}: its attention ({name}) takes {', '.join(extra)} (rotary embeddings or packed images "
            "between the projections and the backend), which hf_qknorm cannot patch exactly"
        )
    if not loading and any(isinstance(getattr(attn, n, None), nn.Module) for n in NORMS.values()):
        raise UnsupportedModelError(f"{where}: its attention ({name}) has q/k norms of its own; they are not replaced")
    if getattr(attn, "is_causal", False):
        raise UnsupportedModelError(f"{where}: its attention ({name}) is causal, not a bidirectional encoder's")
    if cfg.eps is None:
        eps = getattr(getattr(tower, "config", None), "layer_norm_eps", None)
        cfg = QKNormConfig.from_dict({**cfg.to_dict(), "eps": float(eps) if eps else DEFAULT_EPS})
    return VisionPlan(cfg, path, attentions)


def _parameters(fn) -> tuple[str, ...]:
    """The named parameters of ``fn`` behind its decorators (``inspect`` is not among what a saved folder imports)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = fn.__code__
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def install_vision(plan: VisionPlan) -> None:
    """Add ``q_norm``/``k_norm`` to every attention module of the plan (and its cap, if any); reversible."""
    for attn in plan.attentions:
        ref = attn.q_proj.weight
        heads = int(getattr(attn, "num_heads", 0) or 0)
        head_dim = int(getattr(attn, "head_dim", 0) or (ref.shape[0] // heads))
        for role, name in NORMS.items():
            setattr(attn, name, make_norm(plan.cfg.norm, role, head_dim, plan.cfg.eps).to(ref.device, ref.dtype))
        kv_heads = attn.k_proj.weight.shape[0] // head_dim
        install(attn, {"q_proj": ("q",), "k_proj": ("k",)}, dict(NORMS), (head_dim, heads, kv_heads, None),
                plan.cfg.softcap, None)  # fmt: skip


def uninstall_vision(plan: VisionPlan) -> None:
    """Undo :func:`install_vision` (a refused patch leaves the vision encoder as it was)."""
    for attn in plan.attentions:
        if "_qknorm_slots" in attn.__dict__:
            uninstall(attn)
        for name in NORMS.values():
            if name in attn._modules:
                delattr(attn, name)
