"""What ``import hf_qknorm`` costs on top of ``import transformers`` and one model class.

Each round runs a fresh interpreter that imports Transformers and ``LlamaForCausalLM`` (touching the class so the
lazy module loads), then ``hf_qknorm``, timing both steps inside the process; rounds alternate with a baseline
interpreter that skips ``hf_qknorm``, and the medians are reported. Appends a row to
``benchmarks/results/import.jsonl``.

    python benchmarks/bench_import.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_CHILD = """
import time, json, sys
t0 = time.perf_counter()
import transformers
from transformers import LlamaForCausalLM
LlamaForCausalLM.__name__
t1 = time.perf_counter()
if sys.argv[1] == "1":
    import hf_qknorm
t2 = time.perf_counter()
print(json.dumps({"transformers": t1 - t0, "hf_qknorm": t2 - t1}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "import.jsonl")
    args = ap.parse_args()
    rows = {"0": [], "1": []}
    for _ in range(args.rounds):
        for which in ("0", "1"):
            out = subprocess.run([sys.executable, "-c", _CHILD, which], capture_output=True, text=True, check=True)
            rows[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["transformers"] for r in rows["0"])
    ours = statistics.median(r["hf_qknorm"] for r in rows["1"])
    import torch
    import transformers

    import hf_qknorm

    result = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rounds": args.rounds,
        "transformers_and_llama_s": round(base, 3),
        "hf_qknorm_extra_s": round(ours, 3),
        "hf_qknorm": hf_qknorm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    print(f"import transformers + LlamaForCausalLM: {base:.3f} s (median of {args.rounds})")
    print(f"import hf_qknorm on top:                {ours:.3f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
