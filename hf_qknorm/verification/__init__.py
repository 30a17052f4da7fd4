"""``hf_qknorm.verify(model)``: check on a probe batch that a model, as configured, computes its scheme.

The probes (:mod:`.probe`) run the model through its live attention backend and its generation cache and record
what every attention layer saw and returned; the checks (:mod:`.checks`) recompute each layer from its weights with
the float64 formula reference (:mod:`hf_qknorm.reference`) and say whether the cap, the norms and the mask are
applied. ``hf-qknorm verify DIR [--no-plugin]`` (:mod:`hf_qknorm.cli.verify`) does the same for a saved folder,
optionally loaded the way a user without the plugin would load it.
"""

from __future__ import annotations

from .api import FolderResult, capture_without_plugin, verify, verify_folder, verify_folders
from .checks import TOLERANCE
from .report import Check, VerifyReport

__all__ = [
    "Check",
    "FolderResult",
    "TOLERANCE",
    "VerifyReport",
    "capture_without_plugin",
    "verify",
    "verify_folder",
    "verify_folders",
]
