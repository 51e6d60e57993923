#!/usr/bin/env bash
# Everything a GPU session needs, in one call on a machine with a CUDA GPU and
# a CUDA build of torch in `python3` (plus nvcc, ninja, pytest, hypothesis):
# build amp_patch with its CUDA kernels, run the CUDA cases of the test suite,
# GPU-filling models at O0-O3 against autocast (bench_gpu_models, right after the
# build), FP8 training against bf16 (bench_fp8), the kernel and optimizer benchmarks, O2 training with lean optimizer state
# (bench_lean_state), and O0-O3 training on CUDA in fp16 with loss scaling
# (bench_e2e, amp-patch compare).
#
#   bash benchmarks/gpu_session.sh                   # from the repository root
#   BUDGET=300 bash benchmarks/gpu_session.sh        # seconds for the whole run
#   STEPS="install pytest" bash benchmarks/gpu_session.sh   # only these steps
#   PYTEST_K="lean" PYTEST_MARK="" bash benchmarks/gpu_session.sh   # pytest -k, -m (default: "cuda or ops", "not slow")
#
# Device time is short, so the run keeps to BUDGET seconds (default 480, 8 minutes): each
# step gets at most its own cap and what is left of the budget, and a step
# that runs out is stopped and counted as failed. The caps add up to more than
# the budget: the build, gpu_models and the tests come first, and the later
# benchmarks run as far as the budget reaches (STEPS picks them for a second
# call). Every step runs even if an earlier one failed (except the build); the exit status is non-zero if any
# failed. Logs, one per step, go to $OUT/logs.tgz with docs/benchmarks.md and
# a summary beside it ($OUT defaults to out/gpu_session).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/gpu_session}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
BUDGET=${BUDGET:-480}
STEPS=${STEPS:-"env install gpu_models fp8 capture resources kernels pytest optimizers lean e2e compare"}
START=$SECONDS
failed=()
summary=()

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

# step NAME CAP CMD...: runs CMD for at most CAP seconds (and no longer than the
# budget leaves), its output shown and saved as $LOGS/NAME.log.
step() {
  local name=$1 cap=$2
  shift 2
  wanted "$name" || return 0
  local left=$((BUDGET - (SECONDS - START)))
  ((cap > left)) && cap=$left
  if ((cap < 10)); then
    echo "=== $name: skipped, the budget is spent"
    summary+=("$name: skipped (budget)")
    failed+=("$name")
    return 0
  fi
  echo "=== $name (at most ${cap}s): $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$cap" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  tail -n 25 "$LOGS/$name.log"
  local how="ok"
  if ((rc == 124 || rc == 137)); then how="TIMED OUT"; elif ((rc)); then how="FAILED rc=$rc"; fi
  ((rc)) && failed+=("$name")
  summary+=("$name: $how in $((SECONDS - t0))s")
  echo "=== $name: $how in $((SECONDS - t0))s"
}

environment() {
  nvidia-smi
  nvcc --version
  nproc
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
}

finish() {
  cp docs/benchmarks.md "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
  {
    printf '%s\n' "${summary[@]}"
    grep -h -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$LOGS"/pytest.log 2>/dev/null | head -60
  } | tee "$OUT/summary.txt"
  if ((${#failed[@]})); then
    echo "=== failed: ${failed[*]}"
    exit 1
  fi
  echo "=== all steps passed"
}

export -f environment  # timeout runs programs, not functions
step env 30 bash -c environment
# AMP_PATCH_BUILD_EXT=1: compile amp_patch._C (its CUDA kernels too) now, with
# MAX_JOBS compilers, rather than just in time inside the tests.
step install 300 env AMP_PATCH_BUILD_EXT=1 python3 -m pip install -v --no-deps --no-build-isolation -e .
if [[ " ${failed[*]} " == *" install "* ]]; then
  finish
fi
# GPU-filling models first, as what no CPU can say (bench_gpu_models.py: GPT-2-small and
# ResNet-50 at O0-O3, autocast and fp32 with TF32; targets G1, G2, M1). Trimmed to fit the
# lease: 3 warm-up and 6 timed steps a row, fp32 only with TF32, GPT-2 in fp16 and bf16,
# ResNet-50 in fp16 only (14 rows, each a fresh process; estimated, not yet timed on a GPU: 5-10 s a row).
step gpu_models 150 python3 benchmarks/bench_gpu_models.py --device cuda --warmup 3 --steps 6 \
  --grid gpt2:fp16 gpt2:bf16 resnet50:fp16
# FP8 (bench_fp8.py, section fp8-cuda, written after every row): the FP8 linear against bf16
# on an 8192x8192 weight and 16384 tokens (>= 1.5x), every shape of the default filter's grid
# (>= 1.0x), then Llama-style d=4096 blocks filling half the GPU at O2+fp8 tensorwise against
# O2 (>= 1.3x; peak memory at most O2's). Needs sm_89 or later; estimated, not yet timed.
step fp8 90 python3 benchmarks/bench_fp8.py --device cuda --repeats 5 --rounds 2 --steps 3
# G3: the whole O2 step (forward, backward, scale_loss, FusedAdam) as one CUDA graph against
# the same step run eagerly, on the 21 M-param LM; tests/test_sync_free.py's CUDA cases (in
# the pytest step) check that the replays train as eager steps do.
step capture 60 python3 benchmarks/bench_graph_capture.py --device cuda --rounds 5 --steps 20
if command -v cuobjdump >/dev/null; then
  step resources 20 cuobjdump --dump-resource-usage "$(python3 -c 'import amp_patch._C as m; print(m.__file__)')"
fi
step kernels 60 python3 benchmarks/bench_kernels.py --device cuda
# No -x: one failing case must not hide the others. The CUDA cases of
# tests/ops/test_ops.py cover the launcher's table flushes, a tensor split across
# launches, 2**31+ elements, streams, graph capture, denormals and alignment.
pytest_args=(tests -q -rfE -p no:cacheprovider -k "${PYTEST_K:-cuda or ops}")
if [[ -n ${PYTEST_MARK-not slow} ]]; then
  pytest_args+=(-m "${PYTEST_MARK-not slow}")
fi
if python3 -c 'import xdist' 2>/dev/null; then
  pytest_args+=(-n "${PYTEST_WORKERS:-8}")
fi
step pytest 240 env AMP_PATCH_REQUIRE_EXT=1 python3 -m pytest "${pytest_args[@]}"
# 200 M parameters: at the CPU's default 20 M, torch's own fused AdamW took 3.3 times the
# bandwidth floor on an H200, so the steps there measure host work, not the kernels.
step optimizers 90 python3 benchmarks/bench_optimizers.py --device cuda --repeats 5 --params 2e8
# Lean optimizer state in training (L1-L3 of docs/design.md on the GPU): the benchmark LM at O2 in
# bf16, every optimizer_state/master_weights row against O2's fp32 state and masters.
step lean 120 python3 benchmarks/bench_lean_state.py --device cuda --rounds 5 --steps 4
step e2e 90 python3 benchmarks/bench_e2e.py --device cuda --half-dtype fp16 --rounds 3 --steps 2
step compare 60 python3 -m amp_patch compare --device cuda --half-dtype fp16 --steps 60 --out "$LOGS/compare"
finish
