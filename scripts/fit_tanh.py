"""Fit the small-|x| polynomial of the Triton kernels' tanh (``hf_qknorm/kernels/_attention_kernels.py``, ``_tanh``).

tanh(x) = x + x z P(z) with z = x^2 on |x| < SPLIT, P of degree DEGREE, chosen to minimise the largest *relative*
error of tanh (Lawson's algorithm: iteratively reweighted least squares converges to the minimax fit). Prints the
coefficients rounded to float32 and the largest relative error of the whole kernel formula evaluated in float32
(numpy, as Triton's interpreter computes it) against float64 ``tanh`` over 1e-30 <= |x| <= 30.

    python scripts/fit_tanh.py
"""

from __future__ import annotations

import numpy as np

SPLIT, DEGREE = 0.55, 4


def fit(split: float = SPLIT, degree: int = DEGREE, iterations: int = 200) -> tuple[np.ndarray, float]:
    x = np.linspace(1e-4, split, 20001)
    z = x * x
    t = np.tanh(x)
    target = (t / x - 1) / z  # P(z) should equal this
    to_relative = x * z / t  # an error e in P is an error e * x z / tanh(x) in tanh, relatively
    basis = np.vander(z, degree + 1, increasing=True)
    weights = np.ones_like(z)
    for _ in range(iterations):
        w = np.sqrt(weights) * to_relative
        coef, *_ = np.linalg.lstsq(basis * w[:, None], target * w, rcond=None)
        err = np.abs((basis @ coef - target) * to_relative)
        weights = weights * err
        weights /= weights.sum()
    return coef, float(err.max())


def kernel_tanh(x: np.ndarray, coef: np.ndarray, split: float = SPLIT) -> np.ndarray:
    """The kernel's formula, in float32."""
    x = np.asarray(x, np.float32)
    c = coef.astype(np.float32)
    a = np.abs(x)
    small = a < np.float32(split)
    s = np.where(small, a, np.float32(0))
    z = s * s
    p = c[-1]
    for ci in c[-2::-1]:
        p = p * z + ci
    e = np.exp(np.float32(-2) * a)
    t = np.where(small, s + s * z * p, (np.float32(1) - e) / (np.float32(1) + e))
    return np.where(x < 0, -t, t).astype(np.float32)


def main() -> None:
    coef, err = fit()
    print(f"split {SPLIT}, degree {DEGREE}: minimax relative error {err:.2e} in exact arithmetic")
    for i, c in enumerate(coef.astype(np.float32)):
        print(f"TANH_P{i} = tl.constexpr({float(c)!r})")
    x = np.concatenate([np.logspace(-30, np.log10(30), 2_000_001), -np.logspace(-12, 1, 1001)]).astype(np.float32)
    ref = np.tanh(x.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(kernel_tanh(x, coef) - ref) / np.abs(ref)
    print(f"float32 evaluation: largest relative error {rel.max():.2e} ({rel.max() / 2**-24:.1f} x 2^-24)")


if __name__ == "__main__":
    main()
