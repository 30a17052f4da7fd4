"""The per-head norms on the GPU: the fused Triton kernels (hf_qknorm.kernels.norms) beside the norm modules' own
ATen path, forward and forward+backward, in one run.

    python benchmarks/bench_norms.py                                  # bf16, T = 2048 and 8192, head_dim 64 and 128
    python benchmarks/bench_norms.py --tiles 4096:2048:4:8 8192:4096:8:8  # tile variants of the kernels

The input is shaped as a query projection's output, ``(batch, T, heads, head_dim)`` with ``heads * head_dim =
--hidden`` and ``batch * T = --tokens``; every kind the kernels have (rmsnorm, layernorm, lp with p = 2 and a logit
scale), weights in the input's dtype as in a model cast to it. Providers: ``aten`` (the module's forward, what a
patched model runs without ``HF_QKNORM_FUSED_NORMS=1``) and ``fused`` at each ``--tiles`` variant
``FWD_ELEMENTS:BWD_ELEMENTS:BWD_PROGRAMS_PER_SM:NUM_WARPS`` (without --tiles: the committed setting). Each row gives
milliseconds, GB/s over the bytes the call must move (forward: x read, y written; backward: x and dy read, dx
written) and the fused result's largest difference from the module's (forward output, input gradient).

Rows are appended to benchmarks/results/norms_gpu.jsonl with the device name, versions and date. Without a CUDA
device the script says so and exits 0, unless ``--device cpu`` under ``TRITON_INTERPRET=1`` (the tests: the plumbing
at a tiny size, nothing timed that means anything, nothing saved unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "norms_gpu.jsonl"
KINDS = ("rmsnorm", "layernorm", "lp")
MODES = ("fwd", "fwd+bwd")
# the module constants of hf_qknorm.kernels.norms a --tiles variant sets, in its order
TILE_SETTINGS = ("TILE_ELEMENTS_FWD", "TILE_ELEMENTS_BWD", "BWD_PROGRAMS_PER_SM", "NUM_WARPS")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tile_variant(text: str) -> dict[str, int]:
    """``FWD_ELEMENTS:BWD_ELEMENTS:BWD_PROGRAMS_PER_SM:NUM_WARPS`` as the kernels' module constants."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"tile variant {text!r} is not FWD_ELEMENTS:BWD_ELEMENTS:BWD_PROGRAMS_PER_SM:NUM_WARPS (four positive "
            "integers, e.g. 4096:2048:4:4)"
        )
    return dict(zip(TILE_SETTINGS, values))


def make_norm(kind: str, head_dim: int, dtype: torch.dtype, device) -> torch.nn.Module:
    from hf_qknorm.portable.norms import HeadLayerNorm, HeadLpNorm, HeadRMSNorm

    torch.manual_seed(0)
    if kind == "rmsnorm":
        norm = HeadRMSNorm(head_dim, 1e-6)
    elif kind == "layernorm":
        norm = HeadLayerNorm(head_dim, 1e-5)
    else:
        norm = HeadLpNorm(head_dim, 2.0, 1e-6, "logit", init=4.0)
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return norm.to(device=device, dtype=dtype)


def fused(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm through the kernels, as the router (hf_qknorm.attention.fused_norms) sends it there; the kernel policy
    in force must send ``x``'s device to the kernels (``main`` sets it)."""
    from hf_qknorm.attention.fused_norms import fused_head_norm

    out = fused_head_norm(norm, x)
    if out is None:
        raise RuntimeError(f"the fused norms do not take {type(norm).__name__} on {x.device} {x.dtype}")
    return out


def _grad(call, x, dy):
    return torch.autograd.grad(call(), [x], dy)


def _time_ms(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after ``warmup`` calls: CUDA events on a GPU (as
    bench_attention.py times), the wall clock on the CPU (the interpreter: nothing to compare)."""
    if cuda:
        from bench_attention import _time_ms as cuda_ms  # this folder's, beside the script

        return cuda_ms(fn, warmup, reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _versions() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=8192, help="batch * T, fixed across lengths")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--tiles", type=tile_variant, nargs="+", default=None, help="fused-kernel tile variants")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON-lines file for the rows (default {RESULTS})")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_norms: no CUDA device here, nothing to measure. Run this on a GPU machine.")
        return 0
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_norms: --device cpu runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
        return 2
    out_path = args.out if args.out is not None else (RESULTS if cuda else None)
    from hf_qknorm.kernels import norms as kernels

    committed = {name: getattr(kernels, name) for name in TILE_SETTINGS}
    variants = args.tiles or [committed]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    meta = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
        **_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_norms.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}")
    print(f"{'kind':>9} {'provider':>24} {'mode':>7} {'D':>4} {'T':>6} {'ms':>8} {'GB/s':>7} {'max diff':>9}")
    rows = []
    from hf_qknorm.attention import kernel_policy

    try:
        with kernel_policy(devices=(device.type,)):
            _measure(args, kernels, variants, committed, device, dtype, cuda, meta, rows, out_path)
    finally:
        for attr, value in committed.items():
            setattr(kernels, attr, value)
    if out_path is not None:
        print(f"# {len(rows)} rows appended to {out_path}")
    return 0


def _measure(args, kernels, variants, committed, device, dtype, cuda, meta, rows, out_path) -> None:
    """Every (head_dim, T, kind) cell: the module, then the kernels at each variant, in each mode."""
    for d, t, kind in itertools.product(args.head_dims, args.seqlens, args.kinds):
        heads, batch = max(1, args.hidden // d), max(1, args.tokens // t)
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(batch, t, heads, d, device=device, generator=g, dtype=dtype).requires_grad_()
        dy = torch.randn(batch, t, heads, d, device=device, generator=g, dtype=dtype)
        size = x.numel() * x.element_size()
        norm = make_norm(kind, d, dtype, device)
        want = norm(x)
        (want_dx,) = torch.autograd.grad(want, [x], dy)
        providers = [("aten", None)] + [("fused " + ":".join(map(str, v.values())), v) for v in variants]
        for name, variant in providers:
            for attr, value in (variant or committed).items():
                setattr(kernels, attr, value)
            call = functools.partial(norm, x) if variant is None else functools.partial(fused, norm, x)
            diff = None
            if variant is not None:
                got = call()
                (got_dx,) = torch.autograd.grad(got, [x], dy)
                diff = max((got - want).abs().max().item(), (got_dx - want_dx).abs().max().item())
            for mode in args.modes:
                fn = call if mode == "fwd" else functools.partial(_grad, call, x, dy)
                ms = _time_ms(fn, args.warmup, args.reps, cuda)
                moved = (2 if mode == "fwd" else 5) * size
                row = {**meta, "kind": kind, "provider": name, "mode": mode, "dtype": args.dtype, "head_dim": d,
                       "seq_len": t, "batch": batch, "heads": heads, "ms": ms, "gbps": moved / ms / 1e6,
                       "max_diff_vs_aten": diff}  # fmt: skip
                if variant is not None:
                    row["tiles"] = variant
                rows.append(row)
                if out_path is not None:  # row by row: a run cut off by its time limit keeps its rows
                    out_path.parent.mkdir(parents=True, exist_ok=True)
                    with open(out_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                shown = "-" if diff is None else f"{diff:.2e}"
                print(f"{kind:>9} {name:>24} {mode:>7} {d:>4} {t:>6} {ms:>8.3f} {row['gbps']:>7.0f} {shown:>9}")
                sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
