"""The frozen tile table: measured launch configurations of the attention kernels per card and shape.

Each key is ``(arch, direction, head_dim, causal, dtype)``: ``arch`` the CUDA compute capability as ``"sm90"``,
``direction`` one of :data:`DIRECTIONS`, ``head_dim`` the bucket (64, 128 or 256: head dims up to it), ``dtype``
``"bfloat16"``, ``"float16"`` or ``"float32"``. Each value holds ``block_m``, ``block_n``, ``num_warps`` and
``num_stages``; a "dkdv" entry may add ``mode`` ("separate": dQ in its own pass; "atomic": dQ accumulated with
fp32 atomic adds in the dK/dV program, and the "dq" entry is then unused); a "fwd" entry may add ``tma`` (True:
load Q, K and V through tensor descriptors where the call allows it, see ``attention._tma``; absent: pointer
loads); a "decode" entry has no ``block_m`` (the decoding forward sizes its rows to the call).

Entries are written by ``python benchmarks/sweep_tiles.py --apply RESULT`` from a sweep run on that card; nothing
is tuned at run time. A card or shape absent here falls back to ``attention._CONFIGS``; :data:`SOURCES` names the
sweep behind each arch's rows (empty while no sweep has been run on a GPU). The ``arch`` ``"interpreter"`` is
looked up under ``TRITON_INTERPRET=1`` (tests put rows there to check that a row reaches the launch); the
committed table holds none.
"""

from __future__ import annotations

DIRECTIONS = ("fwd", "dkdv", "dq", "decode")
MODES = ("separate", "atomic")
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
TMA_MAX_BLOCK = 256  # the largest TMA box side, in elements

# fmt: off
TILES: dict[tuple[str, str, int, bool, str], dict[str, int | str]] = {
    ("sm90", "decode", 64, True, "bfloat16"):
        {"block_n": 64, "num_warps": 8, "num_stages": 3},
    ("sm90", "decode", 128, True, "bfloat16"):
        {"block_n": 128, "num_warps": 8, "num_stages": 3},
    ("sm90", "dkdv", 64, True, "bfloat16"):
        {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3, "mode": "separate"},
    ("sm90", "dkdv", 128, True, "bfloat16"):
        {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2, "mode": "separate"},
    ("sm90", "dq", 64, True, "bfloat16"):
        {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3},
    ("sm90", "dq", 128, True, "bfloat16"):
        {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
}
# fmt: on

# arch -> the device, date and result file of the sweep its rows come from.
SOURCES: dict[str, str] = {
    "sm90": "NVIDIA H200, 2026-11-30T01:03:01+00:00, 2026-11-30-nvidia-h200-tiles.json",
}


def _power_of_two(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 16 and n & (n - 1) == 0


def check_entry(key, entry) -> None:
    """Raise ``ValueError`` (one line naming the entry) unless ``key``/``entry`` is a valid table row."""
    if not (isinstance(key, tuple) and len(key) == 5):
        raise ValueError(f"tile table key {key!r}: expected (arch, direction, head_dim, causal, dtype)")
    arch, direction, head_dim, causal, dtype = key
    where = f"tile table entry {key!r}"
    if not (isinstance(arch, str) and (arch == "interpreter" or (arch[:2] == "sm" and arch[2:].isdigit()))):
        raise ValueError(f"{where}: arch {arch!r} is not 'smNN' (compute capability) or 'interpreter'")
    if direction not in DIRECTIONS:
        raise ValueError(f"{where}: direction {direction!r} is not one of {DIRECTIONS}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{where}: head_dim {head_dim!r} is not one of the buckets {HEAD_DIMS}")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal {causal!r} is not True or False")
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {DTYPES}")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: value {entry!r} is not a dict")
    fields = {"block_n", "num_warps", "num_stages"} | ({"block_m"} if direction != "decode" else set())
    allowed = fields | ({"mode"} if direction == "dkdv" else set()) | ({"tma"} if direction == "fwd" else set())
    if missing := fields - entry.keys():
        raise ValueError(f"{where}: missing {sorted(missing)}")
    if extra := entry.keys() - allowed:
        raise ValueError(f"{where}: unknown fields {sorted(extra)}; a {direction!r} entry takes {sorted(allowed)}")
    for name in ("block_m", "block_n"):
        if name in entry and not _power_of_two(entry[name]):
            raise ValueError(f"{where}: {name}={entry[name]!r} is not a power of two >= 16")
    warps, stages = entry["num_warps"], entry["num_stages"]
    if not (isinstance(warps, int) and 1 <= warps <= 16 and warps & (warps - 1) == 0):
        raise ValueError(f"{where}: num_warps={warps!r} is not a power of two in 1..16")
    if not (isinstance(stages, int) and 1 <= stages <= 5):
        raise ValueError(f"{where}: num_stages={stages!r} is not in 1..5")
    if entry.get("mode", "separate") not in MODES:
        raise ValueError(f"{where}: mode={entry['mode']!r} is not one of {MODES}")
    if not isinstance(entry.get("tma", False), bool):
        raise ValueError(f"{where}: tma={entry['tma']!r} is not True or False")
    if entry.get("tma") and max(entry["block_m"], entry["block_n"]) > TMA_MAX_BLOCK:
        raise ValueError(
            f"{where}: block_m={entry['block_m']}, block_n={entry['block_n']} with tma=True: a tensor descriptor's "
            f"block is at most {TMA_MAX_BLOCK} rows"
        )


def check_table(table: dict) -> None:
    """Validate every row of ``table`` (see :func:`check_entry`)."""
    for key, entry in table.items():
        check_entry(key, entry)


def lookup(arch: str, direction: str, head_dim: int, causal: bool, dtype: str, table: dict | None = None):
    """The entry for a call (``head_dim`` the actual head dim, bucketed here), or None."""
    bucket = next((b for b in HEAD_DIMS if head_dim <= b), None)
    return (TILES if table is None else table).get((arch, direction, bucket, bool(causal), dtype))


check_table(TILES)
