"""Turn measured attention rows into the delegation table: where FlashAttention's capped call beats our kernel.

    python benchmarks/delegation_table.py                                  # every benchmarks/results/gpu/*.jsonl
    python benchmarks/delegation_table.py benchmarks/results/gpu/<date>-run.jsonl
    python benchmarks/delegation_table.py --apply benchmarks/results/gpu/<date>-run.jsonl   # into the table

Reads bench_attention.py's rows (as benchmarks/run_gpu.sh collects them) and pairs each ``flash-cap`` row with the
``qknorm-triton`` row of the same run and shape (device, date, dtype, head_dim, seq_len, batch, heads, kv_heads,
causal, softcap, mode). For each (arch, head_dim, causal) the newest run with pairs decides: FlashAttention wins
when it is faster than our kernel in **every** measured pair (each length and mode), by more than ``--min-speedup``;
the entry keeps the smallest ratio (our milliseconds over FlashAttention's). The arch comes from a row's
``capability`` where the benchmark wrote one, else from the device's name (:data:`CAPABILITIES`). ``--apply``
rewrites ``WINS`` and ``SOURCES`` in hf_qknorm/attention/delegate.py (validated): a measured key that lost is
removed, keys not measured are kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pprint
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_PATH = ROOT / "hf_qknorm" / "attention" / "delegate.py"
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
OURS = "qknorm-triton"
PROVIDERS = {"flash-cap": "flash_attn"}  # bench_attention.py's provider -> the route it measured
# Device names as torch reports them -> compute capability, for rows written without one.
CAPABILITIES = {"H100": (9, 0), "H200": (9, 0), "H800": (9, 0), "GH200": (9, 0), "A100": (8, 0), "A800": (8, 0),
                "L40": (8, 9), "L4": (8, 9), "A10": (8, 6), "B200": (10, 0), "GB200": (10, 0)}  # fmt: skip
SHAPE = ("device", "date", "dtype", "head_dim", "seq_len", "batch", "heads", "kv_heads", "causal", "softcap", "mode")


def arch_of(row: dict) -> str:
    """``"smNN"`` for a row: its ``capability`` (``[9, 0]`` or ``"sm90"``), else its device's name."""
    cap = row.get("capability")
    if isinstance(cap, str):
        return cap
    if isinstance(cap, (list, tuple)) and len(cap) == 2:
        return f"sm{cap[0]}{cap[1]}"
    words = re.findall(r"[A-Z]+\d+[A-Z]*", str(row.get("device", "")).upper())
    for word in words:
        if word in CAPABILITIES:
            major, minor = CAPABILITIES[word]
            return f"sm{major}{minor}"
    raise SystemExit(
        f"delegation_table.py: no compute capability for device {row.get('device')!r}: the row has no 'capability' "
        f"and the name matches none of {', '.join(CAPABILITIES)}"
    )


def read_rows(paths) -> list[dict]:
    rows = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"delegation_table.py: {path}:{n} is not JSON ({exc})") from None
    return rows


def wins(rows, min_speedup: float = 1.0):
    """``(table, measured, sources)``: the winning entries keyed ``(arch, head_dim, causal)``, every key measured
    (won or lost), and each arch's source (device, date)."""
    measured_ms = {}
    for row in rows:
        provider = row.get("provider")
        if (provider == OURS or provider in PROVIDERS) and isinstance(row.get("ms"), (int, float)):
            measured_ms[(provider, *(row.get(f) for f in SHAPE))] = row
    pairs: dict[tuple, dict[str, list]] = {}
    for (provider, *shape), row in measured_ms.items():
        if provider == OURS:
            continue
        ours = measured_ms.get((OURS, *shape))
        if ours is None:
            continue
        key = (arch_of(row), int(row["head_dim"]), bool(row.get("causal", True)))
        by_date = pairs.setdefault(key, {})
        by_date.setdefault(row.get("date") or "", []).append((provider, ours["ms"] / row["ms"], row))
    table, sources = {}, {}
    for key, by_date in pairs.items():
        date = max(by_date)
        runs = by_date[date]
        routes = {PROVIDERS[p] for p, _, _ in runs}
        worst = min(ratio for _, ratio, _ in runs)
        if len(routes) == 1 and worst > max(1.0, min_speedup):
            row = runs[0][2]
            table[key] = {"route": routes.pop(), "version": str(row.get("flash_attn")), "speedup": round(worst, 3)}
            sources[key[0]] = f"{row.get('device')}, {date}"
    return table, set(pairs), sources


def load_table(path: Path):
    """The delegate module at ``path``, imported fresh inside a stand-in package over its folder (its relative
    import, ``.dispatch``, is its neighbour), so a rewritten file is checked as it will import."""
    name = f"_delegation_table_{len(sys.modules)}"
    package = types.ModuleType(name)
    package.__path__ = [str(path.parent)]
    sys.modules[name] = package
    try:
        spec = importlib.util.spec_from_file_location(f"{name}.{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def apply(table: dict, measured: set, sources: dict, names: str, path: Path) -> int:
    """Write ``table`` into the ``WINS``/``SOURCES`` literals of the delegate module at ``path``."""
    module = load_table(path)
    module.check_table(table)
    merged = {k: e for k, e in module.WINS.items() if k not in measured}
    merged.update(table)
    merged_sources = {a: s for a, s in module.SOURCES.items() if any(k[0] == a for k in merged)}
    merged_sources.update({a: f"{s}, {names}" for a, s in sources.items()})
    body = "".join(
        f"    ({json.dumps(k[0])}, {k[1]}, {k[2]}): "
        f'{{"route": {json.dumps(e["route"])}, "version": {json.dumps(e["version"])}, "speedup": {e["speedup"]}}},\n'
        for k, e in sorted(merged.items())
    )
    text = path.read_text()
    text, n = re.subn(
        r"(# fmt: off\n)WINS: .*?\n}\n(# fmt: on\n)",
        lambda m: m.group(1) + "WINS: dict[tuple[str, int, bool], dict] = {\n" + body + "}\n" + m.group(2),
        text,
        flags=re.S,
    )
    literal = "SOURCES: dict[str, str] = " + pprint.pformat(merged_sources, width=100) + "\n"
    text, m = re.subn(r"SOURCES: dict\[str, str\] = \{.*?\}\n", lambda _: literal, text, count=1, flags=re.S)
    if n != 1 or m != 1:
        raise SystemExit(f"delegation_table.py --apply: {path} has no WINS/SOURCES literal to rewrite")
    path.write_text(text)
    load_table(path)  # the written module imports and validates its table
    print(f"# {len(table)} winning entries, {len(measured)} measured keys merged into {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", help="jsonl files of bench_attention.py rows (default: results/gpu/*.jsonl)")
    p.add_argument("--min-speedup", type=float, default=1.0, help="FlashAttention must beat our kernel by more")
    p.add_argument("--apply", action="store_true", help="write the entries into hf_qknorm/attention/delegate.py")
    p.add_argument("--table", default=str(TABLE_PATH), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    paths = args.results or sorted(RESULTS.glob("*.jsonl"))
    table, measured, sources = wins(read_rows(paths), args.min_speedup)
    for key in sorted(measured):
        entry = table.get(key)
        verdict = f"delegate to {entry['route']} ({entry['speedup']}x)" if entry else "keep our kernel"
        print(f"{key[0]:>6} head_dim {key[1]:>3} {'causal' if key[2] else 'non-causal':>10}: {verdict}")
    if not measured:
        print("# no flash-cap row paired with a qknorm-triton row: nothing measured, the table stays as it is")
    if args.apply and measured:
        return apply(table, measured, sources, ", ".join(Path(x).name for x in paths), Path(args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
