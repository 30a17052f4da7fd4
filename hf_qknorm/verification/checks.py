"""Judge the probes against the float64 formula reference, layer by layer, and say which mechanism is applied.

For each layer and probe the reference output is :func:`hf_qknorm.reference.attention_layer_reference` on the
recorded layer input, with the layer's weights (:mod:`.layers`), RoPE from the recorded ``cos``/``sin``, the cap, and
the mask by absolute position (causal, the probe's padding, the sliding window; a prefix-LM's prefix attended both
ways, as the probe marked it). The error is
``max|out - ref| / max|ref|`` over the real query rows (padded rows have no defined output).

A mechanism ``m`` (norms, cap, padding, causal, window, prefix) is judged with a second reference without ``m``: with
``e`` the error against the reference, ``e_m`` against the one without ``m`` and ``d_m`` the distance between the
two references (all relative to ``max|ref|``), ``m`` is

- *applied* when ``e <= tol`` and ``3 e < d_m``: the output is within tolerance and its measured error is a third of
  what leaving out ``m`` changes, so the output is clearly nearer the reference than the reference without ``m``;
- *DROPPED* when ``e_m <= tol`` and ``3 e_m < d_m`` (the model computed the scheme without ``m``);
- ``?`` otherwise when ``d_m > 3 tol`` (the layer is off, but not by leaving out ``m`` alone), and *not exercised*
  when ``d_m <= 3 tol`` (this probe cannot tell).

With ``d_m > 3 tol`` this is the tolerance rule (``e <= tol`` implies ``3 e < d_m``). Below it, the measured error
decides, not the worst-case tolerance: in half precision a model's error on a probe (~3e-3 in bfloat16) is far below
the tolerance (3e-2), and a mechanism that changes the output by 1e-2 is then plainly applied or not. Rounding noise
cannot fake *applied*: a model that leaves out ``m`` outputs ``ref_m + n``; at the entry where ``|ref_m - ref|`` is
``d_m``, ``e >= d_m - |n|``, so ``e < d_m / 3`` needs noise of at least ``2 d_m / 3`` -- twice the error the verdict
allows -- pointing exactly against ``m``'s effect there, and within ``d_m / 3`` of cancelling it at every other entry:
rounding does not know ``m``'s effect. The same argument keeps a correct model from being called *DROPPED*. The
factor 3 keeps the verdicts exclusive: both would need ``e + e_m < 2 d_m / 3``, but ``e + e_m >= d_m``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..portable.names import ROLES
from ..reference import (
    allowed_reference,
    attention_layer_reference,
    keys_values_reference,
    norm_reference,
    rope_layout_reference,
)
from .derive import run_output_stage
from .layers import LayerSpec, ReferenceModel
from .report import APPLIED, DROPPED, REMOVED, UNCLEAR, UNEXERCISED, Check, VerifyReport

# Tolerance on the relative error, by the dtype the model computes in. float64: the formula to 1e-6 (the bar every
# scheme meets against hf_qknorm/reference.py in the tests);
# Qwen3's own q/k RMSNorm computes in float32 whatever the input, which costs ~1e-7. float32: unit roundoff 6e-8
# grown by sums over up to a few thousand products and by a softmax over logits up to a few caps (~1e-5 measured on
# the probes), with a margin. bfloat16 (unit roundoff 3.9e-3) and float16 (4.9e-4): every projection output and
# the attention output are rounded once or twice, and logits of a few tens amplify the rounding of q and k; the
# stress probe's logits (a few caps) are the worst case. A dropped cap, norm or mask errs by 0.1 to 1.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# A verdict needs the error to be under a third of the mechanism's effect; without one, a mechanism whose effect is
# over 3 tolerances was exercised (``?``), under it not (see the module docstring).
EXERCISED = 3.0
# The largest logit up to which the half-precision tolerances hold as they are; beyond it they grow with the logit
# (:func:`widened`). Measured on correct tiny models of every family and scheme (three seeds, with and without
# dominant biases): bfloat16 errs by up to 7.5e-3 where logits stay below 10, and by up to 5.4e-2 with lp at a 32k
# context (learned logit scale 30, logits ~40) -- over 3e-2, at 0.46 of the widened tolerance.
LOGIT_REFERENCE = 10.0

# Which mechanisms each probe judges (each costs one more reference per layer).
PROBE_MECHANISMS = {
    "unpadded": ("norms", "cap", "causal", "window", "prefix"),
    "padded": ("padding", "window", "prefix"),
    "cache-unpadded": ("window", "prefix"),
    "cache-padded": ("padding", "window", "prefix"),
    "stress": ("cap", "norms"),
    "amplified": ("norms", "causal", "window", "prefix"),
    "amplified-padded": ("padding", "window", "prefix"),
}


def check_tolerance(value) -> float | None:
    """``value`` as a float if it is a usable relative-error tolerance (a number strictly between 0 and 1), ``None``
    for ``None`` (the per-dtype default); else a ``ValueError`` naming it. 0 cannot be met by any rounding, 1 and
    more accept any output, NaN compares false everywhere."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value < 1
    if not ok:
        raise ValueError(
            f"tolerance must be a number between 0 and 1 (exclusive), a relative error such as 1e-4; got {value!r}"
        )
    return float(value)


def tolerance_for(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


def widened(tol: float, logit: float) -> float:
    """A half-precision tolerance for a layer whose largest logit is ``logit``: rounding q and k (relative u/2
    each) moves a logit s by up to ~u |s|, and the softmax turns that into a relative change of the weights; the
    base tolerances hold up to logits of :data:`LOGIT_REFERENCE`, beyond it the tolerance grows with the logit."""
    return tol * max(1.0, logit / LOGIT_REFERENCE)


def _f64(t):
    return None if t is None else t.to(torch.float64)


def source_kv(source, drop=()) -> tuple | None:
    """The keys and values a KV-shared layer attends over: those of its source layer (``source``: that layer's
    spec and its record on the same probe, or ``None`` for a layer with keys of its own), from the formulas on the
    source's recorded input. ``drop``: as :func:`layer_reference`'s (only ``norms`` acts here)."""
    if source is None:
        return None
    spec, rec = source
    x, cos, sin = _f64(rec["x"]), _f64(rec["cos"]), _f64(rec["sin"])
    rope_cos, rope_sin = rotation(spec, cos, sin) if spec.rotates and cos is not None else (None, None)
    w = spec.weights
    return keys_values_reference(
        x,
        wk=w["wk"],
        wv=w["wv"],
        bk=w["bk"],
        bv=w["bv"],
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        norm=spec.norm or "rmsnorm",
        k_norm=None if "norms" in drop else spec.k_norm,
        v_norm=None if "norms" in drop else spec.v_norm,
        cos=rope_cos,
        sin=rope_sin,
        eps=spec.eps,
        p=spec.p,
        rope_layout=spec.rope_layout,
        k_whole=spec.k_whole,
        v_own=spec.v_own,
    )


def layer_reference(
    spec: LayerSpec, x, cos, sin, tokens, *, drop=(), q_gain: float = 1.0, q_scale=None, source=None, prefix=None
) -> torch.Tensor:
    """Reference output ``(batch, seq, hidden)`` of one layer on input ``x`` ``(batch, seq, hidden)``.

    ``cos``/``sin`` ``(batch, seq, rope_dim)`` or ``None``; ``tokens`` ``(batch, seq)`` bool (False = padding);
    ``q_scale``: the recorded factor by position on the rotated query (Beam's ``attention_scaling``), or ``None``.
    ``prefix`` ``(batch, seq)`` bool or ``None``: a prefix-LM's prefix, attended both ways.
    ``drop``: mechanisms to leave out (``norms``, ``cap``, ``padding``, ``causal``, ``window``, ``prefix``). ``q_gain``
    multiplies the final pre-RoPE query (the stress probe's gain): folded into the query norm's gain and bias, or
    into the query projection when the layer has no query norm. ``source``: a KV-shared layer's source
    (:func:`source_kv`)."""
    w = dict(spec.weights)
    norms = {r: (None if "norms" in drop else getattr(spec, f"{r}_norm")) for r in ROLES}
    q_whole = spec.q_whole
    if q_gain != 1.0:
        if norms["q"] is not None or q_whole is not None:  # the gain multiplies the last norm's output
            qn = norms["q"] if norms["q"] is not None else q_whole
            weight = qn["weight"] if qn["weight"] is not None else torch.ones((), dtype=torch.float64)
            scaled = {**qn, "weight": q_gain * weight, "bias": None if qn["bias"] is None else q_gain * qn["bias"]}
            if norms["q"] is not None:
                norms["q"] = scaled
            else:
                q_whole = scaled
        else:
            w["wq"] = q_gain * w["wq"]
            w["bq"] = None if w["bq"] is None else q_gain * w["bq"]
    mask = None if "padding" in drop else tokens[:, None, None, :]
    if spec.stage is not None:  # the attention output, then the model's own code after it (an output gate)
        w["wo"], w["bo"] = torch.eye(spec.heads * spec.head_dim, dtype=torch.float64), None
    rope_cos, rope_sin = rotation(spec, cos, sin) if spec.rotates else (None, None)
    out = attention_layer_reference(
        x,
        **w,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        scaling=spec.scaling,
        softcap=None if "cap" in drop else spec.softcap,
        norm=spec.norm or "rmsnorm",
        q_norm=norms["q"],
        k_norm=norms["k"],
        v_norm=norms["v"],
        cos=rope_cos,
        sin=rope_sin,
        causal="causal" not in drop,
        mask=mask,
        sliding_window=None if "window" in drop else spec.window,
        eps=spec.eps,
        p=spec.p,
        rope_layout=spec.rope_layout,
        sinks=spec.sinks,
        q_whole=q_whole,
        k_whole=spec.k_whole,
        q_scale=q_scale,
        v_own=spec.v_own,
        kv=source_kv(source, drop),
        prefix=None if "prefix" in drop else prefix,
    )
    if spec.stage is None:
        return out
    return run_output_stage(spec.stage, out.view(*out.shape[:2], spec.heads, spec.head_dim), x, cos, sin)


def rotation(spec: LayerSpec, cos, sin) -> tuple:
    """The recorded pair as the reference's ``(cos, sin)``: swapped where the model passes ``(sin, cos)`` (GPT-J's);
    the model's own code (an output stage) takes it as recorded."""
    return (sin, cos) if spec.rope_swapped else (cos, sin)


def relative_error(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None = None):
    """``max|got - ref| / max|scale|`` over ``rows`` ``(batch, seq)`` bool (``scale`` defaults to ``ref``)."""
    scale = ref if scale is None else scale
    denom = float(scale[rows].abs().max()) if rows.any() else 0.0
    num = float((got - ref)[rows].abs().max()) if rows.any() else 0.0
    return num / denom if denom > 0 else num


def mechanism_status(e: float, e_m: float, d_m: float, tol: float) -> str:
    """The status of a mechanism ``m`` on one check (see the module docstring): ``e``, ``e_m``, ``d_m`` relative to
    ``max|ref|``, ``tol`` the check's tolerance."""
    if e <= tol and EXERCISED * e < d_m:
        return APPLIED
    if e_m <= tol and EXERCISED * e_m < d_m:
        return DROPPED
    return UNCLEAR if d_m > EXERCISED * tol else UNEXERCISED


def applicable(spec: LayerSpec, tokens: torch.Tensor, prefix: torch.Tensor | None = None) -> set[str]:
    out = {"causal"}
    if prefix is not None and bool(prefix.any()):
        out.add("prefix")
    if spec.has_norms:
        out.add("norms")
    if spec.softcap is not None:
        out.add("cap")
    if not bool(tokens.all()):
        out.add("padding")
    if spec.window is not None:
        out.add("window")
    return out


def largest_logit(
    spec: LayerSpec, x, cos, sin, tokens, q_gain: float = 1.0, q_scale=None, source=None, prefix=None
) -> float:
    """``max |scaling * q.k|`` (before the cap) over the real queries and the keys they may attend to, from the
    formulas (projection, norm, RoPE) in float64: the logits whose rounding a half-precision attention suffers."""
    b, t, _ = x.shape

    def heads(role: str, n: int, gain: float = 1.0):
        w, bias, norm = spec.weights[f"w{role}"], spec.weights[f"b{role}"], getattr(spec, f"{role}_norm")
        y = x @ w.T + (0 if bias is None else bias)
        whole = getattr(spec, f"{role}_whole")
        if whole is not None:
            y = norm_reference(y, whole["kind"], whole["weight"], whole["bias"], eps=whole["eps"])
        y = y.view(b, t, n, spec.head_dim)
        if norm is not None:
            y = norm_reference(y, spec.norm or "rmsnorm", norm["weight"], norm["bias"], eps=spec.eps, p=spec.p)
        y = (gain * y).transpose(1, 2)  # the stress gain multiplies the final pre-RoPE query
        if cos is None or not spec.rotates:
            return y
        return rope_layout_reference(y, *rotation(spec, cos, sin), spec.rope_layout)

    q = heads("q", spec.heads, q_gain)
    k = heads("k", spec.kv_heads) if source is None else source_kv(source)[0]
    q = q if q_scale is None else q * q_scale
    s = spec.scaling * (q @ k.repeat_interleave(spec.heads // spec.kv_heads, dim=1).transpose(-1, -2))
    n = k.shape[2]  # the keys: every position (a KV-shared layer's queries may be the last ones only)
    ok = allowed_reference(t, n, causal=True, sliding_window=spec.window, mask=tokens[:, None, None, :], prefix=prefix)
    ok = ok & tokens[:, None, n - t :, None]
    return float(s.abs().masked_fill(~ok, 0.0).max()) if bool(ok.any()) else 0.0


def check_layer(
    spec: LayerSpec,
    probe: str,
    rec: dict,
    tokens: torch.Tensor,
    tol: float,
    widen: bool = False,
    source=None,
    prefix: torch.Tensor | None = None,
) -> Check:
    """Compare one layer's recorded output on one probe with the reference (and the references without each
    mechanism the probe judges). ``rec``: ``x``, ``out``, ``cos``, ``sin`` (and ``alpha`` for the stress probe).
    ``widen``: a half-precision check, whose tolerance grows with the largest logit (:func:`widened`). ``source``:
    a KV-shared layer's source layer and its record (:func:`source_kv`). ``prefix``: the probe's prefix (a
    prefix-LM's), or ``None``."""
    if rec.get("given"):  # an argument the reference models as absent reached the layer (Dory's last_loop cache)
        note = f"the layer was given {', '.join(rec['given'])}, which the reference does not model"
        return Check(spec.index, probe, math.nan, tol, note=note)
    x, out = _f64(rec["x"]), _f64(rec["out"])
    cos, sin = _f64(rec["cos"]), _f64(rec["sin"])
    tokens = tokens.to(torch.bool)
    rows = tokens  # the query positions recorded: every position, or (a KV-shared layer) the last ones
    whole = source is not None and tuple(source[1]["x"].shape[:2]) == tuple(tokens.shape)
    if whole and x.shape[0] == tokens.shape[0] and x.shape[1] < tokens.shape[1]:
        # a cached generation computes a KV-shared layer at the last positions only (Gemma 4's prefill: the last
        # prompt token); its queries are the sequence's last ones, its keys its source's over the whole sequence
        rows = tokens[:, tokens.shape[1] - x.shape[1] :]
    elif x.shape[:2] != tokens.shape:
        return Check(
            spec.index,
            probe,
            math.nan,
            tol,
            note=f"recorded {tuple(x.shape[:2])} positions for a {tuple(tokens.shape)} probe",
        )
    gain, scale = float(rec.get("alpha", 1.0)), _f64(rec.get("q_scale"))
    if spec.q_factor is not None:  # a factor per channel of the rotated query (Dory's sqk), times any by position
        factor = spec.q_factor.view(1, spec.heads, 1, spec.head_dim)
        scale = factor if scale is None else scale * factor
    if widen:
        tol = widened(tol, largest_logit(spec, x, cos, sin, tokens, gain, scale, source, prefix))
    given = dict(q_gain=gain, q_scale=scale, source=source, prefix=prefix)
    ref = layer_reference(spec, x, cos, sin, tokens, **given)
    e = relative_error(out, ref, rows)
    mechanisms = {}
    for m in PROBE_MECHANISMS.get(probe, ()):
        if m not in applicable(spec, tokens, prefix):
            continue
        ref_m = layer_reference(spec, x, cos, sin, tokens, drop=(m,), **given)
        dropped = relative_error(out, ref_m, rows, ref)
        mechanisms[m] = mechanism_status(e, dropped, relative_error(ref_m, ref, rows), tol)
    return Check(spec.index, probe, e, tol, mechanisms)


def check_prenorm(spec: LayerSpec, rec: dict, tol: float) -> Check | None:
    """The attention's input against the block's input through the pre-attention norm -- or, for ``qkv_norm``, the
    block's input itself (the norm removed). The other case (no norm; a unit-gain norm) is the ablation. ``None``
    where the block's input is not of the attention input's shape (Gemma 3n's blocks take a stack of predictions
    and normalise one of them): there is no one tensor the norm reads to check it against."""
    block, got = _f64(rec["block"]), _f64(rec["attn"])
    if block.shape != got.shape:
        return None
    rows = torch.ones(got.shape[:2], dtype=torch.bool)
    pn = spec.prenorm
    if pn is None:
        ref, other = block, norm_reference(block, "rmsnorm", eps=spec.eps)
    else:
        with torch.no_grad():
            ref, other = _f64(pn(block)), block
    e = relative_error(got, ref, rows)
    status = mechanism_status(e, relative_error(got, other, rows, ref), relative_error(other, ref, rows), tol)
    return Check(
        spec.index, "prenorm", e, tol, {"prenorm": status if pn is not None else {APPLIED: REMOVED}.get(status, status)}
    )


def build_report(
    ref: ReferenceModel, captured: dict, *, tolerance: float | None = None, source: str = ""
) -> VerifyReport:
    """The report of ``captured`` (from :func:`.probe.run_probes`) against ``ref``'s layers."""
    meta = captured["meta"]
    dtype = getattr(torch, meta["dtype"], torch.float32)
    tol = tolerance if tolerance is not None else tolerance_for(dtype)
    widen = tolerance is None and dtype in (torch.float16, torch.bfloat16)
    checks: list[Check] = []
    probes = captured["probes"]
    for name, probe in probes.items():
        if "error" in probe:
            checks.append(Check(None, name, math.nan, tol, note=f"the probe failed: {probe['error']}"))
    expected = {"causal", "padding", "prenorm"}
    for i in range(len(ref)):
        spec = ref.spec(i)
        _settle_rope(ref, spec, probes)
        ref.place_parts(spec, *_first_rotation(spec, probes))
        expected |= applicable(spec, torch.zeros(1, 1, dtype=torch.bool), _prefix(probes))
        kv_source = _kv_sources(ref, spec, probes)  # a KV-shared layer's source, per probe

        for name, probe in probes.items():
            if "error" not in probe:
                rec, given = probe["layers"][i], (probe["mask"], tol, widen, kv_source(name), probe.get("prefix"))
                for k, loop in enumerate([rec, *rec.get("loops", ())]):  # a layer run in loops: each loop's calls
                    check = check_layer(spec, name, loop, *given)
                    checks.append(check if k == 0 else replace(check, probe=f"{name} loop {k}"))
        if i in captured["prenorm"] and spec.has_prenorm:
            checks += [c for c in (check_prenorm(spec, captured["prenorm"][i], tol),) if c is not None]
        for name, amplified in captured.get("amplified", {}).items():
            rec = amplified["layers"].get(i)
            if rec is not None and "error" in rec:
                checks.append(Check(i, name, math.nan, tol, note=f"the amplified probe failed: {rec['error']}"))
            elif rec is not None:  # a re-call on amplified inputs: a KV-shared layer's keys are its probe's
                base = "padded" if name.endswith("padded") else "unpadded"
                checks.append(
                    check_layer(
                        spec, name, rec, amplified["mask"], tol, widen, kv_source(base), amplified.get("prefix")
                    )
                )
        if i in captured["stress"]:
            rec = captured["stress"][i]
            if "error" in rec:
                checks.append(Check(i, "stress", math.nan, tol, note=f"the stress probe failed: {rec['error']}"))
            else:  # a half-precision model's stress probe runs in float32 (see .probe): float32's tolerance
                stress_tokens = torch.ones(rec["x"].shape[:2], dtype=torch.bool)
                stress_tol = tolerance if tolerance is not None else tolerance_for(rec["x"].dtype)
                prefix = probes.get("unpadded", {}).get("prefix")
                checks.append(
                    check_layer(
                        spec, "stress", rec, stress_tokens, stress_tol, source=kv_source("unpadded"), prefix=prefix
                    )
                )
    for name, logits in captured["logits"].items():
        if "error" in logits:
            checks.append(
                Check(None, f"logits {name}", math.nan, tol, note=f"uncached forward failed: {logits['error']}")
            )
            continue
        cached, uncached = _f64(logits["cached"]), _f64(logits["uncached"])
        rows = torch.ones(cached.shape[:2], dtype=torch.bool)
        checks.append(
            Check(
                None,
                f"logits {name}",
                relative_error(cached, uncached, rows),
                tol,
                note="cached generation vs uncached forward",
            )
        )
    required = tuple(m for m in ("norms", "cap", "padding", "causal", "prefix") if m in expected)
    return VerifyReport(
        model=meta["class"],
        scheme=_scheme(ref),
        backend=meta["backend"],
        cache=_cache(meta, probes),
        dtype=meta["dtype"],
        checks=checks,
        expected=tuple(sorted(expected)),
        required=required,
        source=source,
    )


def _prefix(probes: dict) -> torch.Tensor | None:
    """A prefix-LM's prefix as some probe marked it (for the mechanisms expected), or ``None``."""
    return next((p["prefix"] for p in probes.values() if p.get("prefix") is not None), None)


def _kv_sources(ref: ReferenceModel, spec: LayerSpec, probes: dict):
    """For a KV-shared layer, a function of a probe's name giving its source layer's spec and its record on that
    probe (the probe whose forward a re-call reuses); else a function giving ``None``."""
    source_spec = None if spec.kv_from is None else ref.spec(spec.kv_from)

    def kv_source(probe_name: str):
        base = probes.get(probe_name, {})
        if source_spec is None or "error" in base or "layers" not in base:
            return None
        return source_spec, base["layers"][spec.kv_from]

    return kv_source


def _first_rotation(spec: LayerSpec, probes: dict) -> tuple:
    """The first recorded ``(cos, sin)`` of the layer, float64, or ``(None, None)``."""
    for probe in probes.values():
        rec = probe.get("layers", [None] * (spec.index + 1))[spec.index] if "error" not in probe else None
        if rec is not None and rec.get("cos") is not None:
            return _f64(rec["cos"]), _f64(rec["sin"])
    return None, None


def _settle_rope(ref: ReferenceModel, spec: LayerSpec, probes: dict) -> None:
    """Settle the layer's rotation from the first probe that recorded one (see :meth:`ReferenceModel.settle_rope`)."""
    for probe in probes.values():
        rec = probe.get("layers", [None] * (spec.index + 1))[spec.index] if "error" not in probe else None
        if rec is not None and rec.get("cos") is not None:
            ref.settle_rope(spec, _f64(rec["cos"]), _f64(rec["sin"]))
            if ref._rope.get(spec.index):
                return


def _scheme(ref: ReferenceModel) -> str:
    s = ref.scheme
    if s is None:
        own = " with its own q/k RMSNorm" if ref.family.native_qk_norm else ""
        return f"none (unpatched {ref.family.model_type}{own})"
    parts = [f"norm {s.norm}" + (f" p={s.p:g}" if s.norm == "lp" else "") + f", eps {s.eps:g}"] if s.norms_qk else []
    parts += [f"cap {s.softcap:g}"] if s.caps else []
    return f"{s.scheme} ({', '.join(parts)})"


def _cache(meta: dict, probes: dict) -> str:
    kinds = {
        layer.get("cache")
        for name, p in probes.items()
        if name.startswith("cache") and "layers" in p
        for layer in p["layers"]
    }
    kinds.discard(None)
    impl = meta.get("cache_implementation") or "default"
    return impl + (" (" + ", ".join(sorted(kinds)) + ")" if kinds else "")
