"""Judges every Transformers common test on a patched model against the unpatched run (``differences.py``).

- A test of a ``Test_<family>_<variant>`` class that fails, or is skipped where the baseline passed, must be listed in
  ``expected_differences.toml`` with an error that matches the entry; it is then reported as xfail with the entry's
  id and reason. Anything else fails, with a note that says whether it is a new difference.
- A listed difference whose test passes fails ("no longer occurs"), so the list does not rot.
- The summary prints the counts per family and variant and every difference from the baseline; with
  ``HF_QKNORM_SUITE_REPORT=path.json`` it also writes them as JSON. If Transformers' test sources could not be fetched,
  the summary says so in a banner.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter, defaultdict

import pytest

from tests.transformers_suite import differences

# The stand-ins are imported as part of Transformers' test package (upstream_tests.py), never collected on their own.
collect_ignore = ["shims"]
ENTRIES = differences.load()
IDENTITY = pytest.StashKey[tuple]()
RESULTS: dict[tuple[str, str, str], dict] = {}
REPORT_ENV = "HF_QKNORM_SUITE_REPORT"


def pytest_configure(config):
    # Marks Transformers' test code uses, registered so pytest does not warn about them.
    for mark in _upstream_marks():
        config.addinivalue_line("markers", f"{mark}: used by Transformers' common tests")


def _upstream_marks() -> set[str]:
    import transformers

    from tests.transformers_suite.upstream_tests import fetch_module

    folder = fetch_module().cached(transformers.__version__)
    if folder is None:
        return set()
    text = (folder / "tests" / "test_modeling_common.py").read_text()
    return set(re.findall(r"\bmark\.(\w+)", text)) - {"skip", "skipif", "xfail", "parametrize", "usefixtures"}


def pytest_collection_modifyitems(config, items):
    from tests.transformers_suite.variants import deselected

    kept, dropped = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        variant = getattr(cls, "variant", None)
        if variant is not None and hasattr(cls, "family"):
            if deselected(item.name):
                dropped.append(item)
                continue
            item.stash[IDENTITY] = (cls.family, variant.name, item.name)
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    ident = item.stash.get(IDENTITY, None)
    if ident is None or rep.when != "call":
        return
    family, variant, test = ident
    got = "pass" if rep.passed else "fail" if rep.failed else "skip"
    message = _describe(call.excinfo)
    baseline = RESULTS.get((family, "baseline", test), {}).get("got")
    verdict = differences.judge(ENTRIES, family, variant, test, got, message, baseline)
    RESULTS[ident] = {
        "got": got,
        "verdict": verdict.outcome,
        "entry": verdict.entry,
        "note": verdict.note,
        "message": message.strip().splitlines()[0][:300] if message.strip() else "",
    }
    if verdict.outcome == "listed":
        rep.outcome, rep.wasxfail = "skipped", verdict.note
    elif verdict.outcome == "fail" and got == "fail":
        if hasattr(rep.longrepr, "addsection"):
            rep.longrepr.addsection("hf_qknorm: expected differences", verdict.note)
        else:
            rep.sections.append(("hf_qknorm: expected differences", verdict.note))
    elif verdict.outcome == "fail":
        rep.outcome, rep.longrepr = "failed", verdict.note


def _describe(excinfo) -> str:
    """The error (or skip reason), then the failing statements in Transformers' test code: what an entry of
    ``expected_differences.toml`` matches (an assertion message alone rarely says which check failed)."""
    if excinfo is None:
        return ""
    statements = []
    for entry in excinfo.traceback:
        if "test_modeling_common" in str(entry.path) or "test_configuration_common" in str(entry.path):
            try:
                statements.append(str(entry.statement).strip().splitlines()[0])
            except (IndexError, OSError):
                continue
    return excinfo.exconly() + ("\nat: " + " | ".join(statements) if statements else "")


def summarize() -> dict:
    """Counts per family/variant and the differences from the baseline, from this session's results."""
    counts: dict[str, Counter] = defaultdict(Counter)
    diffs = []
    for (family, variant, test), r in sorted(RESULTS.items()):
        counts[f"{family}/{variant}"][r["verdict"] if r["verdict"] in ("listed", "fail") else r["got"]] += 1
        base = RESULTS.get((family, "baseline", test), {}).get("got")
        if variant != "baseline" and base == "pass" and r["got"] != "pass":
            diffs.append(
                {
                    "family": family,
                    "variant": variant,
                    "test": test,
                    "got": r["got"],
                    "entry": r["entry"] if r["verdict"] == "listed" else None,
                    "message": r["message"],
                }
            )
    return {"counts": {k: dict(v) for k, v in counts.items()}, "differences": diffs}


def pytest_terminal_summary(terminalreporter):
    suite = sys.modules.get("tests.transformers_suite.test_transformers_common")
    if suite is None:
        return
    UPSTREAM = suite.UPSTREAM  # noqa: N806
    write = terminalreporter.write_line
    if UPSTREAM.unavailable is not None:
        terminalreporter.write_sep("!", "Transformers' common model tests were SKIPPED", red=True, bold=True)
        write(f"transformers {UPSTREAM.version}: {UPSTREAM.unavailable}", red=True, bold=True)
        write("fetch them with: python scripts/fetch_transformers_tests.py", red=True, bold=True)
        return
    if not RESULTS:
        return
    summary = summarize()
    terminalreporter.write_sep("=", f"Transformers {UPSTREAM.version} common tests on patched models")
    write(f"{'family/variant':34} {'pass':>5} {'skip':>5} {'listed':>7} {'fail':>5}")
    for key, c in summary["counts"].items():
        write(f"{key:34} {c.get('pass', 0):>5} {c.get('skip', 0):>5} {c.get('listed', 0):>7} {c.get('fail', 0):>5}")
    by_entry = Counter(d["entry"] or "NOT LISTED" for d in summary["differences"])
    write(
        "differences from the unpatched run, by entry of expected_differences.toml: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(by_entry.items())) or "none")
    )
    for d in summary["differences"]:
        if d["entry"] is None:
            write(f"  NOT LISTED: {d['family']}/{d['variant']} {d['test']} ({d['got']}): {d['message']}", red=True)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "transformers": UPSTREAM.version,
                    **summary,
                    "results": {"/".join(k): v for k, v in sorted(RESULTS.items())},
                },
                f,
                indent=1,
            )
        write(f"report written to {path}")
