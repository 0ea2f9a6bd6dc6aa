#!/usr/bin/env bash
# `make gpu-check OUT=DIR`: on a GPU machine (torch, CuPy, nanobind, scikit-build-core, cmake and
# ninja preinstalled; no package registry needed), install kvtool in place, record the GPU and the
# toolchain, run the GPU tests, then the GPU benchmark suite. Everything lands in $OUT:
#   install.log, nvidia-smi.txt, env.txt, pytest_gpu.log, gpu_suite.log, gpu_suite/gpu_suite.{csv,md}
#
# GPU_CHECK_STEPS picks steps (default "install info test bench"), e.g. to fit a time limit per
# command: GPU_CHECK_STEPS="install info test" then GPU_CHECK_STEPS="bench".
# GPU_SUITE_ARGS is passed to bench/gpu_suite.py (e.g. "--sections copy,decode,context,blocks").
# PYTHON selects the interpreter (default: the first of python3, python, .venv/bin/python that
# imports torch; on the GPU machine that is the system interpreter with CUDA torch and CuPy).
# Exit status: non-zero when a step failed; later steps still run so their output is kept.
set -uo pipefail

OUT="${OUT:-out/gpu-check}"
STEPS="${GPU_CHECK_STEPS:-install info test bench}"
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

has_step() { [[ " $STEPS " == *" $1 "* ]]; }
note() { echo "== gpu-check: $*" | tee -a "$OUT/steps.log"; }

if has_step install; then
  note "install ($PY)"
  "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1
  rc=$?
  tail -n 5 "$OUT/install.log"
  [[ $rc -eq 0 ]] || { note "install failed (rc $rc), see install.log"; status=1; }
fi

if has_step info; then
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

if has_step test; then
  note "pytest -m gpu"
  "$PY" -m pytest -m gpu tests/ -q -rs --durations=15 2>&1 | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "GPU tests failed (rc $rc)"; status=1; }
  # A machine without a usable GPU or CuPy skips them all: that is no pass.
  if grep -q "needs a CUDA GPU" "$OUT/pytest_gpu.log"; then
    note "GPU tests were skipped (no CUDA GPU or no CuPy here): nothing was checked"
    status=1
  fi
fi

if has_step bench; then
  note "bench/gpu_suite.py"
  # shellcheck disable=SC2086 # GPU_SUITE_ARGS is a list of flags
  "$PY" bench/gpu_suite.py --output "$OUT/gpu_suite" ${GPU_SUITE_ARGS:-} 2>&1 | tee "$OUT/gpu_suite.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { note "gpu suite reported errors (rc $rc)"; status=1; }
fi

note "done (status $status); results in $OUT"
exit $status
