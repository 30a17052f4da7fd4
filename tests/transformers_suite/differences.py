"""The listed differences between patched and unpatched runs of Transformers' common tests
(``expected_differences.toml``, explained in ``docs/transformers_suite.md``), and how a test's outcome is judged.

A test of a patched variant that fails (or is skipped where the baseline passed) must match exactly one listed entry
-- by family, variant, test name and the error message -- or the suite fails. A listed entry whose tests now pass
fails too (the list must not rot); so does an entry that is not explained in the docs.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
LIST_PATH = HERE / "expected_differences.toml"
DOCS_PATH = HERE.parents[1] / "docs" / "transformers_suite.md"
OUTCOMES = ("fail", "skip")


@dataclass(frozen=True)
class Difference:
    id: str
    tests: tuple[str, ...]  # fnmatch patterns on the test method name
    variants: tuple[str, ...]  # fnmatch patterns on variant names (``baseline`` included)
    families: tuple[str, ...]  # fnmatch patterns on family names
    outcome: str  # "fail" or "skip"
    match: str  # regex the error (or skip reason) must contain
    reason: str
    kind: str  # "intended", "upstream" (Transformers' test cannot apply), "environment"
    exclude: tuple[str, ...] = ()  # fnmatch patterns on "family/variant/test" the entry does not cover
    transformers: str = ""  # a version specifier ("<5.23"): the Transformers versions the entry is about

    def applies(self, family: str, variant: str, test: str) -> bool:
        # patterns match patched variants; the baseline only where an entry names it
        variant_ok = "baseline" in self.variants if variant == "baseline" else _any(self.variants, variant)
        return (
            _any(self.families, family)
            and variant_ok
            and _any(self.tests, test)
            and not _any(self.exclude, f"{family}/{variant}/{test}")
            and _version_matches(self.transformers)
        )

    def explains(self, message: str) -> bool:
        return re.search(self.match, message, flags=re.S) is not None


def _version_matches(spec: str) -> bool:
    if not spec:
        return True
    import transformers
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(transformers.__version__, prereleases=True)


def _any(patterns, name) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def load(path: Path = LIST_PATH) -> list[Difference]:
    data = tomllib.loads(path.read_text())
    out, seen = [], set()
    for i, raw in enumerate(data.get("difference", [])):
        unknown = set(raw) - {
            "id",
            "tests",
            "variants",
            "families",
            "outcome",
            "match",
            "reason",
            "kind",
            "exclude",
            "transformers",
        }
        if unknown:
            raise ValueError(f"{path.name}: entry {i} has unknown keys {sorted(unknown)}")
        entry = Difference(
            id=raw["id"],
            tests=tuple(raw["tests"]),
            variants=tuple(raw["variants"]),
            families=tuple(raw.get("families", ["*"])),
            outcome=raw.get("outcome", "fail"),
            match=raw["match"],
            reason=" ".join(raw["reason"].split()),
            kind=raw["kind"],
            exclude=tuple(raw.get("exclude", ())),
            transformers=raw.get("transformers", ""),
        )
        if entry.outcome not in OUTCOMES or entry.kind not in ("intended", "upstream", "environment"):
            raise ValueError(f"{path.name}: entry {entry.id!r} has outcome {entry.outcome!r} / kind {entry.kind!r}")
        if entry.id in seen:
            raise ValueError(f"{path.name}: duplicate id {entry.id!r}")
        re.compile(entry.match)
        seen.add(entry.id)
        out.append(entry)
    return out


def lookup(entries: list[Difference], family: str, variant: str, test: str) -> list[Difference]:
    return [e for e in entries if e.applies(family, variant, test)]


def undocumented(entries: list[Difference], docs: Path = DOCS_PATH) -> list[str]:
    """Ids of entries that ``docs/transformers_suite.md`` does not explain (a heading or line naming the id)."""
    text = docs.read_text() if docs.is_file() else ""
    return [e.id for e in entries if f"`{e.id}`" not in text]


@dataclass(frozen=True)
class Verdict:
    """How a test's outcome is reported: ``pass``, ``skip``, ``fail`` or ``listed`` (an expected difference,
    reported as xfail), with the note that explains it."""

    outcome: str
    note: str = ""
    entry: str | None = None


def judge(
    entries: list[Difference], family: str, variant: str, test: str, got: str, message: str, baseline: str | None
) -> Verdict:
    """The verdict on ``test`` of ``family``/``variant`` whose outcome was ``got`` (``pass``/``fail``/``skip``) with
    ``message`` (the error, or the skip reason). ``baseline``: the same test's outcome on the unpatched model in this
    session, ``None`` when it did not run."""
    listed = lookup(entries, family, variant, test)
    if len(listed) > 1:
        return Verdict(
            "fail", f"{test} is listed by several entries ({', '.join(e.id for e in listed)}); list each test once"
        )
    if listed:
        entry = listed[0]
        if got == "skip" != entry.outcome and baseline == "skip":
            # skipped patched and unpatched alike (this Transformers skips the test itself): no difference to judge
            return Verdict(got)
        if got == entry.outcome and entry.explains(message):
            return Verdict("listed", f"[{entry.id}] {entry.reason}", entry.id)
        if got == "pass":
            return Verdict(
                "fail",
                f"listed difference [{entry.id}] no longer occurs: {test} passes on "
                f"{family}/{variant}; remove it from {LIST_PATH.name} (or narrow the entry)",
                entry.id,
            )
        return Verdict(
            "fail",
            f"listed difference [{entry.id}] expects {entry.outcome} matching {entry.match!r}, "
            f"but the test gave {got}: {message.strip()[:500]}",
            entry.id,
        )
    where = f"{family}/{variant}"
    if got == "fail":
        before = {"pass": "passes", "fail": "fails too", "skip": "is skipped"}.get(baseline, "did not run")
        kind = "a NEW difference" if baseline == "pass" else "a failure"
        return Verdict(
            "fail",
            f"{kind} not listed in {LIST_PATH.name}: {test} fails on {where} (unpatched it "
            f"{before}). Fix it, or list it with its reason (docs/transformers_suite.md)",
        )
    if got == "skip" and variant != "baseline" and baseline == "pass":
        return Verdict(
            "fail",
            f"a NEW difference not listed in {LIST_PATH.name}: {test} passes unpatched but is "
            f"skipped on {where} ({message.strip()[:300]})",
        )
    return Verdict(got)
