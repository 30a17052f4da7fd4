"""The facts of a model's attention that the float64 reference needs beyond its weights, derived from the structure
and the config -- never from the instance under test (its hooks, its norms, its attention backend).

- the logit scale: ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3), ``attention_multiplier`` (Granite), GPT-2's
  settings, else ``head_dim ** -0.5``; a type whose attention module was built with another scale is refused;
- the model's own cap (``attn_logit_softcapping``), which a scheme's cap replaces;
- the attention sinks (gpt-oss's per-head ``sinks``);
- the model's own q/k norms (per head, or over the whole projection as OLMo 2's): their normalisation (RMS or
  mean-and-variance), gain (``1 + w`` for Gemma's), bias and epsilon, read by a probe as the converter reads them
  (:func:`hf_qknorm.portable.fold.affine_form`);
- a fused projection's rows for q, k and v (``[q | k | v]``, or per head ``[q_h k_h v_h]``);
- the rotary layout: the modelling file's own ``apply_rotary_pos_emb`` called on probe vectors and matched against
  the reference's layouts (:data:`hf_qknorm.reference.ROPE_LAYOUTS`; partial rotary is the width of ``cos``);
- which layers rotate at all (NoPE layers: SmolLM3's, Cohere 2's full-attention layers): a fresh, unpatched
  float64 instance of the layer's Transformers attention class, run eagerly with the recorded rotation and with none.

What cannot be derived is refused in one line (:class:`~hf_qknorm.portable.families.UnsupportedModelError`).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import threading
import types
import typing
from collections import OrderedDict
from collections.abc import MutableMapping

import torch
from torch import nn

from ..portable.families import PER_HEAD, Family, UnsupportedModelError
from ..portable.fold import affine_form
from ..portable.names import ROLES
from ..reference import ROPE_LAYOUTS, norm_reference, rope_layout_reference


def own_class(module: nn.Module) -> type:
    """The model's own class of ``module``: the first class of its MRO that hf_qknorm did not make (patching gives a
    patched attention module or projection a subclass of its own class)."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("hf_qknorm") and not cls.__name__.startswith("QKNorm"):
            return cls
    return type(module)


def unpatched(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` as its own class, without hooks: the model's own computation on the same
    parameters (a norm over the whole projection that patching made apply the scheme's norms too)."""
    clone = copy.copy(module)
    clone.__class__ = own_class(module)
    clone._forward_hooks, clone._forward_pre_hooks = OrderedDict(), OrderedDict()
    return clone


def unmodelled_parts(attn: nn.Module, family: Family) -> list[str]:
    """The children and own parameters of an attention module that the reference does not model (an output gate, a
    norm before the output projection, learned q/k scales): anything but the projections, the q/k(/v) norms (the
    model's own and the scheme's), dropout, a rotary embedding and gpt-oss's ``sinks``."""
    known = {family.qkv_proj, family.q_proj, family.k_proj, family.v_proj, family.out_proj, "sinks"}
    known |= set(family.native.values()) | set(family.kept.values())
    known |= {family.norm_slot(r) for r in ROLES}
    harmless = (nn.Dropout, nn.Identity)
    parts = [
        name
        for name, child in attn.named_children()
        if name not in known and not isinstance(child, harmless) and "Rotary" not in type(child).__name__
    ]
    return parts + [name for name, _ in attn.named_parameters(recurse=False) if name not in known]


# what an attention module's forward may take that the reference models or a decoder leaves None (cross-attention's)
KNOWN_ARGUMENTS = {
    "self", "hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values", "past_key_value",
    "layer_past", "position_ids", "cache_position", "output_attentions", "use_cache", "head_mask", "kwargs",
    "encoder_hidden_states", "encoder_attention_mask", "key_value_states",
}  # fmt: skip


def unmodelled_arguments(attn: nn.Module) -> list[str]:
    """The arguments of ``attn``'s own forward beyond :data:`KNOWN_ARGUMENTS`: inputs the reference models only where
    they scale the query by position (:func:`query_scales`: Beam's ``attention_scaling``), are mappings the layer
    only writes into (:func:`inert_arguments`), say where it keeps its cache (:func:`cache_slot_arguments`), reach
    an earlier layer's keys and values, or default to ``None`` and are given ``None`` on every call
    (:func:`unset_arguments`); else refused."""
    return sorted(set(inspect.signature(own_class(attn).forward).parameters) - KNOWN_ARGUMENTS)


def unset_arguments(attn: nn.Module, arguments: list[str]) -> list[str]:
    """Of ``arguments``, the mappings whose default is ``None`` (Dory's ``shared_kv_states``: other keys and values,
    given only where its loops share one cache): a call given ``None`` computes what a call without them does,
    which the reference models. The probes record each call given one (:meth:`.probe._Recorder`), and such a call's
    check fails, naming it. Any other argument (a tensor: Beam's ``attention_scaling``) is refused before probing."""
    cls = own_class(attn)
    params = inspect.signature(cls.forward).parameters
    return [a for a in arguments if params[a].default is None and _mapping_class(cls, a) is not None]


CAPTURE_ATTENTION = "hf_qknorm_reference_capture"  # records what the attention function is given (:func:`query_scales`)
_CAPTURED = threading.local()


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that records the ``query``, ``key`` and ``value`` it is given and returns zeros."""
    _CAPTURED.value = (query, key, value)
    return torch.zeros_like(query).transpose(1, 2), None


def query_scales(attn: nn.Module, config, index: int, arguments: list[str], inert: dict | None = None) -> list[str]:
    """Of ``arguments`` (:func:`unmodelled_arguments`), those that multiply the query by a per-position factor and do
    nothing else (Beam's ``attention_scaling``, ``(1 + position / 2048) ** 0.1`` on its NoPE layers): a fresh,
    unpatched float64 instance of ``attn``'s Transformers class, given the argument as ``None`` and as a positive
    ``(1, 1, seq, 1)`` tensor, must hand its attention function the first call's query times that tensor and the
    same key and value. The reference multiplies its query by the recorded argument after the rotation. ``inert``
    (:func:`inert_arguments`) are given as new empty mappings. The caller's random state is left as it was."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, config.hidden_size, generator=gen, dtype=torch.float64)
    factor = 1.5 + torch.rand(1, 1, 4, 1, generator=gen, dtype=torch.float64)
    try:
        fresh = fresh_instance(attn, config, index, CAPTURE_ATTENTION)
    except Exception:  # a class that cannot be rebuilt: nothing is derived, the caller refuses
        return []
    try:
        q0, k0, v0 = _captured(fresh, x, _new(inert))
    except Exception:  # a class that does not run on probe inputs: nothing is derived, the caller refuses
        return []
    found = []
    for name in arguments:
        try:
            q1, k1, v1 = _captured(fresh, x, {**_new(inert), name: factor})
        except Exception:  # not a tensor argument, or not one this call takes
            continue
        scaled = q0.shape[-2] == factor.shape[-2] and torch.allclose(q1, q0 * factor, rtol=1e-9, atol=1e-12)
        if scaled and not torch.allclose(q1, q0, rtol=1e-9, atol=1e-12) and torch.equal(k1, k0) and torch.equal(v1, v0):
            found.append(name)
    return found


def _mapping_class(cls: type, name: str) -> type | None:
    """The mutable mapping class that ``cls.forward`` declares its argument ``name`` to be (``dict``, Gemma 4's
    ``KVSharingDict``; ``X | None`` unwrapped), or ``None``."""
    try:
        hint = typing.get_type_hints(cls.forward).get(name)
    except Exception:  # an annotation that does not resolve: read as written
        hint = inspect.signature(cls.forward).parameters[name].annotation
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for candidate in typing.get_args(hint) if union else (hint,):
        candidate = typing.get_origin(candidate) or candidate
        if isinstance(candidate, type) and issubclass(candidate, MutableMapping):
            return candidate
    return None


def cache_slot_arguments(
    attn: nn.Module, config, index: int, arguments: list[str], inert: dict | None = None
) -> list[str]:
    """Of ``arguments`` (:func:`unmodelled_arguments`), the integers that only say where the layer keeps its keys and
    values in the cache (Dory's ``cache_offset``: each loop of its recurrent layers writes its own copy): a fresh,
    unpatched float64 instance of ``attn``'s class, given the argument at its default and at the default plus 3,
    hands its attention function the same query, key and value without a cache, and with a new cache over a
    prefill and a step. The reference assembles each call's keys and values from the layer's own recorded inputs
    (loop by loop: :meth:`.probe._Recorder.layers`), so where the cache put them does not enter it; had a call read
    another call's keys, its recorded output and the cached-versus-uncached logits would show it. The caller's
    random state is left as it was."""
    from transformers import AttentionInterface, DynamicCache

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    params = inspect.signature(own_class(attn).forward).parameters
    cache_name = next((n for n in ("cache", "past_key_values", "past_key_value") if n in params), None)
    candidates = [
        a for a in arguments if isinstance(params[a].default, int) and not isinstance(params[a].default, bool)
    ]
    if not candidates or cache_name is None:
        return []
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 5, config.hidden_size, generator=gen, dtype=torch.float64)
    try:
        fresh = fresh_instance(attn, config, index, CAPTURE_ATTENTION)
    except Exception:  # a class that cannot be rebuilt: nothing is derived, the caller refuses
        return []

    def run(given: dict) -> list:
        out = [_captured(fresh, x, {**_new(inert), **given})]
        cache = DynamicCache()
        _captured(fresh, x[:, :3], {**_new(inert), **given, cache_name: cache})
        out.append(_captured(fresh, x[:, 3:], {**_new(inert), **given, cache_name: cache}))
        return [t for triple in out for t in triple]

    found = []
    for name in candidates:
        try:
            same = run({}), run({name: params[name].default + 3})
        except Exception:  # not an argument the class runs with so: not derived
            continue
        if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(*same)):
            found.append(name)
    return found


def inert_arguments(attn: nn.Module, config, index: int, arguments: list[str]) -> dict[str, type]:
    """Of ``arguments`` (:func:`unmodelled_arguments`), the mappings layer ``index`` only writes into (Gemma 4's
    ``shared_kv_states`` on a layer that stores its keys and values or shares none), which the reference can leave
    out, each with its mapping class: every one of ``arguments`` must be declared a mutable mapping by the forward
    (:func:`_mapping_class`); a fresh, unpatched float64 instance of ``attn``'s class, given a new empty one for each,
    must run; and one is inert where the instance hands its attention function the same query, key and value when
    it comes pre-filled -- under the keys the layer wrote into it and the config's layer types -- with other tensors
    (as a model's later layers get it from earlier ones). A layer that reads one (a layer reusing another's keys and
    values) gives none, and the caller refuses it. The caller's random state is left as it was."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, config.hidden_size, generator=gen, dtype=torch.float64)
    kinds = {name: _mapping_class(own_class(attn), name) for name in arguments}
    if any(kind is None for kind in kinds.values()):
        return {}

    def run(filled: dict) -> tuple:
        given = {name: filled[name] if name in filled else kinds[name]() for name in arguments}
        return _captured(fresh, x, given), given

    try:
        fresh = fresh_instance(attn, config, index, CAPTURE_ATTENTION)
        (q0, k0, v0), written = run({})
    except Exception:  # a class that cannot be rebuilt, or does not run so: the caller refuses
        return {}
    layer_types = getattr(config, "layer_types", None) or []
    found = {}
    for name in arguments:
        other = kinds[name]()
        for key in [*written[name], *(t for t in layer_types if t not in written[name])]:
            other[key] = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (k0, v0))
        try:
            (q1, k1, v1), _ = run({name: other})
        except Exception:  # it reads the mapping, in a way the other tensors do not fit
            continue
        if torch.equal(q1, q0) and torch.equal(k1, k0) and torch.equal(v1, v0):
            found[name] = kinds[name]
    return found


def written_keys(attn: nn.Module, config, index: int, name: str) -> set:
    """The keys layer ``index`` writes into its mapping argument ``name`` (a layer of Gemma 3n or Gemma 4 that stores
    its keys and values for later layers: its layer type), read off a fresh, unpatched float64 instance of its class
    given a new empty mapping; an empty set where it writes none or does not run so."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    kind = _mapping_class(own_class(attn), name)
    if kind is None:
        return set()
    x = torch.randn(1, 4, config.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    given = kind()
    try:
        _captured(fresh_instance(attn, config, index, CAPTURE_ATTENTION), x, {name: given})
    except Exception:
        return set()
    return set(given)


def reused_entry(attn: nn.Module, config, index: int, name: str, kv_heads: int, head_dim: int, keys=()):
    """The key of the mapping argument ``name`` whose keys and values layer ``index`` attends over instead of its
    own (a KV-shared layer of Gemma 3n or Gemma 4), or ``None``: a fresh, unpatched float64 instance of its class is
    given the mapping filled, under each of ``keys`` (what earlier layers write there: a layer type, or a layer's
    index on Transformers 5.17) and the config's layer types, with keys and values of its own; the key is the one
    whose two tensors reach its attention function unchanged. The caller's random state is left as it was."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    kind = _mapping_class(own_class(attn), name)
    types_ = list(dict.fromkeys([*keys, *(getattr(config, "layer_types", None) or [])]))
    if kind is None or not types_:
        return None
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 4, config.hidden_size, generator=gen, dtype=torch.float64)
    filled = kind()
    for key in types_:
        filled[key] = tuple(torch.randn(1, kv_heads, 4, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
    entries = dict(filled)
    try:
        _, k, v = _captured(fresh_instance(attn, config, index, CAPTURE_ATTENTION), x, {name: filled})
    except Exception:
        return None
    found = [key for key, (kk, vv) in entries.items() if torch.equal(k, kk) and torch.equal(v, vv)]
    return found[0] if len(found) == 1 else None


def _captured(fresh: nn.Module, x: torch.Tensor, extra: dict, rotation: tuple | None = None) -> tuple:
    """The query, key and value ``fresh`` hands its attention function on ``x`` with ``extra`` arguments, with the
    rotation ``(cos, sin)`` given; without one, no rotation where the class takes none, else the identity rotation
    (a rotation would not commute with the check)."""
    kwargs = {"hidden_states": x, "attention_mask": None, **extra}
    if "position_ids" in inspect.signature(type(fresh).forward).parameters:
        kwargs["position_ids"] = torch.arange(x.shape[1])[None]
    head_dim = getattr(fresh, "head_dim", None) or x.shape[-1] // fresh.config.num_attention_heads
    identity = (torch.ones(1, x.shape[1], head_dim, dtype=x.dtype), torch.zeros(1, x.shape[1], head_dim, dtype=x.dtype))
    _CAPTURED.value = None
    with torch.no_grad():
        if rotation is not None:
            fresh(position_embeddings=rotation, **kwargs)
        else:
            try:
                fresh(position_embeddings=None, **kwargs)
            except Exception:  # a class that requires its rotation
                fresh(position_embeddings=identity, **kwargs)
    if _CAPTURED.value is None:
        raise RuntimeError("the attention function was not called")
    q, k, v = _CAPTURED.value
    _CAPTURED.value = None
    return q, k, v


def _set_attention(config, name: str) -> None:
    """Set ``config``'s attention implementation to ``name`` (the stored value where the config guards it)."""
    try:
        config._attn_implementation = name
    except Exception:
        config._attn_implementation_internal = name


def rotates_itself(attn: nn.Module) -> bool:
    """Whether ``attn`` computes its rotation from ``position_ids`` inside (its forward takes them and no
    ``position_embeddings``: GPT-J's in Transformers 5.4): the probe records no rotation to read."""
    params = inspect.signature(own_class(attn).forward).parameters
    return "position_ids" in params and "position_embeddings" not in params


CORE_ATTENTION = "hf_qknorm_reference_core"  # the attention function of an output stage (:func:`output_stage`)
_CORE = threading.local()


def _core_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that hands back the reference's attention output ``(batch, seq, heads, head_dim)`` set
    for this call (:func:`run_output_stage`), whatever it is given."""
    return _CORE.value, None


def output_stage(attn: nn.Module, family: Family) -> nn.Module:
    """A float64 copy of ``attn`` as its own class, every hook removed, whose attention function returns the
    reference's attention output: the model's own code after that function -- an output gate (AFMoE's, Beam's,
    Laguna's), a norm before the output projection (BitNet's) -- run on the reference's result. What the reference
    does not model must act there (:func:`place_parts`)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CORE_ATTENTION, _core_attention)  # the same function each time
    stage = copy.deepcopy(unpatched(attn)).to(device="cpu", dtype=torch.float64).eval()
    for module in stage.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    config = copy.copy(getattr(stage, "config", None))
    if config is None:
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: verify cannot run {type(stage).__name__}'s own output stage (no config)"
        )
    _set_attention(config, CORE_ATTENTION)
    stage.config = config
    return stage


def unplaced_parts(stage: nn.Module, family: Family, parts: list[str], cos, sin) -> list[str]:
    """Of ``parts`` (what the reference does not model), those that do not act on the attention output: a part's
    parameters, perturbed, must change ``stage``'s output for a fixed attention output (probe inputs with the
    recorded rotation ``cos``/``sin``, or none); a module without parameters (Dory's ``attn_sub_norm``), its output
    scaled by a hook. The caller models the rest (a factor on the rotated query: :func:`query_factor`) or refuses."""
    out = []
    for part in parts:
        held = getattr(stage, part)
        tensors = [held] if isinstance(held, torch.Tensor) else list(held.parameters())
        perturb = _perturbing(tensors) if tensors else _scaling_output(held)  # parameter-free: its output scaled
        if not _moves_the_output(stage, perturb, cos, sin, family.out_proj):
            out.append(part)
    return out


def query_factor(attn, config, index: int, family: Family, part: str, cos, sin, layout: str) -> torch.Tensor | None:
    """The factor ``(heads, head_dim)`` that the parameter ``part`` of ``attn`` puts on each channel of the rotated
    query (Dory's ``sqk``: ``(sqk * sqk_scale) ** 2`` after RoPE), or ``None`` where it is not one. A fresh, unpatched
    float64 instance of ``attn``'s Transformers class, given ``attn``'s own value of ``part``, hands its attention
    function a query ``q``; without a rotation, ``q`` over the instance's own query (its projection, then its own
    query norm) must be one factor per head and channel at every position and row; with the recorded rotation
    ``cos``/``sin``, ``q`` must be that factor times the rotated query (``layout``: :func:`rope_layout`)."""
    from transformers import AttentionInterface

    value = getattr(attn, part, None)
    q_name, norm_name = family.q_proj, family.native.get("q")
    if not isinstance(value, torch.Tensor) or q_name is None:
        return None
    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    gen = torch.Generator().manual_seed(6)
    try:
        fresh = fresh_instance(attn, config, index, CAPTURE_ATTENTION)
        with torch.no_grad():
            getattr(fresh, part).copy_(_f64(value))
        heads = fresh.config.num_attention_heads
        t = 4 if cos is None else min(4, cos.shape[1])
        x = torch.randn(2, t, config.hidden_size, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            own = getattr(fresh, q_name)(x)
            own = own.view(2, t, heads, -1)
            if norm_name is not None:
                own = getattr(fresh, norm_name)(own)
            own = own.transpose(1, 2)  # (batch, heads, t, head_dim)
        q, _, _ = _captured(fresh, x, {})
    except Exception:  # a class that cannot be rebuilt or run so: not derived, the caller refuses
        return None
    if q.shape != own.shape:
        return None
    factor = (q * own).sum((0, 2)) / own.pow(2).sum((0, 2)).clamp_min(1e-300)  # least squares per head and channel
    if not torch.allclose(q, factor[None, :, None] * own, rtol=1e-9, atol=1e-12 * float(q.abs().max())):
        return None
    if cos is not None:  # after the rotation, not before it
        rot = (cos[:1, :t].to(torch.float64), sin[:1, :t].to(torch.float64))
        try:
            q_rot, _, _ = _captured(fresh, x, {}, rot)
        except Exception:
            return None
        want = factor[None, :, None] * rope_layout_reference(own, rot[0], rot[1], layout)
        if not torch.allclose(q_rot, want, rtol=1e-9, atol=1e-12 * float(want.abs().max())):
            return None
    return factor


def run_output_stage(stage: nn.Module, core: torch.Tensor, x, cos, sin) -> torch.Tensor:
    """``stage`` (:func:`output_stage`) on hidden states ``x`` with the attention output ``core`` ``(batch, seq,
    heads, head_dim)``: the layer's output."""
    kwargs = {"hidden_states": x, "attention_mask": None}
    kwargs["position_embeddings"] = (cos, sin) if cos is not None else None
    if "position_ids" in inspect.signature(type(stage).forward).parameters:
        kwargs["position_ids"] = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    _CORE.value = core
    try:
        with torch.no_grad():
            out = stage(**kwargs)
    finally:
        _CORE.value = None
    return out[0] if isinstance(out, tuple) else out


def _moves_the_output(stage: nn.Module, perturb, cos, sin, out_name: str = "o_proj") -> bool:
    """Whether ``perturb`` (:func:`_perturbing`, :func:`_scaling_output`: it changes a part and returns what undoes
    it) changes ``stage``'s output for a fixed attention output (probe inputs, the first positions of the recorded
    rotation); ``False`` where the stage cannot run on them. ``out_name``: the stage's output projection (the
    family's: Kosmos-2's ``out_proj``)."""
    gen = torch.Generator().manual_seed(3)
    heads, out_proj = stage.config.num_attention_heads, getattr(stage, out_name, None)
    if not isinstance(out_proj, nn.Linear) or out_proj.in_features % heads:
        return False
    head_dim, t = out_proj.in_features // heads, 4 if cos is None else min(4, cos.shape[1])
    x = torch.randn(1, t, stage.config.hidden_size, generator=gen, dtype=torch.float64)
    core = torch.randn(1, t, heads, head_dim, generator=gen, dtype=torch.float64)
    if cos is not None:
        cos, sin = cos[:1, :t].to(torch.float64), sin[:1, :t].to(torch.float64)
    undo = None
    try:
        before = run_output_stage(stage, core, x, cos, sin)
        undo = perturb(gen)
        after = run_output_stage(stage, core, x, cos, sin)
    except Exception:  # a stage that cannot run on probe inputs cannot be placed
        return False
    finally:
        if undo is not None:
            undo()
    return not torch.allclose(before, after, rtol=1e-9, atol=1e-12)


def _perturbing(tensors: list):
    """A perturbation of ``tensors`` (noise added in place) for :func:`_moves_the_output`."""

    def perturb(gen: torch.Generator):
        saved = [p.detach().clone() for p in tensors]
        with torch.no_grad():
            for p in tensors:
                p.add_(0.5 + torch.randn(p.shape, generator=gen, dtype=p.dtype))

        def undo():
            with torch.no_grad():
                for p, value in zip(tensors, saved):
                    p.copy_(value)

        return undo

    return perturb


def _scaling_output(module: nn.Module):
    """A perturbation of a module without parameters (its output scaled by a hook) for :func:`_moves_the_output`."""
    return lambda gen: module.register_forward_hook(lambda m, args, output: 1.5 * output).remove


def base_scaling(config, family: Family, attn, index: int, head_dim: int) -> float:
    """The logit scale of layer ``index`` before any scheme, from the config; ``1`` where Transformers' own class
    builds the layer with a scale of 1 (Gemma 4's, whose q/k norms set the logits' size: :func:`built_scaling`);
    refused when the attention module was built with another one (a rule the reference does not know)."""
    if family.model_type == "gpt2":
        s = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            s /= float(index + 1)
        return s
    if isinstance(getattr(config, "query_pre_attn_scalar", None), (int, float)):
        s = float(config.query_pre_attn_scalar) ** -0.5
    elif isinstance(getattr(config, "attention_multiplier", None), (int, float)):
        s = float(config.attention_multiplier)
    else:
        s = head_dim**-0.5
    built = getattr(attn, "scaling", None)
    if (
        isinstance(built, (int, float))
        and float(built) == 1.0
        and s != 1.0
        and built_scaling(attn, config, index) == 1.0
    ):
        return 1.0
    if isinstance(built, (int, float)) and not math.isclose(float(built), s, rel_tol=1e-9) and float(built) != 1.0:
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: verify cannot derive the logit scale of {type(attn).__name__} from "
            f"its config (the module uses {float(built):g}, the config gives {s:g})"
        )
    return s


def built_scaling(attn, config, index: int) -> float | None:
    """The ``scaling`` a fresh, unpatched instance of ``attn``'s Transformers class is built with for layer ``index``
    (not the instance under test, which a scheme may have changed), or ``None`` where it cannot be rebuilt or has
    none. The caller's random state is left as it was."""
    try:
        built = getattr(fresh_instance(attn, config, index), "scaling", None)
    except Exception:
        return None
    return float(built) if isinstance(built, (int, float)) else None


def native_cap(config) -> float | None:
    """The model's own logit cap (Gemma 2's ``attn_logit_softcapping``), or ``None``."""
    cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and cap > 0 else None


def check_causal(config, model_type: str, attns=(), runner: nn.Module | None = None) -> bool:
    """Whether the model is a prefix-LM the probes mark (True) or causal (False); refused where neither holds.

    ``use_bidirectional_attention`` True (PaliGemma's language model) builds the attention modules non-causal while
    the masks are causal, so the model attends both ways where Transformers passes no mask (an unpadded batch on
    sdpa) and causally where it builds one (padding). Given ``token_type_ids`` -- which ``runner``'s forward must
    take -- it always builds the mask: causal, with the tokens of type 0 (the prefix) attending both ways among
    themselves (PaliGemma's prefix-LM, as its processor marks image and prompt); the probes pass them and the
    reference models that rule. Without that argument the model is refused. ``"vision"`` (Gemma 4 Unified's: image
    tokens attend both ways among themselves) is checked where every module of ``attns`` is built causal: on text
    alone, which the probes feed, its masks are causal."""
    mode = getattr(config, "use_bidirectional_attention", False)
    if not mode or (mode == "vision" and all(getattr(a, "is_causal", False) is True for a in attns)):
        return False
    forward = getattr(runner, "forward", None)
    if mode is True and forward is not None and "token_type_ids" in inspect.signature(forward).parameters:
        return True
    raise UnsupportedModelError(
        f"model type {model_type!r}: verify cannot model use_bidirectional_attention={mode!r} without token_type_ids "
        "to mark the prefix (causal with a padding mask, both ways without one; checked when it was patched, by the "
        "self-check)"
    )


def sinks_of(attn) -> torch.Tensor | None:
    """gpt-oss's per-head attention-sink logits ``(heads,)`` in float64, or ``None``."""
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 1:
        return sinks.detach().to(device="cpu", dtype=torch.float64)
    return None


def own_norm(module: nn.Module, what: str, width: int | None = None) -> dict:
    """A model's own q/k(/v) norm as the reference computes it: ``kind`` (``rmsnorm``/``layernorm``), ``weight`` (the
    gain, ``1 + w`` for Gemma's; ``None`` for a norm without parameters, of ``width`` channels: Gemma 4's v norm),
    ``bias`` and ``eps``, all float64; refused when it is not ``gain * n(x) + bias``. A parameter-free norm onto the
    unit sphere (Dory's ``DoryL2Norm``: ``x / sqrt(sum x^2 + eps)``) is an RMS norm with the gain ``1/sqrt(width)``
    and the epsilon ``eps / width``."""
    eps = next(
        (float(v) for v in (getattr(module, a, None) for a in ("eps", "variance_epsilon")) if v is not None), None
    )
    module = unpatched(module)
    try:
        gain, bias = affine_form(module)
    except ValueError:
        gain = None
    free = gain is None and bias is None and width is not None and not any(True for _ in module.parameters())
    if (gain is None and not free) or eps is None:
        raise UnsupportedModelError(f"verify cannot model {what} ({type(module).__name__}): not gain * n(x) + bias")
    gain, bias = _f64(gain), _f64(bias)
    x = torch.randn(
        16, width if free else gain.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    ref = next(iter(module.parameters()), x)
    y = module(x.to(device=ref.device, dtype=ref.dtype)).to(device="cpu", dtype=torch.float64)
    tol = 2e-2 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
    for kind in ("rmsnorm", "layernorm"):
        if (norm_reference(x, kind, gain, bias, eps=eps) - y).abs().max() <= tol * y.abs().max():
            return {"kind": kind, "weight": gain, "bias": bias, "eps": eps}
    if free:  # onto the unit sphere (Dory's, nGPT's): x / sqrt(sum x^2 + eps), an RMS norm with gain 1/sqrt(width)
        unit = torch.full((width,), width**-0.5, dtype=torch.float64)
        if (norm_reference(x, "rmsnorm", unit, None, eps=eps / width) - y).abs().max() <= tol * y.abs().max():
            return {"kind": "rmsnorm", "weight": unit, "bias": None, "eps": eps / width}
    raise UnsupportedModelError(
        f"verify cannot model {what} ({type(module).__name__}): its output is not an RMS or mean-and-variance norm "
        f"with the gain and bias read off it and epsilon {eps:g}"
    )


def split_fused(w, b, heads: int, kv: int, head_dim: int, layout: str | None, model_type: str) -> dict:
    """``wq``/``wk``/``wv`` and ``bq``/``bk``/``bv`` of a fused projection's ``(out, in)`` weight and bias."""
    sizes = (heads * head_dim, kv * head_dim, kv * head_dim)
    if w.shape[0] != sum(sizes):
        raise UnsupportedModelError(
            f"model type {model_type!r}: the fused q/k/v projection has {w.shape[0]} outputs, not "
            f"{heads} + 2 x {kv} heads of {head_dim}"
        )
    if layout == PER_HEAD:
        if heads != kv:
            raise UnsupportedModelError(f"model type {model_type!r}: a per-head fused q/k/v layout with GQA")

        def parts(t):
            return None if t is None else list(t.reshape(heads, 3, head_dim, *t.shape[1:]).unbind(1))

        ws, bs = parts(w), parts(b)
        ws = [p.reshape(heads * head_dim, *w.shape[1:]) for p in ws]
        bs = None if bs is None else [p.reshape(heads * head_dim) for p in bs]
    else:
        ws = list(w.split(sizes, dim=0))
        bs = None if b is None else list(b.split(sizes, dim=0))
    out = {f"w{r}": ws[i] for i, r in enumerate("qkv")}
    out.update({f"b{r}": (None if bs is None else bs[i]) for i, r in enumerate("qkv")})
    return out


def fused_spans(role: str, heads: int, kv: int, head_dim: int, layout: str | None) -> list[list[int]]:
    """The ``[start, stop)`` spans of a fused projection's output that hold ``role``'s heads."""
    if layout == PER_HEAD:
        i = "qkv".index(role)
        return [[(3 * h + i) * head_dim, (3 * h + i + 1) * head_dim] for h in range(heads)]
    start = {"q": 0, "k": heads * head_dim, "v": (heads + kv) * head_dim}[role]
    return [[start, start + (heads if role == "q" else kv) * head_dim]]


def rope_layout(attn, model_type: str, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[str | None, bool]:
    """The rotary layout in which the modelling file of ``attn``'s class applies the recorded pair ``cos``/``sin``
    ``(batch, seq, r)``, and whether that pair is in fact ``(sin, cos)`` (GPT-J's order): its
    ``apply_rotary_pos_emb`` called on probe vectors in each calling convention it may have
    (:func:`_rotations`) and matched against :data:`ROPE_LAYOUTS` in both orders. The layout is ``None`` when
    several match (positions at which the layouts agree); refused when the function is missing or nothing matches."""
    home = own_class(attn).__module__
    apply = getattr(sys.modules.get(home), "apply_rotary_pos_emb", None)
    where = f"model type {model_type!r}: verify cannot read the rotary layout"
    if apply is None:
        raise UnsupportedModelError(f"{where} ({home} has no apply_rotary_pos_emb)")
    if cos.dim() != 3 or cos.shape[-1] > head_dim:
        raise UnsupportedModelError(f"{where} (position embeddings of shape {tuple(cos.shape)}, e.g. M-RoPE)")
    c, s = cos[:1].to(torch.float64), sin[:1].to(torch.float64)
    q = torch.randn(1, 3, c.shape[1], head_dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results, failure = _rotations(apply, q, c, s)
    if not results:
        raise UnsupportedModelError(f"{where} ({type(failure).__name__} from apply_rotary_pos_emb)") from None
    for got in results:
        found = [
            (layout, swapped)
            for swapped in (False, True)
            for layout in ROPE_LAYOUTS
            if torch.allclose(got, rope_layout_reference(q, *((s, c) if swapped else (c, s)), layout), 1e-5, 1e-5)
        ]
        if found:
            swapped = found[0][1] if len({f[1] for f in found}) == 1 else False
            return (found[0][0] if len(found) == 1 else None), swapped
    raise UnsupportedModelError(f"{where} (apply_rotary_pos_emb of {home} matches none of {', '.join(ROPE_LAYOUTS)})")


def _rotations(apply, q: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> tuple[list, Exception | None]:
    """``q`` ``(1, heads, seq, head_dim)`` rotated by a modelling file's ``apply`` in each calling convention that
    runs and gives back ``q``'s shape: Llama's ``apply(q, k, cos, sin)`` on ``(batch, heads, seq, dim)``, GPT-J's
    ``apply(x, sin, cos)`` on one ``(batch, seq, heads, dim)`` tensor, and Gemma 4's ``apply(x, cos, sin,
    unsqueeze_dim=2)`` on one ``(batch, seq, heads, dim)`` tensor; each on every channel, or on the first
    ``r`` or ``2r`` (``r`` = the pair's width: partial rotary split by the caller), the rest passed unchanged. The
    pair is given as recorded; :func:`rope_layout` tries both orders against the reference. Also the last error."""
    d, r = q.shape[-1], c.shape[-1]
    out, failure = [], None
    for width in dict.fromkeys(w for w in (d, r, 2 * r) if w <= d):
        head, rest = q[..., :width], q[..., width:]
        calls = (
            lambda h=head: apply(h, h, c, s)[0],
            lambda h=head: apply(h.transpose(1, 2), c, s).transpose(1, 2),
            lambda h=head: apply(h.transpose(1, 2), c, s, unsqueeze_dim=2).transpose(1, 2),
        )
        for call in calls:
            try:
                got = call()
            except Exception as exc:  # another convention, or not this width
                failure = exc
                continue
            if isinstance(got, torch.Tensor) and got.shape == head.shape:
                out.append(torch.cat([got.to(torch.float64), rest], dim=-1))
    return out, failure


def rotates(
    attn,
    config,
    index: int,
    x,
    cos,
    sin,
    model_type: str = "?",
    swapped: bool = False,
    inert: dict | None = None,
    reused: tuple | None = None,
) -> bool:
    """Whether layer ``index`` rotates q and k with the recorded pair ``cos``/``sin``: a fresh float64 instance of its
    Transformers attention class (unpatched) run with that rotation and with none (NoPE layers differ; the identity
    given in the recorded order: ``(sin, cos)`` where ``swapped``), the query and key its attention function is
    handed compared (a capturing function: no backend of the model's runs, so one that fails under GQA, as
    Unlimited-OCR's eager, does not matter); the caller's random state is left as it was. ``inert``
    (:func:`inert_arguments`) are given as new empty mappings; ``reused`` ``(argument, key, kv_heads, head_dim)``, a
    KV-shared layer's (:func:`reused_entry`), as a mapping holding random keys and values under that key (then only
    its query can turn)."""
    cls = own_class(attn)
    x = x[:1, :4].to(torch.float64)
    cos, sin = cos[:1, :4].to(torch.float64), sin[:1, :4].to(torch.float64)
    extra = {}
    if reused is not None:
        name, key, kv_heads, head_dim = reused
        filled = _mapping_class(cls, name)()
        gen = torch.Generator().manual_seed(7)
        filled[key] = tuple(torch.randn(1, kv_heads, x.shape[1], head_dim, generator=gen, dtype=x.dtype) for _ in "kv")
        extra[name] = filled
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)  # positions: _captured (Ministral 3's scale)
    try:
        fresh = fresh_instance(attn, config, index, CAPTURE_ATTENTION)
        identity = (torch.ones_like(cos), torch.zeros_like(sin))
        turned, flat = (
            _captured(fresh, x, {**extra, **_new(inert)}, rotation)[:2]
            for rotation in ((cos, sin), identity[::-1] if swapped else identity)
        )
    except Exception as exc:
        raise UnsupportedModelError(
            f"model type {model_type!r}: verify cannot tell whether layer {index} of {cls.__name__} rotates q and k "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return not all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(turned, flat))


def fresh_instance(attn, config, index: int, attention: str | None = None) -> nn.Module:
    """A fresh, unpatched float64 instance of ``attn``'s Transformers class for layer ``index`` of ``config``, in eval
    mode, on the attention implementation ``attention`` (the config's where ``None``): what the model's own code
    computes, never the instance under test. The caller's random state is left as it was; raises what the class
    raises."""
    cls = own_class(attn)
    cfg = copy.deepcopy(config)
    if attention is not None:
        _set_attention(cfg, attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(index)
        return cls(cfg, layer_idx=index, **built_arguments(attn, cls)).to(torch.float64).eval()


def _new(inert: dict | None) -> dict:
    """A new empty mapping of its class for each inert argument (:func:`inert_arguments`)."""
    return {name: kind() for name, kind in (inert or {}).items()}


def built_arguments(attn, cls) -> dict:
    """The arguments ``cls.__init__`` requires beyond the config and the layer index, read off ``attn``'s attributes of
    the same names (Laguna's per-layer ``num_heads``); one ``attn`` lacks is left out (the call then fails, refused by
    the caller)."""
    params = inspect.signature(cls.__init__).parameters
    required = [
        name
        for name, p in params.items()
        if name not in ("self", "config", "layer_idx")
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return {name: getattr(attn, name) for name in required if hasattr(attn, name)}


def _f64(t):
    return None if t is None else t.detach().to(device="cpu", dtype=torch.float64)
