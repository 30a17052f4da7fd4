"""What the reference needs to know about each attention layer, read from a model: effective float64 weights, norms,
scaling, cap, sinks, window, rotation and pre-norm -- and the probe plan that names the modules to watch.

Everything here comes from the weights, the structure and the config (:mod:`.derive`), never from what the attention
code under test computes: the scheme from ``config.qknorm``, the logit scale from the formulas (``1`` for
``l2``/``lp``, whose query norm carries the learnable scale), the cap (the scheme's, else the model's own), the
window from the config. Weights are those a forward would use: ``transformers.Conv1D`` transposed to ``(out, in)``,
a fused q/k/v projection split by its layout, and ``peft`` LoRA layers as ``base + sum of active unmerged deltas``
(``get_delta_weight``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modeling.patch import qknorm_config
from ..portable.families import (
    Family,
    UnsupportedModelError,
    family_of_model,
    head_dim_of,
    heads_of,
    own_roles,
    text_runner,
)
from ..portable.layout import find_layers, unwrap
from ..portable.names import ROLES
from ..portable.schemes import QKNormConfig
from . import derive
from .probe import NEW_TOKENS, PREFIX, probe_tokens, special_ids


@dataclass
class LayerSpec:
    """One attention layer for :func:`hf_qknorm.reference.attention_layer_reference`, all tensors float64 on CPU.

    ``wq`` ``(heads * head_dim, hidden)``, ``wk``/``wv`` ``(kv_heads * head_dim, hidden)``, ``wo``
    ``(hidden, heads * head_dim)``; biases ``(out,)`` or ``None``. ``q_norm``/``k_norm``/``v_norm``: dicts with
    ``weight``/``bias`` (``(head_dim,)``, ``(1,)`` for the lp logit scale, or ``None``), or ``None`` for no norm.
    ``prenorm``: a float64 copy of the block's pre-attention norm module (Transformers' own), or ``None`` when the
    scheme removes it (``qkv_norm``) or the block has none (``has_prenorm`` False). ``q_whole``/``k_whole``: the
    model's own norms over the whole projection (:func:`.derive.own_norm`). ``sinks`` ``(heads,)`` or ``None``.
    ``rotates``/``rope_layout``/``rope_swapped``: settled from the first recorded rotation
    (:meth:`ReferenceModel.settle_rope`); ``rope_swapped``: the recorded pair is ``(sin, cos)`` (GPT-J's)."""

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
    prenorm: nn.Module | None = field(default=None)
    has_prenorm: bool = True
    q_whole: dict | None = None
    k_whole: dict | None = None
    sinks: torch.Tensor | None = None
    rotates: bool = True
    rope_layout: str = "half"
    rope_swapped: bool = False
    stage: nn.Module | None = None  # the model's own code after the attention function (:func:`.derive.output_stage`)
    v_own: dict | None = None  # the model's own per-head v norm (Gemma 4's, without a gain): :func:`.derive.own_norm`
    kv_from: int | None = None  # the earlier layer whose keys and values this one attends over (Gemma 3n's KV sharing)
    q_factor: torch.Tensor | None = None  # (heads, head_dim) on the rotated query (Dory's sqk): :meth:`place_parts`

    @property
    def has_norms(self) -> bool:
        return any(n is not None for n in (self.q_norm, self.k_norm, self.v_norm))


class ReferenceModel:
    """The reference side of a model: its scheme, its layers' specs (built on demand: a large model's float64
    weights are never all held at once) and the probe plan, with module names as seen from ``model``."""

    def __init__(self, model: nn.Module):
        self.outer = model
        self.inner = unwrap(model)
        self.family: Family = family_of_model(self.inner)  # first: a model patching cannot handle is refused here
        self.config = self.inner.config.get_text_config()  # a multimodal model's: its language model's
        self.scheme: QKNormConfig | None = qknorm_config(self.inner)
        self.blocks = find_layers(self.inner, self.family)
        self.attns = [getattr(b, self.family.attention) for b in self.blocks]
        self._names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self._rope: dict[int, tuple[bool, str, bool]] = {}  # index -> (rotates, layout, swapped)
        self._base_scales: dict[int, float] = {}  # index -> the logit scale before any scheme
        # a prefix-LM (PaliGemma): the probes mark a prefix with token_type_ids, the reference attends it both ways
        self.prefix_lm = derive.check_causal(self.config, self.family.model_type, self.attns, text_runner(self.inner))
        self._parts = [derive.unmodelled_parts(attn, self.family) for attn in self.attns]
        self._q_scales: list[list[str]] = []  # per layer: the arguments that scale its query by position
        self._inert: list[dict] = []  # per layer: the mappings it only writes into (Gemma 4's shared_kv_states)
        self._writes: dict[tuple[int, str], set] = {}  # (layer, mapping argument) -> the keys it writes, as asked
        self._kv_from: dict[int, int] = {}  # a layer reusing an earlier layer's keys and values -> that layer
        self._reused: dict[int, tuple] = {}  # such a layer -> (argument, key, kv_heads, head_dim) it reads them by
        self._unset: dict[int, list[str]] = {}  # layer -> the arguments every call must be given as None
        scales_of: dict[type, list[str]] = {}  # one derivation per attention class
        for i, attn in enumerate(self.attns):  # refused before any probe runs when a part cannot be derived
            arguments = derive.unmodelled_arguments(attn)
            cls = derive.own_class(attn)
            self._inert.append(derive.inert_arguments(attn, self.config, i, arguments) if arguments else {})
            if arguments and cls not in scales_of:
                scales_of[cls] = derive.query_scales(attn, self.config, i, arguments, self._inert[i])
            self._q_scales.append(scales_of.get(cls, []))
            rest = [a for a in arguments if a not in self._q_scales[i] and a not in self._inert[i]]
            if len(rest) == 1:  # a mapping it reads: the keys and values of an earlier layer?
                found = self._reused_source(i, attn, rest[0])
                if found is not None:
                    self._kv_from[i], self._reused[i] = found
                    rest = []
            if rest:  # where it keeps its cache (Dory's loops); None on every call, which the probes check
                slots = derive.cache_slot_arguments(attn, self.config, i, rest, self._inert[i])
                rest = [a for a in rest if a not in slots]
                self._unset[i] = derive.unset_arguments(attn, rest)
                rest = [a for a in rest if a not in self._unset[i]]
            if rest:
                raise UnsupportedModelError(
                    f"model type {self.family.model_type!r}: verify's float64 reference does not model the "
                    f"{', '.join(rest)} argument of {cls.__name__} (checked when it was patched, by the self-check)"
                )
            if derive.rotates_itself(attn):
                raise UnsupportedModelError(
                    f"model type {self.family.model_type!r}: verify cannot read the rotation "
                    f"{derive.own_class(attn).__name__} computes itself from position_ids (checked when it was "
                    "patched, by the self-check)"
                )
            self.scaling(i, self.head_counts(attn)[2])

    def __len__(self) -> int:
        return len(self.attns)

    def _reused_source(self, index: int, attn, name: str) -> tuple | None:
        """``(source layer, (name, key, kv_heads, head_dim))`` for a layer that attends over an earlier layer's keys
        and values (Gemma 3n's and Gemma 4's KV-shared layers): the source is the last earlier layer that writes,
        into the mapping argument ``name``, the key whose entry reaches this layer's attention function (both
        derived from fresh instances: :func:`.derive.reused_entry`, :func:`.derive.written_keys`); ``None`` where
        there is none."""
        _, kv, head_dim = self.head_counts(attn)
        written = [key for j in range(index) for key in sorted(self._written(j, name), key=repr)]
        key = derive.reused_entry(attn, self.config, index, name, kv, head_dim, written)
        writers = [j for j in range(index) if key is not None and key in self._written(j, name)]
        return (writers[-1], (name, key, kv, head_dim)) if writers else None

    def _written(self, index: int, name: str) -> set:
        """The keys layer ``index`` writes into its mapping argument ``name`` (none where it does not only write
        into it), derived once, and only where a later layer reads the mapping."""
        if (index, name) not in self._writes:
            inert = name in self._inert[index]
            found = derive.written_keys(self.attns[index], self.config, index, name) if inert else set()
            self._writes[index, name] = found
        return self._writes[index, name]

    # ---------------------------------------------------------------------------------------------------------------
    def head_counts(self, attn) -> tuple[int, int, int]:
        heads, kv = heads_of(attn, self.config)
        return heads, kv, head_dim_of(attn, self.config)

    def scaling(self, index: int, head_dim: int) -> float:
        if self.scheme is not None and self.scheme.learned_logit_scale:
            return 1.0  # the query norm's learnable scale replaces 1/sqrt(head_dim)
        if index not in self._base_scales:  # derived once per layer (Gemma 4's rebuilds its class to read it)
            self._base_scales[index] = derive.base_scaling(self.config, self.family, self.attns[index], index, head_dim)
        return self._base_scales[index]

    def cap(self) -> float | None:
        """The cap the attention applies: the scheme's, which replaces the model's own (Gemma 2's)."""
        if self.scheme is not None and self.scheme.caps:
            return self.scheme.softcap
        return derive.native_cap(self.config)

    def window(self, index: int) -> int | None:
        types = getattr(self.config, "layer_types", None)
        if types:
            return self.config.sliding_window if types[index] == "sliding_attention" else None
        return getattr(self.config, "sliding_window", None)

    def settle_rope(self, spec: LayerSpec, cos, sin) -> None:
        """Set ``spec.rotates``, ``spec.rope_layout`` and ``spec.rope_swapped`` from a recorded rotation
        (:mod:`.derive`), once per layer."""
        known = self._rope.get(spec.index)
        if known is None:
            attn = self.attns[spec.index]
            layout, swapped = derive.rope_layout(attn, self.family.model_type, cos, sin, spec.head_dim)
            x = _probe_x(spec, cos)
            turns = derive.rotates(
                attn,
                self.config,
                spec.index,
                x,
                cos,
                sin,
                self.family.model_type,
                swapped,
                self._inert[spec.index],
                self._reused.get(spec.index),
            )
            known = (turns, layout, swapped)
            if layout is not None:
                self._rope[spec.index] = known
        spec.rotates, spec.rope_layout, spec.rope_swapped = known[0], known[1] or "half", known[2]

    def place_parts(self, spec: LayerSpec, cos, sin) -> None:
        """Place each part the reference does not model (``cos``/``sin``: a recorded rotation, or ``None``): on the
        attention output, run by the layer's own output stage (:func:`.derive.unplaced_parts`), or a factor on each
        channel of the rotated query (Dory's ``sqk``: :func:`.derive.query_factor`, set as ``spec.q_factor``);
        refuse the layer, in one line, for any other."""
        if spec.stage is None:
            return
        i = spec.index
        for part in derive.unplaced_parts(spec.stage, self.family, self._parts[i], cos, sin):
            factor = derive.query_factor(self.attns[i], self.config, i, self.family, part, cos, sin, spec.rope_layout)
            if factor is None:
                raise UnsupportedModelError(
                    f"model type {self.family.model_type!r}: verify's float64 reference does not model {part} of "
                    f"{derive.own_class(self.attns[i]).__name__}, which acts neither on the attention output alone nor "
                    "as a factor on the rotated query (checked when it was patched, by the self-check)"
                )
            spec.q_factor = factor if spec.q_factor is None else spec.q_factor * factor

    def _norms(self, attn, index: int) -> tuple[dict, str | None, float, float]:
        """Per role the per-head norm's ``weight``/``bias`` (or ``None``), and the ``(kind, eps, p)`` they share:
        the scheme's norms, else the model's own per-head q/k norms (Qwen3's; Gemma 3's ``1 + w``)."""
        s, f = self.scheme, self.family
        if s is not None and s.norms_qk:
            norms = {}
            own = own_roles(attn, f)
            for role in ROLES:
                if (role == "v" and not s.norms_v) or role not in own:  # a role another layer projects: its norm
                    norms[role] = None
                    continue
                module = getattr(attn, f.norm_slot(role), None)
                if module is None:
                    raise ValueError(
                        f"layer {index}: the scheme has a {role} norm but the attention module has no "
                        f"{f.norm_slot(role)}"
                    )
                norms[role] = _norm_params(module)
            return norms, s.norm, float(s.eps), float(s.p or 2.0)
        if not f.native:
            return {"q": None, "k": None, "v": None}, None, 1e-6, 2.0
        head_dim = self.head_counts(attn)[2]  # the width of a norm without parameters (Dory's unit-sphere norm)
        own = {
            r: derive.own_norm(_active_module(getattr(attn, n)), f"the {r} norm .{n}", width=head_dim)
            for r, n in f.native.items()
            if r in own_roles(attn, f)  # a KV-shared layer has only its query norm
        }
        first = next(iter(own.values()))
        if any((o["kind"], o["eps"]) != (first["kind"], first["eps"]) for o in own.values()):
            raise UnsupportedModelError(f"model type {f.model_type!r}: its q and k norms differ in kind or epsilon")
        norms = {r: ({"weight": own[r]["weight"], "bias": own[r]["bias"]} if r in own else None) for r in "qkv"}
        return norms, first["kind"], first["eps"], 2.0

    # ---------------------------------------------------------------------------------------------------------------
    def spec(self, index: int) -> LayerSpec:
        attn, block = self.attns[index], self.blocks[index]
        heads, kv, head_dim = self.head_counts(attn)
        norms, kind, eps, p = self._norms(attn, index)
        whole = {
            r: derive.own_norm(_active_module(getattr(attn, n)), f"the {r} norm .{n}")
            for r, n in self.family.kept.items()
        }
        spec = LayerSpec(
            index=index,
            weights=self._weights(attn, heads, kv, head_dim),
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            scaling=self.scaling(index, head_dim),
            softcap=self.cap(),
            norm=kind,
            eps=eps,
            p=p,
            q_norm=norms["q"],
            k_norm=norms["k"],
            v_norm=norms["v"],
            window=self.window(index),
            prenorm=self._prenorm(block),
            has_prenorm=self.family.prenorm is not None,
            q_whole=whole.get("q"),
            k_whole=whole.get("k"),
            sinks=derive.sinks_of(attn),
            stage=derive.output_stage(attn, self.family) if self._parts[index] else None,  # parts placed later
            v_own=self._own_v_norm(attn, head_dim),
            kv_from=self._kv_from.get(index),
        )
        if index in self._rope:
            spec.rotates, spec.rope_layout, spec.rope_swapped = self._rope[index]
        return spec

    def _own_v_norm(self, attn, head_dim: int) -> dict | None:
        """The model's own per-head norm of v (Gemma 4's ``v_norm``, an RMS norm without a gain) where the scheme
        has none in its place (``qkv_norm`` on such a model is refused at patch time), else ``None``."""
        if self.scheme is not None and self.scheme.norms_v:
            return None
        slot = self.family.norm_slot("v")
        module = getattr(attn, slot, None)
        if not isinstance(module, nn.Module):
            return None
        return derive.own_norm(_active_module(module), f"the v norm .{slot}", width=head_dim)

    def _weights(self, attn, heads: int, kv: int, head_dim: int) -> dict:
        f = self.family
        if f.fused_qkv:
            w, b = _effective(getattr(attn, f.qkv_proj), f.conv1d)
            out = derive.split_fused(w, b, heads, kv, head_dim, f.fused_layout, f.model_type)
        else:
            out = {}
            for role, name in f.projections.items():
                if role == "v" and getattr(attn, name, None) is None and "k" in own_roles(attn, f):
                    # values taken from the keys' projection (Gemma 4's attention_k_eq_v layers); had the model done
                    # anything else, the probes' comparison with the model would show it
                    out["wv"], out["bv"] = out["wk"], out["bk"]
                    continue
                if getattr(attn, name, None) is None:  # a KV-shared layer: another layer's keys and values
                    out[f"w{role}"] = out[f"b{role}"] = None
                    continue
                out[f"w{role}"], out[f"b{role}"] = _effective(getattr(attn, name), f.conv1d)
        out["wo"], out["bo"] = _effective(getattr(attn, f.out_proj), f.conv1d)
        return out

    def _prenorm(self, block) -> nn.Module | None:
        """A float64 copy of the block's pre-attention norm: Transformers' own module (not the code under test; a
        norm outside attention, e.g. Gemma's ``1 + w``), run on the recorded block input."""
        if (self.scheme is not None and self.scheme.removes_prenorm) or self.family.prenorm is None:
            return None  # qkv_norm: the attention reads the residual stream itself
        module = _active_module(getattr(block, self.family.prenorm))
        return copy.deepcopy(module).to(device="cpu", dtype=torch.float64).eval()

    # ---------------------------------------------------------------------------------------------------------------
    def name(self, module: nn.Module) -> str:
        try:
            return self._names[id(module)]
        except KeyError:
            raise ValueError(f"{type(module).__name__} is not a submodule of the model") from None

    def plan(self, *, generate: bool = True, seed: int = 0) -> dict:
        """The probe plan (JSON-able): per layer the attention and block names, the modules producing the final
        pre-RoPE query and key (for the stress gain), head_dim, scaling, cap and the arguments that scale the query
        by position (recorded as ``q_scale``); the probe tokens; and ``prefix``, the prefix length a prefix-LM's probes
        mark (``None`` for a causal model)."""
        layers = []
        for i, (attn, block) in enumerate(zip(self.attns, self.blocks)):
            _, _, head_dim = self.head_counts(attn)
            layers.append(
                {
                    "attn": self.name(attn),
                    "block": self.name(block),
                    "q": self._producer(attn, "q"),
                    "k": self._producer(self.attns[self._kv_from.get(i, i)], "k"),  # a KV-shared layer's: its source's
                    "head_dim": head_dim,
                    "scaling": self.scaling(i, head_dim),
                    "cap": self.cap(),
                    "q_scale": self._q_scales[i],
                    "unset": self._unset.get(i, []),
                }
            )
        runner = text_runner(self.inner)  # BLIP-2 runs text on its language model (its own forward needs images)
        gen = getattr(self.inner, "generation_config", None)
        can_generate = generate and callable(getattr(runner, "can_generate", None)) and runner.can_generate()
        window = getattr(self.config, "sliding_window", None)
        if can_generate and "reference_sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            if isinstance(window, int) and window < NEW_TOKENS:
                raise UnsupportedModelError(
                    f"model type {self.family.model_type!r}: its reference sliding-window layers keep the prompt and "
                    f"the last {window} decoded tokens, fewer than the {NEW_TOKENS} verify's cached probes decode: "
                    "not modelled (verify(model, generate=False) checks it uncached)"
                )
        return {
            "layers": layers,
            **probe_tokens(self.config.vocab_size, seed, avoid=special_ids(self.inner.config, self.config, gen)),
            "generate": bool(can_generate),
            "pad_token_id": getattr(gen, "pad_token_id", None),
            "text_forward": None if runner is self.inner else self.name(runner),
            "positions": self.name(runner),  # the module generate calls, inside any wrapper (peft's)
            "prefix": PREFIX if self.prefix_lm else None,
        }

    def _producer(self, attn, role: str) -> list:
        """``[module name, spans]`` of the module whose output is the final pre-RoPE ``role`` vector: the scheme's
        or the model's own per-head norm, else its whole-projection norm, else the projection; ``spans``: the
        ``[start, stop)`` channel ranges of ``role`` in a fused projection's output, ``None`` for the whole output."""
        f = self.family
        per_head = f.norm_slot(role) if self.scheme is not None and self.scheme.norms_qk else f.native.get(role)
        for name in (per_head, f.kept.get(role)):
            module = getattr(attn, name, None) if name else None
            if isinstance(module, nn.Module):
                return [self.name(module), None]
        if f.fused_qkv:
            heads, kv, head_dim = self.head_counts(attn)
            spans = derive.fused_spans(role, heads, kv, head_dim, f.fused_layout)
            return [self.name(getattr(attn, f.qkv_proj)), spans]
        return [self.name(getattr(attn, f.projections[role])), None]


def _probe_x(spec: LayerSpec, cos) -> torch.Tensor:
    """Random hidden states ``(1, seq, hidden)`` for the NoPE probe of :func:`.derive.rotates`."""
    hidden = spec.weights["wq"].shape[1]
    return torch.randn(1, cos.shape[1], hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


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
