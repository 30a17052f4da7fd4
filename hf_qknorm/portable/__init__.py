"""The code every saved ``qknorm_<base>`` folder carries, so that it loads without the plugin.

Everything here imports only the standard library, ``torch`` and the other modules of this subpackage (a test,
``tests/modeling/test_export.py``, holds it). Saving a patched model copies these modules into the folder under
flat names (``norms.py`` -> ``qknorm_norms.py``), rewriting each ``from .x import`` through the table below, and adds
the two entry files of ``entry/`` (which alone import ``transformers``) that build the classes from them. The plugin
runs the very same modules, so a folder computes what the plugin computes.

Nothing in this ``__init__`` is imported eagerly: importing one module of the subpackage stays cheap.
"""

# module of this subpackage -> its file name in a saved folder. Shipped code may import only these (and is checked).
SHIPPED = {
    "names": "qknorm_names.py",
    "schemes": "qknorm_schemes.py",
    "families": "qknorm_families.py",
    "norms": "qknorm_norms.py",
    "hooks": "qknorm_hooks.py",
    "fold": "qknorm_fold.py",
    "layout": "qknorm_layout.py",
    "structure": "qknorm_structure.py",
    "weights": "qknorm_weights.py",
    "autoclasses": "qknorm_autoclasses.py",
    "masks": "qknorm_masks.py",
    "eager": "qknorm_eager.py",
    "vision": "qknorm_vision.py",
}
ENTRY_FILES = ("configuration_qknorm.py", "modeling_qknorm.py")
