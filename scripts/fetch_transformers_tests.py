#!/usr/bin/env python3
"""Fetch Transformers' common model tests for the INSTALLED Transformers version into a cache outside the repository.

``tests/transformers_suite/`` runs Transformers' own ``ModelTesterMixin`` on patched models. Transformers' test code
is not part of this repository: this script downloads the sdist of the installed version from the package index
(``pip download --no-binary :all: --no-deps transformers==X``, so pip's own index settings apply), checks that it is
that version, and extracts the few test files the suite imports (:data:`FILES`) into

    ${HF_QKNORM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/hf_qknorm}/transformers-tests/<version>/

with a ``SOURCE.json`` recording the sdist and the SHA-256 of every extracted file. A complete cache is reused.

Exit status: 0 fetched (or cached), the folder on stdout; 3 the package index cannot be reached (a loud banner on
stderr; the suite then skips with that reason); 1 anything else (a version not on the index, a corrupt sdist...).

    python scripts/fetch_transformers_tests.py [--version 5.23.0] [--python .venv-oldest/bin/python]

Standard library only: the test suite imports it by path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# The test files of the sdist that the suite imports, relative to the sdist's top folder.
FILES = ("tests/test_modeling_common.py", "tests/test_configuration_common.py")
UNREACHABLE_EXIT = 3
# Once the index was found unreachable, the test session does not retry for this long (a CI setup step that could
# not fetch does not make every later pytest run wait on network timeouts again).
RETRY_AFTER_S = 900
# pip's messages when no index could be contacted at all (as opposed to a version the index does not have).
_NETWORK_SIGNS = (
    "Could not fetch URL",
    "connection broken by",
    "Max retries exceeded",
    "NewConnectionError",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Name or service not known",
    "Temporary failure in name resolution",
    "ProxyError",
    "ConnectTimeout",
    "Read timed out",
)


class Unreachable(RuntimeError):
    """The package index could not be reached: the suite is skipped with this reason, never silently."""


class FetchError(RuntimeError):
    """Anything else that went wrong: a failure."""


def cache_dir(version: str) -> Path:
    root = os.environ.get("HF_QKNORM_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "hf_qknorm"
    )
    return Path(root) / "transformers-tests" / version


def installed_version(python: str | None = None) -> str:
    if python is None:
        from importlib.metadata import version

        return version("transformers")
    out = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('transformers'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def cached(version: str) -> Path | None:
    """The cache folder of ``version`` if it is complete, else ``None``."""
    folder = cache_dir(version)
    if not (folder / "SOURCE.json").is_file():
        return None
    return folder if all((folder / f).is_file() for f in (*FILES, "tests/__init__.py")) else None


def recently_unreachable(version: str) -> str | None:
    """The message of an 'index unreachable' failure recorded less than :data:`RETRY_AFTER_S` ago, else ``None``."""
    marker = _marker(version)
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data.get("message") if time.time() - data.get("time", 0) < RETRY_AFTER_S else None


def fetch(version: str, timeout_s: int = 20) -> Path:
    """Download the sdist of Transformers ``version`` and extract :data:`FILES`; returns the cache folder."""
    done = cached(version)
    if done is not None:
        return done
    folder = cache_dir(version)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{version}.tmp-") as tmp:
        sdist = _download(version, Path(tmp) / "dl", timeout_s)
        staging = Path(tmp) / "out"
        _extract(sdist, version, staging)
        if folder.exists():  # an incomplete earlier attempt
            _remove_tree(folder)
        staging.rename(folder)
    _marker(version).unlink(missing_ok=True)
    return folder


def _marker(version: str) -> Path:
    return cache_dir(version).parent / f"{version}.unreachable.json"


def _download(version: str, dest: Path, timeout_s: int) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-binary",
        ":all:",
        "--no-deps",
        "--disable-pip-version-check",
        "--timeout",
        str(timeout_s),
        "--retries",
        "1",
        "-d",
        str(dest),
        f"transformers=={version}",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        tail = "\n".join(log.strip().splitlines()[-6:])
        if any(sign in log for sign in _NETWORK_SIGNS):
            message = f"the package index could not be reached to download transformers=={version}: {tail}"
            _marker(version).parent.mkdir(parents=True, exist_ok=True)
            _marker(version).write_text(json.dumps({"time": time.time(), "message": message}))
            raise Unreachable(message)
        raise FetchError(f"pip could not download the sdist of transformers=={version}:\n{tail}")
    found = sorted(dest.glob("transformers-*.tar.gz"))
    if len(found) != 1:
        raise FetchError(f"expected one transformers sdist in {dest}, found {[p.name for p in dest.iterdir()]}")
    return found[0]


def _extract(sdist: Path, version: str, out: Path) -> None:
    top = f"transformers-{version}"
    record = {"sdist": sdist.name, "sha256": _sha256(sdist.read_bytes()), "files": {}}
    with tarfile.open(sdist) as tar:
        try:
            meta = tar.extractfile(f"{top}/PKG-INFO").read().decode()
        except (KeyError, AttributeError):
            meta = ""
        if f"\nVersion: {version}\n" not in meta:
            raise FetchError(f"{sdist.name} is not transformers {version} (PKG-INFO disagrees)")
        for name in FILES:
            try:
                member = tar.extractfile(f"{top}/{name}")
            except KeyError:
                member = None
            if member is None:
                raise FetchError(f"{sdist.name} has no {name}; the suite needs it")
            data = member.read()
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            record["files"][name] = _sha256(data)
    # The sdist's tests/ folder is no package; the suite imports it as one (and Transformers' test code loads its
    # folder's __init__.py), so an empty one is added.
    (out / "tests" / "__init__.py").write_text("")
    (out / "SOURCE.json").write_text(json.dumps(record, indent=1) + "\n")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def banner(message: str) -> str:
    line = "!" * 100
    return (
        f"\n{line}\n!! Transformers' common model tests are NOT available and will be SKIPPED:\n!! {message}\n{line}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="Transformers version (default: the one installed for --python)")
    parser.add_argument("--python", help="interpreter whose installed Transformers version to fetch")
    parser.add_argument("--timeout", type=int, default=20, help="network timeout per request in seconds")
    args = parser.parse_args(argv)
    version = args.version or installed_version(args.python)
    try:
        folder = fetch(version, args.timeout)
    except Unreachable as exc:
        print(banner(str(exc)), file=sys.stderr)
        return UNREACHABLE_EXIT
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
