"""Every positive float32 through the built native op's tanh (``hf_qknorm/attention/_native.c``, ``tanh_f``), against
float64 ``tanh``: the largest error in ulp (float32's spacing at the true value), and that the result is odd to the
bit, never past 1, ``x`` itself for tiny ``x`` and exactly 1 from the clamp on. The op's forward pass keeps the tanh
it computes, so this reads the tanh of the code as compiled and dispatched on this machine (on x86-64 with AVX2 and
FMA its x86-64-v3 clone). About four minutes on two cores; the tests check a dense grid of the same
(tests/attention/test_native.py).

    python scripts/check_native_tanh.py          # exit 1 if any check fails
"""

from __future__ import annotations

import sys

import torch

from hf_qknorm.attention import native

CHUNK = 1 << 24
CLAMP = 9.01091385  # the least float32 whose tanh rounds to 1 (_native.c)
BOUND = 2.0  # ulp


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """The op's tanh of ``x`` (float32): its forward pass reads 2x and keeps tanh(x)."""
    doubled, kept, sums = (2 * x).reshape(1, 1, -1), torch.empty(1, 1, x.numel()), torch.empty(1, 1, 1)
    native.forward_tile(native.MODULE, doubled, kept, sums, 1.0)
    return kept.view(-1)


def main() -> int:
    if native.MODULE is None:
        print("check_native_tanh: the native op is not built here", file=sys.stderr)
        return 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    worst, where, failures = 0.0, 0.0, []
    top = 0x7F800000  # +inf's bits: every positive finite float32 below
    for start in range(1, top, CHUNK):
        bits = torch.arange(start, min(start + CHUNK, top), dtype=torch.int64).to(torch.int32)
        x = bits.view(torch.float32)
        x = x[2 * x < float("inf")]  # the pass reads 2x: above 1.7e38 that is inf, whose tanh is checked below
        if x.numel() == 0:
            continue
        t = _tanh(x)
        exact = torch.tanh(x.double())
        spacing = torch.nextafter(exact.float().abs(), torch.tensor(float("inf"))) - exact.float().abs()
        ulps = (t.double() - exact).abs() / spacing.double()
        i = int(ulps.argmax())
        if ulps[i] > worst:
            worst, where = float(ulps[i]), float(x[i])
        if not torch.equal(_tanh(-x), -t):
            failures.append(f"not odd near x = {float(x[0]):.9g}")
        if (t.abs() > 1).any():
            failures.append(f"past 1 near x = {float(x[0]):.9g}")
        tiny = x < 2.0**-12
        if not torch.equal(t[tiny], x[tiny]):
            failures.append("tanh(x) != x for tiny x")
        if not (t[x >= CLAMP] == 1).all():
            failures.append("not exactly 1 past the clamp")
    specials = _tanh(torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0]))
    if not (specials[0] == 1 and specials[1] == -1 and specials[2].isnan() and specials[3] == 0):
        failures.append(f"special values: {specials.tolist()}")
    print(f"largest error {worst:.4f} ulp at x = {where:.9g} (bound {BOUND})")
    if worst > BOUND:
        failures.append(f"{worst:.4f} ulp is past the bound")
    for failure in failures[:20]:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
