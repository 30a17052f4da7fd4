#!/usr/bin/env bash
# The decode and step figures on a CUDA machine (one GPU, bf16), in one command of under ten minutes; rows are
# appended to benchmarks/results/decode.jsonl (device, dtype, versions, route and command in each) and, where $OUT is
# set, copied there as decode_gpu.jsonl.
#   bash benchmarks/run_gpu.sh [label]
# Shapes: tiny (4 layers, hidden 64: every kernel launch costs more than its work) and 1b (Llama-3.2-1B's layer,
# 8 of them). Each step has its own time limit; a step that fails or runs out is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
label=${1:-gpu}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
before=$(wc -l < benchmarks/results/decode.jsonl 2>/dev/null || echo 0)
status=0
step() {  # step SECONDS ARGS...: one bench_decode.py run on CUDA
  local limit=$1
  shift
  timeout "$limit" python3 benchmarks/bench_decode.py --device cuda --label "$label" "$@" || {
    echo "!! bench_decode.py $* ended with $?" >&2
    status=1
  }
}
# one decoding forward at a time (dynamic cache, eager), every scheme and the norms' ablations beside them
step 150 --table token --shapes tiny 1b --batch 1 8 --prompt 512 --rounds 8 \
  --schemes qk_norm soft_cap qk_norm_cap qkv_norm qk_norm_noop
# the capped schemes with every attention call on the PyTorch path (kernel_policy(devices=()))
step 90 --table token --shapes tiny 1b --batch 1 8 --prompt 512 --rounds 8 --route pytorch --schemes soft_cap qk_norm_cap
# whole greedy generations of 128 new tokens, eager (generate's own compile turned off), dynamic and static caches
step 120 --table decode --shapes tiny 1b --caches dynamic static --batch 1 --prompt 512 --rounds 2 \
  --schemes qk_norm qk_norm_cap
# generate's compiled decoding with the static cache (CUDA graphs: Transformers' "reduce-overhead")
step 140 --table decode --caches static --compile --shapes 1b --batch 1 --prompt 512 --rounds 2 --schemes qk_norm_cap
# a training step (forward, backward, fused AdamW), batch 1
step 60 --table step --shapes 1b --seq 2048 --rounds 5
if [ -n "${OUT:-}" ]; then tail -n +"$((before + 1))" benchmarks/results/decode.jsonl > "$OUT/decode_gpu.jsonl"; fi
exit $status
