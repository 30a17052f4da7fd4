#!/usr/bin/env bash
# Set up (the project's environment, scripts/setup.sh), then run the test suite (CPU; the Triton kernels run under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_venv.sh
# Transformers' common model tests (tests/transformers_suite) come from the sdist of the installed Transformers,
# fetched from the package index into ~/.cache/hf_qknorm. Index unreachable (exit 3): the script prints a banner and
# the suite is skipped with that reason; any other fetch failure stops here.
fetch_rc=0
"$PY" scripts/fetch_transformers_tests.py || fetch_rc=$?
if [ "$fetch_rc" -eq 3 ]; then
  echo "!! continuing WITHOUT Transformers' common model tests (package index unreachable; see the banner above)" >&2
elif [ "$fetch_rc" -ne 0 ]; then
  exit "$fetch_rc"
fi
# timm (FastVLM's, Gemma 3n's and PerceptionLM's vision towers) in a folder of its own, for their test; not installable
# (exit 3): that test is skipped, saying why.
timm_rc=0
bash scripts/timm_env.sh || timm_rc=$?
if [ "$timm_rc" -ne 0 ] && [ "$timm_rc" -ne 3 ]; then
  exit "$timm_rc"
fi
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Test files are spread over worker processes (pytest-xdist; a module's tests stay together, so its fixtures are built
# once): as many as the CPUs, at most 4 -- each test uses one thread, and the distributed tests start 2-4 processes of
# their own. HF_QKNORM_TEST_WORKERS=1 runs everything in this process.
workers=${HF_QKNORM_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/test.sh: HF_QKNORM_TEST_WORKERS must be a whole number of processes, 1 or more; got '$workers'" >&2
  exit 2
fi
if [ "$workers" -eq 1 ]; then dist=(-p no:xdist); else dist=(-n "$workers" --dist loadscope); fi
"$PY" -m pytest -q -p no:cacheprovider "${dist[@]}" --durations=25 "$@"  # the slowest listed: CI has 25 minutes
