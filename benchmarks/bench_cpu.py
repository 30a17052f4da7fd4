"""CPU benchmark: patched vs unpatched models and the capped attention paths, side by side in one run.

Two tables. Time: every provider of a table runs in one process, in rounds (one step of each provider per round),
and the median per provider is reported with its ratio to the first provider -- load from other processes hits all
providers alike. Two clocks: wall time, and the process's CPU time (with one thread, the step's compute: time spent
descheduled by other jobs does not count, so it is the steadier figure on a shared machine; with several threads it
also counts their spinning). Memory: each provider again alone in a fresh subprocess, peak RSS (VmHWM) above the RSS
just before its first step.

* ``attention``: one attention call, forward+backward, B=4, H=8, D=64, causal, fp32 --
  ``sdpa`` (no cap) | ``eager_cap`` (plain PyTorch with a tanh cap, as Gemma 2's eager path) | ``qknorm_cap``
  (this package's tiled capped path) | ``qknorm_cap_recompute`` (the same with the tanh recomputed in backward, as
  calls above ``KEEP_TANH_MAX`` logits run) | and with per-head max-logit telemetry (QK-Clip's): ``qknorm_cap_max`` (the
  capped path, maxima from its own pass) | ``qknorm_max`` (no cap: the tiled path run for its maxima) |
  ``sdpa_side_max`` (no cap: sdpa, plus the maxima computed on the side as for other backends).
* ``model``: one training step (forward+backward) of a small Llama (4 layers, width 512, 8 heads of 64), B=4 --
  unpatched ``sdpa`` | ``qk_norm`` | ``qk_norm_cap`` | ``qkv_norm``.

Rows are appended to ``benchmarks/results/cpu.jsonl`` with the machine, versions and the command.

    python benchmarks/bench_cpu.py                       # both tables, T = 256, 1024, 2048
    python benchmarks/bench_cpu.py --table attention --seq 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
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


ATTENTION_PROVIDERS = (
    "sdpa",
    "eager_cap",
    "qknorm_cap",
    "qknorm_cap_recompute",
    "qknorm_cap_max",
    "qknorm_max",
    "sdpa_side_max",
)
MODEL_PROVIDERS = ("sdpa", "qk_norm", "qk_norm_cap", "qkv_norm")


def _attention_step(provider: str, seq: int):
    """One forward+backward of attention alone, B=4, H=8, D=64, causal, fp32."""
    import torch
    import torch.nn.functional as F

    from hf_qknorm.attention import chunked
    from hf_qknorm.attention.chunked import chunked_attention
    from hf_qknorm.modeling.telemetry import head_max_logits

    torch.manual_seed(0)
    b, h, d = 4, 8, 64
    q, k, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))

    def recompute():  # the capped path with its tanh recomputed in backward, as calls above KEEP_TANH_MAX are
        kept, chunked.KEEP_TANH_MAX = chunked.KEEP_TANH_MAX, 0
        try:
            return chunked_attention(q, k, v, scaling=d**-0.5, softcap=50.0, causal=True)
        finally:
            chunked.KEEP_TANH_MAX = kept

    def side_max():
        head_max_logits(q.detach(), k.detach(), None, scaling=d**-0.5, causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    fn = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "eager_cap": lambda: _eager_cap(q, k, v, d**-0.5, 50.0),
        "qknorm_cap": lambda: chunked_attention(q, k, v, scaling=d**-0.5, softcap=50.0, causal=True),
        "qknorm_cap_recompute": recompute,
        "qknorm_cap_max": lambda: chunked_attention(
            q, k, v, scaling=d**-0.5, softcap=50.0, causal=True, return_max_logits=True
        )[0],
        "qknorm_max": lambda: chunked_attention(q, k, v, scaling=d**-0.5, causal=True, return_max_logits=True)[0],
        "sdpa_side_max": side_max,
    }[provider]

    def step():
        fn().sum().backward()
        q.grad = k.grad = v.grad = None

    return step, {"batch": b, "heads": h, "head_dim": d}


def _model_step(provider: str, seq: int):
    """One training step (forward+backward) of a 4-layer width-512 Llama, B=4; same weights for every provider."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(cfg)
    if provider != "sdpa":
        hf_qknorm.patch_model(model, provider)
    ids = torch.randint(0, cfg.vocab_size, (4, seq))

    def step():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step, {"batch": 4, "layers": 4, "hidden": 512, "attn_impl": model.config._attn_implementation}


STEPS = {"attention": _attention_step, "model": _model_step}


def run_case(table: str, provider: str, seq: int, repeats: int) -> dict:
    """Peak memory (and a first timing) of one provider alone in this process."""
    step, info = STEPS[table](provider, seq)
    base = _rss_mib()
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "table": table,
        "provider": provider,
        "seq": seq,
        **info,
        "alone_s": min(times[1:]),
        "peak_mib": round(_peak_mib() - base, 1),
    }


def run_interleaved(table: str, seq: int, repeats: int) -> dict:
    """Median wall and CPU seconds of every provider's step, measured in rounds that run each provider once: load
    from other processes then hits all providers alike, so the ratios are trustworthy on a shared machine."""
    providers = ATTENTION_PROVIDERS if table == "attention" else MODEL_PROVIDERS
    steps = {p: STEPS[table](p, seq)[0] for p in providers}
    for step in steps.values():
        step()  # warm-up
    times = {p: [] for p in providers}
    for _ in range(repeats):
        for p, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times[p].append((time.perf_counter() - t0, time.process_time() - c0))
    return {p: [statistics.median(x[0] for x in t), statistics.median(x[1] for x in t)] for p, t in times.items()}


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's string elsewhere): rows from different machines are
    not comparable, and ``machine`` alone (``x86_64``) does not tell them apart."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment() -> dict:
    import torch
    import transformers

    return {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _child(args_list: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, *args_list], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=["attention", "model", "both"], default="both")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (median is reported)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's own)")
    ap.add_argument("--case", nargs=3, metavar=("TABLE", "PROVIDER", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--interleaved", nargs=2, metavar=("TABLE", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.case:  # child process: one provider alone (memory)
        table, provider, seq = args.case
        print(json.dumps(run_case(table, provider, int(seq), 1)))
        return
    if args.interleaved:  # child process: all providers of a table in rounds (time)
        table, seq = args.interleaved
        print(json.dumps(run_interleaved(table, int(seq), args.repeats)))
        return

    tables = ["attention", "model"] if args.table == "both" else [args.table]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    env = _environment()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{'table':9} {'provider':14} {'seq':>5} {'fwd+bwd s':>10} {'vs first':>8} {'cpu s':>8} {'cpu vs first':>12} "
        f"{'peak MiB':>9}"
    )
    for seq in args.seq:
        for table in tables:
            providers = ATTENTION_PROVIDERS if table == "attention" else MODEL_PROVIDERS
            try:
                threads = ["--threads", str(args.threads)] if args.threads else []
                medians = _child([*threads, "--repeats", str(args.repeats), "--interleaved", table, str(seq)])
            except RuntimeError as exc:
                print(f"{table:9} {'(all)':14} {seq:>5} FAILED: {exc}")
                continue
            for provider in providers:
                try:
                    row = _child([*threads, "--case", table, provider, str(seq)])
                except RuntimeError as exc:
                    print(f"{table:9} {provider:14} {seq:>5} FAILED: {exc}")
                    continue
                (wall, cpu), (wall0, cpu0) = medians[provider], medians[providers[0]]
                row.update(fwd_bwd_s=wall, vs_first=wall / wall0, cpu_s=cpu, cpu_vs_first=cpu / cpu0)
                print(
                    f"{table:9} {provider:14} {seq:>5} {wall:>10.3f} {row['vs_first']:>8.3f} {cpu:>8.3f} "
                    f"{row['cpu_vs_first']:>12.3f} {row['peak_mib']:>9.1f}",
                    flush=True,
                )
                with args.out.open("a") as f:
                    f.write(json.dumps({**row, **env, "repeats": args.repeats, "command": command}) + "\n")


if __name__ == "__main__":
    main()
