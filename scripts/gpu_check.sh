#!/usr/bin/env bash
# `make gpu-check OUT=DIR`: on a GPU machine (torch, CuPy, nanobind, scikit-build-core, cmake and
# ninja preinstalled; no package registry needed), install kvtool in place, record the GPU and the
# toolchain, run the GPU tests, the kernel benchmarks, the end-to-end figures on a real model's
# shapes, the peer, the simulation check and the card's commands, then write OUT/summary.md: each
# target of issue 21 with its measured value, the target and met / missed. Everything lands in $OUT:
#   install.log, nvidia-smi.txt, env.txt, pytest_gpu.log          (install info test)
#   gpu_suite.log, gpu_suite/gpu_suite.{csv,md}                     (bench: the kernel sections)
#   gpu_sampler.log, gpu_sampler/gpu_sampler.{csv,md}               (bench: a step's draws at once vs row by row)
#   plan.log                                                        (plan: builds $GPU_MODEL once)
#   gpu_e2e.log, gpu_e2e/gpu_e2e.{csv,md}, gpu_e2e/gpu_steps.{csv,md}  (e2e: TTFT/TPOT, floors, launches per step)
#   peer.log, peer/gpu_peer.csv                                     (peer: transformers' continuous batching)
#   card.log, card/<scenario>/{summary,requests-*}.csv              (card: offload_abab, system_prompt)
#   simulate.log, simulate/gpu_simulate.{csv,md}                    (simcheck: calibrate + simulate vs measured)
#   gpu_startup.log, gpu_startup/gpu_startup.{csv,md}               (startup: a 45 GB host cache)
#   profile.log, profile/{context,decode}.txt                       (profile: ncu of the attention kernels)
#   trace.log, trace/{onboard,decode_graphs_on,decode_graphs_off}.{json,txt}  (trace: torch profiler)
#   steps.log (each step's start, end and seconds), summary.md      (summary: one screen)
#
# GPU_CHECK_STEPS picks steps; three presets (measured on an H100, results/gpu/steps.log):
#   first  (default) install info plan test bench e2e summary      ~3.5 min (install 33 s, test 57-75,
#                    bench 40, e2e 30-51; the plan, 85-120 s, builds behind the tests)
#   second           peer card simcheck startup summary             ~4.5 min (the same warm machine: it
#                    reuses the install, the plan and its kernels; on a fresh one add "install plan")
#   all              both and trace, ~8 min: fits one 10-minute call (the machine goes back 30 s after
#                    a call, so two calls often land on two machines); the deadline skips what is late
# or any list of step names, e.g. GPU_CHECK_STEPS="bench summary". Use the same OUT for both calls:
# the summary covers every file there.
# The plan step builds $GPU_MODEL (default preset:qwen3-8b, bfloat16, 32-token blocks, its kernels
# compiled) in the background while the tests and kernel benchmarks run; the later steps wait for it.
# GPU_SUITE_ARGS is passed to bench/gpu_suite.py (e.g. "--sections copy,decode,context,blocks").
# PYTHON selects the interpreter (default: the first of python3, python, .venv/bin/python that
# imports torch; on the GPU machine that is the system interpreter with CUDA torch and CuPy).
# GPU_CHECK_ARCHIVE=FILE.tgz: OUT packed into one file after every step (a lent machine hands back a
# few files from its own output folder, and none of a call cut off at its time limit but what is
# there already): use a repository path for OUT (kept between two calls on one warm machine) and the
# machine's output folder for the archive, e.g. `make gpu-check OUT=out/gpu GPU_CHECK_ARCHIVE=$OUT/gpu-check.tgz`.
# GPU_CHECK_DEADLINE_S (default 540): no step but summary starts later than this many seconds after
# the script did, so that a call limited to 10 minutes still ends with its summary and archive.
# Exit status: non-zero when a step failed; later steps still run so their output is kept.
set -uo pipefail

OUT="${OUT:-out/gpu-check}"
STEPS="${GPU_CHECK_STEPS:-first}"
case "$STEPS" in
  first) STEPS="install info plan test bench e2e summary" ;;
  second) STEPS="peer card simcheck startup summary" ;;
  all) STEPS="install info plan test bench e2e peer card simcheck startup trace summary" ;;
esac
MODEL="${GPU_MODEL:-preset:qwen3-8b}"
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"  # absolute: the script moves to the repository root
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  for candidate in python3 python .venv/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
      PY="$(command -v "$candidate")"
      break
    fi
  done
fi
[[ -n "$PY" ]] || { echo "gpu-check: no Python with torch found (set PYTHON)"; exit 2; }
status=0
ARCHIVE="${GPU_CHECK_ARCHIVE:-}"
DEADLINE="${GPU_CHECK_DEADLINE_S:-540}"
SECONDS=0

note() { echo "== gpu-check: $*" | tee -a "$OUT/steps.log"; }
has_step() {  # has_step NAME: asked for, and (but for summary) not past the deadline
  [[ " $STEPS " == *" $1 "* ]] || return 1
  if [[ $1 != summary && $SECONDS -ge $DEADLINE ]]; then
    note "$1 skipped: ${SECONDS} s gone, past GPU_CHECK_DEADLINE_S=$DEADLINE"
    status=1
    return 1
  fi
}
pack() {  # OUT as one archive (written aside, then renamed: a call cut off mid-pack keeps the last one);
  # without the profiler's JSON traces: a file over 16 MiB does not come back from a lent machine at all
  [[ -n "$ARCHIVE" ]] || return 0
  tar -czf "$ARCHIVE.part" --exclude="./$(basename "$ARCHIVE")*" --exclude="*.json" -C "$OUT" . 2>/dev/null \
    && mv -f "$ARCHIVE.part" "$ARCHIVE"
}
step_started=$SECONDS
step_name=""
begin() {  # begin NAME: closes the previous step's timing (and packs OUT), opens this one's
  [[ -n "$step_name" ]] && note "$step_name took $((SECONDS - step_started)) s"
  pack
  step_name=$1
  step_started=$SECONDS
}

if has_step install; then
  begin install
  note "install ($PY)"
  "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1
  rc=$?
  tail -n 5 "$OUT/install.log"
  [[ $rc -eq 0 ]] || { note "install failed (rc $rc), see install.log"; status=1; }
fi

if has_step info; then
  begin info
  note "info"
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || note "nvidia-smi failed"
  "$PY" - >"$OUT/env.txt" 2>&1 <<'PYEOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as error:
    print("cupy unavailable:", error)
try:
    from kvtool.kernels.compiler import discover_backends
    print("kernel compilers", [b.identity for b in discover_backends()])
except Exception as error:
    print("kernel compilers unavailable:", error)
PYEOF
  cat "$OUT/env.txt"
fi

if has_step plan; then
  note "plan: building $MODEL in the background (plan.log)"
  "$PY" - "$MODEL" >"$OUT/plan.log" 2>&1 <<'PYEOF' &
import sys, time
from kvtool.plan import resolve_model
from kvtool.plan import BuildOptions
start = time.perf_counter()
# The options `kvtool bench --config bench_configs/<scenario>.yaml --model MODEL` builds with on a GPU.
plan = resolve_model(sys.argv[1], options=BuildOptions(dtype="bfloat16", tokens_per_block=32))
print(f"plan {plan.path} ready in {time.perf_counter() - start:.1f} s")
PYEOF
  plan_pid=$!
fi

if has_step test; then
  begin test
  # Parallel workers when pytest-xdist is there (each compiles its own kernels: 16 cores beat one), a
  # per-test limit when pytest-timeout is (a hung kernel must not eat the lease). kvtool serve's and
  # bench --endpoint's tests hold no GPU test and import fastapi / uvicorn / openai, which GPU images
  # often lack: skip them there. Any other module that fails to import is reported, and the GPU
  # tests still run (pytest stops before running anything on a collection error otherwise).
  test_flags=(-m gpu -q -rs --durations=15 --continue-on-collection-errors)
  if ! "$PY" -c "import fastapi, uvicorn, openai" >/dev/null 2>&1; then
    for module in tests/test_serve_*.py tests/test_bench_endpoint*.py; do test_flags+=(--ignore "$module"); done
  fi
  "$PY" -c "import xdist" >/dev/null 2>&1 && test_flags+=(-n "${GPU_TEST_WORKERS:-8}")
  "$PY" -c "import pytest_timeout" >/dev/null 2>&1 && test_flags+=(--timeout "${GPU_TEST_TIMEOUT:-300}")
  note "pytest ${test_flags[*]}"
  "$PY" -m pytest "${test_flags[@]}" tests/ 2>&1 | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "GPU tests failed (rc $rc)"; status=1; }
  # A machine without a usable GPU or CuPy skips them all: that is no pass.
  if grep -Eq "SKIPPED .*(no CUDA device|CuPy not installed)" "$OUT/pytest_gpu.log"; then  # tests/conftest.py's gpu_missing
    note "GPU tests were skipped (no CUDA GPU or no CuPy here): nothing was checked"
    status=1
  fi
fi

if has_step bench; then
  begin bench
  note "bench/gpu_suite.py"
  # shellcheck disable=SC2086 # GPU_SUITE_ARGS is a list of flags
  "$PY" bench/gpu_suite.py --output "$OUT/gpu_suite" --sections copy,decode,context,blocks,swap ${GPU_SUITE_ARGS:-} \
    2>&1 | tee "$OUT/gpu_suite.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "gpu suite reported errors (rc $rc)"; status=1; }
  note "bench/gpu_sampler.py: a step's rows drawn at once vs row by row"
  "$PY" bench/gpu_sampler.py --output "$OUT/gpu_sampler" --reps 10 2>&1 | tee "$OUT/gpu_sampler.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "gpu sampler failed (rc $rc)"; status=1; }
fi

if has_step profile; then
  begin profile
  note "profile: ncu of one context and one decode launch"
  mkdir -p "$OUT/profile"
  for kernel in context decode; do
    timeout 120 ncu --clock-control none --kernel-name "regex:kvt_paged_${kernel}_attention" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section WarpStateStats \
      "$PY" bench/gpu_suite.py --output "$OUT/profile/suite-$kernel" --sections "$kernel" --reps 20 --warmup 1 \
      >"$OUT/profile/$kernel.txt" 2>&1 || note "ncu of the $kernel kernel failed (profile/$kernel.txt)"
  done
  tail -n 60 "$OUT/profile/context.txt" | tee -a "$OUT/profile.log"
fi

wait_for_plan() {
  if [[ -n "${plan_pid:-}" ]]; then
    wait "$plan_pid" || { note "plan build failed (plan.log)"; status=1; }
    plan_pid=""
    cat "$OUT/plan.log"
  fi
}

if has_step e2e; then
  begin e2e
  wait_for_plan
  note "bench/gpu_e2e.py ($MODEL): reuse off/on with its floor, TPOT with its floor, launches per step"
  # 4,000-token prompts: the longest that leave room to decode within the shared plan's 4,096 tokens.
  "$PY" bench/gpu_e2e.py --model "$MODEL" --plan_options bench --long_len 4000 --output "$OUT/gpu_e2e" 2>&1 \
    | tee "$OUT/gpu_e2e.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "e2e failed (rc $rc)"; status=1; }
fi

if has_step peer; then
  begin peer
  wait_for_plan
  note "bench/gpu_peer_transformers.py ($MODEL, transformers' generate_batch on sdpa_paged)"
  "$PY" bench/gpu_peer_transformers.py --model "$MODEL" --output "$OUT/peer" 2>&1 | tee "$OUT/peer.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "peer failed (rc $rc)"; status=1; }
fi

if has_step startup; then
  begin startup
  wait_for_plan
  note "bench/gpu_startup.py ($MODEL, 45 GB host cache)"
  "$PY" bench/gpu_startup.py --model "$MODEL" --host_cache_bytes 45000000000 --repeats 2 --output "$OUT/gpu_startup" 2>&1 \
    | tee "$OUT/gpu_startup.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "startup failed (rc $rc)"; status=1; }
fi

if has_step card; then
  begin card
  wait_for_plan
  kvtool() { "$PY" -c "from kvtool.cli import main; main()" "$@"; }
  card() {  # card NAME ARGS...: one kvtool bench run into $OUT/card/NAME
    local name=$1; shift
    note "card: kvtool bench $* ($name)"
    kvtool bench --model "$MODEL" --output "$OUT/card/$name" "$@" 2>&1 | tee -a "$OUT/card.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || { note "card $name failed"; status=1; }
  }
  card offload_abab_host45GB --config bench_configs/offload_abab.yaml --kv_host_cache_bytes 45000000000
  card offload_abab --config bench_configs/offload_abab.yaml
  card system_prompt --config bench_configs/system_prompt.yaml
fi

if has_step simcheck; then
  begin simcheck
  wait_for_plan
  reuse=()  # the card's runs of the same scenarios on the same plan are measurements the check can use
  [[ -f "$OUT/card/system_prompt/summary.csv" ]] && reuse+=(--reuse "reuse=$OUT/card/system_prompt")
  [[ -f "$OUT/card/offload_abab/summary.csv" ]] && reuse+=(--reuse "offload_abab=$OUT/card/offload_abab")
  note "bench/gpu_simulate_check.py ($MODEL): kvtool calibrate here, simulate vs measured on 5 scenarios"
  "$PY" bench/gpu_simulate_check.py --model "$MODEL" --output "$OUT/simulate" ${reuse[@]+"${reuse[@]}"} 2>&1 \
    | tee "$OUT/simulate.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "simulation check failed (rc $rc)"; status=1; }
fi

if has_step trace; then
  begin trace
  wait_for_plan
  note "bench/gpu_trace.py ($MODEL): profiler traces of an onboarding step and of decode steps"
  "$PY" bench/gpu_trace.py --model "$MODEL" --output "$OUT/trace" 2>&1 | tee "$OUT/trace.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { note "trace failed"; status=1; }
fi

if has_step summary; then
  begin summary
  "$PY" bench/gpu_summary.py "$OUT" || { note "summary failed"; status=1; }
fi
begin done
note "done (status $status) in ${SECONDS} s; results in $OUT${ARCHIVE:+, packed in $ARCHIVE}"
pack
exit $status
