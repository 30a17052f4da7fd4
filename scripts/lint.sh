#!/usr/bin/env bash
# Lint and format check (ruff, configured in pyproject.toml [tool.ruff]); CI runs it first. To fix what it reports:
#   ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
want=$(python3 -c 'import re; print(re.search(r"\"ruff==([^\"]+)\"", open("pyproject.toml").read()).group(1))')
if [ "$(python3 -m ruff --version 2>/dev/null | cut -d' ' -f2)" != "$want" ]; then
    python3 -m pip install -q "ruff==$want"
fi
python3 -m ruff check .
python3 -m ruff format --check .
