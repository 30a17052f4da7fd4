"""Logits of saved folders loaded as a user without the plugin would load them, in a fresh interpreter in which
``hf_qknorm`` cannot be imported: a ``qknorm_<base>`` folder through its shipped remote code
(``trust_remote_code=True``), a plain export (``qwen3``, or the source's own model type) through plain Transformers.

:func:`hf_qknorm.convert` compares these with the logits of the converted model in memory for every model type,
including those whose attention the float64 reference of :func:`hf_qknorm.verify` refuses to follow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    sys.modules["hf_qknorm"] = None  # any import of the plugin now fails: the folder must stand on its own
    import torch
    import transformers

    jobs = json.load(open(sys.argv[1]))
    torch.set_num_threads(int(sys.argv[3]))
    out = {}
    for job in jobs:
        try:
            auto = getattr(transformers, job.get("auto", "AutoModelForCausalLM"))
            model = auto.from_pretrained(job["path"], trust_remote_code=job["remote"]).eval()
            # a multimodal model whose text runs on its language model (BLIP-2's forward needs images)
            run = model.get_submodule(job["text_forward"]) if job.get("text_forward") else model
            ids, mask = torch.tensor(job["ids"]), torch.tensor(job["mask"])
            with torch.no_grad():
                logits = run(input_ids=ids, attention_mask=mask).logits.float()
            out[job["key"]] = {"logits": logits, "cls": type(model).__name__, "module": type(model).__module__}
            del model
        except Exception as exc:
            out[job["key"]] = {"error": (type(exc).__name__ + ": " + str(exc)).strip().splitlines()[0],
                               "traceback": traceback.format_exc()}
    loaded = [n for n, m in sys.modules.items() if n.startswith("hf_qknorm") and m is not None]
    assert not loaded, f"hf_qknorm was imported: {loaded}"
    torch.save(out, sys.argv[2])
""")


def logits_without_plugin(jobs: list[dict], *, timeout: float = 1800) -> dict:
    """For each job (``key``, folder ``path``, ``remote``: trust_remote_code, ``ids`` and ``mask`` as nested lists;
    optional ``auto``: the Auto class to load with, ``AutoModelForCausalLM`` by default; optional ``text_forward``:
    the submodule text is run on, :func:`hf_qknorm.portable.families.text_forward_path`), the float32 logits of the
    folder's model loaded in one fresh interpreter without the plugin, with the class
    it loaded as: key -> ``{"logits", "cls", "module"}`` or ``{"error", "traceback"}``. Transformers' remote-code
    module cache is private to the run. ``HF_QKNORM_PYTHON`` names another interpreter to use."""
    with tempfile.TemporaryDirectory(prefix="hf_qknorm_plain_") as tmp:
        tmp = Path(tmp)
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        (tmp / "runner.py").write_text(_RUNNER)
        env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules")}
        python = os.environ.get("HF_QKNORM_PYTHON", sys.executable)
        cmd = [
            python,
            str(tmp / "runner.py"),
            str(tmp / "jobs.json"),
            str(tmp / "out.pt"),
            str(torch.get_num_threads()),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
        if res.returncode != 0:
            tail = [line for line in (res.stderr or res.stdout).strip().splitlines() if line.strip()]
            raise RuntimeError(f"the subprocess without hf_qknorm failed: {tail[-1] if tail else res.returncode}")
        return torch.load(tmp / "out.pt", weights_only=True)
