"""Writes the remote code into saved ``qknorm_<base>`` folders: the modules of :mod:`hf_qknorm.portable`, copied.

Transformers loads custom code from a folder (``trust_remote_code=True``) and follows its relative imports between
files. So the code a saved folder carries is not a second implementation: it is :mod:`hf_qknorm.portable`, copied
under flat names (``portable/norms.py`` -> ``qknorm_norms.py``) with each relative import mapped through
``portable.SHIPPED``, plus the two entry files (``portable/entry/``) that build the classes from them. An import the
table cannot map (an absolute ``hf_qknorm`` import, ``from . import x``, a module outside the table) is refused here
and by a test, not discovered when a user saves. A test loads saved folders in a process without the plugin, at
both ends of the supported Transformers range.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
from pathlib import Path

from ..portable import ENTRY_FILES, SHIPPED
from ..portable.names import CLASS_PREFIX, PREFIX

_PORTABLE = Path(__file__).resolve().parents[1] / "portable"


def shipped_source(module: str) -> str:
    """The text of ``portable/<module>.py`` with its relative imports mapped to the shipped file names; raises
    ``RuntimeError`` for an import that would not resolve inside a saved folder."""
    path = _PORTABLE / f"{module}.py"
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or node.module not in SHIPPED:
                what = "." * node.level + (node.module or "")
                raise RuntimeError(
                    f"hf_qknorm/portable/{module}.py imports from {what!r}, which a saved folder does "
                    f"not carry; shipped code imports only from . + one of {sorted(SHIPPED)}"
                )
            line = lines[node.lineno - 1]
            flat = SHIPPED[node.module][:-3]
            lines[node.lineno - 1] = line.replace(f"from .{node.module} import", f"from .{flat} import", 1)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] == "hf_qknorm" for n in names):
                raise RuntimeError(
                    f"hf_qknorm/portable/{module}.py imports {names}: shipped code cannot import the "
                    "plugin (a saved folder loads without it)"
                )
    return "".join(lines)


def remote_files(base_model_type: str | None = None) -> dict[str, str]:
    """File name -> text of everything a saved folder carries besides ``config.json`` and the weights
    (``base_model_type``: the saved model's, written into the entry files: model types can share class names)."""
    from .._version import __version__

    stamp = f"# Written by hf_qknorm {__version__} from hf_qknorm/portable/{{}}; it is regenerated on every save.\n"
    files = {name: stamp.format(f"{module}.py") + shipped_source(module) for module, name in SHIPPED.items()}
    # Older Transformers (5.4 at least) copy only the files an entry file imports itself: name every shipped module.
    direct = "".join(f"from .{n[:-3]} import __name__ as _{n[:-3]}  # noqa: F401\n" for n in SHIPPED.values())
    for name in ENTRY_FILES:
        entry = (_PORTABLE / "entry" / name).read_text().replace("# {SHIPPED_IMPORTS}\n", direct)
        entry = entry.replace(
            "BASE_MODEL_TYPE = None  # {BASE_MODEL_TYPE}",
            f"BASE_MODEL_TYPE = {base_model_type!r}  # {{BASE_MODEL_TYPE}}",
        )
        files[name] = stamp.format(f"entry/{name}") + entry
    return files


def add_remote_code(folder) -> None:
    """Write the remote code into ``folder`` (atomically, file by file) and make sure its ``config.json`` has the
    ``auto_map`` that points at it (folders saved by older versions of the plugin lack it)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type", "") if config_file.is_file() else ""
    if not str(model_type).startswith(PREFIX):
        raise ValueError(
            f"{folder} was not saved from a model patched by hf_qknorm (model_type {model_type!r}); "
            "only qknorm_<base> folders carry the remote code"
        )
    from ..portable.families import base_model_type

    for name, text in remote_files(base_model_type(model_type)).items():
        _write_atomic(folder / name, text)
    data = json.loads(config_file.read_text())
    if "auto_map" not in data:
        from ..portable.autoclasses import auto_map, patched_architecture

        archs = [patched_architecture(a) for a in data.get("architectures") or []]
        data["architectures"] = archs or None
        data["auto_map"] = auto_map(_config_class_name(data), archs, multimodal="text_config" in data)
        _write_atomic(config_file, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _config_class_name(data: dict) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..portable.families import base_model_type

    return CLASS_PREFIX + CONFIG_MAPPING[base_model_type(data.get("model_type", ""))].__name__


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
