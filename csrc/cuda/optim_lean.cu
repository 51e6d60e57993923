// The lean optimizer ops on CUDA: multi_tensor_adam_lean_ and
// multi_tensor_sgd_lean_ (amp_patch/ops/lean_state_ops.py holds their
// reference bodies, which these kernels equal bit for bit).
//
// Each state tensor is stored in a code (fp32, bf16, or block-scaled int8,
// uint8 = square root, float8_e4m3fn) with one fp32 scale per block of
// block_size consecutive elements of a row. One thread block handles one
// state block: it decodes the state with the block's old scale, applies the
// update rule of csrc/cpu/optim_math.h on RnFloat (the reference's fp32
// arithmetic, one rounding per operation), takes the block's largest
// magnitude of each new state (NaN propagating, as torch's amax), and then
// encodes the state with the new scale and writes the param (stochastically
// rounded when it is bf16), the half model copy and the codes. The first
// kLeanCached elements of each thread keep their results in registers between
// the two passes; a block longer than kLeanCached * threads computes the rest
// again in the second pass (the same arithmetic, so the same bits).
//
// A launch carries up to kLeanTensors tensors in its kernel arguments; each
// thread block walks state blocks [blockIdx.x, total) with a stride of
// gridDim.x and finds its tensor by a binary search over the tensors' first
// block numbers. A set noop flag returns before anything is read or written.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;
using optim::StateCode;

// ------------------------------------------------------------------ state codes

// The fp32 value of element e of a state tensor; `factor` is s / code_max.
__device__ __forceinline__ float load_state(const void* base, StateCode code, int64_t e,
                                            float factor) {
  switch (code) {
    case StateCode::kF32:
      return static_cast<const float*>(base)[e];
    case StateCode::kBF16:
      return to_float(static_cast<const c10::BFloat16*>(base)[e]);
    case StateCode::kInt8:
      return __fmul_rn(static_cast<float>(static_cast<const int8_t*>(base)[e]), factor);
    case StateCode::kSqrtU8: {
      const float r =
          __fmul_rn(static_cast<float>(static_cast<const uint8_t*>(base)[e]), factor);
      return __fmul_rn(r, r);
    }
    default:
      return __fmul_rn(
          c10::detail::fp8e4m3fn_to_fp32_value(static_cast<const uint8_t*>(base)[e]), factor);
  }
}

// Stores x (for the uint8 code: the square root of the value) in its code.
// `factor` is code_max / s and `usable` whether it is finite. As the
// reference: y = x * factor (0 where the factor is not usable), rounded half
// to even and clamped for the integer codes (a NaN, from an inf element of a
// block whose scale is inf, is stored as 0, as torch's cast stores it on
// CUDA; the uint8 code of an unusable block is 0, not the clamp's 1), or
// converted by torch's own float -> float8_e4m3fn conversion.
__device__ __forceinline__ void store_state(void* base, StateCode code, int64_t e, float x,
                                            float factor, bool usable) {
  switch (code) {
    case StateCode::kF32:
      static_cast<float*>(base)[e] = x;
      return;
    case StateCode::kBF16:
      static_cast<c10::BFloat16*>(base)[e] = from_float<c10::BFloat16>(x);
      return;
    case StateCode::kE4M3: {
      const float y = usable ? __fmul_rn(x, factor) : 0.0f;
      static_cast<uint8_t*>(base)[e] = c10::detail::fp8e4m3fn_from_fp32_value(y);
      return;
    }
    default: {
      const float q = rintf(usable ? __fmul_rn(x, factor) : 0.0f);
      const bool zero = !usable || isnan(q);
      if (code == StateCode::kInt8) {
        static_cast<int8_t*>(base)[e] =
            zero ? int8_t{0} : static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
      } else {
        static_cast<uint8_t*>(base)[e] =
            zero ? uint8_t{0} : static_cast<uint8_t>(fminf(fmaxf(q, 1.0f), 255.0f));
      }
    }
  }
}

// The larger of a and b, NaN when either is (torch.amax's rule).
__device__ __forceinline__ float max_nan(float a, float b) {
  return isnan(a) ? a : ((isnan(b) || b > a) ? b : a);
}

// ------------------------------------------------------------------ stochastic rounding

// fp32 p to bf16 bits: the 16 random bits of element e added to the low half
// of p's bit pattern, then cut; a non-finite p rounds to nearest.
__device__ __forceinline__ c10::BFloat16 stochastic_round_bf16(float p, uint32_t key, int64_t e) {
  if (!isfinite(p)) {
    return from_float<c10::BFloat16>(p);
  }
  return c10::BFloat16(
      optim::stochastic_bf16_bits(__float_as_uint(p), optim::rounding_bits(key, e)),
      c10::BFloat16::from_bits());
}

// ------------------------------------------------------------------ launch arguments

// Up to two state lists per tensor (Adam: exp_avg, exp_avg_sq; SGD: the
// momentum buffer). A null state is absent (SGD without momentum).
constexpr int kMaxStates = 2;

struct LeanTensor {
  const void* grad;
  void* param;
  void* model;  // null: no model copy
  void* state[kMaxStates];
  float* scale[kMaxStates];  // null unless the code is block-scaled
  int64_t row_len;           // elements per row
  int64_t first_block;       // the launch's number of this tensor's first state block
  int64_t blocks_per_row;
  uint32_t key;              // stochastic rounding (bf16 params)
  int8_t grad_dt, param_dt, model_dt;  // tensor_lists.cuh's dtype_index
  StateCode code[kMaxStates];
};

constexpr int kLeanThreads = 256;
// Elements per thread whose results stay in registers between the two passes.
constexpr int kLeanCached = 4;
// Grid size cap; blocks loop over the rest.
constexpr int64_t kLeanMaxGrid = int64_t{1} << 20;
constexpr int kLeanOwnBytes = 160;  // the launch's other fields, checked below
constexpr int kLeanTensors = (kParamBytes - kLeanOwnBytes) / static_cast<int>(sizeof(LeanTensor));

template <typename Hyper>
struct LeanLaunch {
  LeanTensor t[kLeanTensors];
  OptimCommon common;
  Hyper h;
  int64_t total_blocks;
  int32_t n;
  int32_t block_size;
};

// ------------------------------------------------------------------ update rules

// Adam (optim_math.h's adam_lean_update): state 0 exp_avg, state 1 exp_avg_sq.
struct AdamLeanRule {
  using Hyper = optim::AdamHyper;
  static constexpr int kStates = 2;
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, m = s[0], v = s[1];
    optim::adam_lean_update<RnFloat>(g, pp, m, v, h);
    p = pp.v;
    s[0] = m.v;
    s[1] = v.v;
  }
};

// SGD: state 0 the momentum buffer (absent without momentum; not read on the first run).
struct SgdLeanRule {
  using Hyper = optim::SgdHyper;
  static constexpr int kStates = 1;
  __device__ static bool reads_state(const Hyper& h) { return h.momentum != 0.0f && !h.first_run; }
  __device__ static bool writes_state(const Hyper& h) { return h.momentum != 0.0f; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, mom = s[0];
    optim::sgd_update<RnFloat>(g, pp, h.momentum != 0.0f ? &mom : nullptr, h);
    p = pp.v;
    s[0] = mom.v;
  }
};

// ------------------------------------------------------------------ the kernel

// The NaN-propagating maximum of K values over the thread block; every thread
// gets the result. smem holds one slot per warp and value.
template <int K>
__device__ __forceinline__ void block_max_nan(float (&v)[K], float (*smem)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      v[k] = max_nan(v[k], __shfl_xor_sync(0xffffffffu, v[k], off));
    }
    if (lane == 0) {
      smem[k][warp] = v[k];
    }
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float x = lane < warps ? smem[k][lane] : 0.0f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, off));
      }
      if (lane == 0) {
        smem[k][0] = x;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = smem[k][0];
  }
}

// The model copy receives the param as stored (a bf16 master's own bits), so
// that the model is always its master rounded.
__device__ __forceinline__ void store_param(const LeanTensor& t, int64_t e, float p) {
  if (t.param_dt == 2) {
    const c10::BFloat16 stored = stochastic_round_bf16(p, t.key, e);
    static_cast<c10::BFloat16*>(t.param)[e] = stored;
    p = static_cast<float>(stored);
  } else {
    store_from_float(t.param, t.param_dt, e, p);
    if (t.param_dt == 1) {  // an fp16 param: its rounded value
      p = static_cast<float>(from_float<c10::Half>(p));
    }
  }
  if (t.model != nullptr) {
    store_from_float(t.model, t.model_dt, e, p);
  }
}

// One state block: elements [base, base + n) of the tensor, scale slot `slot`.
template <typename Rule>
__device__ void lean_block(const LeanTensor& t, const typename Rule::Hyper& h, int64_t base,
                           int n, int64_t slot, float (*smem)[32]) {
  constexpr int K = Rule::kStates;
  const bool reads = Rule::reads_state(h), writes = Rule::writes_state(h);
  bool scaled[K];
  float decode[K];
  bool any_scaled = false;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    scaled[k] = t.state[k] != nullptr && writes && optim::block_scaled(t.code[k]);
    any_scaled = any_scaled || scaled[k];
    // s / code_max, one division per block, as the reference's decode factor.
    decode[k] = scaled[k] && reads ? __fdiv_rn(t.scale[k][slot], optim::code_max(t.code[k])) : 0.0f;
  }

  // The new param and state of element j; a uint8 state is returned as its
  // square root, the value its code scales.
  auto compute = [&](int j, float& p, float (&s)[K]) {
    const int64_t e = base + j;
    const float g = load_as_float(t.grad, t.grad_dt, e);
    p = load_as_float(t.param, t.param_dt, e);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      s[k] = t.state[k] != nullptr && reads ? load_state(t.state[k], t.code[k], e, decode[k])
                                            : 0.0f;
    }
    Rule::step(g, p, s, h);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (t.code[k] == StateCode::kSqrtU8) {
        s[k] = __fsqrt_rn(s[k]);
      }
    }
  };

  float cached_p[kLeanCached];
  float cached_s[kLeanCached][K];
  float top[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    top[k] = 0.0f;
  }
#pragma unroll
  for (int u = 0; u < kLeanCached; ++u) {
    const int j = threadIdx.x + u * blockDim.x;
    if (j < n) {
      compute(j, cached_p[u], cached_s[u]);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        top[k] = max_nan(top[k], fabsf(cached_s[u][k]));
      }
    }
  }
  if (any_scaled) {
    for (int j = threadIdx.x + kLeanCached * blockDim.x; j < n; j += blockDim.x) {
      float p, s[K];
      compute(j, p, s);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        top[k] = max_nan(top[k], fabsf(s[k]));
      }
    }
    // Every thread has read the old scales (decode) before this barrier.
    block_max_nan<K>(top, smem);
  }

  float encode[K];
  bool usable[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    // code_max / s, one division per block, as the reference's encode factor.
    encode[k] = scaled[k] ? __fdiv_rn(optim::code_max(t.code[k]), top[k]) : 0.0f;
    // An inf scale gives the finite factor 0: unusable too (the reference's rule).
    usable[k] = isfinite(encode[k]) && isfinite(top[k]);
    if (scaled[k] && threadIdx.x == 0) {
      t.scale[k][slot] = top[k];
    }
  }

  auto store = [&](int j, float p, const float (&s)[K]) {
    const int64_t e = base + j;
    store_param(t, e, p);
    if (writes) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (t.state[k] != nullptr) {
          store_state(t.state[k], t.code[k], e, s[k], encode[k], usable[k]);
        }
      }
    }
  };
#pragma unroll
  for (int u = 0; u < kLeanCached; ++u) {
    const int j = threadIdx.x + u * blockDim.x;
    if (j < n) {
      store(j, cached_p[u], cached_s[u]);
    }
  }
  // Each element is computed again by the thread that computed it first, and
  // only that thread writes it, so nothing it reads has been written yet.
  for (int j = threadIdx.x + kLeanCached * blockDim.x; j < n; j += blockDim.x) {
    float p, s[K];
    compute(j, p, s);
    store(j, p, s);
  }
}

template <typename Rule>
__global__ void __launch_bounds__(kLeanThreads)
    lean_kernel(const __grid_constant__ LeanLaunch<typename Rule::Hyper> a) {
  __shared__ float smem[Rule::kStates][32];
  if (a.common.skipped()) {
    return;
  }
  typename Rule::Hyper h = a.h;
  h.inv_scale = a.common.scale();
  for (int64_t b = blockIdx.x; b < a.total_blocks; b += gridDim.x) {
    int lo = 0, hi = a.n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (a.t[mid].first_block <= b) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const LeanTensor& t = a.t[lo];
    const int64_t slot = b - t.first_block;  // row * blocks_per_row + block: the scale's index
    const int64_t row = slot / t.blocks_per_row;
    const int64_t start = (slot - row * t.blocks_per_row) * a.block_size;
    const int64_t left = t.row_len - start;
    const int n = static_cast<int>(left < a.block_size ? left : a.block_size);
    lean_block<Rule>(t, h, row * t.row_len + start, n, slot, smem);
    __syncthreads();  // smem is reused by the next block
  }
}

// ------------------------------------------------------------------ host side

// The checks the CUDA kernel adds to the reference's (optim::check_lean_lists):
// every tensor on the device of grads[0], dtypes the kernel reads, and a block
// size that fits its int32 arithmetic.
template <size_t S>
void check_cuda_lists(const char* op, const optim::LeanLists<S>& l, const at::Device& device,
                      int64_t block_size) {
  AMP_CHECK(block_size <= std::numeric_limits<int32_t>::max(), "amp_patch::", op,
              ": block_size ", block_size, " is too large for the CUDA kernel");
  auto on_device = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      AMP_CHECK(tensors[i].device() == device, "amp_patch::", op, ": expected all tensors on ",
                  device, " (the device of grads[0]), but ", name, "[", i, "] is on ",
                  tensors[i].device());
    }
  };
  auto half_or_float = [&](const char* name, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int dt = dtype_index(tensors[i].scalar_type());
      AMP_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": ", name, "[", i, "] has dtype ",
                  tensors[i].scalar_type(),
                  "; the CUDA kernel takes float32, float16 and bfloat16 ", name);
    }
  };
  on_device("grads", l.grads);
  on_device("params", l.params);
  on_device("model_params", l.model_params);
  half_or_float("grads", l.grads);
  half_or_float("model_params", l.model_params);
  for (const optim::LeanStateArg& s : l.states) {
    if (!s.used) {
      continue;
    }
    on_device(s.name, s.codes);
    for (size_t i = 0; i < s.codes.size(); ++i) {
      if (optim::block_scaled(optim::state_code(s.codes[i].scalar_type()))) {
        AMP_CHECK(s.scales[i].device() == device, "amp_patch::", op,
                    ": expected all tensors on ", device, " (the device of grads[0]), but ",
                    s.scale_name, "[", i, "] is on ", s.scales[i].device());
      }
    }
  }
}

// (rows, row length) of a tensor as the codes see it.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t) {
  return optim::lean_rows(t.sizes());
}

// The tensors of one call as LeanTensor rows. A tensor the kernel cannot walk
// in row-major order (not contiguous) is replaced by a contiguous stand-in,
// copied back after the launches when the op writes it. Even a written
// stand-in starts as a copy: a set noop must leave the copy-back a no-op.
// (The block-scaled codes and their scales are contiguous: the checks ask it.)
class LeanPlan {
 public:
  template <size_t S>
  LeanPlan(const optim::LeanLists<S>& l, const optim::LeanHyper& lh)
      : block_size_(lh.block_size) {
    static_assert(S <= kMaxStates);
    for (size_t i = 0; i < l.grads.size(); ++i) {
      const at::Tensor& grad = l.grads[i];
      if (grad.numel() == 0) {
        continue;
      }
      LeanTensor t{};
      const auto [rows, len] = rows_of(grad);
      t.row_len = len;
      t.blocks_per_row = (len + block_size_ - 1) / block_size_;
      t.key = optim::lean_tensor_key(lh, static_cast<int64_t>(i));
      t.grad = flat(grad, false);
      t.grad_dt = static_cast<int8_t>(dtype_index(grad.scalar_type()));
      t.param = flat(l.params[i], true);
      t.param_dt = static_cast<int8_t>(dtype_index(l.params[i].scalar_type()));
      t.model = nullptr;
      if (!l.model_params.empty()) {
        t.model = flat(l.model_params[i], true);
        t.model_dt = static_cast<int8_t>(dtype_index(l.model_params[i].scalar_type()));
      }
      for (size_t k = 0; k < kMaxStates; ++k) {
        t.state[k] = nullptr;
        t.scale[k] = nullptr;
        t.code[k] = StateCode::kF32;
        if (k >= S || !l.states[k].used) {
          continue;
        }
        const at::Tensor& s = l.states[k].codes[i];
        t.code[k] = optim::state_code(s.scalar_type());
        t.state[k] = flat(s, true);
        if (optim::block_scaled(t.code[k])) {
          t.scale[k] = static_cast<float*>(l.states[k].scales[i].data_ptr());
        }
      }
      t.first_block = total_blocks_;
      total_blocks_ += rows * t.blocks_per_row;
      tensors_.push_back(t);
    }
  }

  // Launches the kernel of Rule over the tensors, kLeanTensors at a time, then
  // copies the stand-ins back.
  template <typename Rule>
  void run(const OptimCommon& common, const typename Rule::Hyper& h) {
    static_assert(sizeof(LeanLaunch<typename Rule::Hyper>) <= kParamBytes,
                  "the lean launch arguments exceed the kernel parameter space");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int threads = static_cast<int>(
        std::clamp<int64_t>((block_size_ + 31) / 32 * 32, 32, kLeanThreads));
    for (size_t first = 0; first < tensors_.size(); first += kLeanTensors) {
      const size_t count = std::min<size_t>(kLeanTensors, tensors_.size() - first);
      LeanLaunch<typename Rule::Hyper> a{};
      const int64_t offset = tensors_[first].first_block;
      for (size_t k = 0; k < count; ++k) {
        a.t[k] = tensors_[first + k];
        a.t[k].first_block -= offset;
      }
      const size_t end = first + count;
      a.total_blocks = (end < tensors_.size() ? tensors_[end].first_block : total_blocks_) - offset;
      a.n = static_cast<int32_t>(count);
      a.block_size = static_cast<int32_t>(block_size_);
      a.common = common;
      a.h = h;
      const int64_t grid = std::min(a.total_blocks, kLeanMaxGrid);
      lean_kernel<Rule><<<static_cast<unsigned>(grid), threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

 private:
  void* flat(const at::Tensor& t, bool written) {
    if (t.is_contiguous()) {
      return t.data_ptr();
    }
    at::Tensor stand_in = t.contiguous();
    if (written) {
      write_back_.emplace_back(t, stand_in);
    } else {
      keep_alive_.push_back(stand_in);
    }
    return stand_in.data_ptr();
  }

  int64_t block_size_;
  int64_t total_blocks_ = 0;
  std::vector<LeanTensor> tensors_;
  // Stand-ins are freed after the launches; the caching allocator reuses
  // memory in stream order, so that is safe.
  std::vector<at::Tensor> keep_alive_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

template <typename Rule, size_t S>
void run_lean(const char* op, const optim::LeanLists<S>& l, const optim::Flags& flags,
              const typename Rule::Hyper& h, const optim::LeanHyper& lh) {
  if (l.grads.empty()) {
    return;
  }
  const at::Device device = l.grads[0].device();
  check_cuda_lists(op, l, device, lh.block_size);
  const c10::cuda::CUDAGuard guard(device);
  const OptimCommon common = optim_common(op, flags.noop, flags.inv_scale, device);
  LeanPlan plan(l, lh);
  plan.run<Rule>(common, h);
}

// The CUDA side of optim_args.h's lean entry points (which ran the reference's checks).
struct CudaLean {
  static void adam_lean(const char* op, const optim::LeanLists<2>& l, const optim::Flags& flags,
                        const optim::AdamHyper& h, const optim::LeanHyper& lh) {
    run_lean<AdamLeanRule>(op, l, flags, h, lh);
  }

  static void sgd_lean(const char* op, const optim::LeanLists<1>& l, const optim::Flags& flags,
                       const optim::SgdHyper& h, const optim::LeanHyper& lh) {
    run_lean<SgdLeanRule>(op, l, flags, h, lh);
  }
};

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  using amp_patch::cuda::CudaLean;
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_lean_", &optim::adam_lean_op<CudaLean>);
  m.impl("multi_tensor_sgd_lean_", &optim::sgd_lean_op<CudaLean>);
}
