#!/usr/bin/env bash
# Every GPU figure of issue 50 in one command that fits one device call (the limits below sum to 585 s; run it with
# the device call's timeout_s 595):
#   bash benchmarks/run_gpu.sh [label]          # on a CUDA machine, bf16
#   bash benchmarks/run_gpu.sh --dry-run        # every section at a tiny size on CPU, nothing saved (tests)
# Sections, each under its own time limit (seconds, in the step lines below):
#   attention  bench_attention.py: our kernel with and without the cap, sdpa's default pick and sdpa pinned to cuDNN,
#              flash and efficient, FlexAttention with the tanh score_mod, flash-attn's softcap where installed
#              (then `python3 benchmarks/delegation_table.py --apply` on the rows); fwd, bwd, fwd+bwd TFLOP/s;
#              head_dim 64/128; T 1k, 4k, 16k; causal
#   norms      bench_norms.py: the per-head norms, fused kernels (tile variants) against the modules' ATen path
#   step       bench_decode.py --table step: the 1B-shaped training step, T 2k and 8k, every scheme and unpatched
#   step-fused-norms  the same at T 2k with HF_QKNORM_FUSED_NORMS=1, for the schemes with head norms
#   step-compiled  the same step compiled (torch.compile, inductor), T 2k, qk_norm and qk_norm_cap and unpatched
#   token      bench_decode.py --table token: one eager decoding forward, every scheme
#   decode     bench_decode.py --table decode: eager generations, dynamic and static cache; compiled static cache
# Rows go to benchmarks/results/attention_gpu.jsonl, norms_gpu.jsonl and decode.jsonl as the benchmarks write them
# (device, versions, date in each) and, at exit -- a failure included -- the rows of this run are copied to
# benchmarks/results/gpu/<date>-run.jsonl with the command, and to $OUT where it is set. A failing section (an error
# or its time limit) is named with its exit status on stderr and the next one runs: device time is scarce, and a
# broken kernel must not cost the step and decode rows. The run exits with the first failing section's status.
# Not a section here (the limits above fill the call): the tile sweep is its own device call, 420 s by default,
#   python3 benchmarks/sweep_tiles.py            # then --apply the .json it writes (docs/kernels.md, "Tile sizes")
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
  export TRITON_INTERPRET=1
fi
label=${1:-gpu}
command="bash benchmarks/run_gpu.sh $*"
attn=benchmarks/results/attention_gpu.jsonl
dec=benchmarks/results/decode.jsonl
norms=benchmarks/results/norms_gpu.jsonl
if [ "$dry" = 1 ]; then
  attn=$(mktemp)
  : > "$attn"
fi
attn_before=$(wc -l < "$attn" 2>/dev/null || echo 0)
dec_before=$(wc -l < "$dec" 2>/dev/null || echo 0)
norms_before=$(wc -l < "$norms" 2>/dev/null || echo 0)

rows_so_far() {  # this run's rows so far, each with the command and the exit status given
  {
    tail -n +"$((attn_before + 1))" "$attn" 2>/dev/null || true
    tail -n +"$((dec_before + 1))" "$dec" 2>/dev/null || true
    tail -n +"$((norms_before + 1))" "$norms" 2>/dev/null || true
  } | python3 -c 'import json, sys
for line in sys.stdin:
    if line.strip():
        row = json.loads(line)
        row["command"] = sys.argv[1]
        row["run_exit"] = None if sys.argv[2] == "running" else int(sys.argv[2])
        print(json.dumps(row))' "$command" "$1"
}

snapshot() {  # after each section: the rows so far in $OUT, in case the device call is cut off before the exit
  if [ "$dry" = 0 ] && [ -n "${OUT:-}" ]; then rows_so_far running > "$OUT/run-partial.jsonl" || true; fi
}

collect() {  # at exit: this run's rows, with the command, in one file
  local rc=$?
  if [ "$dry" = 0 ]; then
    local dest="benchmarks/results/gpu/$(date -u +%F)-run.jsonl"
    mkdir -p benchmarks/results/gpu
    rows_so_far "$rc" >> "$dest"
    echo "# rows of this run appended to $dest (exit $rc)"
    if [ -n "${OUT:-}" ]; then cp "$dest" "$OUT/" && rm -f "$OUT/run-partial.jsonl"; fi
  fi
  exit $rc
}
trap collect EXIT

first_failure=0
section() {  # section NAME SECONDS CMD...: one benchmark under a time limit; a failure is named, the run goes on
  local name=$1 limit=$2
  shift 2
  echo "## $name (limit ${limit}s): $*"
  local rc=0
  timeout "$limit" "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    if [ "$rc" = 124 ]; then echo "!! section $name ran out of its ${limit}s" >&2; fi
    echo "!! section $name ended with exit status $rc" >&2
    if [ "$first_failure" = 0 ]; then first_failure=$rc; fi
  fi
  snapshot
}

if [ "$dry" = 1 ]; then
  # bench_attention.py says there is no CUDA device and exits 0: its arguments are checked, nothing is timed
  section attention 60 python3 benchmarks/bench_attention.py --head-dims 64 --seqlens 128 --tokens 128 \
    --warmup 0 --reps 1 --out "$attn"
  # the dry run checks this script's sections and flags, at the least cost: the tiny shape, and for the compiled
  # step Dynamo's trace alone (tests/recipes/test_bench_decode.py compiles the step through aot_eager)
  section norms 120 python3 benchmarks/bench_norms.py --device cpu --seqlens 8 --tokens 8 --hidden 32 \
    --head-dims 16 --kinds rmsnorm --warmup 0 --reps 1 --tiles 4096:2048:4:4 64:32:2:4
  section step 120 python3 benchmarks/bench_decode.py --device cpu --no-save --table step --shapes tiny \
    --seq 16 --rounds 1 --schemes qk_norm_cap
  section step-fused-norms 120 env HF_QKNORM_FUSED_NORMS=1 python3 benchmarks/bench_decode.py --device cpu \
    --no-save --table step --shapes tiny --seq 16 --rounds 1 --schemes qk_norm
  section step-compiled 120 python3 benchmarks/bench_decode.py --device cpu --no-save --table step --shapes tiny \
    --seq 16 --rounds 1 --schemes qk_norm_cap --compile --compile-backend eager
  section token 120 python3 benchmarks/bench_decode.py --device cpu --no-save --table token --shapes tiny \
    --batch 1 --prompt 8 --rounds 1 --schemes qk_norm_cap
  section decode 120 python3 benchmarks/bench_decode.py --device cpu --no-save --table decode --shapes tiny \
    --caches dynamic static --batch 1 --prompt 8 --new-tokens 4 --rounds 1 --schemes qk_norm_cap
  rm -f "$attn"
  if [ "$first_failure" != 0 ]; then exit "$first_failure"; fi
  echo "# dry run: every section ran"
  exit 0
fi

python3 -c 'import torch, triton, transformers; print("#", torch.cuda.get_device_name(), "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)' || echo "!! could not name the device and versions" >&2
section attention 140 python3 benchmarks/bench_attention.py --head-dims 64 128 --seqlens 1024 4096 16384 \
  --providers sdpa sdpa-cudnn sdpa-flash sdpa-efficient flex-cap flash-cap qknorm-triton qknorm-nocap --warmup 2 --reps 5
section norms 40 python3 benchmarks/bench_norms.py --kinds rmsnorm layernorm --tiles 4096:2048:4:8 \
  2048:1024:4:4 8192:4096:8:8 --warmup 3 --reps 10
section step 90 python3 benchmarks/bench_decode.py --device cuda --label "$label" --table step --shapes 1b \
  --seq 2048 8192 --rounds 3
section step-fused-norms 30 env HF_QKNORM_FUSED_NORMS=1 python3 benchmarks/bench_decode.py --device cuda \
  --label "$label-fused-norms" --table step --shapes 1b --seq 2048 --rounds 3 --schemes qk_norm qk_norm_cap qkv_norm
section step-compiled 110 python3 benchmarks/bench_decode.py --device cuda --label "$label" --table step --shapes 1b \
  --seq 2048 --rounds 3 --compile --schemes qk_norm qk_norm_cap
section token 45 python3 benchmarks/bench_decode.py --device cuda --label "$label" --table token --shapes 1b \
  --batch 1 8 --prompt 512 --rounds 5 --schemes qk_norm soft_cap qk_norm_cap qkv_norm
section decode 60 python3 benchmarks/bench_decode.py --device cuda --label "$label" --table decode --shapes 1b \
  --caches dynamic static --batch 1 --prompt 512 --rounds 2 --schemes qk_norm qk_norm_cap
section decode-compiled 70 python3 benchmarks/bench_decode.py --device cuda --label "$label" --table decode \
  --caches static --compile --shapes 1b --batch 1 --prompt 512 --rounds 2 --schemes qk_norm_cap
exit "$first_failure"
