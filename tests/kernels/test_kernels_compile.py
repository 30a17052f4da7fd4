"""The Triton kernels compile for a real GPU target (sm_90), without a GPU.

Triton's interpreter (what tests/kernels/test_kernels.py uses on CPU) accepts code that the compiler rejects and knows
nothing of shared memory or registers. This runs ``python scripts/compile_kernels.py --quick`` in a fresh
process with ``TRITON_INTERPRET`` unset, which compiles a representative set of kernel variants down to cubins with
the ptxas Triton ships and fails on a compile error or a shared-memory overflow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_kernels.py"

pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend")


@pytest.mark.spawns
@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; fusion is the default
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in rows if not r["ok"]]
    assert res.returncode == 0 and rows and not bad, bad or res.stderr[-3000:]
    kernels = {r["kernel"] for r in rows}
    assert {
        "_attn_fwd_kernel",
        "_attn_bwd_preprocess_kernel",
        "_attn_bwd_dkdv_kernel",
        "_attn_bwd_dq_kernel",
        "_attn_fwd_split_kernel",
        "_attn_combine_kernel",
        "_head_norm_fwd",
        "_head_norm_bwd",
    } <= kernels
    assert all(r.get("local_bytes", 0) == 0 for r in rows), "register spills"
