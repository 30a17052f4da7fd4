"""``hf-qknorm inspect DIR``: what a saved folder is, and the per-layer statistics of its q/k/v norm weights.

Everything is read from ``config.json`` and the safetensors files (headers checked first, then only the norm tensors
loaded), so a folder of any size is inspected in a moment and without building the model.
"""

from __future__ import annotations

import json
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

    from ..conversion.shards import check_safetensors

    rows = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        header = check_safetensors(path)
        keys = [(k, _NORM_KEY.search(k)) for k in header if k != "__metadata__"]
        keys = [(k, m) for k, m in keys if m]
        if not keys:
            continue
        with safe_open(path, framework="pt") as f:
            for key, m in keys:
                t = f.get_tensor(key).to(torch.float64)
                rows.append({"layer": int(m.group(1)), "name": f"{m.group(2)}.{m.group(3)}", "shape": list(t.shape),
                             "mean": t.mean().item(), "std": t.std(unbiased=False).item() if t.numel() else 0.0,
                             "min": t.min().item(), "max": t.max().item()})
    return sorted(rows, key=lambda r: (r["layer"], "qkv".index(r["name"][0]), r["name"].endswith("bias")))


def folder_summary(folder: Path) -> str:
    """The text ``hf-qknorm inspect`` prints."""
    cfg = read_config(folder)
    lines = [f"model_type: {cfg.get('model_type')}", f"architectures: {cfg.get('architectures')}",
             f"qknorm: {json.dumps(cfg.get('qknorm'))}"]
    rows = norm_statistics(folder)
    if not rows:
        lines.append("norm weights: none (no q_norm / k_norm / v_norm tensors in the safetensors files)")
        return "\n".join(lines)
    lines += ["", "norm weights per layer (statistics over the tensor's elements):",
              "| layer | tensor | shape | mean | std | min | max |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['name']} | {tuple(r['shape'])} | {r['mean']:.4g} | {r['std']:.4g} | "
              f"{r['min']:.4g} | {r['max']:.4g} |" for r in rows]
    return "\n".join(lines)
