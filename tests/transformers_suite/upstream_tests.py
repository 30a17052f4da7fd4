"""Import Transformers' ``ModelTesterMixin`` and ``ConfigTester`` from the sdist of the installed version.

The test files come from ``scripts/fetch_transformers_tests.py`` (a cache outside the repository, fetched from the
package index on first use). They are imported as the package :data:`PACKAGE`, whose search path is the cached
``tests/`` folder followed by ``shims/`` (this project's stand-ins for the modules the sdist lacks), so their relative
imports (``from .generation.test_utils import ...``) resolve without copying anything into the repository.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
FETCH_SCRIPT = HERE.parents[1] / "scripts" / "fetch_transformers_tests.py"
PACKAGE = "transformers_sdist_tests"


@dataclass
class Upstream:
    """What the suite takes from Transformers' test code, or why it is unavailable."""

    version: str
    modeling: types.ModuleType | None = None  # tests/test_modeling_common.py
    configuration: types.ModuleType | None = None  # tests/test_configuration_common.py
    folder: Path | None = None
    unavailable: str | None = None  # the skip reason when the sources could not be had


def fetch_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("_hf_qknorm_fetch_transformers_tests", FETCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> Upstream:
    """Fetch (if needed) and import the upstream test modules. An unreachable package index gives an
    :class:`Upstream` with ``unavailable`` set; any other problem raises."""
    import transformers

    version = transformers.__version__
    fetch = fetch_module()
    folder = fetch.cached(version)
    if folder is None:
        recent = fetch.recently_unreachable(version)
        if recent is not None:
            return Upstream(version, unavailable=f"{recent} (recorded less than {fetch.RETRY_AFTER_S} s ago)")
        try:
            folder = fetch.fetch(version)
        except fetch.Unreachable as exc:
            return Upstream(version, unavailable=str(exc))
    package = sys.modules.get(PACKAGE)
    if package is None:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(folder / "tests"), str(SHIMS)]
        sys.modules[PACKAGE] = package
    try:
        modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
        configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"Transformers {version}'s common tests (in {folder}) need {exc.name!r}, which is "
            "not installed: pip install -e '.[dev]'"
        ) from exc
    return Upstream(version, modeling, configuration, folder)
