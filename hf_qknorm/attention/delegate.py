"""Capped attention delegated to FlashAttention where it is measured faster than the Triton kernels on the card.

FlashAttention 2.6+ (``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func``) and FlashAttention-3
(``flash_attn_interface``) compute the same capped attention as the kernels: ``softcap * tanh(scaling * q.k /
softcap)`` before the mask and the softmax (their ``softmax_scale`` is our ``scaling``), causality aligned
bottom-right, GQA heads grouped the same way, differentiable. A call the kernels would run goes there instead when

* it **fits** (:func:`why_not`): CUDA, float16/bfloat16, a cap, no dense mask (causal or none, a sliding window, or
  packed ``cu_seq_lens``), no dropout, attention sinks, max-logits probe or attention weights, a head_dim that is a
  multiple of 8 up to 256, a card the package supports (FA2: compute capability 8.x and up; FA3: 9.x);
* and the policy says so (:func:`~hf_qknorm.attention.dispatch.kernel_policy`'s ``flash_attn``): ``"auto"`` (the
  default) only where :data:`WINS` holds an entry for the card's ``(arch, head_dim, causal)`` measured with the
  package installed here; ``"on"`` for every call that fits; ``"off"`` never.

A sliding window ``w`` (our rule: keep keys with ``pos_q - pos_k < w``) is FlashAttention's
``window_size=(w - 1, 0)`` causal or ``(w - 1, -1)`` not: its bounds are inclusive. :data:`WINS` is written by
``python benchmarks/delegation_table.py --apply`` from benchmarks/bench_attention.py's rows (``flash-cap`` against
``qknorm-triton``, the same run); it is empty while nothing is measured, so by default nothing is delegated. What
ran is counted (:func:`delegated_calls`) and ``hf-qknorm info`` prints the package and whether delegation is active
here.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.metadata
import logging

import torch

from .dispatch import _POLICY

logger = logging.getLogger(__name__)

# route -> (what it is, the smallest compute capability major it runs on, the largest)
ROUTES = {"flash_attn": ("FlashAttention 2", 8, 99), "flash_attn_interface": ("FlashAttention 3", 9, 9)}
MIN_FA2 = (2, 6)  # softcap arrived in flash-attn 2.6
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

# (arch "smNN", head_dim, causal) -> {"route": a ROUTES key, "version": the package's version measured, "speedup":
# the smallest of our kernel's time over FlashAttention's across the measured lengths and modes}.
# fmt: off
WINS: dict[tuple[str, int, bool], dict] = {
}
# fmt: on

# arch -> the device, date and result file its entries were measured in.
SOURCES: dict[str, str] = {}


def check_entry(key, entry) -> None:
    """Raise ``ValueError`` (one line naming the entry) unless ``key``/``entry`` is a valid :data:`WINS` row."""
    where = f"delegation table entry {key!r}"
    if not (isinstance(key, tuple) and len(key) == 3):
        raise ValueError(f"{where}: expected the key (arch, head_dim, causal)")
    arch, head_dim, causal = key
    if not (isinstance(arch, str) and arch[:2] == "sm" and arch[2:].isdigit()):
        raise ValueError(f"{where}: arch {arch!r} is not 'smNN' (compute capability)")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{where}: head_dim {head_dim!r} is not a whole number in 1..{MAX_HEAD_DIM}")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal {causal!r} is not True or False")
    if not isinstance(entry, dict) or set(entry) != {"route", "version", "speedup"}:
        raise ValueError(f"{where}: value {entry!r} must hold exactly 'route', 'version' and 'speedup'")
    if entry["route"] not in ROUTES:
        raise ValueError(f"{where}: route {entry['route']!r} is not one of {', '.join(map(repr, ROUTES))}")
    if not isinstance(entry["version"], str):
        raise ValueError(f"{where}: version {entry['version']!r} is not a string")
    speedup = entry["speedup"]
    if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not speedup > 1:
        raise ValueError(f"{where}: speedup {speedup!r} is not above 1 (delegation only where it is faster)")


def check_table(table: dict) -> None:
    """Validate every row of ``table`` (:func:`check_entry`)."""
    for key, entry in table.items():
        check_entry(key, entry)


check_table(WINS)


@functools.cache
def load(route: str):
    """``(module, version, None)`` for an importable route, else ``(None, None, why not)``; cached (tests clear it
    with ``load.cache_clear()``)."""
    try:
        module = importlib.import_module(route)
    except ModuleNotFoundError as exc:
        if exc.name == route:
            return None, None, f"{route} is not installed"
        return None, None, f"{route} does not import ({exc})"
    except Exception as exc:  # a broken build raises more than ImportError (undefined symbols, CUDA mismatch)
        return None, None, f"{route} does not import ({type(exc).__name__}: {str(exc)[:120]})"
    version = getattr(module, "__version__", None)
    if version is None:
        for dist in ("flash_attn_3", "flash-attn-3", route):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    version = str(version or "unknown")
    if route == "flash_attn":
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
        if len(parts) < 2 or parts < MIN_FA2:
            return None, None, f"flash_attn {version} has no softcap (2.6 or newer needed)"
    if not callable(getattr(module, "flash_attn_func", None)):
        return None, None, f"{route} {version} has no flash_attn_func"
    LOADED[route] = module
    return module, version, None


# route -> its module, as the last load() found it: what a traced graph reads (Dynamo does not trace load's cache;
# the decision that picked the route ran load() when the graph was traced)
LOADED: dict = {}


def installed() -> dict[str, str]:
    """The importable routes and their versions."""
    return {route: load(route)[1] for route in ROUTES if load(route)[0] is not None}


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, ``None`` for any other (tests replace this function)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def arch_name(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


def why_not(
    route: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    kv_heads: int,
    *,
    softcap,
    masked: bool,
    dropout: float = 0.0,
    sink: bool = False,
    want_max: bool = False,
    weights: bool = False,
) -> str | None:
    """Why ``route`` cannot compute such a call exactly as the kernels would, or ``None`` when it can."""
    name, lowest, highest = ROUTES[route]
    if capability is None:
        return "the tensors are not on a CUDA device"
    if not lowest <= capability[0] <= highest:
        return f"{name} does not run on compute capability {capability[0]}.{capability[1]}"
    if dtype not in DTYPES:
        return f"{name} takes float16 and bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if heads % kv_heads:
        return f"{heads} query heads do not group over {kv_heads} key/value heads"
    if softcap is None:
        return "the call has no cap (delegation is measured for capped calls only)"
    if masked:
        return "the call has a dense mask (padding or a custom pattern), which FlashAttention does not take"
    if dropout > 0:
        return f"attention dropout {dropout} (FlashAttention's softcap excludes dropout)"
    if sink:
        return "attention sinks (s_aux)"
    if want_max:
        return "a probe wants the per-head max logits, which the kernels compute in the same pass"
    if weights:
        return "attention weights were requested"
    return None


def choose(setting: str, capability, head_dim: int, causal: bool, table: dict | None = None) -> str | None:
    """The route a fitting call takes under the policy's ``flash_attn`` setting, or ``None`` for the kernels:
    ``"auto"`` takes the table's route for ``(arch, head_dim, causal)`` where that package is installed; ``"on"``
    the first installed route that runs on this card (FA3 before FA2)."""
    if setting == "off" or capability is None:
        return None
    if setting == "on":
        for route in ("flash_attn_interface", "flash_attn"):
            _, lowest, highest = ROUTES[route]
            if load(route)[0] is not None and lowest <= capability[0] <= highest:
                return route
        return None
    entry = (WINS if table is None else table).get((arch_name(capability), head_dim, bool(causal)))
    if entry is None or load(entry["route"])[0] is None:
        return None
    return entry["route"]


_warned: set[str] = set()


@torch.compiler.assume_constant_result
def _decide(device_type, device_index, dtype, head_dim, heads, kv_heads, capped, masked, causal, want_max):
    """:func:`plan`'s decision from plain values: a traced-in constant under ``torch.compile`` (the policy is read
    when the graph is traced, as :func:`~.dispatch.route` is)."""
    setting = _POLICY.get().flash_attn
    if setting == "off" or (setting == "auto" and not WINS):  # nothing measured: no device query per call
        return None
    capability = device_capability(torch.device(device_type, device_index))
    route = choose(setting, capability, head_dim, causal)
    if route is None:
        if setting == "on" and capability is not None and "on" not in _warned:
            _warned.add("on")
            reasons = "; ".join(load(r)[2] or f"{ROUTES[r][0]} does not run on {capability}" for r in ROUTES)
            logger.warning("kernel_policy(flash_attn='on'): no FlashAttention to delegate to (%s).", reasons)
        return None
    reason = why_not(
        route, capability, dtype, head_dim, heads, kv_heads, softcap=1.0 if capped else None, masked=masked,
        want_max=want_max,
    )  # fmt: skip
    if reason is not None and setting == "on" and reason not in _warned:
        _warned.add(reason)
        logger.warning("kernel_policy(flash_attn='on'): a call runs the Triton kernels because %s.", reason)
    return route if reason is None else None


def plan(query, key, *, softcap, mask, causal: bool, want_max: bool = False) -> str | None:
    """The route this call is delegated to, or ``None`` for the kernels. ``query`` ``(batch, heads, q_len,
    head_dim)``, ``key`` ``(batch, kv_heads, kv_len, head_dim)``; the call is one the kernels would run (no dropout,
    sinks or weights)."""
    return _decide(
        query.device.type, query.device.index, query.dtype, query.shape[-1], query.shape[1], key.shape[1],
        softcap is not None, mask is not None, bool(causal), bool(want_max),
    )  # fmt: skip


def window_size(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """Our window (keep ``pos_q - pos_k < w``) as FlashAttention's inclusive ``(left, right)``."""
    left = -1 if sliding_window is None else sliding_window - 1
    return left, 0 if causal else -1


def flash_attention(
    route: str,
    query,
    key,
    value,
    *,
    scaling: float,
    softcap: float,
    causal: bool,
    sliding_window: int | None = None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
):
    """The call through ``route``'s ``flash_attn_func`` (or ``flash_attn_varlen_func`` for packed sequences).

    ``query`` ``(batch, heads, q_len, head_dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)`` (batch 1
    when packed); returns ``(batch, q_len, heads, head_dim)``, the layout the backend hands back to Transformers."""
    module = LOADED[route] if torch.compiler.is_compiling() else load(route)[0]
    common = dict(softmax_scale=float(scaling), causal=bool(causal), softcap=float(softcap))
    common["window_size"] = window_size(sliding_window, causal)
    if cu_seqlens_q is None:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views: flash-attn reads strided rows
        out = module.flash_attn_func(q, k, v, **common)
    else:
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_k.to(torch.int32)
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max())
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (total, heads, head_dim)
        out = module.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k), **common,
        )  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        return out.unsqueeze(0)
    return out[0] if isinstance(out, tuple) else out  # some FA3 releases return (out, lse)


CALLS: collections.Counter = collections.Counter()


def delegated_calls() -> dict[str, int]:
    """How many eager calls each route ran in this process (compiled graphs are not counted)."""
    return dict(CALLS)


def try_delegate(query, key, value, mask, cu_q, cu_k, scaling, softcap, causal, sliding_window, want_max, kwargs):
    """The backend's call (one the kernels would run) through FlashAttention, ``(batch, q_len, heads, head_dim)``,
    or ``None`` when it stays on the kernels (:func:`plan`)."""
    route = plan(query, key, softcap=softcap, mask=mask, causal=causal, want_max=want_max)
    if route is None:
        return None
    if not torch.compiler.is_compiling():
        CALLS[route] += 1
    key, value = key.to(query.dtype), value.to(query.dtype)
    packed = {}
    if cu_q is not None:
        packed = dict(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=kwargs.get("max_length_q"),
            max_seqlen_k=kwargs.get("max_length_k"),
        )  # fmt: skip
    return flash_attention(
        route, query, key, value, scaling=scaling, softcap=softcap, causal=causal, sliding_window=sliding_window,
        **packed,
    )  # fmt: skip


def describe(device: torch.device | None = None) -> tuple[str, str]:
    """Two lines for ``hf-qknorm info``: the FlashAttention packages installed, and whether delegation is active
    on ``device`` (the current CUDA device by default) under the policy in force."""
    found = installed()
    package = ", ".join(f"{r} {v} ({ROUTES[r][0]})" for r, v in found.items())
    if not package:
        package = "; ".join(load(r)[2] for r in ROUTES)
    setting = _POLICY.get().flash_attn
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    capability = device_capability(device)
    if capability is None:
        state = "inactive: no CUDA device"
    elif setting == "off":
        state = "off (kernel_policy(flash_attn='off'))"
    elif setting == "on":
        route = choose("on", capability, 0, True)
        state = f"on: every fitting capped call goes to {route}" if route else "on, but nothing installed runs here"
    else:
        arch = arch_name(capability)
        rows = [(k, e) for k, e in WINS.items() if k[0] == arch and e["route"] in found]
        if rows:
            cases = ", ".join(
                f"head_dim {k[1]} {'causal' if k[2] else 'non-causal'} ({e['speedup']}x)" for k, e in rows
            )
            state = f"active on {arch} for capped calls of {cases} (measured: {SOURCES.get(arch, '?')})"
        else:
            state = f"inactive on {arch}: no measured entry where FlashAttention beats the kernels"
    return package, f"{state}; kernel_policy(flash_attn='auto'|'on'|'off')"
