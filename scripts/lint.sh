#!/usr/bin/env bash
# Lint and format check (ruff, configured in pyproject.toml [tool.ruff]); CI runs it first. To fix what it reports:
#   ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh  # the project's environment (scripts/setup.sh makes it)
if [ ! -x "$PY" ]; then
  echo "$0: the project's environment $VENV is missing; run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
want=$("$PY" -c 'import re; print(re.search(r"\"ruff==([^\"]+)\"", open("pyproject.toml").read()).group(1))')
if [ "$("$PY" -m ruff --version 2>/dev/null | cut -d' ' -f2)" != "$want" ]; then
    "$PY" -m pip install -q "ruff==$want"
fi
"$PY" -m ruff check .
"$PY" -m ruff format --check .
