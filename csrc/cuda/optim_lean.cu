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

#include "optim_lists.cuh"

namespace amp_patch::cuda {
namespace {

using optim::RnFloat;

constexpr const char* kAdamLean = "multi_tensor_adam_lean_";
constexpr const char* kSgdLean = "multi_tensor_sgd_lean_";

// ------------------------------------------------------------------ state codes

// The code of a state tensor, from its dtype. The last three are block-scaled.
enum Code : int8_t { kCodeF32 = 0, kCodeBF16 = 1, kCodeI8 = 2, kCodeU8 = 3, kCodeE4M3 = 4 };

__host__ __device__ __forceinline__ bool is_scaled(int8_t code) {
  return code >= kCodeI8;
}

// The largest code of each block-scaled code, as the fp32 constant of its factor.
__device__ __forceinline__ float code_max(int8_t code) {
  return code == kCodeI8 ? 127.0f : (code == kCodeU8 ? 255.0f : 448.0f);
}

// The fp32 value of element e of a state tensor; `factor` is s / code_max.
__device__ __forceinline__ float load_state(const void* base, int8_t code, int64_t e,
                                            float factor) {
  switch (code) {
    case kCodeF32:
      return static_cast<const float*>(base)[e];
    case kCodeBF16:
      return to_float(static_cast<const c10::BFloat16*>(base)[e]);
    case kCodeI8:
      return __fmul_rn(static_cast<float>(static_cast<const int8_t*>(base)[e]), factor);
    case kCodeU8: {
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
__device__ __forceinline__ void store_state(void* base, int8_t code, int64_t e, float x,
                                            float factor, bool usable) {
  switch (code) {
    case kCodeF32:
      static_cast<float*>(base)[e] = x;
      return;
    case kCodeBF16:
      static_cast<c10::BFloat16*>(base)[e] = from_float<c10::BFloat16>(x);
      return;
    case kCodeE4M3: {
      const float y = usable ? __fmul_rn(x, factor) : 0.0f;
      static_cast<uint8_t*>(base)[e] = c10::detail::fp8e4m3fn_from_fp32_value(y);
      return;
    }
    default: {
      const float q = rintf(usable ? __fmul_rn(x, factor) : 0.0f);
      const bool zero = !usable || isnan(q);
      if (code == kCodeI8) {
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

// The odd constants of the hash (lean_state_ops.random_bits).
constexpr uint32_t kK0 = 0x9E3779B9u, kK1 = 0x85EBCA6Bu, kK2 = 0xC2B2AE35u;

__device__ __forceinline__ uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= kK1;
  x ^= x >> 13;
  x *= kK2;
  return x ^ (x >> 16);
}

// fp32 p to bf16 bits: the 16 random bits of element e added to the low half
// of p's bit pattern, then cut; a non-finite p rounds to nearest.
__device__ __forceinline__ c10::BFloat16 stochastic_round_bf16(float p, uint32_t key, int64_t e) {
  if (!isfinite(p)) {
    return from_float<c10::BFloat16>(p);
  }
  const uint32_t bits = fmix32(key ^ (static_cast<uint32_t>(e) * kK0)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>((__float_as_uint(p) + bits) >> 16),
                       c10::BFloat16::from_bits());
}

// Host side: the hash key of tensor `index` of the call, mod 2^32.
uint32_t tensor_key(int64_t seed, int64_t step, int64_t index) {
  const uint64_t k = static_cast<uint64_t>(seed) * kK0 + static_cast<uint64_t>(step) * kK1 +
                     static_cast<uint64_t>(index) * kK2;
  return static_cast<uint32_t>(k);
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
  int8_t code[kMaxStates];
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

// Adam: state 0 exp_avg, state 1 exp_avg_sq.
struct AdamLeanRule {
  using Hyper = optim::AdamHyper;
  static constexpr int kStates = 2;
  __device__ static bool reads_state(const Hyper&) { return true; }
  __device__ static bool writes_state(const Hyper&) { return true; }
  __device__ static void step(float g, float& p, float (&s)[kStates], const Hyper& h) {
    RnFloat pp = p, m = s[0], v = s[1];
    optim::adam_update<RnFloat>(g, pp, m, v, h);
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

__device__ __forceinline__ void store_param(const LeanTensor& t, int64_t e, float p) {
  if (t.param_dt == 2) {
    static_cast<c10::BFloat16*>(t.param)[e] = stochastic_round_bf16(p, t.key, e);
  } else {
    store_from_float(t.param, t.param_dt, e, p);
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
    scaled[k] = t.state[k] != nullptr && writes && is_scaled(t.code[k]);
    any_scaled = any_scaled || scaled[k];
    // s / code_max, one division per block, as the reference's decode factor.
    decode[k] = scaled[k] && reads ? __fdiv_rn(t.scale[k][slot], code_max(t.code[k])) : 0.0f;
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
      if (t.code[k] == kCodeU8) {
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
    encode[k] = scaled[k] ? __fdiv_rn(code_max(t.code[k]), top[k]) : 0.0f;
    usable[k] = isfinite(encode[k]);
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

// A state list of the call: its tensors, its scales, and the checks'
// names (as the reference's _check_state).
struct StateList {
  const char* name;
  at::TensorList tensors;
  const char* scale_name;
  at::TensorList scales;
  bool present;
};

int8_t code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kCodeF32;
    case at::kBFloat16:
      return kCodeBF16;
    case at::kChar:
      return kCodeI8;
    case at::kByte:
      return kCodeU8;
    case at::kFloat8_e4m3fn:
      return kCodeE4M3;
    default:
      return -1;
  }
}

// (rows, row length) of a tensor as the codes see it: size(0) rows for two or
// more dimensions, else one row.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t) {
  const int64_t rows = t.dim() >= 2 ? t.size(0) : 1;
  return {rows, rows != 0 ? t.numel() / rows : 0};
}

// The reference's _check_rows: equal list lengths and shapes.
void check_rows(const char* op, const std::vector<std::pair<const char*, at::TensorList>>& lists) {
  const auto& [lead_name, lead] = lists[0];
  for (size_t l = 1; l < lists.size(); ++l) {
    const auto& [name, tensors] = lists[l];
    TORCH_CHECK(tensors.size() == lead.size(), "amp_patch::", op, ": list lengths differ (",
                lead_name, " has ", lead.size(), ", ", name, " has ", tensors.size(), ")");
    for (size_t i = 0; i < lead.size(); ++i) {
      TORCH_CHECK(tensors[i].sizes() == lead[i].sizes(), "amp_patch::", op, ": ", name, "[", i,
                  "] has shape ", tensors[i].sizes(), " but ", lead_name, "[", i, "] has ",
                  lead[i].sizes());
    }
  }
}

// The reference's _check_common, and the dtypes the CUDA kernel reads.
void check_common(const char* op, at::TensorList grads, at::TensorList params,
                  at::TensorList model_params, int64_t block_size) {
  TORCH_CHECK(block_size >= 1, "amp_patch::", op, ": block_size must be positive, got ",
              block_size);
  TORCH_CHECK(block_size <= std::numeric_limits<int32_t>::max(), "amp_patch::", op,
              ": block_size ", block_size, " is too large for the CUDA kernel");
  for (size_t i = 0; i < params.size(); ++i) {
    const int dt = dtype_index(params[i].scalar_type());
    TORCH_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": params[", i, "] has dtype ",
                params[i].scalar_type(), "; params are float32, bfloat16 or float16");
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const int dt = dtype_index(grads[i].scalar_type());
    TORCH_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": grads[", i, "] has dtype ",
                grads[i].scalar_type(), "; the CUDA kernel takes float32, float16 and bfloat16 grads");
  }
  for (size_t i = 0; i < model_params.size(); ++i) {
    const int dt = dtype_index(model_params[i].scalar_type());
    TORCH_CHECK(dt >= 0 && dt <= 2, "amp_patch::", op, ": model_params[", i, "] has dtype ",
                model_params[i].scalar_type(),
                "; the CUDA kernel takes float32, float16 and bfloat16 model params");
  }
}

// The reference's _check_state.
void check_state(const char* op, const StateList& s, int64_t block_size) {
  TORCH_CHECK(s.scales.empty() || s.scales.size() == s.tensors.size(), "amp_patch::", op, ": ",
              s.scale_name, " has ", s.scales.size(), " tensors for ", s.tensors.size(), " ",
              s.name, " (give one per tensor, or none)");
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const at::Tensor& t = s.tensors[i];
    const int8_t code = code_of(t.scalar_type());
    TORCH_CHECK(code >= 0, "amp_patch::", op, ": ", s.name, "[", i, "] has dtype ",
                t.scalar_type(), "; state codes are torch.float32, torch.bfloat16, torch.int8, ",
                "torch.uint8, torch.float8_e4m3fn");
    TORCH_CHECK(code != kCodeU8 || std::string(s.name) == "exp_avg_sqs", "amp_patch::", op, ": ",
                s.name, "[", i, "] is uint8, the code of a second moment (never negative); ",
                "signed state takes int8");
    if (!is_scaled(code)) {
      continue;
    }
    TORCH_CHECK(!s.scales.empty(), "amp_patch::", op, ": ", s.name, "[", i, "] is ",
                t.scalar_type(), " but ", s.scale_name, " is empty");
    const at::Tensor& sc = s.scales[i];
    const auto [rows, len] = rows_of(t);
    const int64_t nb = (len + block_size - 1) / block_size;
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 2 && sc.size(0) == rows &&
                    sc.size(1) == nb,
                "amp_patch::", op, ": ", s.scale_name, "[", i, "] must be float32 of shape (",
                rows, ", ", nb, ") for block_size ", block_size, ", got ", sc.scalar_type(), " ",
                sc.sizes());
    TORCH_CHECK(t.is_contiguous() && sc.is_contiguous(), "amp_patch::", op, ": ", s.name, "[",
                i, "] and its scales must be contiguous");
  }
}

void check_device(const char* op, const char* name, at::TensorList tensors,
                  const at::Device& device) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == device, "amp_patch::", op,
                ": expected all tensors on ", device, " (the device of grads[0]), but ", name,
                "[", i, "] is on ", tensors[i].device());
  }
}

// The tensors of one call as LeanTensor rows. A tensor the kernel cannot walk
// in row-major order (not contiguous) is replaced by a contiguous stand-in,
// copied back after the launches when the op writes it. Even a written
// stand-in starts as a copy: a set noop must leave the copy-back a no-op.
class LeanPlan {
 public:
  LeanPlan(at::TensorList grads, at::TensorList params, at::TensorList model_params,
           const std::vector<StateList>& states, int64_t block_size, int64_t seed, int64_t step)
      : block_size_(block_size) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].numel() == 0) {
        continue;
      }
      LeanTensor t{};
      const auto [rows, len] = rows_of(grads[i]);
      t.row_len = len;
      t.blocks_per_row = (len + block_size - 1) / block_size;
      t.key = tensor_key(seed, step, static_cast<int64_t>(i));
      t.grad = flat(grads[i], false);
      t.grad_dt = static_cast<int8_t>(dtype_index(grads[i].scalar_type()));
      t.param = flat(params[i], true);
      t.param_dt = static_cast<int8_t>(dtype_index(params[i].scalar_type()));
      t.model = nullptr;
      if (!model_params.empty()) {
        t.model = flat(model_params[i], true);
        t.model_dt = static_cast<int8_t>(dtype_index(model_params[i].scalar_type()));
      }
      for (size_t k = 0; k < states.size(); ++k) {
        t.state[k] = nullptr;
        t.scale[k] = nullptr;
        t.code[k] = kCodeF32;
        if (!states[k].present) {
          continue;
        }
        const at::Tensor& s = states[k].tensors[i];
        t.code[k] = code_of(s.scalar_type());
        t.state[k] = flat(s, true);
        if (is_scaled(t.code[k])) {
          t.scale[k] = states[k].scales[i].data_ptr<float>();
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

// Device checks of every list and of the scales of the block-scaled states.
void check_devices(const char* op, const at::Device& device, at::TensorList grads,
                   at::TensorList params, at::TensorList model_params,
                   const std::vector<StateList>& states) {
  check_device(op, "grads", grads, device);
  check_device(op, "params", params, device);
  check_device(op, "model_params", model_params, device);
  for (const StateList& s : states) {
    if (!s.present) {
      continue;
    }
    check_device(op, s.name, s.tensors, device);
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      if (is_scaled(code_of(s.tensors[i].scalar_type()))) {
        TORCH_CHECK(s.scales[i].device() == device, "amp_patch::", op,
                    ": expected all tensors on ", device, " (the device of grads[0]), but ",
                    s.scale_name, "[", i, "] is on ", s.scales[i].device());
      }
    }
  }
}

template <typename Rule>
void run_lean(const char* op, at::TensorList grads, at::TensorList params,
              at::TensorList model_params, const std::vector<StateList>& states,
              const std::optional<at::Tensor>& noop, const std::optional<at::Tensor>& inv_scale,
              const typename Rule::Hyper& h, int64_t block_size, int64_t seed, int64_t step) {
  if (grads.empty()) {
    return;
  }
  const at::Device device = grads[0].device();
  check_devices(op, device, grads, params, model_params, states);
  const c10::cuda::CUDAGuard guard(device);
  const OptimCommon common = optim_common(op, noop, inv_scale, device);
  LeanPlan plan(grads, params, model_params, states, block_size, seed, step);
  plan.run<Rule>(common, h);
}

void adam_lean_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                    at::TensorList exp_avg_scales, at::TensorList exp_avg_sqs,
                    at::TensorList exp_avg_sq_scales, at::TensorList model_params,
                    const std::optional<at::Tensor>& noop,
                    const std::optional<at::Tensor>& inv_scale, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step,
                    bool adam_w_mode, bool bias_correction, int64_t block_size, int64_t seed) {
  const char* op = kAdamLean;
  std::vector<std::pair<const char*, at::TensorList>> rows = {
      {"grads", grads}, {"params", params}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}};
  if (!model_params.empty()) {
    rows.emplace_back("model_params", model_params);
  }
  check_rows(op, rows);
  check_common(op, grads, params, model_params, block_size);
  const std::vector<StateList> states = {
      {"exp_avgs", exp_avgs, "exp_avg_scales", exp_avg_scales, true},
      {"exp_avg_sqs", exp_avg_sqs, "exp_avg_sq_scales", exp_avg_sq_scales, true}};
  for (const StateList& s : states) {
    check_state(op, s, block_size);
  }
  run_lean<AdamLeanRule>(
      op, grads, params, model_params, states, noop, inv_scale,
      optim::adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction),
      block_size, seed, step);
}

void sgd_lean_cuda(at::TensorList grads, at::TensorList params, at::TensorList momentum_buffers,
                   at::TensorList momentum_scales, at::TensorList model_params,
                   const std::optional<at::Tensor>& noop,
                   const std::optional<at::Tensor>& inv_scale, double lr, double weight_decay,
                   double momentum, double dampening, bool nesterov, bool first_run,
                   bool wd_after_momentum, int64_t step, int64_t block_size, int64_t seed) {
  const char* op = kSgdLean;
  const bool with_momentum = momentum != 0.0;
  TORCH_CHECK(!with_momentum || momentum_buffers.size() == grads.size(), "amp_patch::", op,
              ": momentum is ", momentum, " but momentum_buffers has ", momentum_buffers.size(),
              " tensors for ", grads.size(), " grads");
  std::vector<std::pair<const char*, at::TensorList>> rows = {{"grads", grads},
                                                              {"params", params}};
  if (with_momentum) {
    rows.emplace_back("momentum_buffers", momentum_buffers);
  }
  if (!model_params.empty()) {
    rows.emplace_back("model_params", model_params);
  }
  check_rows(op, rows);
  check_common(op, grads, params, model_params, block_size);
  const std::vector<StateList> states = {
      {"momentum_buffers", momentum_buffers, "momentum_scales", momentum_scales, with_momentum}};
  if (with_momentum) {
    check_state(op, states[0], block_size);
  }
  run_lean<SgdLeanRule>(op, grads, params, model_params, states, noop, inv_scale,
                        optim::sgd_hyper(lr, weight_decay, momentum, dampening, nesterov,
                                         first_run, wd_after_momentum),
                        block_size, seed, step);
}

}  // namespace
}  // namespace amp_patch::cuda

TORCH_LIBRARY_IMPL(amp_patch, CUDA, m) {
  m.impl("multi_tensor_adam_lean_", &amp_patch::cuda::adam_lean_cuda);
  m.impl("multi_tensor_sgd_lean_", &amp_patch::cuda::sgd_lean_cuda);
}
