#!/usr/bin/env bash
# Everything a GPU session needs, in one call on a machine with a CUDA GPU and
# a CUDA build of torch in `python3` (plus nvcc, ninja, pytest, hypothesis):
# build amp_patch with its CUDA kernels, check the launcher's table overflow
# paths, run the test suite (CUDA cases included) and the kernel benchmarks.
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

# Table overflow is the part of the launcher no unit test reaches: it needs
# more tensors (>710) or chunks (>3072, i.e. >201 M elements) than one launch
# holds. Also covers misaligned views, which take the scalar path.
launcher_check() {
  python3 - <<'EOF'
import torch
from amp_patch import ops

names = ["multi_tensor_unscale_", "multi_tensor_unscale_copy_", "multi_tensor_axpby_",
         "multi_tensor_l2norm", "multi_tensor_copy_"]
missing = [n for n in names if not ops.has_native_kernel("cuda", n)]
assert not missing, f"no CUDA kernel registered for {missing}: extension not built with CUDA"

dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
dtypes = [torch.float32, torch.bfloat16, torch.float16]


def rand(n, dtype, offset=0):
    return (torch.randn(n + offset, device=dev, generator=gen) * 100).to(dtype)[offset:]


def clone(t):
    """A copy at the same storage offset, so misaligned views stay misaligned."""
    off = t.storage_offset()
    return torch.empty(off + t.numel(), dtype=t.dtype, device=dev)[off:].copy_(t)


def bitwise(got, want, what):
    """Bit-identical, except that any NaN may stand for any NaN."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}: tensor {i} dtype"
        bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
        both_nan = g.isnan() & w.isnan()
        assert torch.equal(g.isnan(), w.isnan()), f"{what}: tensor {i} NaNs differ"
        assert torch.equal(g.view(bits)[~both_nan], w.view(bits)[~both_nan]), f"{what}: tensor {i} differs"


def check(label, xs):
    scale = torch.full((1,), 3 / 1024, device=dev)
    got, want = [clone(x) for x in xs], [clone(x) for x in xs]
    f_got, f_want = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    ops.multi_tensor_unscale_(got, f_got, scale)
    ops._unscale_ref(want, f_want, scale)
    bitwise(got, want, f"{label} unscale_")
    assert f_got.item() == f_want.item(), f"{label} unscale_ flag"
    for dst_dtype in (torch.float32, torch.bfloat16):
        got = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        want = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        f_got, f_want = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
        ops.multi_tensor_unscale_copy_(xs, got, f_got, scale)
        ops._unscale_copy_ref(xs, want, f_want, scale)
        bitwise(got, want, f"{label} unscale_copy_ -> {dst_dtype}")
        assert f_got.item() == f_want.item(), f"{label} unscale_copy_ flag"
        ops.multi_tensor_copy_(xs, got)
        ops._copy_ref(xs, want)
        bitwise(got, want, f"{label} copy_ -> {dst_dtype}")
    y = [rand(x.numel(), torch.float32) for x in xs]
    got, want = [clone(t) for t in y], [clone(t) for t in y]
    f_got, f_want = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    ops.multi_tensor_axpby_(xs, got, f_got, 0.25, 1.5)
    ops._axpby_ref(xs, want, f_want, 0.25, 1.5)
    bitwise(got, want, f"{label} axpby_")
    assert f_got.item() == f_want.item(), f"{label} axpby_ flag"
    total, norms = ops.multi_tensor_l2norm(xs, True)
    exact = torch.stack([x.double().pow(2).sum() for x in xs]).sqrt()
    close = dict(rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(norms.double(), exact, **close)
    torch.testing.assert_close(total.double(), exact.norm(), **close)
    print(f"ok: {label} ({len(xs)} tensors, {sum(x.numel() for x in xs)} elements)")


many = [rand(1 + (97 * i) % 3000, dtypes[i % 3], offset=int(i % 5 == 0)) for i in range(1500)]
check("1500 tensors, some misaligned", many)
many[777].view(-1)[-1] = float("inf")
check("1500 tensors, one inf", many)

big = [rand(5, torch.float32), rand(3072 * 65536 + 777, torch.bfloat16), rand(70_001, torch.float16)]
big[1][-1] = float("nan")
check("a tensor of more chunks than one launch holds", big)
EOF
}

step env environment
step install python3 -m pip install --no-deps --no-build-isolation -e .
if [[ " ${failed[*]} " == *" install "* ]]; then
  exit 1
fi
if command -v cuobjdump >/dev/null; then
  step resources cuobjdump --dump-resource-usage "$(python3 -c 'import amp_patch._C as m; print(m.__file__)')"
fi
step launcher launcher_check
pytest_args=(tests -q -x)
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
