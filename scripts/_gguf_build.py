"""What the real-model build scripts (build_smollm2.py, build_gemma3.py) share: reading a GGUF through Transformers
into a plain float32 model, the idempotence check, the staged write renamed into place, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path


def is_built(out: Path, info: dict) -> bool:
    """Whether ``out`` is a finished build with exactly these ``build_info.json`` settings."""
    try:
        return json.loads((out / "build_info.json").read_text()) == info and (out / "config.json").is_file()
    except (OSError, ValueError):
        return False


def read_gguf(path: Path, install_hint: str):
    """The model and tokenizer of the GGUF file ``path`` as Transformers loads them (dequantised to float32)."""
    try:
        import gguf  # noqa: F401  (Transformers needs it to read GGUF)
    except ImportError:
        raise ImportError(f"reading GGUF needs the gguf package: {install_hint}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def load_plain(path: Path, install_hint: str):
    """:func:`read_gguf`'s model rebuilt from a clean config: Transformers flags a GGUF-loaded model as quantised
    (and refuses save_pretrained) although its tensors are plain float32."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded, tokenizer = read_gguf(path, install_hint)
    raw = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        raw.pop(key, None)
    config = type(loaded.config).from_dict(raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    return model.eval(), tokenizer


@contextlib.contextmanager
def staged(out: Path):
    """A temporary folder beside ``out``, renamed into its place when the block completes and removed when it
    raises (an interrupted build leaves ``out`` as it was)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def terminate_as_exit() -> None:
    """SIGTERM raises SystemExit like Ctrl-C raises KeyboardInterrupt, so :func:`staged` removes its folder either
    way (by default SIGTERM ends the process with no cleanup)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv, doc: str, build, default_out: Path, default_shard: str) -> int:
    """The build scripts' command line: ``--out``, ``--max-shard-size``, ``--force``; a missing package is one line."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=default_out, help=f"output folder (default {default_out})")
    p.add_argument("--max-shard-size", default=default_shard, help=f"safetensors shard size (default {default_shard})")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is up to date")
    args = p.parse_args(argv)
    terminate_as_exit()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build(args.out, args.max_shard_size, args.force))
    except (FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
