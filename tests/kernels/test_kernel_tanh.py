"""The cap's tanh in the kernels: ``tanh.approx.f32`` on NVIDIA GPUs for fp16/bf16, the exact tanh elsewhere.

On CPU: the switch (``HF_QKNORM_EXACT_TANH``), what ``kernels.tanh_mode()`` reports, the launchers' ``FAST_TANH`` flag
for every dtype and device, that every kernel computing a tanh receives it, and (without a GPU, through Triton's
compiler) that the flagged kernels compile for sm_90 with the instruction in them and no register spills. On a
GPU (``cuda`` marker): the capped logits' error stays within flash-attention's rule -- at most twice the error of the
same-dtype PyTorch reference -- for caps from 1 to 1e4, and so do the outputs and gradients.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_qknorm import kernels
from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.reference import attention_reference
from tests.kernels.conftest import DEVICE, INTERPRETED

ROOT = Path(__file__).resolve().parents[2]
TANH_KERNELS = {"_attn_fwd_kernel", "_attn_fwd_split_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}


@pytest.mark.parametrize(
    ("value", "exact"),
    [(None, False), ("", False), ("0", False), ("off", False), ("No", False), (" false ", False)]
    + [("1", True), ("on", True), (" TRUE ", True), ("yes", True)],
)
def test_exact_tanh_switch(monkeypatch, value, exact):
    if value is None:
        monkeypatch.delenv(kernels.EXACT_TANH_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.EXACT_TANH_ENV, value)
    assert kernels.exact_tanh_requested() is exact
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.tanh_mode() == ("exact" if exact else "approx")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.tanh_mode() == "exact"  # the interpreter cannot run inline assembly


@pytest.mark.parametrize("value", ["fast", "2", " exact "])
def test_exact_tanh_switch_refuses_an_unknown_value(monkeypatch, value):
    """Neither on nor off: one line naming the value and the valid ones, from the switch, ``hf-qknorm info``'s
    report and a launch's ``FAST_TANH`` flag -- rather than a guess that measures the other tanh."""
    monkeypatch.setenv(kernels.EXACT_TANH_ENV, value)
    monkeypatch.setattr(attn_mod, "_has_tanh_approx", lambda device: True)

    def launch():  # the launchers' flag for fp16 on a GPU with the instruction
        return attn_mod.fast_tanh(torch.float16, torch.device("cuda", 0), interpreted=False)

    for call in (kernels.exact_tanh_requested, kernels.tanh_mode, launch):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == (
            f"HF_QKNORM_EXACT_TANH={value!r} is not one of 0, off, false, no, 1, on, true, yes "
            "(or unset: tanh.approx.f32 for fp16/bf16 on NVIDIA GPUs)"
        )


@pytest.mark.parametrize("has_instruction", [True, False], ids=["sm75+", "no-instruction"])
def test_fast_tanh_flag(monkeypatch, has_instruction):
    """Only fp16/bf16 on a CUDA device that has the instruction, compiled, and not switched off."""
    monkeypatch.setattr(attn_mod, "_has_tanh_approx", lambda device: has_instruction)
    monkeypatch.delenv(kernels.EXACT_TANH_ENV, raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for dtype in (torch.float16, torch.bfloat16):
        assert attn_mod.fast_tanh(dtype, cuda, interpreted=False) is has_instruction
        assert not attn_mod.fast_tanh(dtype, cuda, interpreted=True)
        assert not attn_mod.fast_tanh(dtype, cpu, interpreted=True)
    assert not attn_mod.fast_tanh(torch.float32, cuda, interpreted=False)  # fp32 is for exactness
    monkeypatch.setenv(kernels.EXACT_TANH_ENV, "1")
    assert not attn_mod.fast_tanh(torch.bfloat16, cuda, interpreted=False)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records ``kernel[grid](*args, **kwargs)`` instead of launching."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, kwargs))


def _record(monkeypatch, flag, dtype):
    """Launch every path (general and decoding forward, backward) with ``fast_tanh`` answering ``flag``; returns the
    recorded launches and the arguments ``fast_tanh`` was asked about."""
    calls, asked = [], []
    for name in TANH_KERNELS | {"_attn_bwd_preprocess_kernel", "_attn_combine_kernel"}:
        monkeypatch.setattr(attn_mod, name, _Recorder(name, calls))

    def fake(*args):
        asked.append(args)
        return flag

    monkeypatch.setattr(attn_mod, "fast_tanh", fake)
    q = torch.zeros(1, 4, 8, 32, dtype=dtype, device=DEVICE)
    k = torch.zeros(1, 2, 8, 32, dtype=dtype, device=DEVICE)
    kw = dict(scaling=0.1, softcap=30.0, causal=True, sliding_window=5)
    out, lse = attn_mod.attn_fwd(q, k, k, **kw, decode=False)
    attn_mod.attn_fwd(q[:, :, :1], k, k, **kw, decode=True, num_splits=2)
    attn_mod.attn_bwd(out, q, k, k, out, lse.fill_(0.0), **kw)
    return calls, asked


@pytest.mark.parametrize("flag", [True, False])
def test_every_tanh_kernel_gets_the_flag(monkeypatch, flag):
    calls, asked = _record(monkeypatch, flag, torch.bfloat16)
    assert {name for name, _ in calls} >= TANH_KERNELS
    for name, kwargs in calls:
        if name in TANH_KERNELS:
            assert kwargs["FAST_TANH"] is flag, name
    # (the recorders are not interpreted kernels, so the launchers pass interpreted=False here)
    assert asked and all(a[0] == torch.bfloat16 and a[1].type == DEVICE for a in asked)


def test_interpreter_never_gets_the_instruction(monkeypatch):
    """The real flag under the interpreter: off for every dtype, even with the instruction claimed available."""
    if not INTERPRETED:
        pytest.skip("runs under Triton's interpreter")
    monkeypatch.setattr(attn_mod, "_has_tanh_approx", lambda device: True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert not attn_mod.fast_tanh(dtype, torch.device("cpu"), INTERPRETED)


# Compiles the FAST_TANH variants that a GPU runs (bf16 with a cap; causal + window, so every loop of the split is
# there; and the decoding forward) for sm_90 through Triton's whole pipeline, as scripts/compile_kernels.py does
# for the rest, and prints one JSON line per kernel.
_COMPILE = r"""
import json, sys
from unittest import mock
import torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import compile_kernels as ck
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_qknorm.kernels import attention

scenario = dict(dtype=torch.bfloat16, head_dim=128, softcap=30.0, window=256)
with mock.patch.object(attention, "fast_tanh", lambda dtype, device, interpreted: dtype != torch.float32):
    calls = ck.record_launches(scenario) + ck.record_launches(dict(scenario, decode=True, window=None))
for fn, args, kwargs in calls:
    if "FAST_TANH" not in kwargs:
        continue
    signature, constexprs, options = ck._signature(fn, args, kwargs)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    row = dict(kernel=fn.__name__, fast=kwargs["FAST_TANH"], tanh=compiled.asm["ptx"].count("tanh.approx.f32"))
    row.update(shared=compiled.metadata.shared, **ck._resource_usage(compiled.asm["cubin"]))
    print(json.dumps(row), flush=True)
"""


@pytest.mark.spawns
@pytest.mark.slow
def test_fast_tanh_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_QKNORM_EXACT_TANH")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(ROOT)], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows} == TANH_KERNELS
    for r in rows:
        assert r["fast"] and r["tanh"] > 0, r  # the instruction is in the code, not folded away
        assert r.get("local_bytes", 0) == 0, f"register spills: {r}"
        assert r["shared"] <= 232448, r  # sm_90's largest shared memory per block


# ------------------------------------------------------------------------------------------------ GPU only

CAPS = (1.0, 10.0, 50.0, 1e2, 1e3, 1e4)


def _capped_logits_from_lse(q, k, cap, scaling, decode):
    """The kernel's capped logits ``s[j, h, i]`` of query ``i`` and key ``j``, read from the LSE of a call where
    batch element ``j`` holds key ``j`` alone (so the LSE is that one logit)."""
    n = k.shape[2]
    qb = q.expand(n, -1, -1, -1).contiguous()
    kb = k[0].transpose(0, 1).unsqueeze(2).contiguous()  # (n, kv_heads, 1, head_dim)
    _, lse = attn_mod.attn_fwd(qb, kb, kb, scaling=scaling, softcap=cap, causal=False, decode=decode)
    return lse


@pytest.mark.cuda
@pytest.mark.parametrize("decode", [False, True], ids=["general", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_tanh_capped_logits_within_flash_rule_cuda(monkeypatch, dtype, decode):
    """Every capped logit of the hardware tanh is within 2x the error of PyTorch's same-dtype ``c * tanh(s / c)``
    (both against float64), at caps from 1 to 1e4 with logits spread over [-3c, 3c]; the exact mode (switched on
    by the environment) is more accurate still, which also shows that the switch reaches the GPU kernels."""
    monkeypatch.delenv(kernels.EXACT_TANH_ENV, raising=False)
    assert attn_mod.fast_tanh(dtype, torch.device("cuda"), False), "this GPU should get tanh.approx.f32"
    d, t, n, scaling = 64, 16 if decode else 128, 64, 1.0
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(1, 2, t, d, generator=g), torch.randn(1, 2, n, d, generator=g)
    for cap in CAPS:
        # scaling 1 and q.k of spread ~cap: the same-dtype reference's q @ k.T stays below fp16's 65504 at c = 1e4
        a = math.sqrt(cap / math.sqrt(d))
        q, k = (q0 * a).to("cuda", dtype), (k0 * a).to("cuda", dtype)
        s64 = scaling * (q.double() @ k.double().transpose(-1, -2))
        ref64 = (cap * torch.tanh(s64 / cap))[0].permute(2, 0, 1)  # (n, heads, t): the LSE's layout
        s = scaling * (q @ k.transpose(-1, -2))  # attention_reference's logits, in the inputs' dtype
        lowp = (cap * torch.tanh(s / cap))[0].permute(2, 0, 1)
        assert (s64.abs() > cap).double().mean() > 0.2, "the cap must engage"
        err_ref = (lowp.double() - ref64).abs().max().item()
        err_fast = (_capped_logits_from_lse(q, k, cap, scaling, decode).double() - ref64).abs().max().item()
        assert err_fast <= 2 * err_ref + 1e-6 * cap, (cap, err_fast, err_ref)
        monkeypatch.setenv(kernels.EXACT_TANH_ENV, "1")
        err_exact = (_capped_logits_from_lse(q, k, cap, scaling, decode).double() - ref64).abs().max().item()
        monkeypatch.delenv(kernels.EXACT_TANH_ENV)
        assert err_exact < err_fast, (cap, err_exact, err_fast)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_tanh_attention_within_flash_rule_cuda(monkeypatch, dtype):
    """Outputs and gradients with the hardware tanh, causal with a window (every loop of the split), at every cap:
    within flash-attention's rule with a cap (3x the same-dtype reference's error, + 1e-3). Logits spread over about
    2c where that is small, else over about 16, where the large caps test tanh's small arguments."""
    monkeypatch.delenv(kernels.EXACT_TANH_ENV, raising=False)
    d, t, scaling = 128, 700, 128**-0.5
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(2, h, t, d, generator=g) for h in (8, 2, 2, 8)]
    for cap in CAPS:
        a = math.sqrt(min(2 * cap, 16.0))  # scaling = d^-1/2: the logits' spread is a^2
        q, k = (base[0] * a).to("cuda", dtype), (base[1] * a).to("cuda", dtype)
        v, do = base[2].to("cuda", dtype), base[3].to("cuda", dtype)
        kw = dict(scaling=scaling, softcap=cap, causal=True, sliding_window=300)
        leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*leaves64, **kw)
        ref.backward(do.double())
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        lowp = attention_reference(*leaves, **kw)
        lowp.backward(do)
        out, lse = attn_mod.attn_fwd(q, k, v, **kw)
        grads = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw)
        for got, r, lo in zip((out, *grads), (ref, *(x.grad for x in leaves64)), (lowp, *(x.grad for x in leaves))):
            # fp16's own reference overflows in the backward at cap 1e4 (the tanh's gradient times the cap passes
            # 65504 in some rows): its error is taken where it has an answer; the kernel's everywhere, and finite
            finite = torch.isfinite(lo)
            assert torch.isfinite(got).all() and finite.double().mean() > 0.5, (cap, finite.double().mean())
            err, err_ref = (got.double() - r).abs().max().item(), (lo.double() - r)[finite].abs().max().item()
            assert err <= 3 * err_ref + 1e-3, (cap, err, err_ref)
