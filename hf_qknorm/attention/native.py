"""The optional native ops: ``_native.c``, built at install time by ``setup.py`` where a C compiler is.

Two users: the lean path's one-query capped attention (:func:`.lean._native_capped`: one call where the ATen ops are
six) and the tiled path's capped elementwise passes (:mod:`.chunked`: one pass over a tile where the ATen ops make six
in forward and seven in backward). Both take float32 CPU tensors only and keep the ATen ops for everything else.

``NATIVE[0]`` is the module in use, or ``None``: where it was not built, or ``HF_QKNORM_NATIVE=0`` is set in the
environment (then every call takes the ATen ops, to compare or to rule the op out). Tests and benchmarks set the slot
in-process.
"""

from __future__ import annotations

import os

try:
    from . import _native as MODULE
except ImportError:  # pragma: no cover - a build without a C compiler
    MODULE = None

NATIVE = [None if os.environ.get("HF_QKNORM_NATIVE", "1").strip() == "0" else MODULE]
