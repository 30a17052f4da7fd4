"""Conversion quality: held-out perplexity of the original, identity-initialised, least-squares-initialised and
calibrated models, for every scheme and norm, side by side in one run.

Each case is a full ``hf_qknorm.convert`` of the source (default: the bundled tiny Llama, calibrated on the first
90% of Tiny Shakespeare, evaluated on the last 10%, exactly as ``hf-qknorm convert`` does by default) into a
temporary folder. Rows are appended to ``benchmarks/results/convert.jsonl`` with the machine, versions and command;
a markdown table is printed.

    python benchmarks/bench_convert.py --eval-blocks 256                 # all schemes, all held-out blocks
    python benchmarks/bench_convert.py --cases qk_norm_cap:layernorm --local-steps 0 100 --steps 0 200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "convert.jsonl"
CASES = [
    "qk_norm_cap:layernorm",
    "qk_norm:layernorm",
    "qk_norm:rmsnorm",
    "qkv_norm:layernorm",
    "qkv_norm:rmsnorm",
    "qk_norm:l2",
    "qk_norm:lp",
    "soft_cap:-",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default=None, help="source folder (default: the bundled tiny Llama)")
    p.add_argument("--cases", nargs="+", default=CASES, help="scheme:norm pairs (norm '-' for soft_cap)")
    p.add_argument(
        "--steps", nargs="+", type=int, default=[None], help="KL distillation steps to compare (default: the library's)"
    )
    p.add_argument(
        "--local-steps",
        nargs="+",
        type=int,
        default=[None],
        help="layer-wise fit steps to compare (default: the library's)",
    )
    p.add_argument("--calibration-blocks", type=int, default=None)
    p.add_argument("--eval-blocks", type=int, default=None)
    p.add_argument("--p", type=float, default=4.0, help="exponent for the lp cases")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--no-save", action="store_true", help="do not append to the results file")
    return p.parse_args(argv)


def run_case(args, scheme: str, norm: str | None, steps: int | None, local_steps: int | None) -> dict:
    import hf_qknorm
    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings

    given = {
        "steps": steps,
        "local_steps": local_steps,
        "calibration_blocks": args.calibration_blocks,
        "eval_blocks": args.eval_blocks,
    }
    settings = CalibrationSettings(**{k: v for k, v in given.items() if v is not None})
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        result = hf_qknorm.convert(
            args.src,
            Path(tmp) / "out",
            config=hf_qknorm.QKNormConfig(scheme=scheme, norm=norm, p=args.p if norm == "lp" else None),
            calibration=settings,
            progress=False,
            log=lambda *a: None,
        )
        seconds = time.time() - t0
    r = result.report
    return {
        "scheme": scheme,
        "norm": norm,
        "p": args.p if norm == "lp" else None,
        "steps": r.steps,
        "local_steps": r.local_steps,
        "calibration_blocks": settings.calibration_blocks,
        "export": result.export,
        "ppl_original": r.ppl_original,
        "ppl_identity": r.ppl_identity,
        "ppl_least_squares": r.ppl_least_squares,
        "ppl_calibrated": r.ppl_calibrated,
        "recovered": r.recovered,
        "kl_start": r.kl_start,
        "kl_end": r.kl_end,
        "max_logit_converted": max(s.max_logit_converted for s in r.layers),
        "calibration_tokens": r.calibration_tokens,
        "eval_tokens": r.eval_tokens,
        "seconds": seconds,
    }


def markdown(rows) -> str:
    lines = [
        "| scheme | norm | layer-wise steps | KL steps | original | identity init | least-squares init | "
        "calibrated init | recovered | export | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        norm = r["norm"] or "-"
        if r["norm"] == "lp":
            norm = f"lp (p={r['p']:g})"
        lines.append(
            f"| {r['scheme']} | {norm} | {r['local_steps']} | {r['steps']} | {r['ppl_original']:.2f} | "
            f"{r['ppl_identity']:.2f} | "
            f"{r['ppl_least_squares']:.2f} | {r['ppl_calibrated']:.2f} | {100 * r['recovered']:.1f}% | "
            f"{r['export']} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    meta = {
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "src": args.src or "bundled",
        "command": "python " + " ".join([os.path.relpath(__file__), *(argv or sys.argv[1:])]),
    }
    rows = []
    for case in args.cases:
        scheme, norm = case.split(":")
        for steps in args.steps:
            for local_steps in args.local_steps:
                row = {**run_case(args, scheme, None if norm == "-" else norm, steps, local_steps), **meta}
                rows.append(row)
                print(
                    json.dumps(
                        {
                            k: row[k]
                            for k in (
                                "scheme",
                                "norm",
                                "local_steps",
                                "steps",
                                "ppl_calibrated",
                                "recovered",
                                "seconds",
                            )
                        }
                    ),
                    flush=True,
                )
                if not args.no_save:
                    RESULTS.parent.mkdir(parents=True, exist_ok=True)
                    with RESULTS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
