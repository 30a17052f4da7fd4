"""The optional native ops: ``_native.c``, built at install time by ``setup.py`` where a C compiler is.

Two users: the lean path's one-query capped attention (:func:`.lean._native_capped`: one call where the ATen ops
are six) and the tiled path's capped elementwise passes (:mod:`.chunked`: one pass over a tile where the ATen ops make
six in forward and seven in backward, the causal band included). Both take float32 CPU tensors only and keep the ATen
ops for everything else.

``NATIVE[0]`` is the module in use, or ``None``: where it was not built, or ``HF_QKNORM_NATIVE=0`` (or ``off``,
``false``, ``no``) is set in the environment (then every call takes the ATen ops, to compare or to rule the op out).
Tests and benchmarks set the slot in-process.
"""

from __future__ import annotations

import os
import warnings

try:
    from . import _native as MODULE
except ImportError:  # pragma: no cover - a build without a C compiler
    MODULE = None


_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _switch(value: str | None) -> bool:
    """``HF_QKNORM_NATIVE``: unset, empty or one of :data:`_ON` uses the op where it was built, one of :data:`_OFF`
    turns it off. Anything else warns, naming the value and the valid ones, and turns it off (the ATen ops run every
    call correctly; an import-time error would break every entry point, the CLI's included)."""
    value = "1" if value is None or not value.strip() else value.strip().lower()
    if value not in _ON + _OFF:
        warnings.warn(
            f"HF_QKNORM_NATIVE={value!r} is not one of {', '.join(_OFF + _ON)}: the native op is off",
            stacklevel=2,
        )
        return False
    return value in _ON


NATIVE = [MODULE if _switch(os.environ.get("HF_QKNORM_NATIVE")) else None]
