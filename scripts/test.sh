#!/usr/bin/env bash
# Set up, then run the test suite (CPU; the Triton kernels run under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
python3 -m pytest -q -p no:cacheprovider "$@"
