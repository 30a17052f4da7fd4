"""The harness around Transformers' common tests: how outcomes are judged, that the list of differences is complete
and explained, that the suite's models really are patched, and how the test sources are fetched (offline)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from tests.transformers_suite import differences, upstream_tests
from tests.transformers_suite import test_transformers_common as suite
from tests.transformers_suite.differences import Difference, judge
from tests.transformers_suite.variants import BASELINE, FAMILIES, VARIANTS


def _entry(**kw):
    base = dict(
        id="x",
        tests=("test_a*",),
        variants=("cap-*",),
        families=("*",),
        outcome="fail",
        match="boom",
        reason="r",
        kind="intended",
    )
    return Difference(**{**base, **kw})


# --- judging ----------------------------------------------------------------------------------------------------------
def test_a_listed_difference_is_excused_only_with_its_error():
    entries = [_entry()]
    assert judge(entries, "llama", "cap-2", "test_a1", "fail", "ValueError: boom", "pass").outcome == "listed"
    other = judge(entries, "llama", "cap-2", "test_a1", "fail", "ValueError: bang", "pass")
    assert other.outcome == "fail" and "expects fail" in other.note


def test_a_listed_difference_that_no_longer_occurs_fails():
    verdict = judge([_entry()], "llama", "cap-2", "test_a1", "pass", "", "pass")
    assert verdict.outcome == "fail" and "no longer occurs" in verdict.note


def test_a_listed_test_skipped_unpatched_too_is_a_skip():
    """A Transformers version that skips the test itself (both sides skipped): nothing to compare, not a failure;
    skipped on the patched side only, it still fails."""
    assert judge([_entry()], "llama", "cap-2", "test_a1", "skip", "Skipped: not a priority", "skip").outcome == "skip"
    verdict = judge([_entry()], "llama", "cap-2", "test_a1", "skip", "Skipped: not a priority", "pass")
    assert verdict.outcome == "fail" and "expects fail" in verdict.note


def test_an_unlisted_failure_or_lost_test_fails_and_says_whether_it_is_new():
    new = judge([_entry()], "llama", "cap-2", "test_b", "fail", "AssertionError", "pass")
    assert new.outcome == "fail" and "NEW difference" in new.note
    both = judge([_entry()], "llama", "cap-2", "test_b", "fail", "AssertionError", "fail")
    assert both.outcome == "fail" and "fails too" in both.note
    skipped = judge([_entry()], "llama", "cap-2", "test_b", "skip", "Skipped: no", "pass")
    assert skipped.outcome == "fail" and "skipped" in skipped.note
    assert judge([_entry()], "llama", "cap-2", "test_b", "skip", "Skipped: no", "skip").outcome == "skip"
    assert judge([_entry()], "llama", "cap-2", "test_b", "pass", "", "pass").outcome == "pass"


def test_an_entry_is_scoped_and_a_test_is_listed_once():
    entries = [_entry(families=("gpt2",), exclude=("gpt2/*/test_a9",))]
    assert judge(entries, "llama", "cap-2", "test_a1", "fail", "boom", "pass").outcome == "fail"
    assert judge(entries, "gpt2", "cap-2", "test_a9", "fail", "boom", "pass").outcome == "fail"
    assert judge(entries, "gpt2", "cap-2", "test_a1", "fail", "boom", "pass").outcome == "listed"
    assert judge([_entry(transformers=">=99")], "llama", "cap-2", "test_a1", "fail", "boom", "pass").outcome == "fail"
    assert judge([_entry(transformers=">=5")], "llama", "cap-2", "test_a1", "fail", "boom", "pass").outcome == "listed"
    assert judge([_entry(variants=("*",))], "llama", "baseline", "test_a1", "pass", "", None).outcome == "pass"
    twice = [_entry(), _entry(id="y")]
    assert "several entries" in judge(twice, "llama", "cap-2", "test_a1", "fail", "boom", "pass").note


# --- the list ---------------------------------------------------------------------------------------------------------
def test_every_listed_difference_is_explained_in_the_docs():
    entries = differences.load()
    assert entries, "expected_differences.toml lists nothing"
    assert differences.undocumented(entries) == [], "explain these ids in docs/transformers_suite.md"


def test_every_entry_names_real_tests_variants_and_families():
    from fnmatch import fnmatchcase

    names = [v.name for v in VARIANTS]
    if suite.UPSTREAM.unavailable is not None:
        pytest.skip("Transformers' common tests are unavailable")
    tests = [t for t in dir(suite.UPSTREAM.modeling.ModelTesterMixin) if t.startswith("test_")]
    for entry in differences.load():
        for pattern in entry.tests if differences._version_matches(entry.transformers) else ():
            # (an entry about other Transformers versions may name a test this one does not have)
            assert any(fnmatchcase(t, pattern) for t in tests), f"{entry.id}: no test matches {pattern!r}"
        for pattern in entry.variants:
            assert pattern == BASELINE.name or any(fnmatchcase(v, pattern) for v in names), (entry.id, pattern)
        for pattern in entry.families:
            assert any(fnmatchcase(f, pattern) for f in FAMILIES), (entry.id, pattern)


# --- the models under test --------------------------------------------------------------------------------------------
def _cases():
    if suite.UPSTREAM.unavailable is not None:
        return []
    return [
        obj
        for obj in vars(suite).values()
        if isinstance(obj, type) and hasattr(obj, "_tester_class") and obj.__name__.startswith("Test_")
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.__name__)
def test_the_suite_runs_patched_models_of_its_variant(case):
    """Each head class of a patched variant builds a model patched with the variant's scheme (and nothing else
    differs from the class the plugin provides but its name); the baseline's models are not patched."""
    import hf_qknorm
    from hf_qknorm import get_family
    from hf_qknorm.portable.families import base_model_type
    from hf_qknorm.portable.norms import NORM_CLASSES

    tester = case._tester_class(None, case.variant)
    for cls in case.all_model_classes:
        model = cls(tester.get_config())
        settings = hf_qknorm.qknorm_config(model)
        if not case.variant.patched:
            assert settings is None and not hf_qknorm.is_patched(model)
            continue
        assert {k: v for k, v in settings.to_dict().items() if k in case.variant.settings} == case.variant.settings
        # q/k norms in every layer: the scheme's, or for soft_cap (which has none) only the family's own (Qwen3's)
        # (the scheme's norms wherever they live: q_norm, a native slot, or beside a kept whole-projection norm)
        if settings.norms_qk:
            norms = [m for m in model.modules() if isinstance(m, NORM_CLASSES)]
            wanted = (3 if settings.norms_v else 2) * tester.num_hidden_layers
        else:
            norms = [n for n, _ in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
            family = get_family(base_model_type(model.config.model_type))
            own = family.native_qk_norm or bool(family.kept)
            wanted = 2 * tester.num_hidden_layers if own else 0
        assert len(norms) == wanted, (cls.__name__, case.variant.name, len(norms))
        assert model._get_name() == cls.__name__
        if case.variant.route == "config":
            parent = cls.__mro__[1]
            assert parent.__name__.startswith("QKNorm") and cls.config_class is parent.config_class
            # Transformers sets config_class and caches a flag on every subclass; nothing else is defined here
            own = set(vars(cls)) - {"__module__", "__qualname__", "__doc__", "config_class"}
            assert {k for k in own if not k.endswith("_cached_value")} == set(), own


# --- fetching the sources ---------------------------------------------------------------------------------------------
def _sdist(path, version, files):
    with tarfile.open(path, "w:gz") as tar:
        meta = f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n"
        for name, text in {"PKG-INFO": meta, **files}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"transformers-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_QKNORM_CACHE", str(tmp_path / "cache"))
    return upstream_tests.fetch_module()


def test_fetch_extracts_the_test_files_of_the_right_version(tmp_path, fetch):
    files = {name: f"# {name}\n" for name in fetch.FILES}
    _sdist(tmp_path / "good.tar.gz", "9.9.9", files)
    out = tmp_path / "out"
    fetch._extract(tmp_path / "good.tar.gz", "9.9.9", out)
    for name in fetch.FILES:
        assert (out / name).read_text() == f"# {name}\n"
    record = json.loads((out / "SOURCE.json").read_text())
    assert record["sdist"] == "good.tar.gz" and set(record["files"]) == set(fetch.FILES)

    _sdist(tmp_path / "other.tar.gz", "9.9.8", files)
    with pytest.raises(fetch.FetchError, match="not transformers 9.9.9"):
        fetch._extract(tmp_path / "other.tar.gz", "9.9.9", tmp_path / "o2")
    _sdist(tmp_path / "short.tar.gz", "9.9.9", {fetch.FILES[0]: ""})
    with pytest.raises(fetch.FetchError, match="has no"):
        fetch._extract(tmp_path / "short.tar.gz", "9.9.9", tmp_path / "o3")
    assert fetch.cached("9.9.9") is None


@pytest.mark.spawns
def test_an_unreachable_index_is_told_apart_and_remembered(fetch, monkeypatch):
    # Nothing listens on port 9 of this machine: pip cannot reach the index (and never leaves the machine).
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(fetch.Unreachable, match="could not be reached"):
        fetch.fetch("9.9.9", timeout_s=2)
    assert fetch.recently_unreachable("9.9.9") is not None
    assert "SKIPPED" in fetch.banner("x")
