"""Sweep the attention kernels' tile configurations on one GPU and write the winners for the frozen tile table.

    python benchmarks/sweep_tiles.py                         # on a CUDA machine: bf16, head_dim 64/128, causal and not
    python benchmarks/sweep_tiles.py --head-dims 64 128 256 --budget-s 420
    python benchmarks/sweep_tiles.py --causal causal --budget-s 160   # a short call: the masks training runs
    python benchmarks/sweep_tiles.py --apply benchmarks/results/gpu/<date>-<device>-tiles.json   # into the table
    python benchmarks/sweep_tiles.py --dry-run               # CPU, TRITON_INTERPRET=1, tiny shapes, temp dir

For each (head_dim, causal) case and each direction -- "fwd", "fwd-tma" (the forward loading Q, K and V through
tensor descriptors: a "fwd" entry with ``tma``; compute capability 9.0+ only), "dkdv" (backward, dQ in its own
pass), "dq", "atomic" (backward, dQ accumulated in the dK/dV program: a "dkdv" entry with mode "atomic") and
"decode" -- a small grid of candidates, filtered by a shared-memory estimate, is put into the tile table one at a
time (the launchers read it at every call). Each candidate is first checked against the float32 reference at a
length no tile size divides (its error at most 2x the fallback configuration's, plus 1e-3); a wrong one, or one that
fails to compile or launch, is recorded and skipped. The rest are timed with CUDA events at the timing shape; the
backward directions time the whole backward with the other direction at its fallback tiles; the separate mode's two
winners are then timed together, and the "dkdv" row written is the faster of the two modes; likewise the "fwd" row
is the faster of the pointer and descriptor loads. The fallback configuration is candidate 0 of every grid, so a
winner is never slower than today's launch (as measured), and replaces it only when ``--min-gain`` (5%) faster:
a few per cent is the card's spread between runs; "fwd-tma" candidates are held to the pointer fallback's
error.
``--budget-s`` stops the sweep between candidates and writes what it has, so the sweep fits one device call.

Writes ``<date>-<device>-tiles.jsonl`` (every candidate: tiles, status, error, milliseconds, TFLOP/s) and
``<date>-<device>-tiles.json`` (the winning table rows, device name, capability, torch/triton versions, date and
the exact command) under ``--out`` (default benchmarks/results/gpu/), copied to ``$OUT`` where that is set.
``--apply`` merges such a file into hf_qknorm/kernels/_tile_table.py (validated; rows of the same arch replaced),
for a session to commit.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_PATH = ROOT / "hf_qknorm" / "kernels" / "_tile_table.py"
DTYPE = "bfloat16"

# Candidate grids (block_m, block_n, num_warps, num_stages), small on purpose: each costs a compile. The fallback
# (attention._CONFIGS) is prepended to each. dK/dV keeps keys resident (block_n large); fwd/dQ keep queries.
GRIDS = {
    "fwd": [(128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 2), (128, 64, 8, 4)],
    # the pointer forward's fallback (prepended), then shapes of the Triton tutorial's TMA forward on Hopper
    "fwd-tma": [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 2), (16, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3), (16, 64, 4, 3)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 32, 4, 3), (32, 64, 4, 2)],
    "atomic": [(64, 128, 8, 2), (32, 128, 8, 2), (16, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (16, 64, 4, 3)],
    "decode": [(None, 64, 4, 3), (None, 128, 4, 2), (None, 32, 4, 3), (None, 64, 8, 3), (None, 128, 8, 3)],
}
DRY_GRIDS = {  # the interpreter: tiles only change which edge paths run, not speed
    "fwd": [(16, 32, 4, 1)],
    "fwd-tma": [(16, 32, 4, 1)],
    "dkdv": [(16, 32, 4, 1)],
    "dq": [(32, 16, 4, 1)],
    "atomic": [(32, 32, 4, 1)],
    "decode": [(None, 16, 4, 1)],
}
CAUSAL = {"both": (True, False), "causal": (True,), "noncausal": (False,)}  # --causal: the masks swept
DECODE_FALLBACK = {64: (None, 64, 4, 3), 128: (None, 64, 4, 3), 256: (None, 32, 4, 2)}


def _shared_limit(capability: tuple[int, int]) -> int | None:
    """Largest shared memory per block for this capability, from scripts/compile_kernels.py (None: unknown)."""
    spec = importlib.util.spec_from_file_location("_compile_kernels", ROOT / "scripts" / "compile_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SHARED_LIMIT.get(capability[0] * 10 + capability[1])


def shared_estimate(direction: str, tiles, head_dim: int, elem: int = 2) -> int:
    """Bytes of shared memory a launch stages: the streamed tiles times the pipeline depth, plus the resident one.
    An estimate (Triton may keep more or fewer tiles in shared memory); a wrong estimate costs a compile error,
    recorded, not a wrong table."""
    bm, bn, _, stages = tiles
    d = 1 << max(4, math.ceil(math.log2(head_dim)))
    if direction in ("fwd", "fwd-tma", "dq", "decode"):
        return (stages * 2 * bn + (bm or 64)) * d * elem
    return (2 * bn + stages * 2 * bm) * d * elem  # dkdv/atomic: K and V resident, Q and dO streamed


def _entry(direction: str, tiles) -> tuple[str, dict]:
    bm, bn, warps, stages = tiles
    entry = {"block_n": bn, "num_warps": warps, "num_stages": stages}
    if direction != "decode":
        entry["block_m"] = bm
    if direction in ("dkdv", "atomic"):
        entry["mode"] = "atomic" if direction == "atomic" else "separate"
        return "dkdv", entry
    if direction == "fwd-tma":
        entry["tma"] = True
        return "fwd", entry
    return direction, entry


def _rel_err(a, ref) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(0.1)).item()


class Sweep:
    def __init__(self, args):
        import torch

        from hf_qknorm.kernels import _tile_table
        from hf_qknorm.kernels import attention as attn_mod

        self.args, self.torch, self.table, self.attn = args, torch, _tile_table, attn_mod
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.interpreted = args.dry_run
        self.arch = attn_mod._arch(self.device, self.interpreted)
        self.capability = None if args.dry_run else torch.cuda.get_device_capability()
        self.limit = None if args.dry_run else _shared_limit(self.capability)
        self.start = time.monotonic()
        self.rows, self.winners, self.stopped = [], {}, None
        self.base_errs = {}  # (direction, head_dim, causal) -> the fallback candidate's error
        self.base_ms = {}  # (direction, head_dim, causal) -> the fallback candidate's time

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def inputs(self, b, h, hkv, tq, tk, d, seed):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(seed)
        dtype = torch.float32 if self.args.dry_run else torch.bfloat16

        def randn(*shape):
            return torch.randn(shape, generator=g, device=self.device).to(dtype)

        return randn(b, h, tq, d), randn(b, hkv, tk, d), randn(b, hkv, tk, d), randn(b, h, tq, d)

    def saved(self, direction, q, k, v, do, kw):
        """The forward's output and LSE (fallback tiles) that a backward direction starts from; None otherwise."""
        if direction in ("fwd", "fwd-tma", "decode"):
            return None
        return self.attn.attn_fwd(q, k, v, **kw, decode=False)

    def run_direction(self, direction, q, k, v, do, saved, kw):
        """What a direction computes: the forward's output, or the backward's three gradients (not the forward)."""
        attn = self.attn
        if direction in ("fwd", "fwd-tma", "decode"):
            return (attn.attn_fwd(q, k, v, **kw, decode=direction == "decode")[0],)
        return attn.attn_bwd(do, q, k, v, *saved, **kw)

    def reference(self, direction, q, k, v, do, kw):
        from hf_qknorm.reference import attention_reference

        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out = attention_reference(*leaves, **kw)
        if direction in ("fwd", "fwd-tma", "decode"):
            return (out.detach(),)
        out.backward(do.float())
        return tuple(t.grad for t in leaves)

    def timed(self, fn) -> float:
        """Milliseconds per call: CUDA events around ``reps`` calls after ``warmup`` (wall clock on CPU)."""
        torch = self.torch
        for _ in range(self.args.warmup):
            fn()
        if self.args.dry_run:
            t0 = time.perf_counter()
            for _ in range(self.args.reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / self.args.reps
        torch.cuda.synchronize()
        times = []
        for _ in range(self.args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def fallback(self, direction, head_dim, causal):
        if direction == "decode":
            if self.interpreted:
                return (None, 32, 4, 1)
            return DECODE_FALLBACK[64 if head_dim <= 64 else 128 if head_dim <= 128 else 256]
        kernel = {"atomic": "dkdv", "fwd-tma": "fwd"}.get(direction, direction)
        saved = dict(self.table.TILES)
        self.table.TILES.clear()  # the fallback, whatever the table holds now
        try:
            dtype = self.torch.float32 if self.interpreted else self.torch.bfloat16
            return self.attn._config(kernel, head_dim, dtype, self.interpreted, causal, self.device)
        finally:
            self.table.TILES.update(saved)

    def case(self, head_dim, causal):
        kw = dict(scaling=head_dim**-0.5, softcap=self.args.softcap or None, causal=causal)
        bests, self.combo = {}, None
        try:
            return self.directions(head_dim, causal, kw, bests)
        finally:
            self.finish(bests, head_dim, causal, kw)

    def directions(self, head_dim, causal, kw, bests) -> bool:
        args, torch = self.args, self.torch
        grids = DRY_GRIDS if args.dry_run else GRIDS
        for direction in args.directions:
            decode = direction == "decode"
            if decode and not causal:
                continue  # decoding calls are causal (one query against its cache)
            if decode:
                check = self.inputs(2, args.heads, args.kv_heads, 1, args.check_len, head_dim, 1)
                timing = self.inputs(args.decode_batch, args.heads, args.kv_heads, 1, args.decode_len, head_dim, 2)
                flops = 4 * args.decode_batch * args.heads * args.decode_len * head_dim
            else:
                check = self.inputs(1, args.heads, args.kv_heads, args.check_len, args.check_len, head_dim, 1)
                timing = self.inputs(args.batch, args.heads, args.kv_heads, args.seqlen, args.seqlen, head_dim, 2)
                fwd_flops = 4 * args.batch * args.heads * args.seqlen**2 * head_dim // (2 if causal else 1)
                flops = fwd_flops if direction in ("fwd", "fwd-tma") else fwd_flops * 5 // 2  # backward: 2.5x
            ref = self.reference(direction, *check, kw)
            check_saved, timing_saved = self.saved(direction, *check, kw), self.saved(direction, *timing, kw)
            if timing_saved is not None:
                self.combo = (timing, timing_saved, flops)
            base = self.fallback(direction, head_dim, causal)
            candidates = [base] + [c for c in grids[direction] if c != base]
            # TMA candidates are held to the pointer forward's error: the fallback tiles with descriptors are a
            # candidate like the others, not the reference
            tma = direction == "fwd-tma"
            base_err = self.base_errs.get(("fwd", head_dim, causal)) if tma else None
            unusable = self.tma_unusable(check[:3], kw) if tma else None
            best = None
            for i, tiles in enumerate(candidates):
                if self.left() < args.reserve_s:
                    self.stopped = f"budget: stopped before {direction} hd{head_dim} causal={causal} candidate {i}"
                    return False
                row = dict(
                    direction=direction,
                    head_dim=head_dim,
                    causal=causal,
                    dtype=DTYPE if not args.dry_run else "float32",
                    softcap=args.softcap or None,
                    block_m=tiles[0],
                    block_n=tiles[1],
                    num_warps=tiles[2],
                    num_stages=tiles[3],
                    fallback=i == 0 and not tma,
                )
                if unusable:
                    row.update(status="skipped", error=unusable)
                    self.emit(row)
                    continue
                if self.limit is not None and shared_estimate(direction, tiles, head_dim) > self.limit:
                    row.update(status="skipped", error="shared-memory estimate over the card's limit")
                    self.emit(row)
                    continue
                key_direction, entry = _entry(direction, tiles)
                key = (self.arch, key_direction, head_dim, causal, DTYPE if not args.dry_run else "float32")
                saved = self.table.TILES.get(key)
                self.table.TILES[key] = entry
                try:
                    got = self.run_direction(direction, *check, check_saved, kw)
                    err = max(_rel_err(g, r) for g, r in zip(got, ref))
                    row["max_rel_err"] = err
                    if row["fallback"]:
                        base_err = self.base_errs[(direction, head_dim, causal)] = err
                    limit = 0.05 if base_err is None else 2 * base_err + 1e-3  # 0.05: the fallback itself failed
                    if err > limit or not all(torch.isfinite(g).all() for g in got):
                        row.update(status="wrong", error=f"error {err:.3g} over {limit:.3g} (2x the fallback's)")
                        self.emit(row)
                        continue
                    ms = self.timed(functools.partial(self.run_direction, direction, *timing, timing_saved, kw))
                    row.update(status="ok", ms=ms, tflops=flops / ms / 1e9)
                    if row["fallback"]:
                        self.base_ms[(direction, head_dim, causal)] = ms
                    if self.better(direction, head_dim, causal, ms, best, fallback=row["fallback"]):
                        best = (ms, key, entry)
                except Exception as exc:  # a compile error, out of resources: recorded, the sweep goes on
                    row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                finally:
                    if saved is None:
                        self.table.TILES.pop(key, None)
                    else:
                        self.table.TILES[key] = saved
                self.emit(row)
            if best is not None:
                bests[direction] = best
        return True

    def better(self, direction, head_dim, causal, ms, best, fallback=False) -> bool:
        """Whether a candidate timed at ``ms`` becomes its direction's best. The fallback always does (it is timed
        first); any other only where it beats the launch it would replace by ``--min-gain`` (a share): its own
        direction's fallback, the pointer forward's for "fwd-tma", the separate backward's fallback for "atomic".
        Where that launch has no time (it failed, or the budget stopped first), the fastest wins. A row the card's
        run-to-run spread alone put ahead of the fallback would change the launch for nothing, or for worse at
        another shape."""
        if fallback:
            return True
        ref = self.base_ms.get(({"fwd-tma": "fwd", "atomic": "dkdv"}.get(direction, direction), head_dim, causal))
        if ref is not None and ms > ref * (1 - self.args.min_gain):
            return False
        return best is None or ms < best[0]

    def tma_unusable(self, qkv, kw) -> str | None:
        """Why this card or these inputs would not take the descriptor loads (the launcher would silently run the
        pointer ones, and the sweep would time those under the TMA label), or None."""
        if self.capability is not None and self.capability < (9, 0):
            return f"TMA needs compute capability 9.0 or later, this card has {self.capability}"
        q, k, v = qkv
        if not self.attn._tma({"tma": True}, q, k, v, False, 16, 16, self.interpreted):
            return "the launcher would not take the descriptor loads here (Triton, head_dim or strides)"
        return None

    def finish(self, bests, head_dim, causal, kw):
        """The case's table rows: each direction's fastest; for "fwd", the faster of the pointer and descriptor
        loads; for "dkdv", the faster backward of the two modes, the separate one re-timed with its dK/dV and dQ
        winners together (each was timed with the other at fallback)."""
        fwd = [bests[d] for d in ("fwd", "fwd-tma") if d in bests]
        if fwd:
            ms, key, entry = min(fwd, key=lambda c: c[0])
            self.winners[key] = (ms, entry)
        for direction in ("dq", "decode"):
            if direction in bests:
                ms, key, entry = bests[direction]
                self.winners[key] = (ms, entry)
        sep, atomic, dq = bests.get("dkdv"), bests.get("atomic"), bests.get("dq")
        if sep and dq and self.combo and self.left() > self.args.reserve_s / 2:
            timing, saved, flops = self.combo
            row = dict(direction="bwd-separate", head_dim=head_dim, causal=causal, dkdv=sep[2], dq=dq[2])
            held = {key: self.table.TILES.get(key) for key in (sep[1], dq[1])}
            self.table.TILES.update({sep[1]: sep[2], dq[1]: dq[2]})
            try:
                ms = self.timed(functools.partial(self.run_direction, "dkdv", *timing, saved, kw))
                row.update(status="ok", ms=ms, tflops=flops / ms / 1e9)
                sep = (ms, sep[1], sep[2])
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            finally:
                for key, entry in held.items():
                    if entry is None:
                        self.table.TILES.pop(key, None)
                    else:
                        self.table.TILES[key] = entry
            self.emit(row)
        choices = [c for c in (sep, atomic) if c is not None]
        if choices:
            ms, key, entry = min(choices, key=lambda c: c[0])
            self.winners[key] = (ms, entry)

    def emit(self, row):
        row["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def _meta(args, sweep) -> dict:
    import torch
    import triton

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        torch=torch.__version__,
        triton=triton.__version__,
        arch=sweep.arch,
        dry_run=args.dry_run,
    )
    if not args.dry_run:
        meta.update(device=torch.cuda.get_device_name(), capability=list(sweep.capability))
    else:
        meta.update(device="cpu (TRITON_INTERPRET=1)", capability=None)
    return meta


def sweep(args) -> int:
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("sweep_tiles.py: torch sees no CUDA device; run --dry-run on a CPU machine", file=sys.stderr)
        return 2
    s = Sweep(args)
    out = (
        Path(args.out) if args.out else (Path(tempfile.mkdtemp()) if args.dry_run else ROOT / "benchmarks/results/gpu")
    )
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args, s)
    slug = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")[:40]
    stem = out / f"{meta['date'][:10]}-{slug}-tiles"
    try:
        for head_dim in args.head_dims:
            for causal in (True,) if args.dry_run else CAUSAL[args.causal]:  # dry run: the same code, half the time
                if not s.case(head_dim, causal):
                    break
            if s.stopped:
                break
    finally:  # whatever happened, what was measured is written
        with open(f"{stem}.jsonl", "a") as f:
            for row in s.rows:
                f.write(json.dumps({**meta, **row}) + "\n")
        rows = [dict(key=list(key), entry=entry, ms=ms) for key, (ms, entry) in sorted(s.winners.items())]
        result = dict(meta, stopped=s.stopped, tiles=rows)
        Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        if os.environ.get("OUT") and not args.dry_run:  # a device call brings back only what is under $OUT
            for suffix in (".jsonl", ".json"):
                shutil.copy(f"{stem}{suffix}", os.environ["OUT"])
        print(
            f"# {len(s.rows)} candidates, {len(rows)} table rows -> {stem}.json(l)"
            + (f"; {s.stopped}" if s.stopped else "")
        )
    return 0


def _key_literal(key) -> str:
    return "(" + ", ".join(json.dumps(x) if isinstance(x, str) else repr(x) for x in key) + ")"


def _value_literal(value) -> str:
    return repr(value) if isinstance(value, bool) else json.dumps(value)  # True, not JSON's true


def _entry_literal(entry) -> str:
    order = ["block_m", "block_n", "num_warps", "num_stages", "mode", "tma"]
    return "{" + ", ".join(f'"{k}": {_value_literal(entry[k])}' for k in order if k in entry) + "}"


def apply(result_path: str, table_path: Path) -> int:
    """Merge a sweep result's rows into the table module: validated, the arch's older rows replaced."""
    result = json.loads(Path(result_path).read_text())
    if result.get("dry_run") or result.get("arch") == "interpreter":
        raise SystemExit(
            f"sweep_tiles.py --apply: {result_path} is a dry run's result (arch 'interpreter'); nothing to apply"
        )
    spec = importlib.util.spec_from_file_location("_tile_table_target", table_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    arch = result["arch"]
    new = {tuple(row["key"]): row["entry"] for row in result["tiles"]}
    for key, entry in new.items():
        if key[0] != arch:
            raise SystemExit(f"sweep_tiles.py --apply: row {key!r} is not for the result's arch {arch!r}")
        module.check_entry(key, entry)
    tiles = {key: entry for key, entry in module.TILES.items() if key[0] != arch}
    tiles.update(new)
    sources = dict(module.SOURCES)
    sources[arch] = f"{result['device']}, {result['date']}, {Path(result_path).name}"
    text = table_path.read_text()
    body = "".join(f"    {_key_literal(key)}:\n        {_entry_literal(tiles[key])},\n" for key in sorted(tiles))
    head = "TILES: dict[tuple[str, str, int, bool, str], dict[str, int | str]] = {\n"
    text, n = re.subn(r"(# fmt: off\n)TILES: .*?\n}\n", lambda g: g.group(1) + head + body + "}\n", text, flags=re.S)
    lines = "".join(f"    {json.dumps(a)}: {json.dumps(sources[a])},\n" for a in sorted(sources))
    literal = "SOURCES: dict[str, str] = {\n" + lines + "}\n"
    text, m = re.subn(r"SOURCES: dict\[str, str\] = \{.*?\}\n", lambda g: literal, text, flags=re.S)
    if n != 1 or m != 1:
        raise SystemExit(f"sweep_tiles.py --apply: {table_path} has no TILES/SOURCES literal to rewrite")
    table_path.write_text(text)
    print(f"# {len(new)} rows for {arch} merged into {table_path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[64, 128, 256])
    p.add_argument("--directions", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    p.add_argument(
        "--causal",
        choices=list(CAUSAL),
        default="both",
        help="which masks to sweep: causal (what training and prefill run), noncausal, or both (default)",
    )
    p.add_argument("--seqlen", type=int, default=4096, help="timing length (queries = keys)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    # 1008: no tile size divides it (edge tiles are checked), 16 does (the kernels compile once for both lengths)
    p.add_argument("--check-len", type=int, default=1008, help="length of the correctness check")
    p.add_argument("--decode-len", type=int, default=8192)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--softcap", type=float, default=30.0, help="the cap timed (0: uncapped)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop between candidates after this many seconds")
    p.add_argument("--reserve-s", type=float, default=20.0, help="seconds kept for the last candidate and the writes")
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="a candidate replaces the fallback only when this share faster (default 0.05: the card's spread)",
    )
    p.add_argument("--out", help="result folder (default benchmarks/results/gpu; a temp dir with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, one candidate each")
    p.add_argument("--apply", metavar="RESULT", help="merge a sweep's .json into the tile table and exit")
    p.add_argument("--table", default=str(TABLE_PATH), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.min_gain < 1:
        p.error(f"--min-gain {args.min_gain}: a share from 0 (the fastest wins) to below 1")
    if args.apply:
        return apply(args.apply, Path(args.table))
    if args.dry_run:
        args.min_gain = 0.0  # the interpreter's times say nothing: the dry run checks that every candidate can win
        args.head_dims = [64]
        args.seqlen, args.batch, args.heads, args.kv_heads = 40, 1, 2, 1
        args.check_len, args.decode_len, args.decode_batch = 37, 70, 1  # 37: odd, edge tiles
        args.warmup, args.reps = 0, 1
    return sweep(args)


if __name__ == "__main__":
    if "--dry-run" in sys.argv:  # before the kernels are imported: triton.jit picks the interpreter at decoration
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))  # this clone's hf_qknorm, not an installed copy
    sys.exit(main())
