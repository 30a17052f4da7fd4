"""Capped attention on the GPU: hf_qknorm's Triton kernel beside the alternatives, in one run.

    python benchmarks/bench_attention.py                       # causal bf16, head_dim 64 and 128, T = 512 .. 16k
    python benchmarks/bench_attention.py --seqlens 1024 4096 --head-dims 128 --modes fwd+bwd

Providers (each skipped, with a note, where unavailable):
  eager-cap     plain PyTorch: q k^T, c*tanh(s/c), mask, softmax, @ v (materialises T x T logits; what Llama's
                `eager` path costs with a cap)
  sdpa          torch's scaled_dot_product_attention, NO cap: the speed of light for uncapped attention (its
                default pick of backend)
  sdpa-cudnn / sdpa-flash / sdpa-efficient
                the same, pinned to one backend (torch.nn.attention.sdpa_kernel), NO cap
  flex-cap      FlexAttention, torch.compile'd, tanh score_mod + causal block mask
  flash-cap     flash-attn's `softcap=` (flash_attn_func), where flash-attn is installed
  qknorm-triton hf_qknorm.kernels.qknorm_attn_func with the cap
  qknorm-nocap  the same kernel without the cap
Modes: fwd, bwd (backward alone, forward graph kept), fwd+bwd. The token count per step is fixed (batch =
tokens // T), so every row does the same useful work; TFLOP/s count causal FLOPs (half of 4*B*H*T^2*D forward,
2.5x that backward, as flash-attn's benchmarks do). Peak memory is the allocator's peak during the measured call,
above what the inputs already hold.

Rows are appended to benchmarks/results/attention_gpu.jsonl with the device name, torch/triton versions and the
date. Without a CUDA device the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "attention_gpu.jsonl"
PROVIDERS = (
    "eager-cap",
    "sdpa",
    "sdpa-cudnn",
    "sdpa-flash",
    "sdpa-efficient",
    "flex-cap",
    "flash-cap",
    "qknorm-triton",
    "qknorm-nocap",
)
UNCAPPED = ("sdpa", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "qknorm-nocap")
_SDPA_BACKENDS = {
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}
MODES = ("fwd", "bwd", "fwd+bwd")


def _eager_cap(q, k, v, scaling, cap):
    s = (q @ k.transpose(-1, -2)) * scaling
    s = cap * torch.tanh(s / cap)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def make_provider(name: str, q, k, v, scaling: float, cap: float):
    """``(fn, leaves)``: a zero-argument callable computing the attention output and the tensors it takes
    gradients for; or a string saying why the provider is unavailable."""
    if name == "eager-cap":
        return (lambda: _eager_cap(q, k, v, scaling, cap)), (q, k, v)
    if name == "sdpa":
        return (
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling),
            (q, k, v),
        )
    if name in _SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_BACKENDS[name])

        def pinned():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)

        return pinned, (q, k, v)
    if name == "flex-cap":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            return f"FlexAttention unavailable ({exc})"
        flex = torch.compile(flex_attention, dynamic=False)
        t = q.shape[2]
        block_mask = create_block_mask(
            lambda b, h, qi, ki: ki <= qi, B=None, H=None, Q_LEN=t, KV_LEN=t, device=q.device
        )

        def score_mod(score, b, h, qi, ki):
            return cap * torch.tanh(score / cap)

        return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling)), (q, k, v)
    if name == "flash-cap":
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            return "flash-attn is not installed"
        # flash-attn wants (batch, seq, heads, head_dim); the transposed views are made once, outside the timing.
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        return (lambda: flash_attn_func(qt, kt, vt, softmax_scale=scaling, causal=True, softcap=cap)), (qt, kt, vt)
    if name in ("qknorm-triton", "qknorm-nocap"):
        from hf_qknorm import kernels

        if not kernels.is_available():
            return kernels.unavailable_reason()
        softcap = cap if name == "qknorm-triton" else None
        return (lambda: kernels.qknorm_attn_func(q, k, v, scaling=scaling, softcap=softcap, causal=True)), (q, k, v)
    raise ValueError(name)


def sdpa_pick(q, k, v, scaling: float) -> str:
    """The backend sdpa's default dispatch picks for these inputs (causal, no mask), by name; "?" where torch cannot
    say."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scaling)
        names = {int(b.value): name for name, b in SDPBackend.__members__.items()}
        return names.get(int(choice), str(choice))
    except Exception:  # a private API: its absence must not stop the benchmark
        return "?"


def _time_ms(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(provider, leaves, mode: str, do, warmup: int, reps: int) -> tuple[float, float]:
    """(milliseconds, peak MiB above the baseline) for one provider and mode."""

    def clear():
        for t in leaves:
            t.grad = None

    if mode == "fwd":

        def fn():
            with torch.no_grad():
                provider()
    elif mode == "fwd+bwd":

        def fn():
            clear()
            provider().backward(do)
    else:
        out = provider()

        def fn():
            clear()
            out.backward(do, retain_graph=True)

    ms = _time_ms(fn, warmup, reps)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak


def causal_flops(batch, heads, t, d, mode: str) -> float:
    fwd = 4 * batch * heads * t * t * d / 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def _versions() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq_len, fixed across seq lengths")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: key/value heads (default: = heads)")
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON-lines file the rows are appended to")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "bench_attention: no CUDA device here, nothing to measure (the kernels' CPU path is the Triton "
            "interpreter, far too slow to time). Run this on a GPU machine."
        )
        return 0

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device("cuda")
    meta = {
        "device": torch.cuda.get_device_name(device),
        "capability": "sm{}{}".format(*torch.cuda.get_device_capability(device)),  # what delegation_table.py keys on
        **_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flash-attn {meta['flash_attn']}")
    print(f"{'provider':>14} {'mode':>8} {'D':>4} {'T':>6} {'B':>3} {'ms':>9} {'TFLOP/s':>8} {'peak MiB':>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for d in args.head_dims:
        heads = max(1, args.hidden // d)
        kv_heads = args.kv_heads or heads
        for t in args.seqlens:
            batch = max(1, args.tokens // t)
            g = torch.Generator(device=device).manual_seed(0)
            scaling = d**-0.5
            # logits ~ N(0, scale^4 * (d * scaling^2)) = N(0, softcap^2): most exceed softcap / 2, so the cap
            # is really exercised (its cost does not depend on the values, but its numerics do)
            scale = math.sqrt(args.softcap)
            q = (torch.randn(batch, heads, t, d, device=device, generator=g, dtype=dtype) * scale).requires_grad_()
            k = (torch.randn(batch, kv_heads, t, d, device=device, generator=g, dtype=dtype) * scale).requires_grad_()
            v = torch.randn(batch, kv_heads, t, d, device=device, generator=g, dtype=dtype).requires_grad_()
            do = torch.randn(batch, heads, t, d, device=device, generator=g, dtype=dtype)
            for name in args.providers:
                kk, vv = k, v
                if kv_heads != heads and (
                    name == "eager-cap" or name.startswith("sdpa")
                ):  # no native GQA in these paths
                    kk, vv = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
                provider = make_provider(name, q, kk, vv, scaling, args.softcap)
                for mode in args.modes:
                    row = {
                        **meta,
                        "provider": name,
                        "mode": mode,
                        "dtype": args.dtype,
                        "causal": True,
                        "head_dim": d,
                        "seq_len": t,
                        "batch": batch,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "softcap": None if name in UNCAPPED else args.softcap,
                    }
                    if name == "sdpa":
                        row["sdpa_backend"] = sdpa_pick(q, kk, vv, scaling)
                    if isinstance(provider, str):
                        row["skipped"] = provider
                    else:
                        try:
                            ms, peak = measure(*provider, mode, do, args.warmup, args.reps)
                            row.update(ms=ms, tflops=causal_flops(batch, heads, t, d, mode) / ms / 1e9, peak_mib=peak)
                        except torch.cuda.OutOfMemoryError:
                            row["skipped"] = "out of memory"
                        except Exception as exc:  # one failing provider must not lose the others' rows
                            row["skipped"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        torch.cuda.empty_cache()
                    shown = f"{name}({row['sdpa_backend']})" if "sdpa_backend" in row else name
                    if "ms" in row:
                        print(
                            f"{shown:>14} {mode:>8} {d:>4} {t:>6} {batch:>3} {row['ms']:>9.3f} "
                            f"{row['tflops']:>8.1f} {row['peak_mib']:>9.0f}"
                        )
                    else:
                        print(f"{name:>14} {mode:>8} {d:>4} {t:>6} {batch:>3}   skipped: {row['skipped']}")
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    sys.stdout.flush()
            del q, k, v, do
            torch.cuda.empty_cache()
    print(f"# rows appended to {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
