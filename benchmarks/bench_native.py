"""One capped decoding call through the native op (hf_qknorm/attention/_native.c), the lean path's ATen ops and sdpa
without a cap, side by side: microseconds per call, and each result's largest error against float64.

    python benchmarks/bench_native.py                       # one thread
    python benchmarks/bench_native.py --threads 2           # as dispatched: large calls keep the ATen ops
    python benchmarks/bench_native.py --threads 2 --no-thread-limit   # where native.PARALLEL_MAX comes from
    python benchmarks/bench_native.py --passes              # the tiled path's passes: nanoseconds per logit

The three are timed in interleaved rounds (50 calls each per round, best round kept), on the shapes (batch, heads,
kv_heads, keys, head_dim) below: the tiny test models', the bundled model's, a 12-head hidden-768 layer, a Llama-1B
layer with a long cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch

SHAPES = [(1, 4, 2, 64, 16), (1, 4, 2, 512, 16), (8, 4, 2, 512, 16), (1, 4, 2, 512, 32), (4, 4, 2, 512, 16),
          (1, 12, 12, 512, 64), (2, 12, 12, 512, 64), (4, 12, 12, 512, 64), (8, 12, 12, 512, 64),
          (1, 32, 8, 1024, 128)]  # fmt: skip


def _row(shape, cap: float, rounds: int) -> str:
    """The table row of one shape: microseconds per call, best of ``rounds`` interleaved rounds of 50 calls."""
    from hf_qknorm.attention import lean, native
    from hf_qknorm.reference import attention_reference

    batch, heads, kv_heads, keys, dim = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, heads, dim, generator=g).transpose(1, 2) * 3
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in "kv")
    kw = dict(scaling=dim**-0.5, softcap=cap, mask=None, causal=False, sliding_window=None)
    exact = attention_reference(q.double(), k.double(), v.double(), scaling=dim**-0.5, softcap=cap, causal=False)
    exact = exact.transpose(1, 2)

    def native_call():
        native.NATIVE[0] = native.MODULE
        return lean.lean_attention(q, k, v, **kw)

    def aten_call():
        native.NATIVE[0] = None
        return lean.lean_attention(q, k, v, **kw)

    def sdpa_call():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, enable_gqa=True)

    calls = {"native": native_call, "aten": aten_call, "sdpa": sdpa_call}
    errors = {name: (calls[name]().double() - exact).abs().max().item() for name in ("native", "aten")}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(50):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / 50 * 1e6)
    native.NATIVE[0] = native.MODULE
    return (
        f"| {batch}, {heads}, {kv_heads}, {keys}, {dim} | {best['native']:.1f} ({errors['native']:.1e}) | "
        f"{best['aten']:.1f} ({errors['aten']:.1e}) | {best['sdpa']:.1f} |"
    )


def _passes(rounds: int) -> None:
    """Nanoseconds per logit of the tiled path's native passes (chunked.py) on one tile of 16k logits (in cache) and
    one of 512k (the default tile, ``tiles.TILE_ELEMENTS``), rows of 512 logits, best of ``rounds`` calls; beside
    them ``torch.tanh`` and ``torch.exp2`` over the same tile, for scale."""
    from hf_qknorm.attention import native

    op, gain = native.MODULE, 50.0 * 1.4426950408889634  # cap 50's exponent scale
    print("nanoseconds per logit (one thread)")
    print("| logits | forward, tanh kept | forward | backward p, kept tanh | backward p, tanh recomputed | "
          "backward dS | torch.tanh | torch.exp2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in (1 << 14, 1 << 19):
        g = torch.Generator().manual_seed(1)
        x0 = (torch.rand(n, generator=g) - 0.5) * 8  # 2s/c of logits within +-2c
        rows, cols = n // 512, 512
        x, kept, p, slope, out = (torch.empty(1, rows, cols) for _ in range(5))
        x0 = x0.view(1, rows, cols)
        sums, neg_lse, delta = torch.empty(1, rows, 1), torch.full((1, rows, 1), -80.0), torch.full((1, rows, 1), 0.1)
        kept.copy_(torch.tanh(x0 / 2))
        calls = {
            "fk": partial(native.forward_tile, op, x, kept, sums, gain),
            "f": partial(native.forward_tile, op, x, None, sums, gain),
            "bk": partial(native.backward_p, op, kept, False, neg_lse, p, slope, gain),
            "br": partial(native.backward_p, op, x0, True, neg_lse, p, slope, gain),
            "ds": partial(native.backward_ds, op, out, p, slope, delta),
            "tanh": partial(torch.tanh, x0, out=out),
            "exp2": partial(torch.exp2, x0, out=out),
        }
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(rounds):
            for name, call in calls.items():
                x.copy_(x0)  # the forward writes over its input
                out.copy_(x0)
                start = time.perf_counter()
                call()
                best[name] = min(best[name], (time.perf_counter() - start) / n * 1e9)
        print(f"| {n} | " + " | ".join(f"{best[name]:.2f}" for name in calls) + " |")


def main(argv=None) -> int:
    from hf_qknorm.attention import native

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cap", type=float, default=5.0)
    parser.add_argument(
        "--no-thread-limit",
        action="store_true",
        help="the native op for every call, however large, with several threads too (native.PARALLEL_MAX lifted)",
    )
    parser.add_argument("--passes", action="store_true", help="time the tiled path's native passes instead")
    args = parser.parse_args(argv)
    for name, value in (("--threads", args.threads), ("--rounds", args.rounds), ("--cap", args.cap)):
        if not value > 0:
            parser.error(f"{name} must be positive; got {value}")
    if native.MODULE is None:
        print("the native op was not built here (no GCC or Clang at install time)", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    if args.passes:
        _passes(args.rounds)
        return 0
    limit = native.PARALLEL_MAX
    if args.no_thread_limit:
        native.PARALLEL_MAX = float("inf")
    limited = "" if args.no_thread_limit else " (as dispatched)"
    print(f"threads {args.threads}, cap {args.cap}: microseconds per call{limited}, max error against float64")
    print("| batch, heads, kv heads, keys, head dim | native op | ATen ops | sdpa, no cap |")
    print("|---|---|---|---|")
    try:
        for shape in SHAPES:
            print(_row(shape, args.cap, args.rounds))
    finally:
        native.PARALLEL_MAX = limit
    return 0


if __name__ == "__main__":
    sys.exit(main())
