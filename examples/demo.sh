#!/usr/bin/env bash
# `make demo`: the main job on the built-in tiny model, start to finish, with the public CLI.
# Builds tiny-llama with 32-token blocks, then runs two scenarios, each variant 5 times alternating
# after an unrecorded warm-up round (and 2 uncounted warm-up requests per run): a
# shared-system-prompt workload with KV reuse on and off, and
# the A,B,A,B workload without and with a host cache. kvtool compare reports the medians, the
# runs' spread and whether the difference is larger than it, and plots the TTFT distributions.
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL=${KVTOOL:-.venv/bin/kvtool}
OUT=${OUT:-results/demo}
PLAN=plans/tiny-llama
rm -rf "$OUT" && mkdir -p "$OUT"
SECONDS=0

echo "== kvtool build: preset:tiny-llama, tokens_per_block 32"
$KVTOOL build --model preset:tiny-llama --output "$PLAN" --tokens_per_block 32 --max_seq_len 2048

echo "== datasets"
$KVTOOL dataset system-prompt --output "$OUT/system_prompt.jsonl" --num_groups 4 --prompts_per_group 4 \
  --system_prompt_len 512 --question_len 32 --output_len 4 --seed 0
$KVTOOL dataset abab --output "$OUT/abab.jsonl" --prompt_len 512 --num_rounds 3 --output_len 4 --seed 0

echo "== shared system prompt: KV cache reuse on vs off (4 requests in flight, 5 runs each)"
$KVTOOL bench --config examples/demo_reuse.yaml --plan "$PLAN" --dataset "$OUT/system_prompt.jsonl" \
  --output "$OUT/system_prompt"

echo "== A,B,A,B one at a time, primary pool holds one request: host cache off vs on (5 runs each)"
$KVTOOL bench --config examples/demo_offload.yaml --plan "$PLAN" --dataset "$OUT/abab.jsonl" \
  --output "$OUT/abab"

echo "== comparison"
$KVTOOL compare "$OUT/system_prompt/summary.csv" --plot "$OUT/system_prompt_ttft.png"
$KVTOOL compare "$OUT/abab/summary.csv" --plot "$OUT/abab_ttft.png"
echo "Reports and plots are in $OUT/ ($SECONDS s)"
