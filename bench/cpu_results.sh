#!/usr/bin/env bash
# Reproduces results/cpu/: every shipped scenario on preset:small-llama, the system-prompt
# scenario at three shared-prefix lengths, a comparison table and a TTFT plot per scenario, and
# the CPU TTFT benchmark (results/ttft_cpu.md). Wall-clock figures: run it on an otherwise idle machine.
#   bash bench/cpu_results.sh            (OUT=results/cpu MODEL=preset:small-llama by default)
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL=${KVTOOL:-.venv/bin/kvtool}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/cpu}
MODEL=${MODEL:-preset:small-llama}
mkdir -p "$OUT"

run() {  # run NAME ARGS...: one scenario into $OUT/NAME, then its comparison table and plot
  local name=$1; shift
  echo "== $name"
  "$KVTOOL" bench --model "$MODEL" --output "$OUT/$name" "$@"
  "$KVTOOL" compare "$OUT/$name/summary.csv" --plot "$OUT/$name/ttft.png" --output "$OUT/$name/compare.csv" \
    > "$OUT/$name/compare.txt"
}

for scenario in system_prompt multi_turn offload_abab block_size_sweep host_cache_sweep scheduler_policies; do
  run "$scenario" --config "bench_configs/$scenario.yaml"
done
for len in 256 2048; do
  run "system_prompt_len$len" --config bench_configs/system_prompt.yaml --set "dataset.system_prompt_len=$len"
done
"$PY" bench/ttft_cpu.py --output results/ttft_cpu.md
