#!/usr/bin/env bash
# Everything a GPU session needs, in one call on a machine with a CUDA GPU and
# a CUDA build of torch in `python3` (plus nvcc, ninja, pytest, hypothesis):
# build amp_patch with its CUDA kernels, run the test suite (CUDA cases
# included) and the kernel benchmarks.
# Logs and docs/benchmarks.md are copied to $OUT (default out/gpu_session).
#
#   bash benchmarks/gpu_session.sh          # from the repository root
#   PYTEST_MARK="not slow" bash benchmarks/gpu_session.sh   # if time is short
#
# Every step runs even if an earlier one failed (except the build); the exit
# status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
failed=()

# step NAME CMD...: runs CMD, its output shown and saved as $OUT/NAME.log.
step() {
  local name=$1
  shift
  echo "=== $name: $*"
  if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo "=== $name FAILED"
    failed+=("$name")
  fi
}

environment() {
  nvidia-smi
  nvcc --version
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
}

step env environment
step install python3 -m pip install --no-deps --no-build-isolation -e .
if [[ " ${failed[*]} " == *" install "* ]]; then
  exit 1
fi
if command -v cuobjdump >/dev/null; then
  step resources cuobjdump --dump-resource-usage "$(python3 -c 'import amp_patch._C as m; print(m.__file__)')"
fi
# No -x: one failing case must not hide the others. The CUDA cases of
# tests/ops/test_ops.py cover the launcher's table flushes, a tensor split across
# launches, 2**31+ elements, streams, graph capture, denormals and alignment.
pytest_args=(tests -q -rfEs)
if [[ -n ${PYTEST_MARK:-} ]]; then
  pytest_args+=(-m "$PYTEST_MARK")
fi
step pytest env AMP_PATCH_REQUIRE_EXT=1 python3 -m pytest "${pytest_args[@]}"
step bench python3 benchmarks/bench_kernels.py --device cuda
if [[ -f docs/benchmarks.md ]]; then
  cp docs/benchmarks.md "$OUT/"
fi

if ((${#failed[@]})); then
  echo "=== failed: ${failed[*]}"
  exit 1
fi
echo "=== all steps passed"
