"""Peak memory of a conversion: shard-by-shard writing and layer-by-layer calibration vs loading the whole model.

Builds random sharded Llama checkpoints (from a config; the bundled tiny model's tokenizer) of each depth in
``--layers``, then, each in a fresh subprocess so that the peak is its own:

* ``stream``: ``hf_qknorm.convert(..., calibrate=False)`` -- read one shard, add the norm tensors, write it;
* ``stream_qkv``: the same with ``qkv_norm`` (the removed pre-norm is folded into q/k/v shard by shard);
* ``full_load``: the naive way -- ``from_pretrained``, ``patch_model``, ``save_pretrained``;
* ``calibrate``: a calibrated conversion, layer by layer (the default: one decoder block in memory at a time);
* ``calibrate_kl``: the same plus end-to-end KL distillation (``--steps``), which loads the whole model.

Peak memory is the process's peak RSS (VmHWM) above its RSS just before the work (after imports). Rows are appended to
``benchmarks/results/convert_memory.jsonl``.

    python benchmarks/bench_convert_memory.py
    python benchmarks/bench_convert_memory.py --hidden 512 --layers 8 32 --modes calibrate calibrate_kl
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "convert_memory.jsonl"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """VmHWM: this process's own peak RSS. (``ru_maxrss`` would not do: a child inherits its parent's high-water
    mark across fork and exec, and the parent has just built the whole model.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _child(mode: str, src: str, dst: str) -> None:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import hf_qknorm

    logging.disable_progress_bar()
    torch.set_num_threads(1)
    base = _rss_mib()
    t0 = time.time()
    if mode == "full_load":
        model = AutoModelForCausalLM.from_pretrained(src)
        hf_qknorm.patch_model(model, "qk_norm_cap")
        model.save_pretrained(dst, max_shard_size="50MB")
    elif mode.startswith("calibrate"):
        from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings

        settings = CalibrationSettings(
            block_len=64,
            calibration_blocks=8,
            eval_blocks=4,
            local_steps=20,
            steps=int(os.environ.get("BENCH_KL_STEPS", "2")) if mode == "calibrate_kl" else 0,
            threads=1,
        )
        hf_qknorm.convert(
            src,
            dst,
            config=hf_qknorm.QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
            calibration=settings,
            progress=False,
            log=lambda *a: None,
        )
    else:
        scheme = "qkv_norm" if mode == "stream_qkv" else "qk_norm_cap"
        hf_qknorm.convert(
            src, dst, config=hf_qknorm.QKNormConfig(scheme=scheme), calibrate=False, progress=False, log=lambda *a: None
        )
    peak = _peak_rss_mib()
    print(json.dumps({"peak_mib": peak - base, "seconds": time.time() - t0}))


def build_source(path: Path, hidden: int, layers: int, shard_mb: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_qknorm.data import bundled_model_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bundled tiny Llama's (vocabulary 2048)
        shutil.copyfile(bundled_model_dir() / name, path / name)
    sizes = [p.stat().st_size / 2**20 for p in path.glob("*.safetensors")]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "total_mib": sum(sizes),
        "largest_shard_mib": max(sizes),
        "shards": len(sizes),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, nargs="+", default=[8])
    p.add_argument("--shard-mb", type=int, default=50)
    p.add_argument("--modes", nargs="+", default=["stream", "stream_qkv", "full_load"])
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return
    import torch
    import transformers

    tmp = Path(tempfile.mkdtemp(prefix="bench_convert_memory-"))
    try:
        for layers in args.layers:
            src = tmp / f"src{layers}"
            info = {"layers": layers, "hidden": args.hidden, **build_source(src, args.hidden, layers, args.shard_mb)}
            print(json.dumps(info), flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
            for mode in args.modes:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, str(src), str(tmp / mode)],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                )
                shutil.rmtree(tmp / mode, ignore_errors=True)
                row = {
                    "mode": mode,
                    **json.loads(out.stdout.strip().splitlines()[-1]),
                    **info,
                    "time": dt.datetime.now().isoformat(timespec="seconds"),
                    "machine": platform.machine(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "command": "python " + " ".join([os.path.relpath(__file__), *(argv or sys.argv[1:])]),
                }
                print(
                    f"{layers:>3} layers {mode:>12}: peak {row['peak_mib']:7.1f} MiB above baseline  "
                    f"({row['seconds']:.1f} s; checkpoint {info['total_mib']:.0f} MiB, largest shard "
                    f"{info['largest_shard_mib']:.0f} MiB)",
                    flush=True,
                )
                if not args.no_save:
                    RESULTS.parent.mkdir(parents=True, exist_ok=True)
                    with RESULTS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
