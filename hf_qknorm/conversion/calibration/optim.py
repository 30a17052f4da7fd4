"""The one training loop every fit of a conversion runs: Adam with each step size cosine-decayed to 0.

Calibration's layer-wise fit and distillation and healing's layer-wise and end-to-end stages differ in what they
train and in their loss, never in how they step; each passes its loss as a function of the step.
"""

from __future__ import annotations

import math

import torch


def _fused_device_types() -> set[str]:
    """The device types this torch has fused Adam kernels for, of CPU and CUDA (a private helper of torch's,
    read where it exists; else CUDA alone, which every supported torch fuses)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return {"cuda"}
    return {"cpu", "cuda"} & set(_get_fused_kernels_supported_devices())


def _fusable(groups: list[dict]) -> bool:
    """Whether torch's fused Adam takes these parameters: floating point, all on one CPU or CUDA device that this
    torch fuses on."""
    params = [p for group in groups for p in group["params"]]
    devices = {p.device for p in params}
    return (
        len(devices) == 1
        and next(iter(devices)).type in _fused_device_types()
        and all(p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for p in params)
    )


def cosine_adam(groups: list[dict], steps: int, loss, on_step=None) -> None:
    """``steps`` Adam steps (betas 0.9, 0.99) on the parameter ``groups`` (``{"params": [...], "lr": ...}``), each
    group's step size cosine-decayed from its ``lr`` to 0. ``loss(step)`` returns the step's loss (drawing its batch
    itself); ``on_step(step, loss)`` runs after each step. torch's fused Adam where it takes the parameters (one
    vectorised pass per tensor; the per-tensor loop costs a healing layer fit an eighth of its time on a CPU), the
    same update to rounding; else the plain one."""
    for group in groups:
        group["base_lr"] = group["lr"]
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99), fused=True if _fusable(groups) else None)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * 0.5 * (1 + math.cos(math.pi * step / steps))
        value = loss(step)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        if on_step is not None:
            on_step(step, value)


def scaled_groups(tensors: list, lr: float, scales: list | None = None) -> list[dict]:
    """Adam parameter groups for ``tensors`` with step size ``lr`` times each tensor's factor in ``scales`` (one per
    tensor; ``None``: all 1), tensors of one factor in one group."""
    groups: dict[float, list] = {}
    for tensor, scale in zip(tensors, [1.0] * len(tensors) if scales is None else scales, strict=True):
        groups.setdefault(float(scale), []).append(tensor)
    return [{"params": group, "lr": lr * scale} for scale, group in groups.items()]
