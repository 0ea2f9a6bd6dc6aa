#!/usr/bin/env bash
# `make demo`: the main job on the built-in tiny model, start to finish, with the public CLI.
# Builds tiny-llama with 32-token blocks, replays a shared-system-prompt workload with KV reuse
# on and off and the A,B,A,B workload with and without a host cache, then compares the reports.
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL=${KVTOOL:-.venv/bin/kvtool}
OUT=${OUT:-results/demo}
PLAN=plans/tiny-llama
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== kvtool build: preset:tiny-llama, tokens_per_block 32"
$KVTOOL build --model preset:tiny-llama --output "$PLAN" --tokens_per_block 32 --max_seq_len 2048

echo "== datasets"
$KVTOOL dataset system-prompt --output "$OUT/system_prompt.jsonl" --num_groups 4 --prompts_per_group 8 \
  --system_prompt_len 1024 --question_len 64 --output_len 16 --seed 0
$KVTOOL dataset abab --output "$OUT/abab.jsonl" --prompt_len 1024 --num_rounds 4 --output_len 8 --seed 0

echo "== shared system prompt: KV cache reuse on vs off (4 requests in flight)"
$KVTOOL bench --plan "$PLAN" --dataset "$OUT/system_prompt.jsonl" --concurrency 4 \
  --enable_kv_cache_reuse --label reuse-on --output "$OUT/system_prompt-reuse-on"
$KVTOOL bench --plan "$PLAN" --dataset "$OUT/system_prompt.jsonl" --concurrency 4 \
  --disable_kv_cache_reuse --label reuse-off --output "$OUT/system_prompt-reuse-off"

echo "== A,B,A,B one at a time, primary pool holds one request: host offloading off vs on"
$KVTOOL bench --plan "$PLAN" --dataset "$OUT/abab.jsonl" --mode sequential \
  --max_tokens_in_paged_kv_cache 1152 --label no-host-cache --output "$OUT/abab-no-host-cache"
$KVTOOL bench --plan "$PLAN" --dataset "$OUT/abab.jsonl" --mode sequential \
  --max_tokens_in_paged_kv_cache 1152 --kv_host_cache_bytes 256MiB --label host-cache-256MiB \
  --output "$OUT/abab-host-cache"

echo "== comparison"
$KVTOOL compare "$OUT/system_prompt-reuse-on/summary.csv" "$OUT/system_prompt-reuse-off/summary.csv" \
  --plot "$OUT/system_prompt_ttft.png"
$KVTOOL compare "$OUT/abab-no-host-cache/summary.csv" "$OUT/abab-host-cache/summary.csv" \
  --plot "$OUT/abab_ttft.png"
echo "Reports and plots are in $OUT/"
