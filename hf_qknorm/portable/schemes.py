"""The schemes and their settings: :class:`QKNormConfig` and its validation.

A scheme says what changes in every attention layer (the README's scheme table; details in docs/patching.md):

========== ==========================================================================
scheme     change
========== ==========================================================================
qk_norm     a norm on each head's query and key, before RoPE
soft_cap    logits ``s = scaling * q.k`` become ``c * tanh(s / c)`` before mask and softmax
qk_norm_cap both of the above (Rybakov et al. 2024)
qkv_norm    a norm on each head's query, key and value; the pre-attention norm is removed
========== ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

Scheme = Literal["qk_norm", "soft_cap", "qk_norm_cap", "qkv_norm"]
Norm = Literal["layernorm", "rmsnorm", "l2", "lp"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
NORMS: tuple[str, ...] = get_args(Norm)
DEFAULT_SOFTCAP = 50.0  # Gemma 2 / Rybakov et al. 2024
# The largest cap accepted. c*tanh(s/c) with c this large never bends a logit (s < 1e3 changes by < 1e-9 relative),
# and beyond it s/c underflows float32's precision for ordinary logits; 1e39 is not even a float32 (it is inf, and
# c*tanh(s/c) = inf*0 = NaN). This module imports only the standard library: it is also copied into saved folders.
MAX_SOFTCAP = 1e6
# The smallest eps accepted: float32's smallest normal number, 2**-126. The norms compute in float32 for float32 and
# half-precision models (and the Triton kernels flush subnormals to 0): a smaller eps becomes 0 there, and a zero
# query or key vector -- a padding token, a zeroed embedding -- gives 0 / 0 = NaN logits.
MIN_EPS = 2.0**-126


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_softcap(value, what: str = "softcap") -> float:
    """``value`` as a float if it is a usable cap (a positive finite number up to :data:`MAX_SOFTCAP`), else a
    ``ValueError`` naming it and the valid range. The one rule for configs, the attention backend and saved folders."""
    if not _is_number(value) or not math.isfinite(value) or not 0 < value <= MAX_SOFTCAP:
        raise ValueError(f"{what} must be a positive finite number up to {MAX_SOFTCAP:g}, got {value!r}")
    return float(value)


def check_eps(value, what: str = "") -> float:
    """``value`` as a float if it is a usable norm epsilon (finite, at least :data:`MIN_EPS`), else a ``ValueError``
    naming it (``what`` says where it came from)."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"eps must be a positive finite number, got {value!r}{what}")
    if value < MIN_EPS:
        raise ValueError(
            f"eps must be a positive finite number of at least {MIN_EPS:.3g} (float32's smallest normal "
            f"number: the norms compute in float32, where a smaller eps becomes 0 and a zero query or "
            f"key gives NaN), got {value!r}{what}"
        )
    return float(value)


_CAPPED = ("soft_cap", "qk_norm_cap")
_NORMED = ("qk_norm", "qk_norm_cap", "qkv_norm")


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass(frozen=True)
class QKNormConfig:
    """Validated settings of one patch: ``scheme`` (one of ``SCHEMES``), ``norm`` (one of ``NORMS``; ``None``:
    layernorm), ``softcap`` (``None``: 50 for the capped schemes), ``eps`` (``None``: the model's own), ``p`` (the
    ``lp`` norm's exponent, ``>= 1``). A setting the scheme or norm has no use for is an error. Fields: docs/patching.md
    (Settings)."""

    # metadata["help"]: the command line's help for each field (its flags are made from these fields)
    scheme: Scheme = field(default="qk_norm_cap", metadata={"help": "what changes in every attention layer"})
    norm: Norm | None = field(
        default=None,
        metadata={
            "help": "the norm on queries and keys (and values for qkv_norm); default layernorm; not for soft_cap"
        },
    )
    softcap: float | None = field(
        default=None,
        metadata={"help": "the cap c in c*tanh(s/c), > 0 (default 50 for the capped schemes; an error for the others)"},
    )
    eps: float | None = field(default=None, metadata={"help": "epsilon of the new norms (default: the model's own)"})
    p: float | None = field(default=None, metadata={"help": "exponent of the lp norm (p >= 1)"})

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; valid schemes: {_choices(SCHEMES)}")
        self._check_norm()
        self._check_softcap()
        if self.eps is not None:
            check_eps(self.eps)

    def _check_norm(self) -> None:
        norm, p = self.norm, self.p
        if self.scheme == "soft_cap":
            if norm is not None:
                raise ValueError(
                    f"scheme 'soft_cap' has no norm, but norm={norm!r} was given; "
                    f"use one of {_choices(_NORMED)} for a norm"
                )
            if p is not None:
                raise ValueError(f"scheme 'soft_cap' has no norm, so p={p!r} has no meaning")
            return
        if norm is None:
            norm = "layernorm"
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; valid norms: {_choices(NORMS)}")
        if norm == "lp":
            if p is None:
                raise ValueError("norm 'lp' needs an exponent p >= 1, e.g. p=4.0")
            if not (_is_number(p) and math.isfinite(p) and p >= 1):
                raise ValueError(f"p must be a finite number >= 1 for norm 'lp', got {p!r}")
            p = float(p)
        elif norm == "l2":
            if p not in (None, 2, 2.0):
                raise ValueError(f"norm 'l2' is the Lp norm with p=2, got p={p!r}; use norm='lp' for other p")
            p = 2.0
        elif p is not None:
            raise ValueError(f"p={p!r} only applies to norm 'lp' (or 'l2'), not {norm!r}")
        object.__setattr__(self, "norm", norm)
        object.__setattr__(self, "p", p)

    def _check_softcap(self) -> None:
        cap = self.softcap
        if self.scheme not in _CAPPED:
            if cap is not None:
                raise ValueError(
                    f"scheme {self.scheme!r} has no cap, but softcap={cap!r} was given; "
                    f"capped schemes: {_choices(_CAPPED)}"
                )
            return
        object.__setattr__(self, "softcap", check_softcap(DEFAULT_SOFTCAP if cap is None else cap))

    # --- what the scheme does -------------------------------------------------------------------------------
    @property
    def norms_qk(self) -> bool:
        """True when q and k get a per-head norm."""
        return self.scheme in _NORMED

    @property
    def norms_v(self) -> bool:
        """True when v gets a per-head norm (``qkv_norm``)."""
        return self.scheme == "qkv_norm"

    @property
    def removes_prenorm(self) -> bool:
        """True when the block's pre-attention norm is removed (``qkv_norm``)."""
        return self.scheme == "qkv_norm"

    @property
    def caps(self) -> bool:
        return self.softcap is not None

    @property
    def learned_logit_scale(self) -> bool:
        """True for ``l2``/``lp``: the query norm carries the logit scale that replaces ``1/sqrt(head_dim)``."""
        return self.norm in ("l2", "lp")

    # --- (de)serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QKNormConfig:
        """The config a saved ``config.qknorm`` describes. A saved config states every field exactly as
        :meth:`to_dict` writes it (``eps`` resolved, ``softcap`` present for capped schemes, ``p`` for ``lp``/``l2``):
        nothing is filled in from defaults, so a hand-edited or truncated entry fails here, naming the field,
        instead of loading with a cap or epsilon the model was not trained with."""
        if not isinstance(d, dict):
            raise ValueError(f"config.qknorm must be a dict with keys {_choices(_FIELDS)}, got {type(d).__name__}")
        unknown, missing = sorted(set(d) - set(_FIELDS)), [k for k in _FIELDS if k not in d]
        if unknown:
            raise ValueError(f"unknown keys in config.qknorm: {unknown}; valid keys: {_choices(_FIELDS)}{_NEWER}")
        if missing:
            raise ValueError(
                f"config.qknorm lacks {missing}: a saved scheme states every field "
                f"({_choices(_FIELDS)}; null where it does not apply)"
            )
        for key, known in (("scheme", SCHEMES), ("norm", NORMS)):  # a name from a newer version (not a typo here)
            if isinstance(d[key], str) and d[key] not in known and d[key].strip().lower() not in known:
                raise ValueError(f"unknown {key} {d[key]!r} in config.qknorm; valid: {_choices(known)}{_NEWER}")
        cfg = cls(**d)
        stated = {k: d[k] for k in _FIELDS}
        resolved = cfg.to_dict()
        if stated["eps"] is None:
            raise ValueError("config.qknorm has eps null: a saved scheme states the epsilon its norms use")
        for key in ("norm", "softcap", "p"):  # what the constructor would otherwise fill in from defaults
            if stated[key] != resolved[key]:
                raise ValueError(
                    f"config.qknorm has {key}={stated[key]!r}, but scheme {cfg.scheme!r} with these "
                    f"settings means {key}={resolved[key]!r}; write it explicitly"
                )
        return cfg


_FIELDS = tuple(f.name for f in fields(QKNormConfig))
_NEWER = " (a folder saved by a newer hf_qknorm? load it with that version)"
