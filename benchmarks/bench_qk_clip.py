"""Overhead of QK-Clip (per-head max-logit telemetry on every training forward + the clip after every step).

A plain training loop (forward, backward, AdamW step) on a small Llama, timed with and without ``QKClip`` attached,
in interleaved rounds (off, on, off, on, ...) so that load on a shared machine disturbs both alike; the overhead is
the median over rounds of ``on / off - 1`` (each round's step times are medians too). Cases: the unpatched model on
``sdpa`` (telemetry from projection hooks) and a ``qk_norm_cap`` model on the ``"qknorm"`` backend (telemetry from
the backend's probe). Rows are appended to ``benchmarks/results/qk_clip.jsonl``.

    python benchmarks/bench_qk_clip.py                       # 4 layers, width 256, batch 8 x 256, one thread
    python benchmarks/bench_qk_clip.py --context 1024 --batch 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", nargs="+", default=["none", "qk_norm_cap"], help="'none': the unpatched model")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps per round and arm (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tau", type=float, default=100.0)
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def _model(args, scheme):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.context)
    model = LlamaForCausalLM(config).train()
    if scheme != "none":
        hf_qknorm.patch_model(model, scheme)
    return model


def _steps(model, opt, clip, batches) -> list[float]:
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if clip is not None:
            clip.step()
        times.append(time.perf_counter() - t0)
    return times


def measure(args, scheme) -> dict:
    import torch

    import hf_qknorm

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 2048, (args.batch, args.context), generator=g) for _ in range(args.steps + 2)]
    arms = {}
    for clipped in (False, True):
        model = _model(args, scheme)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        clip = hf_qknorm.QKClip(model, tau=args.tau) if clipped else None
        arms[clipped] = (model, opt, clip)
    ratios, off_med, on_med = [], [], []
    for _ in range(args.rounds):
        meds = {}
        for clipped in (False, True):  # interleaved: both arms see the same load
            model, opt, clip = arms[clipped]
            meds[clipped] = statistics.median(_steps(model, opt, clip, batches)[2:])
        ratios.append(meds[True] / meds[False] - 1.0)
        off_med.append(meds[False])
        on_med.append(meds[True])
    return {"step_ms_off": 1e3 * statistics.median(off_med), "step_ms_on": 1e3 * statistics.median(on_med),
            "overhead": statistics.median(ratios), "overhead_min": min(ratios), "overhead_max": max(ratios)}


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers

    import hf_qknorm

    torch.set_num_threads(args.threads)
    base = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": platform.processor() or platform.machine(),
            "threads": args.threads, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "batch": args.batch, "context": args.context, "rounds": args.rounds,
            "steps": args.steps, "hf_qknorm": hf_qknorm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))}
    rows = []
    for scheme in args.schemes:
        row = {**base, "scheme": scheme, **measure(args, scheme)}
        rows.append(row)
        print(f"{scheme:12s} step {row['step_ms_off']:.1f} ms -> {row['step_ms_on']:.1f} ms with QK-Clip: "
              f"overhead {100 * row['overhead']:.2f}% (rounds {100 * row['overhead_min']:.2f}% to "
              f"{100 * row['overhead_max']:.2f}%)", flush=True)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / "qk_clip.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
