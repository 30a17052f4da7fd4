"""The conversion's one training loop (hf_qknorm.conversion.calibration.optim.cosine_adam) against Adam written out
in float64: the step sizes' cosine decay, each group's own step size, and the fused update it takes where it can."""

from __future__ import annotations

import math

import pytest
import torch

from hf_qknorm.conversion.calibration import optim


def _reference(start: list[torch.Tensor], lrs: list[float], targets: list[torch.Tensor], steps: int):
    """Adam (betas 0.9, 0.99, eps 1e-8) with the cosine schedule, by hand, on the loss
    sum((p - t)^4 + (p - t)^2 / 2)."""
    params = [p.clone() for p in start]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        t = step + 1
        for i, (p, target) in enumerate(zip(params, targets)):
            g = 4 * (p - target) ** 3 + (p - target)  # d/dp of (p - target)^4 + (p - target)^2 / 2
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.99 * v[i] + 0.01 * g * g
            lr = lrs[i] * 0.5 * (1 + math.cos(math.pi * step / steps))
            params[i] = p - lr * (m[i] / (1 - 0.9**t)) / ((v[i] / (1 - 0.99**t)).sqrt() + 1e-8)
    return params


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cosine_adam_is_adam_with_the_cosine_schedule(dtype):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)]
    targets = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in start]
    lrs = [3e-2, 1e-2]  # two groups, each with its own step size
    params = [p.to(dtype).clone().requires_grad_() for p in start]
    steps = 25

    def loss(step):
        return sum(((p - t.to(dtype)) ** 4 + (p - t.to(dtype)) ** 2 / 2).sum() for p, t in zip(params, targets))

    seen = []
    optim.cosine_adam(optim.scaled_groups(params, 1e-2, [3.0, 1.0]), steps, loss, lambda s, v: seen.append(s))
    assert seen == list(range(steps))
    want = _reference(start, lrs, targets, steps)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, ref in zip(params, want):
        torch.testing.assert_close(got.detach().double(), ref, atol=tol, rtol=tol)
    assert (params[0].detach().double() - start[0]).abs().max() > 1e-2  # it moved


def test_fused_where_torch_takes_the_parameters(monkeypatch):
    made = []
    real = torch.optim.Adam
    monkeypatch.setattr(torch.optim, "Adam", lambda *a, **k: made.append(k) or real(*a, **k))
    p = torch.zeros(3, requires_grad=True)
    optim.cosine_adam([{"params": [p], "lr": 0.1}], 2, lambda step: (p - 1).pow(2).sum())
    assert made[-1]["fused"] is True
    assert optim._fusable([{"params": [torch.zeros(2)], "lr": 1.0}])
    assert not optim._fusable([{"params": [torch.zeros(2, device="meta")], "lr": 1.0}])


def test_a_torch_without_cpu_fused_adam_takes_the_plain_one(monkeypatch):
    monkeypatch.setattr(optim, "_fused_device_types", lambda: {"cuda"})
    assert not optim._fusable([{"params": [torch.zeros(2)], "lr": 1.0}])
    p = torch.zeros(3, requires_grad=True)
    optim.cosine_adam([{"params": [p], "lr": 0.1}], 2, lambda step: (p - 1).pow(2).sum())
    assert (p > 0).all()
