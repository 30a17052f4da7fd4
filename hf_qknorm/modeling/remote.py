"""The remote code saved with every ``qknorm_<base>`` folder: the plugin's own modules, flattened.

Transformers loads custom code from a folder (``trust_remote_code=True``) and follows its relative imports between
files. So the code a saved folder carries is not a second implementation: it is the plugin's standalone modules
(those that import nothing but the standard library, ``torch`` and each other), copied under flat names
(``hf_qknorm/modeling/norms.py`` -> ``qknorm_norms.py``) with their relative imports rewritten, plus two entry files
(``_remote/configuration_qknorm.py``, ``_remote/modeling_qknorm.py``) that build the classes from them. A test loads
saved folders in a process without the plugin, at both ends of the supported Transformers range.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from .families import PREFIX

_PACKAGE = Path(__file__).resolve().parents[1]  # hf_qknorm/
# Package module (relative to hf_qknorm/) -> shipped file name. Only these may be imported by shipped code.
SHIPPED = {
    "modeling/schemes.py": "qknorm_schemes.py",
    "modeling/families.py": "qknorm_families.py",
    "modeling/norms.py": "qknorm_norms.py",
    "modeling/hooks.py": "qknorm_hooks.py",
    "modeling/fold.py": "qknorm_fold.py",
    "modeling/layout.py": "qknorm_layout.py",
    "modeling/structure.py": "qknorm_structure.py",
    "attention/masks.py": "qknorm_masks.py",
    "attention/eager.py": "qknorm_eager.py",
}
ENTRY_FILES = ("configuration_qknorm.py", "modeling_qknorm.py")
_RELATIVE = re.compile(r"^(\s*)from (\.+)([\w.]*) import (.+)$", re.MULTILINE)


def _flatten(source: str, where: str) -> str:
    """Rewrite the relative imports of the package module ``where`` to the flat shipped names."""
    here = Path(where).parent

    def repl(m):
        indent, dots, name, names = m.groups()
        target = here
        for _ in range(len(dots) - 1):
            target = target.parent
        path = (target / name.replace(".", "/")).as_posix() + ".py"
        path = os.path.normpath(path)
        if path not in SHIPPED:
            raise RuntimeError(f"hf_qknorm/{where} imports {path}, which is not shipped as remote code; make it "
                               f"standalone or add it to hf_qknorm.modeling.remote.SHIPPED")
        return f"{indent}from .{SHIPPED[path][:-3]} import {names}"

    return _RELATIVE.sub(repl, source)


def remote_files() -> dict[str, str]:
    """File name -> text of everything a saved folder carries besides ``config.json`` and the weights."""
    from .._version import __version__

    stamp = f"# Written by hf_qknorm {__version__} from hf_qknorm/{{}}; it is regenerated on every save.\n"
    files = {name: stamp.format(path) + _flatten((_PACKAGE / path).read_text(), path)
             for path, name in SHIPPED.items()}
    # Older Transformers (5.4 at least) copy only the files an entry file imports itself: name every shipped module.
    direct = "".join(f"from .{n[:-3]} import __name__ as _{n[:-3]}  # noqa: F401\n" for n in SHIPPED.values())
    for name in ENTRY_FILES:
        entry = (_PACKAGE / "modeling" / "_remote" / name).read_text().replace("# {SHIPPED_IMPORTS}\n", direct)
        files[name] = stamp.format(f"modeling/_remote/{name}") + entry
    return files


def add_remote_code(folder) -> None:
    """Write the remote code into ``folder`` (atomically, file by file) and make sure its ``config.json`` has the
    ``auto_map`` that points at it (folders saved by older versions of the plugin lack it)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type", "") if config_file.is_file() else ""
    if not str(model_type).startswith(PREFIX):
        raise ValueError(f"{folder} was not saved from a model patched by hf_qknorm (model_type {model_type!r}); "
                         "only qknorm_<base> folders carry the remote code")
    for name, text in remote_files().items():
        _write_atomic(folder / name, text)
    data = json.loads(config_file.read_text())
    if "auto_map" not in data:
        from .structure import auto_map, patched_architecture

        archs = [patched_architecture(a) for a in data.get("architectures") or []]
        data["architectures"] = archs or None
        data["auto_map"] = auto_map(_config_class_name(data), archs)
        _write_atomic(config_file, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _config_class_name(data: dict) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .families import base_model_type

    from .structure import CLASS_PREFIX

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
