#!/usr/bin/env bash
# The main job on its embedded default: set up (the project's environment, scripts/setup.sh), then convert the bundled tiny Llama (pretrained on Tiny Shakespeare)
# into a Hub-ready folder with calibrated QK-norm + cap, printing the perplexity report. Extra arguments go to
# `hf-qknorm convert` (e.g. `bash scripts/main.sh path/to/llama out --scheme qk_norm --norm rmsnorm`).
set -euo pipefail
cd "$(dirname "$0")/.."
HF_QKNORM_EXTRAS="" bash scripts/setup.sh  # the package alone: no test or kernel tooling
source scripts/_venv.sh
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
if [ "$#" -eq 0 ]; then
  set -- --overwrite  # the default output folder converted/tiny-llama-qk_norm_cap-layernorm is rebuilt on each run
fi
"$VENV/bin/hf-qknorm" convert "$@"
