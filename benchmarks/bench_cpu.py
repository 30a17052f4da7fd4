"""CPU benchmark: patched vs unpatched models and the capped attention paths, side by side in one run.

Two tables, each case in a fresh subprocess so that peak memory (max RSS above the process's RSS just before the
timed work) is its own:

* ``attention``: one attention call, forward+backward, B=4, H=8, D=64, causal, fp32 --
  ``sdpa`` (no cap) | ``eager_cap`` (plain PyTorch with a tanh cap, as Gemma 2's eager path) | ``qknorm_cap``
  (this package's chunked capped path).
* ``model``: one training step (forward+backward) of a small Llama (4 layers, width 512, 8 heads of 64), B=4 --
  unpatched ``sdpa`` | ``qk_norm`` | ``qk_norm_cap`` | ``qkv_norm``.

Rows are appended to ``benchmarks/results/cpu.jsonl`` with the machine, versions and the command.

    python benchmarks/bench_cpu.py                       # both tables, T = 256, 1024, 2048
    python benchmarks/bench_cpu.py --table attention --seq 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "cpu.jsonl"


def _status_mib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in MiB. VmHWM starts afresh at exec, unlike ru_maxrss,
    which a child inherits from its parent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    return _status_mib("VmHWM")


def _eager_cap(q, k, v, scaling, softcap):
    import torch

    s = (q @ k.transpose(-1, -2)) * scaling
    s = softcap * torch.tanh(s / softcap)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def run_attention_case(provider: str, seq: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hf_qknorm.cpu_attention import chunked_attention

    torch.manual_seed(0)
    b, h, d = 4, 8, 64
    q, k, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "eager_cap": lambda: _eager_cap(q, k, v, d**-0.5, 50.0),
        "qknorm_cap": lambda: chunked_attention(q, k, v, scaling=d**-0.5, softcap=50.0, causal=True),
    }
    fn = fns[provider]
    base = _rss_mib()
    times = []
    for _ in range(repeats + 1):  # first run warms up
        t0 = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    peak = _peak_mib() - base
    return {"table": "attention", "provider": provider, "batch": b, "heads": h, "head_dim": d, "seq": seq,
            "fwd_bwd_s": min(times[1:]), "peak_mib": round(peak, 1)}


def run_model_case(provider: str, seq: int, repeats: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    if provider != "sdpa":
        hf_qknorm.patch_model(model, provider)
    ids = torch.randint(0, cfg.vocab_size, (4, seq))
    base = _rss_mib()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = _peak_mib() - base
    return {"table": "model", "provider": provider, "batch": 4, "seq": seq, "layers": 4, "hidden": 512,
            "attn_impl": model.config._attn_implementation, "fwd_bwd_s": min(times[1:]),
            "peak_mib": round(peak, 1)}


def _environment() -> dict:
    import torch
    import transformers

    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=["attention", "model", "both"], default="both")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (min is reported)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--case", nargs=3, metavar=("TABLE", "PROVIDER", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.case:  # child process: one case, JSON on stdout
        table, provider, seq = args.case
        runner = run_attention_case if table == "attention" else run_model_case
        print(json.dumps(runner(provider, int(seq), args.repeats)))
        return

    plan = []
    if args.table in ("attention", "both"):
        plan += [("attention", p) for p in ("sdpa", "eager_cap", "qknorm_cap")]
    if args.table in ("model", "both"):
        plan += [("model", p) for p in ("sdpa", "qk_norm", "qk_norm_cap", "qkv_norm")]
    env = _environment()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'table':9} {'provider':12} {'seq':>5} {'fwd+bwd s':>10} {'peak MiB':>9}")
    for seq in args.seq:
        for table, provider in plan:
            res = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--case", table,
                                  provider, str(seq)], capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{table:9} {provider:12} {seq:>5} FAILED: {res.stderr.strip().splitlines()[-1:]}")
                continue
            row = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{table:9} {provider:12} {seq:>5} {row['fwd_bwd_s']:>10.3f} {row['peak_mib']:>9.1f}", flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps({**row, **env, "command": command}) + "\n")


if __name__ == "__main__":
    main()
