#!/usr/bin/env bash
# The test suite on a CUDA machine whose Python already holds torch, Triton and Transformers (no package index
# needed): the Triton kernels run compiled on the GPU, not interpreted, and the tests marked `cuda` run.
# Transformers' common model tests (tests/transformers_suite) are left out: they are fetched from the package index.
#   bash scripts/test_gpu.sh                 # everything else
#   bash scripts/test_gpu.sh tests/kernels   # one folder
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "scripts/test_gpu.sh: torch sees no CUDA device; on a CPU machine run scripts/test.sh")'
# The package from this checkout: installed in place where pip can do it offline, else on the path.
python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -e . 2>/dev/null \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
workers=${HF_QKNORM_TEST_WORKERS:-$(python3 -c 'import os; print(max(1, min(14, len(os.sched_getaffinity(0)) - 2)))')}
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/test_gpu.sh: HF_QKNORM_TEST_WORKERS must be a whole number of processes, 1 or more; got '$workers'" >&2
  exit 2
fi
if [ "$workers" -eq 1 ]; then dist=(-p no:xdist); else dist=(-n "$workers" --dist loadscope); fi
if [ $# -eq 0 ]; then set -- tests; fi
python3 -m pytest -q -p no:cacheprovider "${dist[@]}" --ignore=tests/transformers_suite --durations=15 "$@"
