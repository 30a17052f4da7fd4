"""Old import paths of modules that moved, kept working for one release with a ``FutureWarning``.

The code saved folders carry moved from ``hf_qknorm.modeling`` and ``hf_qknorm.attention`` into
``hf_qknorm.portable``. Each old module file calls :func:`alias`, which puts the new module in its place in
``sys.modules``: ``from hf_qknorm.modeling.schemes import QKNormConfig`` gets the very same objects (one module, one
set of globals), and says where they live now.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` the module ``new`` (imported), with a ``FutureWarning`` naming the new path."""
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", FutureWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
