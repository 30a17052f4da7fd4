"""Triton kernels against the float64 reference (hf_qknorm.reference).

Without CUDA the kernels run on CPU under Triton's interpreter (tests/kernels/conftest.py says how it is chosen).
With CUDA the same tests run the compiled kernels on the GPU, and the ``cuda``-marked tests add bf16/fp16 and larger
shapes, judged by flash-attention's rule: the kernel's error against the fp64 reference is at most 2x (3x with a
cap) that of the same-dtype PyTorch reference, plus a small atol.

Shapes are small on purpose (the interpreter costs a few ms per tile pair) but cover every path: odd lengths
(1, 17, 113, 255), tiles smaller than and misaligned with the sequence, GQA/MQA, head_dim 16/64/80/96/256,
bottom-right causality with q_len < kv_len and q_len > kv_len, sliding windows, dense and per-head masks with
fully masked rows, packed sequences, a cap that really engages, the LSE output and its gradient, and both forward
kernels (general, and GQA-packed split-KV for decoding shapes).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.kernels import attn_interface as api
from hf_qknorm.reference import attention_reference
from tests.kernels.conftest import DEVICE

FP32_TOL = 1e-4  # max error relative to the largest reference value; measured ~1e-6 under the interpreter


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, with max |ref| floored at 0.1: a gradient that is exactly 0 in fp64 (e.g. dq
    when a row attends to one key) comes out as fp32 rounding noise, ~1e-8, which is not an error."""
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(0.1)).item()


def _qkv(b, h, hkv, tq, tk, d, *, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g) * scale
    k = torch.randn(b, hkv, tk, d, generator=g) * scale
    v = torch.randn(b, hkv, tk, d, generator=g)
    do = torch.randn(b, h, tq, d, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v, do)]


def _reference(q, k, v, do, **kw):
    """Output and (dq, dk, dv) of the float64 reference."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, **kw)
    out.backward(do.double())
    return out.detach(), [t.grad for t in leaves]


def _call(q, k, v, **kw):
    """The public entry point for the call's shape: varlen when ``cu_seqlens_q`` is given, else padded."""
    if "cu_seqlens_q" in kw:
        cu = kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_k")
        return api.qknorm_attn_varlen_func(
            q, k, v, *cu, kw.pop("max_seqlen_q", None), kw.pop("max_seqlen_k", None), **kw
        )
    return api.qknorm_attn_func(q, k, v, **kw)


def _kernel(q, k, v, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = _call(*leaves, **kw)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves]


def _cap_fraction(q, k, scaling, softcap):
    """Fraction of logits with |s| > softcap / 2: the cap must really bend the logits for the test to mean much."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = scaling * (q.double() @ k.double().transpose(-1, -2))
    return (s.abs() > softcap / 2).double().mean().item()


# (batch, heads, kv_heads, q_len, kv_len, head_dim, causal, softcap, window, blocks)
CASES = {
    "causal-17": (2, 2, 2, 17, 17, 64, True, None, None, None),
    "gqa-cap-113-d80": (1, 4, 2, 113, 113, 80, True, 5.0, None, None),
    "mqa-cap-noncausal-255": (1, 2, 1, 255, 255, 64, False, 10.0, None, None),
    "decode-1x113-cap": (2, 4, 2, 1, 113, 64, True, 5.0, None, None),
    "chunk-17x113-d96": (1, 2, 1, 17, 113, 96, True, None, None, (16, 32)),
    "more-queries-113x17": (1, 2, 2, 113, 17, 64, True, 5.0, None, None),
    "window-causal-cap": (1, 2, 1, 113, 113, 64, True, 5.0, 20, (16, 32)),
    "window-noncausal": (1, 2, 2, 113, 80, 64, False, None, 33, (32, 16)),
    "d16-len1": (1, 1, 1, 1, 1, 16, True, None, None, None),
    "d256-cap": (1, 2, 1, 17, 17, 256, False, 5.0, None, None),
}


@pytest.fixture(params=["separate", "atomic"])
def bwd_mode(request, monkeypatch):
    """Both ways of computing dQ (its own pass, or atomic adds from the dK/dV program), forced whatever the tile
    table says, on every path that reaches ``attn_bwd`` (the autograd of the public entry points included)."""
    monkeypatch.setattr(attn_mod, "_bwd_mode", lambda *args: request.param)
    return request.param


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_matches_reference(case, bwd_mode):
    b, h, hkv, tq, tk, d, causal, cap, window, blocks = CASES[case]
    scaling = d**-0.5
    # |s| ~ scale^2 for unit-variance inputs and scaling = d^-1/2: sqrt(cap) puts the logits well into the tanh
    q, k, v, do = _qkv(b, h, hkv, tq, tk, d, scale=math.sqrt(cap) if cap else 1.0, seed=len(case))
    if cap:
        assert _cap_fraction(q, k, scaling, cap) > 0.3
    kw = dict(scaling=scaling, softcap=cap, causal=causal, sliding_window=window)
    ref, ref_grads = _reference(q, k, v, do, **kw)
    if blocks:  # tiles smaller than / misaligned with the sequence: exercises every block-edge path
        leaves = [t.detach().clone() for t in (q, k, v)]
        out, lse = attn_mod.attn_fwd(*leaves, **kw, block_m=blocks[0], block_n=blocks[1])
        grads = attn_mod.attn_bwd(do, *leaves, out, lse, **kw, block_m=blocks[0], block_n=blocks[1])
    else:
        out, grads = _kernel(q, k, v, do, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_err(out, ref) < FP32_TOL
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has non-finite values"
        assert _rel_err(g, r) < FP32_TOL, f"d{name}"
    if tq > tk and causal:  # bottom-right alignment: the first tq - tk queries see no key at all
        assert (out[:, :, : tq - tk] == 0).all()


DECODE_CASES = {  # (batch, heads, kv_heads, q_len, kv_len, causal, softcap, window, with_mask, decode, num_splits)
    "split-kv-gqa8-cap-mask": (2, 8, 1, 1, 200, True, 5.0, None, True, True, 3),
    "split-kv-spec-window": (1, 4, 2, 5, 150, True, 5.0, 40, False, True, 5),
    "general-kernel-q1": (2, 4, 2, 1, 113, True, 5.0, None, True, False, None),
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_attention_decode_paths(case):
    """The GQA-packed split-KV forward (used automatically when q_len * heads / kv_heads <= 64) and the general
    forward agree with the reference on decoding shapes, and the backward works from either's LSE."""
    b, h, hkv, tq, tk, causal, cap, window, with_mask, decode, splits = DECODE_CASES[case]
    q, k, v, do = _qkv(b, h, hkv, tq, tk, 64, scale=math.sqrt(cap), seed=21)
    mask = _padding_mask(b, tq, tk, [0, 150][:b]) if with_mask else None
    kw = dict(scaling=0.125, softcap=cap, causal=causal, sliding_window=window, attn_mask=mask)
    ref, ref_grads = _reference(
        q, k, v, do, scaling=0.125, softcap=cap, causal=causal, sliding_window=window, mask=mask
    )
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, decode=decode, num_splits=splits)
    assert _rel_err(out, ref) < FP32_TOL
    for g, r in zip(attn_mod.attn_bwd(do, q, k, v, out, lse, **kw), ref_grads):
        assert _rel_err(g, r) < FP32_TOL


def test_attention_noncontiguous_inputs():
    """Transformers hands over (batch, seq, heads, head_dim).transpose(1, 2) views: read in place, same result."""
    q, k, v, do = _qkv(2, 4, 2, 33, 33, 64, scale=2.0)
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    assert not qt.is_contiguous()
    kw = dict(scaling=0.125, softcap=4.0, causal=True)
    ref, ref_grads = _reference(q, k, v, do, **kw)
    out, grads = _kernel(qt, kt, vt, dot, **kw)
    assert _rel_err(out, ref) < FP32_TOL
    assert all(_rel_err(g, r) < FP32_TOL for g, r in zip(grads, ref_grads))


def _padding_mask(b, tq, tk, pads):
    """sdpa-style key-padding mask (batch, 1, 1, kv_len) with ``pads[i]`` left-padding keys in row i."""
    m = torch.ones(b, 1, 1, tk, dtype=torch.bool)
    for i, p in enumerate(pads):
        m[i, ..., :p] = False
    return m.to(DEVICE)


@pytest.mark.parametrize("mask_kind", ["padding-broadcast", "dense-fully-masked-rows", "per-head"])
def test_attention_dense_mask(mask_kind, bwd_mode):
    b, h, hkv, t, d, cap = 2, 4, 2, 40, 64, 5.0
    q, k, v, do = _qkv(b, h, hkv, t, t, d, scale=math.sqrt(cap), seed=3)
    g = torch.Generator().manual_seed(7)
    causal = mask_kind == "padding-broadcast"
    if mask_kind == "padding-broadcast":
        mask = _padding_mask(b, t, t, [0, 13])  # left padding; causal on top, as for a batch of prompts
    elif mask_kind == "dense-fully-masked-rows":
        mask = torch.rand(b, 1, t, t, generator=g) > 0.4
        mask[0, 0, 5] = False
        mask[1, 0, -1] = False
        mask = mask.to(DEVICE)
    else:
        mask = (torch.rand(b, h, t, t, generator=g) > 0.5).to(DEVICE)
    kw = dict(scaling=d**-0.5, softcap=cap, causal=causal, attn_mask=mask)
    ref, ref_grads = _reference(q, k, v, do, scaling=d**-0.5, softcap=cap, causal=causal, mask=mask)
    out, grads = _kernel(q, k, v, do, **kw)
    assert _rel_err(out, ref) < FP32_TOL
    for g_, r in zip(grads, ref_grads):
        assert torch.isfinite(g_).all() and _rel_err(g_, r) < FP32_TOL
    if mask_kind == "dense-fully-masked-rows":
        assert (out[0, :, 5] == 0).all() and (out[1, :, -1] == 0).all()
        assert (grads[0][0, :, 5] == 0).all()


@pytest.mark.parametrize("window", [None, 7])
def test_attention_varlen(window, bwd_mode):
    """Packed sequences = each sequence attended alone; lengths include 1 and 0, q_len != kv_len per sequence,
    and trailing rows past cu_seqlens[-1] that belong to no sequence (zero output, zero gradient)."""
    lens_q, lens_k = [17, 1, 40, 0, 5], [20, 11, 40, 3, 5]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    total_q, total_k = sum(lens_q) + 3, sum(lens_k)
    cap = 5.0
    q, k, v, do = _qkv(1, 4, 2, total_q, total_k, 64, scale=math.sqrt(cap), seed=11)
    out, (dq, dk, dv) = _kernel(
        q,
        k,
        v,
        do,
        scaling=0.125,
        softcap=cap,
        causal=True,
        sliding_window=window,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(lens_q),
    )
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if qe == qs:
            continue
        ref, (rq, rk, rv) = _reference(
            q[:, :, qs:qe],
            k[:, :, ks:ke],
            v[:, :, ks:ke],
            do[:, :, qs:qe],
            scaling=0.125,
            softcap=cap,
            causal=True,
            sliding_window=window,
        )
        assert _rel_err(out[:, :, qs:qe], ref) < FP32_TOL, f"sequence {i}"
        assert _rel_err(dq[:, :, qs:qe], rq) < FP32_TOL
        assert _rel_err(dk[:, :, ks:ke], rk) < FP32_TOL
        assert _rel_err(dv[:, :, ks:ke], rv) < FP32_TOL
    assert (out[:, :, sum(lens_q) :] == 0).all() and (dq[:, :, sum(lens_q) :] == 0).all()


def test_attention_lse_and_its_gradient(bwd_mode):
    """The forward's LSE equals logsumexp of the masked, capped logits (+inf on empty rows), and a gradient
    flowing into it is honoured."""
    q, k, v, do = _qkv(1, 2, 1, 20, 12, 32, scale=2.0, seed=5)
    cap, scaling = 4.0, 32**-0.5
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.hf_qknorm.attn_fwd(*leaves, None, None, None, 20, 12, scaling, cap, True, None)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = cap * torch.tanh(scaling * ref_leaves[0] @ ref_leaves[1].repeat_interleave(2, 1).transpose(-1, -2) / cap)
    allowed = torch.arange(12)[None, :] <= torch.arange(20)[:, None] - 8
    ref_lse = s.masked_fill(~allowed.to(DEVICE), float("-inf")).logsumexp(-1)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4
    assert (lse[~finite] == float("inf")).all()
    weights = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ((out * do).sum() + (lse.nan_to_num(posinf=0.0) * weights).sum()).backward()
    ref_out = attention_reference(*ref_leaves, scaling=scaling, softcap=cap, causal=True)
    ((ref_out * do.double()).sum() + (ref_lse.nan_to_num(posinf=0.0, neginf=0.0) * weights).sum()).backward()
    for a, r in zip(leaves, ref_leaves):
        assert _rel_err(a.grad, r.grad) < FP32_TOL


def _flash_rule(kernel_val, ref64, lowp_ref, factor, atol):
    err_kernel = (kernel_val.double() - ref64).abs().max().item()
    err_torch = (lowp_ref.double() - ref64).abs().max().item()
    assert err_kernel <= factor * err_torch + atol, (err_kernel, err_torch)


def _check_low_precision(dtype, b, h, hkv, tq, tk, d, causal, cap, seed=0, **extra):
    q, k, v, do = _qkv(b, h, hkv, tq, tk, d, scale=math.sqrt(cap) if cap else 1.0, dtype=dtype, seed=seed)
    kw = dict(scaling=d**-0.5, softcap=cap, causal=causal, **extra)
    ref_kw = {("mask" if key == "attn_mask" else key): val for key, val in kw.items()}
    ref, ref_grads = _reference(q, k, v, do, **ref_kw)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lowp = attention_reference(*leaves, **ref_kw)  # the same-dtype PyTorch computation
    lowp.backward(do)
    out, grads = _kernel(q, k, v, do, **kw)
    assert out.dtype == dtype
    factor = 3.0 if cap else 2.0
    _flash_rule(out, ref, lowp, factor, 1e-3)
    for g, r, lg in zip(grads, ref_grads, (t.grad for t in leaves)):
        _flash_rule(g, r, lg, factor, 1e-3)


CAPS = (30.0, 1e2, 1e3, 1e4, 1e5, 1e6)  # up to schemes.MAX_SOFTCAP, the largest cap accepted


@pytest.mark.parametrize("decode", [False, True], ids=["general", "split-kv"])
def test_cap_is_exact_at_every_size(decode):
    """With a large cap c, ``c * tanh(s / c)`` is ``s`` to float32 precision only if tanh is accurate *relative to
    its small argument*: ``2 * sigmoid(2x) - 1`` leaves an absolute error ~1e-7 in tanh, i.e. ~1e-7 c in the logit
    (0.12 at c = 1e6 on an H100). The kernel's error against float64 must stay within flash-attention's rule at
    every accepted cap, forward and backward, and not grow with the cap."""
    tq = 1 if decode else 32
    q, k, v, do = _qkv(1, 2, 1, tq, 32, 64, scale=2.0, seed=13)  # logits up to ~15: the cap bends them at c = 30
    errors = []
    for cap in CAPS:
        kw = dict(scaling=0.125, softcap=cap, causal=True)
        ref, ref_grads = _reference(q, k, v, do, **kw)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        lowp = attention_reference(*leaves, **kw)  # the float32 PyTorch computation (torch.tanh)
        lowp.backward(do)
        out, lse = attn_mod.attn_fwd(q, k, v, **kw, decode=decode)
        grads = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw)
        for got, r, lg in zip((out, *grads), (ref, *ref_grads), (lowp, *(t.grad for t in leaves))):
            _flash_rule(got, r, lg, 3.0, 2e-6)
        errors.append((out.double() - ref).abs().max().item())
    assert max(errors) <= 4 * errors[0] + 1e-6, dict(zip(CAPS, errors))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_low_precision_small(dtype, bwd_mode):
    """bf16/fp16 inputs on a small case (the GPU tests below cover larger ones)."""
    _check_low_precision(dtype, 1, 4, 2, 33, 33, 64, True, 5.0)


def test_attention_errors():
    q, k, v, _ = _qkv(1, 4, 2, 8, 8, 64)
    f = api.qknorm_attn_func
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        f(q, k[:, :1].expand(1, 3, 8, 64), v[:, :1].expand(1, 3, 8, 64), scaling=0.1)
    with pytest.raises(TypeError, match="boolean"):
        f(q, k, v, scaling=0.1, attn_mask=torch.zeros(1, 1, 8, 8, device=DEVICE))
    with pytest.raises(ValueError, match="broadcast"):
        f(q, k, v, scaling=0.1, attn_mask=torch.ones(1, 1, 8, 9, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="share a dtype"):
        f(q, k.half(), v, scaling=0.1)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        api.qknorm_attn_with_kvcache(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 1, 4, 512, device=DEVICE)
        f(big, big, big, scaling=0.1)
    with pytest.raises(ValueError, match="softcap"):
        f(q, k, v, scaling=0.1, softcap=0.0)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="packed"):
        api.qknorm_attn_varlen_func(
            q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), cu, cu, scaling=0.1
        )
    with pytest.raises(ValueError, match="int32"):
        api.qknorm_attn_varlen_func(q, k, v, cu.long(), cu.long(), scaling=0.1)


def test_attention_opcheck():
    from torch.library import opcheck

    q, k, v, do = _qkv(2, 4, 2, 20, 24, 32, scale=2.0)
    mask = _padding_mask(2, 20, 24, [0, 5])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    opcheck(torch.ops.hf_qknorm.attn_fwd.default, (*leaves, mask, None, None, 20, 24, 0.2, 3.0, True, 9))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    packed = [t[:1].detach().requires_grad_() for t in (q, k, v)]
    opcheck(torch.ops.hf_qknorm.attn_fwd.default, (*packed, None, cu, cu, 13, 13, 0.2, None, False, None))
    out, lse = torch.ops.hf_qknorm.attn_fwd(
        *[t.detach() for t in leaves], mask, None, None, 20, 24, 0.2, 3.0, True, None
    )
    opcheck(
        torch.ops.hf_qknorm.attn_bwd.default,
        (do, *[t.detach() for t in leaves], out, lse, None, mask, None, None, 20, 24, 0.2, 3.0, True, None),
    )


def test_attention_under_torch_compile():
    """fullgraph=True: the custom op is traced as one node (no graph break), forward and backward."""
    q, k, v, do = _qkv(1, 2, 1, 17, 17, 32, scale=2.0)
    fn = torch.compile(
        lambda a, b, c: api.qknorm_attn_func(a, b, c, scaling=0.2, softcap=3.0), backend="aot_eager", fullgraph=True
    )
    ref, ref_grads = _reference(q, k, v, do, scaling=0.2, softcap=3.0, causal=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    assert _rel_err(out, ref) < FP32_TOL
    assert all(_rel_err(t.grad, r) < FP32_TOL for t, r in zip(leaves, ref_grads))


@pytest.mark.spawns
def test_package_imports_without_triton():
    """`import hf_qknorm.kernels` must work, and explain itself, where triton is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import hf_qknorm.kernels as k\n"
        "assert not k.is_available() and 'pip install' in k.unavailable_reason()\n"
        "try:\n    k.qknorm_attn_func\nexcept ImportError as e:\n    print('ok', e)\n"
    )
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok") and "triton is not installed" in res.stdout


@pytest.mark.spawns
def test_no_gpu_means_unavailable():
    """Without a CUDA device (and without the interpreter that tests use), the kernels say they cannot run and why:
    `hf-qknorm info` and `kernels.is_available()` must not claim them on a CPU-only machine."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = (
        "import hf_qknorm.kernels as k\n"
        "assert not k.is_available(), 'claims the kernels on a machine with no GPU'\n"
        "print(k.unavailable_reason())\n"
    )
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("no CUDA device")
    res = subprocess.run(
        [sys.executable, "-m", "hf_qknorm.cli", "info"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0 and "triton kernels: unavailable (no CUDA device" in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------ GPU only

CUDA_CASES = [  # (batch, heads, kv_heads, q_len, kv_len, head_dim, causal, softcap, extra)
    (2, 8, 2, 512, 512, 64, True, 50.0, {}),
    (2, 8, 8, 1000, 1000, 128, True, 30.0, {}),
    (1, 4, 1, 255, 255, 80, False, 20.0, {}),
    (1, 4, 2, 113, 113, 96, True, None, {}),
    (1, 4, 4, 300, 300, 256, True, 50.0, {}),
    (4, 8, 2, 1, 4096, 128, True, 50.0, {}),
    (2, 4, 2, 700, 700, 64, True, 30.0, {"sliding_window": 128}),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(CUDA_CASES)))
def test_attention_low_precision_cuda(dtype, case, bwd_mode):
    b, h, hkv, tq, tk, d, causal, cap, extra = CUDA_CASES[case]
    _check_low_precision(dtype, b, h, hkv, tq, tk, d, causal, cap, seed=case, **extra)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_padding_mask_cuda(dtype, bwd_mode):
    mask = _padding_mask(3, 257, 257, [0, 31, 200])
    _check_low_precision(dtype, 3, 8, 4, 257, 257, 128, True, 50.0, attn_mask=mask)
