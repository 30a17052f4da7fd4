"""``hf-qknorm inspect DIR``: what a saved folder is, and the per-layer statistics of its q/k/v norm weights.

Everything is read from ``config.json`` and the safetensors files (headers checked first, then only the norm tensors
loaded), so a folder of any size is inspected in a moment: the model is built on the ``meta`` device only, to know
each layer's norm tensors. The rows are checked
against the norm weights the folder's scheme needs (:func:`expected_norms`): a tensor that is missing, not part of
the scheme, of another shape or not floating point is flagged, and ``inspect`` exits 1 -- the same folder fails
``hf-qknorm verify`` and does not load.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..modeling.saved import read_config

# <...>.layers.<i>.<...>.q_norm.weight (Llama-style) or <...>h.<i>.<...>.k_norm.bias (GPT-2)
_NORM_KEY = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\..*\b([qkv]_norm)\.(weight|bias)$")


def norm_statistics(folder: Path) -> list[dict]:
    """One row per norm tensor: ``layer``, ``name`` (e.g. ``q_norm.weight``), ``shape``, ``mean``, ``std``
    (population), ``min``, ``max``; sorted by layer, then q, k, v, weight before bias."""
    import torch
    from safetensors import safe_open

    from ..conversion.output.shards import check_safetensors

    rows = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        header = check_safetensors(path)
        keys = [(k, _NORM_KEY.search(k)) for k in header if k != "__metadata__"]
        keys = [(k, m) for k, m in keys if m]
        if not keys:
            continue
        with safe_open(path, framework="pt") as f:
            for key, m in keys:
                t = f.get_tensor(key)
                row = {
                    "layer": int(m.group(1)),
                    "name": f"{m.group(2)}.{m.group(3)}",
                    "shape": list(t.shape),
                    "dtype": header[key]["dtype"],
                    "finite": not t.is_floating_point() or bool(torch.isfinite(t).all()),
                }
                t = t.to(torch.float64)
                rows.append(
                    {
                        **row,
                        "mean": t.mean().item(),
                        "std": t.std(unbiased=False).item() if t.numel() else 0.0,
                        "min": t.min().item() if t.numel() else math.nan,
                        "max": t.max().item() if t.numel() else math.nan,
                    }
                )
    return sorted(rows, key=_row_order)


def _row_order(r: dict):
    return r["layer"], "qkv".index(r["name"][0]), r["name"].endswith("bias")


def expected_norms(cfg: dict, folder: Path | None = None) -> tuple[str, dict[tuple[int, str], list[int]]] | None:
    """``(what, {(layer, "q_norm.weight"): shape})``: the norm tensors a folder with config ``cfg`` must hold (a
    ``qknorm_<base>`` folder: its scheme's; a plain Qwen3: its own q/k norms); ``None`` when nothing is known (a plain
    folder of another family, or sizes config.json does not give). With the ``folder``, the tensors are those of
    the model its config builds, on the ``meta`` device (:func:`_built_norms`: a layer's own head width, a layer
    with no key norm of its own); else, or where that model cannot be built, one shape for every layer."""
    from ..modeling.derive import get_family
    from ..portable.families import base_model_type
    from ..portable.names import PREFIX
    from ..portable.norms import make_norm
    from ..portable.schemes import QKNormConfig

    try:
        family = get_family(base_model_type(cfg.get("model_type")))
    except ValueError:
        family = None
    settings = cfg.get("qknorm")
    patched = str(cfg.get("model_type", "")).startswith(PREFIX)
    if family is None or (not patched and not family.native_qk_norm):
        return None
    try:  # the config class knows its own names for the sizes (GPT-2's n_layer / n_head / n_embd)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        from ..portable.families import head_dim_of

        config = CONFIG_MAPPING[family.model_type].from_dict(
            {k: v for k, v in cfg.items() if k not in ("model_type", "qknorm", "auto_map", "architectures")}
        )
        layers, head_dim = config.num_hidden_layers, head_dim_of(None, config)
    except Exception:  # sizes config.json does not give
        return None
    if not isinstance(layers, int) or not isinstance(head_dim, int) or head_dim < 1:
        return None
    scheme = QKNormConfig.from_dict(settings) if patched else None
    if scheme is None or not scheme.norms_qk:  # the family's own q/k norms (Qwen3), kept by soft_cap
        what = "Qwen3's own q/k norms" if scheme is None else f"{scheme.scheme} (Qwen3's own q/k norms)"
        params = {"q_norm.weight": [head_dim], "k_norm.weight": [head_dim]} if family.native_qk_norm else {}
    else:
        what = f"{scheme.scheme} / {scheme.norm}"
        roles = ("q", "k", "v") if scheme.norms_v else ("q", "k")
        params = {
            f"{role}_norm.{name}": list(prm.shape)
            for role in roles
            for name, prm in make_norm(scheme.norm, role, head_dim, 1e-6, scheme.p).named_parameters()
        }
    built = _built_norms(folder) if folder is not None else None
    if built is not None:
        return what, built
    return what, {(i, name): shape for i in range(layers) for name, shape in params.items()}


def _built_norms(folder: Path) -> dict[tuple[int, str], list[int]] | None:
    """The q/k/v norm tensors, by layer, of the model ``folder``'s config builds as loading builds it (a patched
    class applies its scheme), on the ``meta`` device: no weight is read. ``None`` where it cannot be built."""
    import torch
    from transformers import AutoConfig

    from ..modeling.saved import auto_class
    from ..verification.loading import quiet_transformers

    try:
        with quiet_transformers(), torch.device("meta"):
            config = AutoConfig.from_pretrained(folder)
            names = auto_class(config).from_config(config).state_dict()
    except Exception:
        return None
    out = {}
    for name, tensor in names.items():
        m = _NORM_KEY.search(name)
        if m:
            out[(int(m.group(1)), f"{m.group(2)}.{m.group(3)}")] = list(tensor.shape)
    return out


def check_rows(rows: list[dict], expected) -> list[dict]:
    """``rows`` with a ``check`` entry each (``ok`` or what is wrong), plus a ``MISSING`` row for every expected norm
    tensor the folder lacks; sorted as :func:`norm_statistics` sorts."""
    if expected is None:
        return [{**r, "check": _value_check(r) or "ok"} for r in rows]
    what, shapes = expected
    out, seen = [], set()
    for r in rows:
        key = (r["layer"], r["name"])
        seen.add(key)
        if key not in shapes:
            check = f"UNEXPECTED: not a weight of {what}"
        elif r["shape"] != shapes[key]:
            check = f"shape {tuple(r['shape'])}, the scheme needs {tuple(shapes[key])}"
        else:
            check = _value_check(r) or "ok"
        out.append({**r, "check": check})
    out += [
        {"layer": layer, "name": name, "shape": shape, "check": "MISSING"}
        for (layer, name), shape in shapes.items()
        if (layer, name) not in seen
    ]
    return sorted(out, key=_row_order)


_STAMP = re.compile(r"^# Written by hf_qknorm (\S+) from ")


def _remote_code_line(folder: Path) -> list[str]:
    """Which hf_qknorm wrote the folder's shipped code (what runs without the plugin; with it, the plugin's own code
    runs), and a hint when that is not this version."""
    from .._version import __version__

    entry = Path(folder) / "modeling_qknorm.py"
    if not entry.is_file():
        return []
    with entry.open(encoding="utf-8", errors="replace") as f:
        m = _STAMP.match(f.readline())
    version = m.group(1) if m else "unknown"
    if version == __version__:
        return [f"remote code: written by hf_qknorm {version} (this version)"]
    return [
        f"remote code: written by hf_qknorm {version}, not this version ({__version__}): without the plugin "
        "that code runs; hf_qknorm.add_remote_code(DIR) replaces it with this version's"
    ]


def _value_check(row: dict) -> str | None:
    """What is wrong with a norm tensor's values whatever the scheme: not floating point, or NaN/inf (a model with
    such a gain computes NaN)."""
    if not row["dtype"].startswith(("F", "BF")):
        return "not floating point"
    return None if row.get("finite", True) else "NaN/inf values"


def folder_summary(folder: Path) -> tuple[str, int]:
    """The text ``hf-qknorm inspect`` prints, and how many norm tensors it flags."""
    cfg = read_config(folder)
    lines = [
        f"model_type: {cfg.get('model_type')}",
        f"architectures: {cfg.get('architectures')}",
        f"qknorm: {json.dumps(cfg.get('qknorm'))}",
        *_remote_code_line(folder),
    ]
    rows = check_rows(norm_statistics(folder), expected_norms(cfg, Path(folder)))
    if not rows:
        lines.append("norm weights: none (no q_norm / k_norm / v_norm tensors in the safetensors files)")
        return "\n".join(lines), 0
    lines += [
        "",
        "norm weights per layer (statistics over the tensor's elements; check: against the scheme):",
        "| layer | tensor | shape | mean | std | min | max | dtype | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stats = " | ".join(f"{r[k]:.4g}" if k in r else "-" for k in ("mean", "std", "min", "max"))
        lines.append(
            f"| {r['layer']} | {r['name']} | {tuple(r['shape'])} | {stats} | {r.get('dtype', '-')} | {r['check']} |"
        )
    flagged = sum(r["check"] != "ok" for r in rows)
    if flagged:
        lines += [
            "",
            f"norm weights do not match the scheme: {flagged} tensor{'s' if flagged > 1 else ''} flagged "
            "above (hf-qknorm verify fails this folder)",
        ]
    return "\n".join(lines), flagged
