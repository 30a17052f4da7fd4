"""Compile every attention kernel variant for a GPU architecture without a GPU, and report its resources.

    python scripts/compile_kernels.py --arch 80 90 [--quick]      # from a clone, with hf_qknorm importable

Why: the CPU tests run the kernels under Triton's interpreter, which accepts code that the compiler rejects
(non-constexpr globals, unsupported casts) and knows nothing of shared memory or registers. This tool drives the
real launchers with small CPU tensors, records each launch instead of running it, then compiles exactly those
arguments through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas Triton ships)
for the requested architecture, and prints shared memory, registers and spills (local memory) per kernel. A
kernel whose shared memory exceeds the architecture's limit, or that fails to compile, is a failure.

Must run in a process where ``TRITON_INTERPRET`` is unset (the kernels must be decorated for compilation). A
maintainer's tool, not part of the package: it swaps the kernels for recorders with ``unittest.mock``.
tests/kernels/test_kernels_compile.py runs ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this clone's hf_qknorm, not an installed copy

# Largest dynamic shared memory per block: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB, sm_86/89 99 KiB.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _signature(fn, args, kwargs):
    names = [p.name for p in fn.params]
    values = dict(zip(names, args), **kwargs)
    signature, constexprs = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr or v is None:  # None: an absent optional pointer, specialised away
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TRITON_TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int) and v == 1:  # Triton's launcher specialises ints equal to 1 into constants
            signature[p.name] = "constexpr"
            constexprs[p.name] = 1
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return signature, constexprs, options


def record_launches(scenario: dict) -> list:
    """Run the launchers for one scenario with tiny CPU tensors and return the recorded kernel launches."""
    if scenario.get("norm"):
        return _record_norm_launches(scenario)
    from hf_qknorm.kernels import _attention_args, attention

    calls: list = []
    patches = [
        mock.patch.object(_attention_args, "check_device", lambda *a, **k: None),
        # the launches a GPU makes: the hardware tanh for fp16/bf16 (the CPU tensors here would turn it off)
        mock.patch.object(attention, "fast_tanh", lambda dtype, device, interpreted: dtype != torch.float32),
    ]
    for name in (
        "_attn_fwd_kernel",
        "_attn_bwd_preprocess_kernel",
        "_attn_bwd_dkdv_kernel",
        "_attn_bwd_dq_kernel",
        "_attn_fwd_split_kernel",
        "_attn_combine_kernel",
    ):
        patches.append(mock.patch.object(attention, name, _Recorder(getattr(attention, name), calls)))
    dtype, d = scenario["dtype"], scenario["head_dim"]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        q = torch.zeros(1, 4, 8, d, dtype=dtype)
        k = torch.zeros(1, 2, 8, d, dtype=dtype)
        kw = dict(scaling=0.1, softcap=scenario.get("softcap"), causal=True, sliding_window=scenario.get("window"))
        if scenario.get("mask"):
            kw["attn_mask"] = torch.ones(1, 1, 1, 8, dtype=torch.bool)  # key padding, any q_len
        if scenario.get("varlen"):
            cu = torch.tensor([0, 3, 8], dtype=torch.int32)
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
        out = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:3])
        fwd = dict(return_max=bool(scenario.get("max_logits")))
        if scenario.get("decode"):
            attention.attn_fwd(q[:, :, :1], k, k, **kw, **fwd, decode=True, num_splits=2)
        else:
            attention.attn_fwd(q, k, k, **kw, **fwd, decode=False)
            if not fwd["return_max"]:  # the backward does not depend on it
                attention.attn_bwd(out, q, k, k, out, lse, **kw)
    return calls


def _resource_usage(cubin: bytes) -> dict:
    """Registers, spill (local) bytes and static shared memory from the cubin, via the cuobjdump Triton ships."""
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 has no knobs module: skip the resource report
        return {}
    tool = getattr(knobs.nvidia, "cuobjdump", None)
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run(
            [tool.path, "--dump-resource-usage", f.name], capture_output=True, text=True, check=False
        ).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", text))
    return {
        "regs": int(found.get("REG", -1)),
        "local_bytes": int(found.get("LOCAL", 0)),
        "stack_bytes": int(found.get("STACK", 0)),
    }


def _record_norm_launches(scenario: dict) -> list:
    """The fused per-head norm's forward and backward launches (hf_qknorm.kernels.norms) for one norm kind."""
    from hf_qknorm.kernels import norms

    calls: list = []
    kind, dtype, d = scenario["norm"], scenario["dtype"], scenario["head_dim"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(norms, "check_device", lambda *a, **k: None))
        for name in ("_head_norm_fwd", "_head_norm_bwd"):
            stack.enter_context(mock.patch.object(norms, name, _Recorder(getattr(norms, name), calls)))
        # a 1B step's queries (2048 tokens x 32 heads): the tiles a GPU run takes, so spills show here
        x = torch.zeros(65536, d, dtype=dtype, requires_grad=True)
        w = torch.ones(1 if scenario.get("logit") else d, dtype=dtype, requires_grad=True)
        b = torch.zeros(d, dtype=dtype, requires_grad=True) if kind == "layernorm" else None
        y = norms.head_norm(x, w, b, kind=kind, eps=1e-6, p=scenario.get("p", 2.0))
        y.backward(torch.zeros_like(y))
    return calls


def compile_launch(fn, args, kwargs, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, options = _signature(fn, args, kwargs)
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options=options,
    )
    row = {
        "kernel": fn.__name__,
        "arch": arch,
        "shared": kernel.metadata.shared,
        **options,
        **{k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "HEAD_DIM", "D"))},
    }
    row.update(_resource_usage(kernel.asm["cubin"]))
    limit = SHARED_LIMIT.get(arch)
    row["ok"] = limit is None or kernel.metadata.shared <= limit
    return row


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def scenarios(quick: bool, dtypes=None) -> list[dict]:
    if dtypes is None:
        dtypes = ["bf16", "fp32"] if quick else list(_DTYPES)
    dtypes = [_DTYPES[d] for d in dtypes]
    dims = [64, 256] if quick else [64, 80, 96, 128, 256]
    out = []
    for dtype, d in itertools.product(dtypes, dims):
        if quick and dtype == torch.float32 and d != max(dims):
            continue  # --quick: fp32 (the largest tiles in bytes) at the largest head_dim only: shared memory binds
        out.append(dict(dtype=dtype, head_dim=d, softcap=50.0, mask=True, window=None))
        if not quick or d == 64:
            out.append(dict(dtype=dtype, head_dim=d, softcap=None, varlen=True, window=128))
        out.append(dict(dtype=dtype, head_dim=d, softcap=50.0, mask=True, decode=True))
        if not quick or d == 64:  # the forward variants that also write the per-row max logits (telemetry)
            out.append(dict(dtype=dtype, head_dim=d, softcap=50.0, mask=True, max_logits=True))
            out.append(dict(dtype=dtype, head_dim=d, softcap=None, varlen=True, max_logits=True))
            out.append(dict(dtype=dtype, head_dim=d, softcap=50.0, decode=True, max_logits=True))
    for dtype, d in itertools.product(dtypes, [64, 80] if quick else [64, 80, 96, 128, 256]):
        out.append(dict(dtype=dtype, head_dim=d, norm="layernorm"))
        out.append(dict(dtype=dtype, head_dim=d, norm="rmsnorm"))
        out.append(dict(dtype=dtype, head_dim=d, norm="lp", p=2.0, logit=True))
        out.append(dict(dtype=dtype, head_dim=d, norm="lp", p=3.0))
    return out


def run(archs, quick: bool, dtypes=None):
    """Yield one result row per compiled kernel variant."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit("unset TRITON_INTERPRET: compile_kernels.py needs kernels decorated for compilation")
    for scenario, arch in itertools.product(scenarios(quick, dtypes), archs):
        label = {k: (str(v).replace("torch.", "") if k == "dtype" else v) for k, v in scenario.items()}
        for fn, args, kwargs in record_launches(scenario):
            try:
                row = compile_launch(fn, args, kwargs, arch)
            except Exception as exc:  # report every failure, not just the first
                row = {"kernel": fn.__name__, "arch": arch, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            yield {**label, **row}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a representative subset (what the test runs): every attention variant in bf16 at head_dim 64, "
        "the training and decoding kernels at 256 in bf16 and fp32, the norms at 64 and 80",
    )
    parser.add_argument("--dtype", nargs="+", choices=list(_DTYPES), help="only these input dtypes")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    keys = (
        "dtype",
        "head_dim",
        "arch",
        "kernel",
        "BLOCK_M",
        "BLOCK_N",
        "num_warps",
        "num_stages",
        "shared",
        "regs",
        "local_bytes",
        "ok",
        "error",
    )
    total = bad = 0
    for row in run(args.arch, args.quick, args.dtype):
        total, bad = total + 1, bad + (not row["ok"])
        print(json.dumps(row) if args.json else "  ".join(f"{k}={row[k]}" for k in keys if k in row), flush=True)
    print(f"{total - bad}/{total} kernel variants compiled within limits", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
