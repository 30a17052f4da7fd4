"""Overhead of QK-Clip (per-head max-logit telemetry on every training forward + the clip after every step).

A plain training loop (forward, backward, AdamW step) on a small Llama, timed with and without ``QKClip`` attached,
in interleaved rounds (off, on, off, on, ...) so that load on a shared machine disturbs both alike; the overhead is
the median over rounds of ``on / off - 1`` (each round's step times are medians too). Two clocks: wall time, and the
process's CPU time, which time spent descheduled by other jobs does not inflate (with one thread it is the step's
compute; the figure to trust on a shared machine). Cases: the unpatched model on ``sdpa`` (telemetry from projection
hooks, computed on the side) and a ``qk_norm_cap`` model on the ``"qknorm"`` backend (the per-head maxima come out of
the attention's own pass); ``--schemes none_qknorm`` runs the unpatched model on the ``"qknorm"`` backend (uncapped,
so the same attention as sdpa, which it runs until QK-Clip asks for maxima). Rows are appended to
``benchmarks/results/qk_clip.jsonl``.

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
    p.add_argument(
        "--schemes",
        nargs="+",
        default=["none", "qk_norm_cap"],
        help="'none': the unpatched model on sdpa; 'none_qknorm': the unpatched model on the \"qknorm\" "
        "backend (the same attention, uncapped; its telemetry comes from the attention's own pass)",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps per round and arm (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tau", type=float, default=100.0)
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def _model(args, scheme):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
    )
    model = LlamaForCausalLM(config).train()
    if scheme == "none_qknorm":
        model.set_attn_implementation("qknorm")
    elif scheme != "none":
        hf_qknorm.patch_model(model, scheme)
    return model


def _steps(model, opt, clip, batches) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step."""
    times = []
    for ids in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if clip is not None:
            clip.step()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
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
    ratios = {"wall": [], "cpu": []}
    meds = {(clock, clipped): [] for clock in ratios for clipped in (False, True)}
    for _ in range(args.rounds):
        for clipped in (False, True):  # interleaved: both arms see the same load
            model, opt, clip = arms[clipped]
            times = _steps(model, opt, clip, batches)[2:]
            for i, clock in enumerate(ratios):
                meds[clock, clipped].append(statistics.median(t[i] for t in times))
        for clock in ratios:
            ratios[clock].append(meds[clock, True][-1] / meds[clock, False][-1] - 1.0)
    row = {}
    for clock, prefix in (("wall", ""), ("cpu", "cpu_")):
        row.update(
            {
                f"{prefix}step_ms_off": 1e3 * statistics.median(meds[clock, False]),
                f"{prefix}step_ms_on": 1e3 * statistics.median(meds[clock, True]),
                f"{prefix}overhead": statistics.median(ratios[clock]),
                f"{prefix}overhead_min": min(ratios[clock]),
                f"{prefix}overhead_max": max(ratios[clock]),
            }
        )
    return row


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers

    import hf_qknorm

    torch.set_num_threads(args.threads)
    base = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "batch": args.batch,
        "context": args.context,
        "rounds": args.rounds,
        "steps": args.steps,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "hf_qknorm": hf_qknorm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
    }
    rows = []
    for scheme in args.schemes:
        row = {**base, "scheme": scheme, **measure(args, scheme)}
        rows.append(row)
        for prefix, clock in (("", "wall"), ("cpu_", "CPU ")):
            print(
                f"{scheme:12s} {clock} step {row[prefix + 'step_ms_off']:.1f} ms -> "
                f"{row[prefix + 'step_ms_on']:.1f} ms with QK-Clip: overhead {100 * row[prefix + 'overhead']:.2f}% "
                f"(rounds {100 * row[prefix + 'overhead_min']:.2f}% to {100 * row[prefix + 'overhead_max']:.2f}%)",
                flush=True,
            )
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / "qk_clip.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
