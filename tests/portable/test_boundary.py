"""hf_qknorm/portable is the code that travels into saved model folders: it imports only the standard library, torch
and itself, and every module of it is in the shipped table."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def test_portable_modules_import_only_the_standard_library_torch_and_each_other():
    """The boundary of hf_qknorm/portable: checked on the package's own files (so a bad import fails here, not
    when a user saves a model), and every module file of the subpackage is in the shipped table."""
    from hf_qknorm import portable
    from hf_qknorm.modeling.remote import shipped_source

    folder = Path(portable.__file__).parent
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(portable.SHIPPED)
    for module in portable.SHIPPED:
        tree = ast.parse((folder / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module in portable.SHIPPED, (module, ast.dump(node))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    root = name.split(".")[0]
                    assert root == "torch" or root in sys.stdlib_module_names, (module, name)
        shipped_source(module)  # maps every import


def test_the_cap_check_reads_the_attention_implementation_as_the_config_does():
    """The patched forward reads ``config._attn_implementation`` from the instance where Transformers' own property
    keeps it; a config class whose property is another reads it through the attribute."""
    from transformers import LlamaConfig

    from hf_qknorm.portable import hooks

    config = LlamaConfig()
    for impl in ("qknorm", "sdpa", None):
        config._attn_implementation = impl
        assert hooks._attn_implementation(config) == impl

    class Routed(LlamaConfig):
        @property
        def _attn_implementation(self):
            return "eager"

        @_attn_implementation.setter
        def _attn_implementation(self, value):
            self._attn_implementation_internal = value

    routed = Routed()
    routed._attn_implementation = "qknorm"
    assert routed.__dict__["_attn_implementation_internal"] == "qknorm"
    assert hooks._attn_implementation(routed) == "eager"
