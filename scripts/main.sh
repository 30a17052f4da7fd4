#!/usr/bin/env bash
# The main job on its embedded default: set up, then run it. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
hf-qknorm demo "$@"
