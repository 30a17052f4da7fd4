"""The verifier's result: one row per (layer, probe) check, the mechanisms' status, and a readable table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Status of one mechanism on one check.
APPLIED, DROPPED, UNEXERCISED = "applied", "DROPPED", "not exercised"
UNCLEAR = "?"  # the layer is off, but not by leaving out this mechanism alone
REMOVED = "removed"  # the pre-attention norm of qkv_norm: its removal is what is applied
MECHANISMS = ("norms", "cap", "padding", "causal", "window", "prenorm", "prefix")  # prefix: a prefix-LM's (PaliGemma)


@dataclass(frozen=True)
class Check:
    """One comparison: ``error`` = max|got - reference| / max|reference| over the real (unpadded) query rows.

    ``layer`` is ``None`` for model-level checks (cached vs uncached logits). ``mechanisms`` maps a mechanism to
    its status on this check (see :func:`hf_qknorm.verification.checks.mechanism_status`). ``note`` says why a check
    could not run (then ``error`` is NaN)."""

    layer: int | None
    probe: str
    error: float
    tolerance: float
    mechanisms: dict = field(default_factory=dict)
    note: str = ""

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


@dataclass
class VerifyReport:
    """Everything :func:`hf_qknorm.verify` found. ``ok`` is True when every check is within tolerance and every
    mechanism the scheme has that must be exercised (the norms, the cap) was seen applied."""

    model: str
    scheme: str
    backend: str | None
    cache: str
    dtype: str
    checks: list[Check] = field(default_factory=list)
    expected: tuple[str, ...] = ()  # mechanisms the model has (n/a for the others)
    required: tuple[str, ...] = ()  # mechanisms that must be exercised somewhere
    source: str = ""  # how the model was run (in process, or the folder without the plugin)

    def mechanism(self, name: str) -> str:
        """Overall status of a mechanism: ``DROPPED`` (somewhere), else ``applied`` (``removed`` for the pre-norm
        of ``qkv_norm``) when some check saw it applied, ``not verified`` when the checks that exercised it were off
        for another reason, ``not exercised`` when no probe could tell, ``n/a`` when the model does not have it."""
        if name not in self.expected:
            return "n/a"
        seen = [c.mechanisms[name] for c in self.checks if name in c.mechanisms]
        for status in (DROPPED, APPLIED, REMOVED):
            if status in seen:
                return status
        return "not verified" if UNCLEAR in seen else UNEXERCISED

    def problems(self) -> list[str]:
        """What failed, the diagnosis first: mechanisms dropped or not verified, then the checks out of tolerance."""
        out = [f"{_where(c)}: {c.note}" for c in self.checks if c.note and not math.isfinite(c.error)]
        for name in MECHANISMS:
            status = self.mechanism(name)
            if status == DROPPED:
                layers = sorted(
                    {c.layer for c in self.checks if c.mechanisms.get(name) == DROPPED and c.layer is not None}
                )
                out.append(f"{name} DROPPED (layers {', '.join(map(str, layers))})")
            elif status in ("not verified", UNEXERCISED) and name in self.required:
                out.append(
                    f"{name} {status}: "
                    + ("the layers are off for another reason" if status != UNEXERCISED else "no probe exercised it")
                )
        out += [
            f"{_where(c)}: error {c.error:.3g} > tolerance {c.tolerance:.1g}"
            for c in self.checks
            if not c.ok and math.isfinite(c.error)
        ]
        return out

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.problems()

    def table(self) -> str:
        head = f"{'layer':>5}  {'probe':<22} {'error':>9} {'tolerance':>9}  {'ok':<3} mechanisms"
        lines = [head, "-" * len(head)]
        for c in self.checks:
            err = "-" if not math.isfinite(c.error) else f"{c.error:.2e}"
            mech = ", ".join(f"{k} {v}" for k, v in c.mechanisms.items())
            lines.append(
                f"{'-' if c.layer is None else c.layer:>5}  {c.probe:<22} {err:>9} {c.tolerance:>9.0e}  "
                f"{'yes' if c.ok else 'NO':<3} {mech or c.note}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        return "; ".join(f"{m} {self.mechanism(m)}" for m in MECHANISMS if m != "prefix" or m in self.expected)

    def __str__(self) -> str:
        header = (
            f"hf_qknorm verify: {self.model}{f' ({self.source})' if self.source else ''}\n"
            f"scheme {self.scheme}, attention backend {self.backend!r}, cache {self.cache}, dtype {self.dtype}"
        )
        verdict = "OK" if self.ok else "FAILED: " + "; ".join(self.problems()[:8])
        return f"{header}\n{self.table()}\nmechanisms: {self.summary()}\n{verdict}"


def _where(c: Check) -> str:
    return f"{c.probe}" if c.layer is None else f"layer {c.layer} {c.probe}"
